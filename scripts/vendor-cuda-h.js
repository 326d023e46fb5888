#!/usr/bin/env node
/**
 * Vendors the lines of cuda.h that native/src/cuda_api.h declares again:
 *   node scripts/vendor-cuda-h.js [/usr/local/cuda/include/cuda.h]
 * writes native/vendor/cuda13.h: CUDA_VERSION, the versioned-name defines,
 * the typedefs of every type those functions take, and their prototypes,
 * copied as they stand. test/unit/cuda-abi.test.ts checks each function
 * pointer of cuda_api.h's Api against them, where no toolkit is (CI).
 */
'use strict';
const fs = require('node:fs');
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const source = process.argv[2] ?? '/usr/local/cuda/include/cuda.h';
const header = fs.readFileSync(source, 'utf8');
const api = fs.readFileSync(path.join(root, 'native', 'src', 'cuda_api.h'), 'utf8');

const version = /#define CUDA_VERSION (\d+)/.exec(header)?.[1];
if (version === undefined || Math.floor(Number(version) / 1000) !== 13) throw new Error(`${source} is not CUDA 13 (CUDA_VERSION ${version})`);

// The driver entry points cuda_api.h resolves with dlsym.
const names = [...api.matchAll(/Result \(\*(cu\w+)\)\(/g)].map((match) => match[1]);
const out = [
  `/* Lines of cuda.h (CUDA ${Math.floor(version / 1000)}.${(version % 1000) / 10}, CUDA_VERSION ${version}), copied as they stand by scripts/vendor-cuda-h.js`,
  ' * for test/unit/cuda-abi.test.ts: the prototypes of every function native/src/cuda_api.h',
  ' * declares, the defines that map versioned names to them, and the typedefs of their types.',
  ' * Not compiled. Copyright NVIDIA Corporation; see the CUDA toolkit EULA for cuda.h. */',
  `#define CUDA_VERSION ${version}`,
];
const types = new Set();
for (const name of names) {
  // cuda_api.h resolves the versioned symbol (cuMemGetInfo_v2); cuda.h declares the plain name and defines it to the symbol.
  const plain = name.replace(/_v\d+$/, '');
  const define = new RegExp(`^#define ${plain}\\s+.*\\b${name}\\b.*$`, 'm').exec(header);
  if (define !== null && plain !== name) out.push(define[0]);
  const prototype = new RegExp(`^CUresult CUDAAPI (${name}|${plain})\\([^;]*\\);`, 'm').exec(header);
  if (prototype === null) throw new Error(`no prototype of ${name} in ${source}`);
  out.push(prototype[0].replace(/\s+/g, ' '));
  // The parameters' types (CUDAAPI, the calling convention, is not one).
  const parameters = prototype[0].slice(prototype[0].indexOf('('));
  for (const type of parameters.matchAll(/\bCU\w+/g)) types.add(type[0]);
}
types.add('CUresult');
// Every typedef a type resolves through, down to a base type, a struct or an enum.
const typedefs = [];
const pending = [...types];
const seen = new Set();
while (pending.length > 0) {
  const type = pending.pop();
  if (seen.has(type)) continue;
  seen.add(type);
  const simple = new RegExp(`^typedef ([\\w ]+?\\*?)\\s*\\b${type};`, 'm').exec(header);
  if (simple !== null) {
    typedefs.push(simple[0].replace(/\s+/g, ' '));
    // A struct or enum tag ends the chain (an opaque pointer's, as CUstream's).
    if (!/\b(struct|enum) /.test(simple[1])) for (const next of simple[1].matchAll(/\bCU\w+/g)) pending.push(next[0]);
    continue;
  }
  // typedef enum X_enum { … } X;  typedef struct X_st { … } X_v1;
  // (the nearest typedef that opens before the block's end names it).
  const end = header.search(new RegExp(`^\\}\\s*${type};`, 'm'));
  const opens = end < 0 ? [] : [...header.slice(0, end).matchAll(/^typedef (enum|struct) (\w+)\s*\{/gm)];
  const block = opens[opens.length - 1];
  if (block === undefined) throw new Error(`no typedef of ${type} in ${source}`);
  typedefs.push(`typedef ${block[1]} ${block[2]} ${type};`);
}
out.push(...typedefs.sort());
fs.writeFileSync(path.join(root, 'native', 'vendor', 'cuda13.h'), `${out.join('\n')}\n`);
console.log(`native/vendor/cuda13.h: ${names.length} prototypes, ${typedefs.length} typedefs from ${source} (CUDA_VERSION ${version})`);
