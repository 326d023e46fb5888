/**
 * The driver ABI that native/src/cuda_api.h declares (it builds without the
 * CUDA toolkit and resolves every entry point with dlsym), checked here
 * against the lines of CUDA 13's cuda.h vendored in native/vendor/cuda13.h
 * (scripts/vendor-cuda-h.js): every function pointer's symbol, return type
 * and parameter types, reduced on both sides to C's own types. Runs
 * everywhere, CI included; no toolkit needed.
 */
import * as fs from 'node:fs';
import * as path from 'node:path';

const root = path.resolve(__dirname, '..', '..');
const apiHeader = fs.readFileSync(path.join(root, 'native', 'src', 'cuda_api.h'), 'utf8');
const vendored = fs.readFileSync(path.join(root, 'native', 'vendor', 'cuda13.h'), 'utf8');

/** Structs that are the same type on both sides (their layouts: static_asserts in cuda_driver.cc where cuda.h is). */
const SAME_STRUCT: Record<string, string> = {
  Uuid: 'CUuuid_st',
  MemLocation: 'CUmemLocation_st',
  MemAllocationProp: 'CUmemAllocationProp_st',
  MemAccessDesc: 'CUmemAccessDesc_st',
  // Opaque handles: pointers to incomplete structs, whatever their tags.
  OpaqueContext: 'CUctx_st',
  OpaqueStream: 'CUstream_st',
};

/** A C type reduced to its base: C types, `struct <tag>`, enums as `int` (their size on every ABI CUDA supports), pointers as trailing `*`, const kept on pointees. */
function canonical(type: string, typedefs: Map<string, string>): string {
  let text = type.replace(/\*/g, ' * ').replace(/\s+/g, ' ').trim();
  for (let depth = 0; depth < 20; depth++) {
    const words = text.split(' ');
    let changed = false;
    const out: string[] = [];
    for (let index = 0; index < words.length; index++) {
      const word = words[index];
      if ((word === 'enum' || word === 'struct') && index + 1 < words.length) {
        const tag = words[++index];
        out.push(word === 'enum' ? 'int' : `struct ${SAME_STRUCT[tag] ?? tag}`);
        continue;
      }
      const target = typedefs.get(word);
      if (target !== undefined) {
        out.push(target);
        changed = true;
      } else {
        out.push(word);
      }
    }
    text = out.join(' ').replace(/\*/g, ' * ').replace(/\s+/g, ' ').trim();
    if (!changed) break;
  }
  return text.replace(/ \*/g, '*');
}

function splitParameters(list: string): string[] {
  const trimmed = list.trim();
  return trimmed === '' || trimmed === 'void' ? [] : trimmed.split(',').map((part) => part.trim());
}

// cuda_api.h: `using X = Y;`, enums with an int base, structs, and the Api struct's function pointers.
const apiTypedefs = new Map<string, string>();
for (const [, name, target] of apiHeader.matchAll(/using (\w+) = ([^;]+);/g)) apiTypedefs.set(name, target);
for (const [, name, base] of apiHeader.matchAll(/enum (\w+) : (\w+)/g)) apiTypedefs.set(name, base);
for (const [, name] of apiHeader.matchAll(/^struct (\w+) \{/gm)) if (name !== 'Api') apiTypedefs.set(name, `struct ${name}`);
const apiBody = /struct Api \{([\s\S]*?)\n\};/.exec(apiHeader)?.[1] ?? '';
const declared = [...apiBody.matchAll(/(\w+) \(\*(cu\w+)\)\(([^)]*)\);/g)].map(([, result, name, parameters]) => ({
  name,
  result: canonical(result, apiTypedefs),
  parameters: splitParameters(parameters).map((parameter) => canonical(parameter, apiTypedefs)),
}));

// cuda.h's lines: typedefs, name defines, prototypes (parameters carry names: the last word goes).
const cudaTypedefs = new Map<string, string>();
for (const [, target, name] of vendored.matchAll(/^typedef (.+?)\s*\b(\w+);$/gm)) cudaTypedefs.set(name, target);
const defines = new Map<string, string>();
for (const [, name, value] of vendored.matchAll(/^#define (cu\w+)\s+(.+)$/gm)) defines.set(name, /\b(cu\w+)\)?\s*$/.exec(value)![1]);
const prototypes = new Map<string, { result: string; parameters: string[] }>();
for (const [, result, name, parameters] of vendored.matchAll(/^(\w+) CUDAAPI (cu\w+)\(([^)]*)\);$/gm)) {
  prototypes.set(name, {
    result: canonical(result, cudaTypedefs),
    parameters: splitParameters(parameters).map((parameter) => canonical(parameter.replace(/\s*\b\w+$/, ''), cudaTypedefs)),
  });
}

describe('the driver ABI of native/src/cuda_api.h against CUDA 13 cuda.h', () => {
  it('vendors cuda.h of CUDA 13', () => {
    expect(Number(/#define CUDA_VERSION (\d+)/.exec(vendored)?.[1]) / 1000).toBeGreaterThanOrEqual(13);
    expect(Number(/#define CUDA_VERSION (\d+)/.exec(vendored)?.[1])).toBeLessThan(14000);
    expect(declared.length).toBeGreaterThanOrEqual(30);
  });

  it.each(declared.map((entry) => [entry.name, entry] as const))('%s: the symbol cuda.h binds, with its return and parameter types', (name, entry) => {
    // The plain name cuda.h defines to this versioned symbol, or the name itself when cuda.h maps no other symbol onto it.
    const plain = [...defines].find(([, symbol]) => symbol === name)?.[0] ?? name;
    expect({ name, mapsTo: defines.get(name) ?? name }).toEqual({ name, mapsTo: name });
    const prototype = prototypes.get(plain);
    expect(prototype).toBeDefined();
    expect({ result: entry.result, parameters: entry.parameters }).toEqual(prototype);
  });

  it('reduces types as the compiler would: a wrong width, pointer or struct is a difference', () => {
    const cuda = new Map([...cudaTypedefs]);
    expect(canonical('CUdeviceptr', cuda)).toBe('unsigned long long');
    expect(canonical('CUmemGenericAllocationHandle *', cuda)).toBe('unsigned long long*');
    expect(canonical('const CUmemAllocationProp *', cuda)).toBe('const struct CUmemAllocationProp_st*');
    expect(canonical('CUmemAllocationHandleType', cuda)).toBe('int');
    expect(canonical('CUstream', cuda)).toBe('struct CUstream_st*');
    expect(canonical('const MemAllocationProp*', apiTypedefs)).toBe('const struct CUmemAllocationProp_st*');
    expect(canonical('Context*', apiTypedefs)).toBe('struct CUctx_st**');
    expect(canonical('unsigned int', apiTypedefs)).not.toBe(canonical('unsigned long long', apiTypedefs));
  });
});
