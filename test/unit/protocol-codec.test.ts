/**
 * The session codec against protobufjs's reflective converters: every frame
 * case, edge values and odd inputs give the same bytes (or the same error)
 * and decode to the same objects, key for key, as
 * `type.encode(type.fromObject(frame))` and `type.toObject(type.decode(bytes),
 * { longs: String, enums: String, defaults: true, oneofs: true })`, which the
 * daemon and the clients read.
 */
import * as path from 'node:path';
import * as protobuf from 'protobufjs';
import { decodeClientFrame, decodeDaemonFrame, encodeClientFrame, encodeDaemonFrame, isProtocol1, PROTOCOL_VERSION } from '../../common/protocol';
import { PROTO_DIR } from '../../common/proto';

// The reference: protobufjs's own converters on a root of their own, as the session codec first used them.
const root = new protobuf.Root();
root.resolvePath = (_origin, target) => (path.isAbsolute(target) ? target : path.join(PROTO_DIR, target));
root.loadSync('vmmd/v1/session.proto', { keepCase: false });
root.resolveAll();
const CLIENT = root.lookupType('vmmd.v1.ClientFrame');
const DAEMON = root.lookupType('vmmd.v1.DaemonFrame');
const TO_OBJECT: protobuf.IConversionOptions = { longs: String, enums: String, defaults: true, oneofs: true };

function referenceEncode(type: protobuf.Type, frame: object): Buffer {
  const bytes = type.encode(type.fromObject(frame)).finish();
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
}

function referenceDecode(type: protobuf.Type, data: Buffer): unknown {
  if (isProtocol1(data)) return `the frame is JSON, a frame of session protocol 1; this side speaks protocol ${PROTOCOL_VERSION} (proto/vmmd/v1/session.proto)`;
  try {
    return type.toObject(type.decode(data), TO_OBJECT);
  } catch (error) {
    return `the frame is not a ${type.name} (${(error as Error).message})`;
  }
}

/** The bytes, or the error's class and message: what a caller sees either way. */
function outcome(run: () => Buffer): { bytes?: string; error?: string } {
  try {
    return { bytes: run().toString('hex') };
  } catch (error) {
    return { error: `${(error as Error).name}: ${(error as Error).message}` };
  }
}

/** Deep equality, classes (Buffer) and key order included: what JSON logs and spreads of the objects see. */
function expectSame(actual: unknown, expected: unknown): void {
  expect(actual).toStrictEqual(expected);
  expect(JSON.stringify(actual)).toBe(JSON.stringify(expected));
}

const U64_MAX = '18446744073709551615';
/** 64-bit values as callers write them, plain and odd: each must give protobufjs's bytes or its error. */
const U64_VALUES: unknown[] = [
  '0',
  '1',
  '2097152',
  '999999999999999',
  '1000000000000000',
  '9007199254740993',
  U64_MAX,
  '18446744073709551616',
  '0018',
  '-5',
  '',
  ' 12',
  '12abc',
  '1e3',
  'abc',
  0,
  -0,
  7,
  2 ** 53 - 1,
  2 ** 53 + 2,
  -1,
  1.5,
  Number.NaN,
  { low: 5, high: 1 },
  { low: -1, high: -1, unsigned: true },
  true,
  null,
];

const LOCATION = { type: 'LOCATION_TYPE_DEVICE', id: 0, deviceUuid: '' };
const EXPORTED = {
  transferId: '0',
  allocationId: '98765',
  size: '2097152',
  location: LOCATION,
  device: 0,
  handleType: 'HANDLE_TYPE_POSIX_FD',
  granularity: '2097152',
  fabricHandle: Buffer.alloc(0),
  deviceUuid: 'GPU-8c1a9a5e-7d8f-2b4c-9e13-0a6f5d3c2b1e',
};
const STORE = {
  id: '3',
  name: 'weights',
  target: 'STORE_TARGET_FBMEM',
  device: 1,
  size: U64_MAX,
  readOnly: true,
  attached: false,
  ownerSession: '0',
  state: 'STORE_STATE_LIVE',
  opens: 4294967295,
  allocationId: '12',
};

const CLIENT_FRAMES: Array<[string, object]> = [
  ['an empty frame', {}],
  ['hello', { hello: { protocol: 2 } }],
  ['hello resuming', { hello: { protocol: 2, resumeToken: 'tok' } }],
  ['hello, empty', { hello: {} }],
  ['transfer', { transfer: { id: '17' } }],
  ['transfer at 2^64-1', { transfer: { id: U64_MAX, allocationId: U64_MAX, size: U64_MAX } }],
  ['ping', { request: '5', ping: {} }],
  ['ping with a nonce', { request: '5', ping: { nonce: 'n'.repeat(100) } }],
  ['allocate', { request: '1234', allocate: { size: '2097152', location: undefined } }],
  ['allocate, no location', { request: '1', allocate: { size: '2097152', location: null } }],
  ['allocate, size 0', { request: '1', allocate: { size: '0' } }],
  [
    'allocate on a NUMA node, FABRIC',
    { request: U64_MAX, allocate: { size: '2097152', location: { type: 'LOCATION_TYPE_HOST_NUMA', id: 1 }, handleType: 'HANDLE_TYPE_FABRIC' } },
  ],
  ['allocate with enum numbers', { request: '2', allocate: { size: '1', location: { type: 2, id: 0 }, handleType: 1 } }],
  ['allocate with unknown enum numbers', { request: '2', allocate: { size: '1', location: { type: 9, id: 3 }, handleType: 77 } }],
  ['allocate with unknown enum names', { request: '2', allocate: { size: '1', location: { type: 'LOCATION_TYPE_MOON' }, handleType: 'toString' } }],
  ['allocate with a device uuid', { request: '2', allocate: { size: '1', location: { deviceUuid: 'GPU-1', id: -1 } } }],
  ['allocate again', { request: '9', allocate: { size: '4194304' }, again: true }],
  ['release', { request: '3', release: { allocationId: '42' } }],
  ['release of 0', { request: '3', release: {} }],
  ['share', { request: '4', share: { allocationId: '42' } }],
  ['export', { request: '6', export: { allocationId: '42', handleType: 'HANDLE_TYPE_POSIX_FD', shareKey: 'k'.repeat(64) } }],
  ['open by id', { request: '7', open: { store: { id: '5' }, writable: true } }],
  ['open by name', { request: '7', open: { store: { name: 'bait' }, writable: false } }],
  ['open, no store', { request: '7', open: {} }],
  ['two cases at once', { request: '8', hello: { protocol: 2 }, ping: { nonce: 'x' } }],
  ['keys no field has', { request: '8', body: 'ping', ping: { nonce: 'x', extra: 1 }, other: true }],
  ['a number request id', { request: 12, ping: {} }],
  ['again as a string', { request: '1', ping: {}, again: 'yes' }],
  ['a number nonce', { request: '1', ping: { nonce: 42 } }],
  ['a string protocol', { hello: { protocol: '2' } }],
  ['a negative protocol', { hello: { protocol: -1 } }],
  ['a body that is not an object', { request: '1', allocate: 5 }],
  ['a nested body that is not an object', { request: '1', allocate: { size: '1', location: 'here' } }],
  ['a body that is a string', { request: '1', ping: 'x' }],
  ['an array body', { request: '1', ping: [] }],
  ...U64_VALUES.map((value): [string, object] => [`request ${JSON.stringify(value)}`, { request: value, release: { allocationId: value } }]),
];

const DAEMON_FRAMES: Array<[string, object]> = [
  ['an empty frame', {}],
  [
    'hello',
    {
      hello: {
        protocol: 2,
        session: '7',
        token: 't'.repeat(43),
        pid: 1234,
        uid: 1000,
        gid: 1000,
        capabilities: ['CAPABILITY_MEMFD_DESCRIPTORS', 'CAPABILITY_READ_ONLY_DESCRIPTORS'],
        resumeToken: 'r',
        resumed: true,
      },
    },
  ],
  ['hello, no capabilities', { hello: { protocol: 2, session: '1', capabilities: [] } }],
  ['hello, capabilities as numbers and unknown ones', { hello: { capabilities: [1, 42, 'CAPABILITY_NOPE', 'CAPABILITY_HOST_NUMA', null] } }],
  ['hello, capabilities not an array', { hello: { capabilities: 'CAPABILITY_HOST_NUMA' } }],
  ['hello, a negative pid', { hello: { pid: -1, uid: 4294967295, gid: 2 ** 32 + 5 } }],
  ['transfer', { transfer: { id: '4321', allocationId: '98765', size: '2097152' } }],
  ['transfer at 2^64-1', { transfer: { id: U64_MAX, allocationId: U64_MAX, size: U64_MAX } }],
  ['pong', { request: '5', pong: { nonce: '' } }],
  ['pong with a nonce', { request: '5', pong: { nonce: 'abc' } }],
  ['allocated', { request: '1234', allocated: EXPORTED }],
  ['allocated, host', { request: '1', allocated: { ...EXPORTED, location: { type: 'LOCATION_TYPE_HOST', id: 0, deviceUuid: '' }, deviceUuid: '' } }],
  ['allocated with a fabric handle', { request: '1', allocated: { ...EXPORTED, handleType: 'HANDLE_TYPE_FABRIC', fabricHandle: Buffer.alloc(64, 0xab) } }],
  ['allocated with a base64 fabric handle', { request: '1', allocated: { ...EXPORTED, fabricHandle: Buffer.alloc(9, 7).toString('base64') } }],
  ['allocated with a fabric handle that is not bytes', { request: '1', allocated: { ...EXPORTED, fabricHandle: 5 } }],
  ['allocated with a Uint8Array', { request: '1', allocated: { ...EXPORTED, fabricHandle: new Uint8Array([1, 2, 3]) } }],
  ['allocated with unknown enum numbers', { request: '1', allocated: { ...EXPORTED, location: { type: 11 }, handleType: 5 } }],
  ['allocated, all defaults', { request: '1', allocated: {} }],
  ['released', { request: '3', released: { freed: true, handleReferences: 4294967295, mappingCount: 0 } }],
  ['released, nothing freed', { request: '3', released: { freed: false } }],
  ['shared', { request: '4', shared: { shareKey: 'k'.repeat(43) } }],
  ['exported', { request: '6', exported: EXPORTED }],
  ['opened', { request: '7', opened: { store: STORE, transferId: '0', granularity: '2097152', mappedSize: '4194304', descriptorReadOnly: true } }],
  ['opened, store enums unknown', { request: '7', opened: { store: { ...STORE, target: 9, state: 'STORE_STATE_GONE' } } }],
  ['opened, no store', { request: '7', opened: {} }],
  ['error', { request: '4', error: { code: 'NOT_ALIGNED', status: 3, message: 'm' } }],
  ['error of a transfer', { error: { code: 'BAD_TRANSFER', status: 3, message: 'm', transfer: U64_MAX, protocol: 2 } }],
  ['error for protocol', { error: { code: 'PROTOCOL_VERSION', status: 9, message: 'x'.repeat(500), protocol: 2 } }],
  ['two cases at once', { request: '1', pong: { nonce: 'a' }, error: { code: 'X' } }],
  ['a body that is not an object', { request: '1', allocated: 'x' }],
  ['a nested body that is not an object', { request: '1', opened: { store: 7 } }],
  ...U64_VALUES.map((value): [string, object] => [
    `u64 ${JSON.stringify(value)}`,
    { request: value, allocated: { ...EXPORTED, size: value, granularity: value } },
  ]),
];

describe('the session codec gives the bytes and objects of protobufjs converters', () => {
  it.each(CLIENT_FRAMES)('ClientFrame: %s', (_what, frame) => {
    const expected = outcome(() => referenceEncode(CLIENT, frame));
    expect(outcome(() => encodeClientFrame(frame))).toEqual(expected);
    if (expected.bytes !== undefined) {
      const bytes = Buffer.from(expected.bytes, 'hex');
      expectSame(decodeClientFrame(bytes), referenceDecode(CLIENT, bytes));
    }
  });

  it.each(DAEMON_FRAMES)('DaemonFrame: %s', (_what, frame) => {
    const expected = outcome(() => referenceEncode(DAEMON, frame));
    expect(outcome(() => encodeDaemonFrame(frame))).toEqual(expected);
    if (expected.bytes !== undefined) {
      const bytes = Buffer.from(expected.bytes, 'hex');
      expectSame(decodeDaemonFrame(bytes), referenceDecode(DAEMON, bytes));
    }
  });

  it('decodes every cut of every frame as protobufjs does: the same object or the same refusal', () => {
    const cases: Array<[protobuf.Type, (data: Buffer) => unknown, object]> = [
      ...CLIENT_FRAMES.map(([, frame]): [protobuf.Type, (data: Buffer) => unknown, object] => [CLIENT, decodeClientFrame, frame]),
      ...DAEMON_FRAMES.map(([, frame]): [protobuf.Type, (data: Buffer) => unknown, object] => [DAEMON, decodeDaemonFrame, frame]),
    ];
    let compared = 0;
    for (const [type, decode, frame] of cases) {
      const whole = outcome(() => referenceEncode(type, frame)).bytes;
      if (whole === undefined) continue;
      const bytes = Buffer.from(whole, 'hex');
      for (let end = 0; end <= bytes.length; end++) {
        const cut = bytes.subarray(0, end);
        expectSame(decode(cut), referenceDecode(type, cut));
        compared++;
      }
    }
    expect(compared).toBeGreaterThan(1000);
  });

  it('decodes random bytes as protobufjs does: the same object or the same refusal', () => {
    // A fixed sequence (xorshift32): a failure names bytes that fail again.
    let state = 0x9e3779b9;
    const next = () => {
      state ^= state << 13;
      state ^= state >>> 17;
      state ^= state << 5;
      return state >>> 0;
    };
    // Bytes that start like frames (a request id, a body's tag and length) reach deeper than bytes of any kind.
    const TAGS = [0x08, 0x12, 0x1a, 0x22, 0x2a, 0x32, 0x3a, 0x42, 0x4a, 0x7a, 0x80];
    for (let i = 0; i < 3000; i++) {
      const length = next() % 40;
      const bytes = Buffer.alloc(length);
      for (let j = 0; j < length; j++) bytes[j] = next() % 3 === 0 ? TAGS[next() % TAGS.length] : next() & 0xff;
      expectSame(decodeClientFrame(bytes), referenceDecode(CLIENT, bytes));
      expectSame(decodeDaemonFrame(bytes), referenceDecode(DAEMON, bytes));
    }
  });
});
