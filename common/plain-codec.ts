/**
 * Plain objects to and from protobufjs messages, for the session socket's
 * frames, without protobufjs's reflective converters' per-call cost: the same
 * results as `type.encode(type.fromObject(value))` and
 * `type.toObject(type.decode(bytes), { longs: String, enums: String, defaults:
 * true, oneofs: true })`, byte for byte and key for key, generated once per
 * type from its reflection (proto/ stays the one contract). What the converters
 * spend per call and this does not: a Long object per 64-bit field on both
 * sides, a Long division per decimal string, a message instance per level on
 * the way out, a Long per default on the way in. A 64-bit value that is not a
 * plain decimal below 2^53 goes through protobufjs's own Long conversion, so
 * every input, odd ones included, gives what protobufjs gives.
 */
import * as protobuf from 'protobufjs';

const { util } = protobuf;

/** A 64-bit value as protobufjs holds it: the `long` package's Long. */
interface LongValue {
  low: number;
  high: number;
  unsigned: boolean;
}

/** protobufjs represents 64-bit values with the `long` package, a dependency of its own: the conversions below assume it, as protobufjs's converters do when it is there. */
const LONG = util.Long as unknown as { fromValue(value: unknown, unsigned: boolean): LongValue; prototype: { toString(this: LongValue): string } };
if (LONG === undefined || LONG === null) throw new Error("protobufjs found no 'long' package: the session codec needs it (npm ci installs it with protobufjs)");

const TWO_TO_32 = 4294967296;
/** A 64-bit value's high word below this is a value below 2^53: String(Number) writes it exactly. */
const HIGH_OF_2_TO_53 = 0x200000;

type Kind = 'message' | 'enum' | 'uint64' | 'int64' | 'uint32' | 'int32' | 'number' | 'bool' | 'string' | 'bytes';

const SCALAR_KINDS: Record<string, Kind> = {
  uint64: 'uint64',
  fixed64: 'uint64',
  int64: 'int64',
  sint64: 'int64',
  sfixed64: 'int64',
  uint32: 'uint32',
  fixed32: 'uint32',
  int32: 'int32',
  sint32: 'int32',
  sfixed32: 'int32',
  double: 'number',
  float: 'number',
  bool: 'bool',
  string: 'string',
  bytes: 'bytes',
};

interface FieldPlan {
  name: string;
  fullName: string;
  kind: Kind;
  repeated: boolean;
  /** The oneof it is a case of: the output names the case present under this key. */
  oneof?: string;
  message?: TypePlan;
  /** A message field: its type's converter's index among the type's message fields, in declaration order. */
  nested?: number;
  /** Enum: each name's number (own keys only, so that "toString" is no name). */
  numbers?: Map<string, number>;
  /** Enum: each number's name. */
  names?: Map<number, string>;
  /** The value a field absent from the bytes has in the output: a literal, or for bytes the bytes of a new Buffer each time. */
  absent: unknown;
  /** Enum: the number an unknown name in a repeated field becomes. */
  enumDefault: number;
}

/** How to convert one message type, made once from its reflection by planOf. */
export interface TypePlan {
  type: protobuf.Type;
  /** In declaration order: the order protobufjs's fromObject checks them, so the first bad field is the one named. */
  declared: FieldPlan[];
  /** By field number: the order of toObject's keys and of the wire. */
  byNumber: FieldPlan[];
  /** The output's keys set before any value: repeated fields, then the rest outside a oneof (toObject's order). */
  defaults: FieldPlan[];
}

const plans = new Map<protobuf.Type, TypePlan>();

/**
 * The plan of a type and of every message type under it, made once.
 * @throws Error when the type has a map field or contains itself (no session frame does: the converters here do not handle either)
 */
export function planOf(type: protobuf.Type, within: Set<protobuf.Type> = new Set()): TypePlan {
  const made = plans.get(type);
  if (made !== undefined) return made;
  if (within.has(type)) throw new Error(`${type.fullName} contains itself: plain-codec plans only types that do not`);
  within.add(type);
  type.setup();
  const fields = type.fieldsArray.map((field) => planField(field.resolve(), within));
  fields.filter((field) => field.message !== undefined).forEach((field, index) => (field.nested = index));
  const byNumber = [...fields].sort((a, b) => type.fields[a.name].id - type.fields[b.name].id);
  const plan: TypePlan = {
    type,
    declared: fields,
    byNumber,
    defaults: [
      ...byNumber.filter((field) => field.repeated && field.oneof === undefined),
      ...byNumber.filter((field) => !field.repeated && field.oneof === undefined),
    ],
  };
  within.delete(type);
  plans.set(type, plan);
  return plan;
}

function planField(field: protobuf.Field, within: Set<protobuf.Type>): FieldPlan {
  if (field.map) throw new Error(`${field.fullName} is a map: plain-codec plans only types without one`);
  const base = { name: field.name, fullName: field.fullName, repeated: field.repeated, oneof: field.partOf?.name, enumDefault: 0 };
  const resolved = field.resolvedType;
  if (resolved instanceof protobuf.Type) return { ...base, kind: 'message', message: planOf(resolved, within), absent: null };
  if (resolved instanceof protobuf.Enum) {
    const names = new Map(Object.entries(resolved.valuesById).map(([number, name]) => [Number(number), name]));
    const numbers = new Map(Object.entries(resolved.values));
    const name = resolved.valuesById[field.typeDefault as number];
    return { ...base, kind: 'enum', names, numbers, enumDefault: field.typeDefault as number, absent: name };
  }
  const kind = SCALAR_KINDS[field.type];
  if (kind === undefined) throw new Error(`${field.fullName} has type ${field.type}, which plain-codec does not know`);
  if (kind === 'bytes') {
    return { ...base, kind, absent: Array.prototype.slice.call(field.typeDefault as Uint8Array) };
  }
  const value = kind === 'uint64' || kind === 'int64' ? String(field.typeDefault) : field.typeDefault;
  return { ...base, kind, absent: value };
}

// The converters are generated as source, once per type, as protobufjs generates its own: a
// function of straight-line code with the fields' names as constants is what the optimizing
// compiler makes fast (a loop over field plans with computed keys is slower than the converters it replaces).

/** Helpers the generated code calls, passed in by name. */
const SCOPE = {
  isObject: util.isObject,
  hasOwn: Object.prototype.hasOwnProperty,
  newBuffer: util.newBuffer,
  base64: util.base64,
  long64,
  decimal,
};

function long64(given: unknown, unsigned: boolean): unknown {
  if (typeof given === 'string') {
    const value = shortDecimal(given);
    if (value >= 0) return value;
  } else if (typeof given === 'number' && Number.isSafeInteger(given) && given >= 0) return given;
  return LONG.fromValue(given, unsigned);
}

/** The value of 1 to 15 decimal digits (Long.fromString reads them as Number does), else -1. */
function shortDecimal(text: string): number {
  const length = text.length;
  if (length === 0 || length > 15) return -1;
  let value = 0;
  for (let i = 0; i < length; i++) {
    const digit = text.charCodeAt(i) - 48;
    if (digit < 0 || digit > 9) return -1;
    value = value * 10 + digit;
  }
  return value;
}

/** A 64-bit value as protobufjs's toObject writes it with longs: String. */
function decimal(value: number | LongValue): string {
  if (typeof value === 'number') return String(value);
  const high = value.high >>> 0;
  if (high < HIGH_OF_2_TO_53 && (value.unsigned || value.high >= 0)) return String(high * TWO_TO_32 + (value.low >>> 0));
  return LONG.prototype.toString.call(value);
}

const js = JSON.stringify;

/** Compiles `body` over the helpers, the nested types' converters (`conv[i]`) and the type's constructor (`ctor`). */
function compile<F>(param: string, body: string, conv: unknown[], ctor: unknown): F {
  const names = Object.keys(SCOPE);
  return new Function(...names, 'conv', 'ctor', `"use strict"; return function (${param}) {\n${body}\n};`)(...Object.values(SCOPE), conv, ctor) as F;
}

/** The nested message types' converters, indexed as FieldPlan.nested says. */
function nestedOf<F>(plan: TypePlan, of: (plan: TypePlan) => F): F[] {
  return plan.declared.filter((field) => field.message !== undefined).map((field) => of(field.message!));
}

// ---- plain object → what protobufjs's encode takes (fromObject's conversions, into a plain object) ----

type Encodable = (value: unknown) => object;
const encodables = new Map<TypePlan, Encodable>();

/** The converter of a plan, generated on first use; nested types' converters come from `conv`, filled in after. */
function encodableOf(plan: TypePlan): Encodable {
  const made = encodables.get(plan);
  if (made !== undefined) return made;
  const lines: string[] = [`if (d instanceof ctor) return d;`];
  if (plan.declared.length === 0) lines.push('return {};');
  else {
    lines.push(`if (!isObject(d)) throw TypeError(${js(`${plan.type.fullName}: object expected`)});`, 'var m = {}, v, a, i;');
    for (const field of plan.declared) {
      const key = js(field.name);
      lines.push(`v = d[${key}];`);
      if (field.repeated) {
        lines.push(
          `if (v) {`,
          `  if (!Array.isArray(v)) throw TypeError(${js(`${field.fullName}: array expected`)});`,
          `  a = [];`,
          `  for (i = 0; i < v.length; ++i) {`,
          // An unknown name in a repeated enum becomes its default, leaving no hole.
          `    ${field.kind === 'enum' ? enumIn(field, 'v[i]', 'a[i]', String(field.enumDefault)) : valueIn(field, 'v[i]', 'a[i]')}`,
          `  }`,
          `  m[${key}] = a;`,
          `}`,
        );
      } else if (field.kind === 'enum') lines.push(enumIn(field, 'v', `m[${key}]`, undefined));
      else lines.push(`if (v != null) {`, `  ${valueIn(field, 'v', `m[${key}]`)}`, `}`);
    }
    lines.push('return m;');
  }
  const encodable = compile<Encodable>('d', lines.join('\n'), nestedOf(plan, encodableOf), plan.type.ctor);
  encodables.set(plan, encodable);
  return encodable;
}

/** A name or a number (any number passes, as in fromObject); anything else: `otherwise` if given, else unset. */
function enumIn(field: FieldPlan, from: string, to: string, otherwise: string | undefined): string {
  const cases = [...field.numbers!].map(([name, number]) => `case ${js(name)}: ${to} = ${number}; break;`).join(' ');
  return `if (typeof ${from} === "number") ${to} = ${from}; else switch (${from}) { ${cases} default: ${otherwise === undefined ? '' : `${to} = ${otherwise};`} }`;
}

function valueIn(field: FieldPlan, from: string, to: string): string {
  switch (field.kind) {
    case 'message':
      return `if (!isObject(${from})) throw TypeError(${js(`${field.fullName}: object expected`)}); ${to} = conv[${field.nested}](${from});`;
    case 'uint64':
    case 'int64':
      // A number or a short decimal goes to the writer as a number (exact below 2^53); anything else as protobufjs's Long.
      return `${to} = long64(${from}, ${field.kind === 'uint64'});`;
    case 'uint32':
      return `${to} = ${from} >>> 0;`;
    case 'int32':
      return `${to} = ${from} | 0;`;
    case 'number':
      return `${to} = Number(${from});`;
    case 'bool':
      return `${to} = Boolean(${from});`;
    case 'string':
      return `${to} = String(${from});`;
    case 'bytes':
      return `if (typeof ${from} === "string") base64.decode(${from}, ${to} = newBuffer(base64.length(${from})), 0); else if (${from}.length >= 0) ${to} = ${from};`;
    default:
      throw new Error(`${field.fullName}: no conversion for ${field.kind}`);
  }
}

/**
 * The bytes of `value` as a message of `plan`'s type: what
 * `type.encode(type.fromObject(value)).finish()` returns.
 * @throws TypeError as fromObject does ("<field>: object expected", "<field>: array expected"); Error as Long.fromValue for an odd 64-bit value
 */
export function encodePlain(plan: TypePlan, value: object): Uint8Array {
  return (plan.type.encode as (message: object) => protobuf.Writer)(encodableOf(plan)(value)).finish();
}

// ---- decoded message → the output shape (toObject with longs: String, enums: String, defaults, oneofs) ----

type Plain = (message: unknown) => Record<string, unknown>;
const plains = new Map<TypePlan, Plain>();

function plainOf(plan: TypePlan): Plain {
  const made = plains.get(plan);
  if (made !== undefined) return made;
  // The defaults first, in one literal: the keys' order is toObject's (repeated fields, then the rest, by number).
  const defaults = plan.defaults.map((field) => `${js(field.name)}: ${field.repeated ? '[]' : absent(field)}`);
  const lines = [`var d = {${defaults.join(', ')}}, v, a, i;`];
  for (const field of plan.byNumber) {
    const key = js(field.name);
    lines.push(`v = m[${key}];`);
    if (field.repeated) {
      lines.push(`if (v && v.length) {`, `  a = [];`, `  for (i = 0; i < v.length; ++i) { ${valueOut(field, 'v[i]', 'a[i]')} }`, `  d[${key}] = a;`, `}`);
    } else {
      lines.push(
        `if (v != null && hasOwn.call(m, ${key})) {`,
        `  ${valueOut(field, 'v', `d[${key}]`)}`,
        ...(field.oneof === undefined ? [] : [`  d[${js(field.oneof)}] = ${key};`]),
        `}`,
      );
    }
  }
  // A bytes field's default is a new Buffer (util.newBuffer, as toObject makes it), made only where the bytes lack the field.
  for (const field of plan.defaults) {
    if (field.kind === 'bytes' && !field.repeated) lines.push(`if (d[${js(field.name)}] === undefined) d[${js(field.name)}] = newBuffer(${js(field.absent)});`);
  }
  lines.push('return d;');
  const plain = compile<Plain>('m', lines.join('\n'), nestedOf(plan, plainOf), plan.type.ctor);
  plains.set(plan, plain);
  return plain;
}

/** A field's value in the output when the bytes do not have it, as a literal (bytes: set at the end, where still undefined). */
function absent(field: FieldPlan): string {
  return field.absent === undefined || field.kind === 'bytes' ? 'undefined' : js(field.absent);
}

function valueOut(field: FieldPlan, from: string, to: string): string {
  switch (field.kind) {
    case 'message':
      return `${to} = conv[${field.nested}](${from});`;
    case 'enum': {
      const cases = [...field.names!].map(([number, name]) => `case ${number}: ${to} = ${js(name)}; break;`).join(' ');
      return `switch (${from}) { ${cases} default: ${to} = ${from}; }`;
    }
    case 'uint64':
    case 'int64':
      return `${to} = decimal(${from});`;
    default:
      return `${to} = ${from};`;
  }
}

/**
 * The message in `bytes` as a plain object: what `type.toObject(type.decode(bytes),
 * { longs: String, enums: String, defaults: true, oneofs: true })` returns.
 * @throws Error as protobufjs's decode does for bytes that are not a message of the type
 */
export function decodePlain<T>(plan: TypePlan, bytes: Uint8Array): T {
  return plainOf(plan)(plan.type.decode(bytes)) as T;
}
