/**
 * What the session socket's codec costs: CPU microseconds (process.cpuUsage,
 * user plus system, so that a busy machine's waiting is not counted) per
 * encode and per decode of the frames on the allocate path and of ping, in
 * this process, no daemon. The frames are the ones the client and the daemon
 * send: the client's allocate request, the daemon's answer (the descriptor
 * attached: transfer_id 0) and the transfer frame an Allocate RPC's
 * descriptor rides, ping and pong. Beside each, in the same rounds, the
 * same frame through protobufjs's reflective converters
 * (`type.encode(type.fromObject(frame))`, `type.toObject(type.decode(bytes), …)`),
 * the codec the session socket used before common/plain-codec.ts.
 *   node dist/bench/codec.js [--iterations 20000] [--rounds 7] [--json FILE]
 * Prints a table and one JSON line: each row's median over the rounds, CPU µs per call.
 */
import * as fs from 'node:fs';
import * as path from 'node:path';
import * as protobuf from 'protobufjs';
import { PROTO_DIR } from '../common/proto';
import { decodeClientFrame, decodeDaemonFrame, encodeClientFrame, encodeDaemonFrame, type ClientFrame, type DaemonFrame } from '../common/protocol';
import { markdownTable } from './lib/stats';

function option(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at > 0 ? process.argv[at + 1] : fallback;
}

/** What the client library sends for `session.allocate(2 MiB)`: a location only where the caller gave one. */
const ALLOCATE: ClientFrame = { request: '1234', allocate: { size: '2097152', location: undefined } };
/** The daemon's answer to it (server/transport/grpc/services/virtual-memory.ts, handOver). */
const ALLOCATED: DaemonFrame = {
  request: '1234',
  allocated: {
    transferId: '0',
    allocationId: '98765',
    size: '2097152',
    location: { type: 'LOCATION_TYPE_DEVICE', id: 0, deviceUuid: '' },
    device: 0,
    handleType: 'HANDLE_TYPE_POSIX_FD',
    granularity: '2097152',
    fabricHandle: Buffer.alloc(0),
    deviceUuid: 'GPU-8c1a9a5e-7d8f-2b4c-9e13-0a6f5d3c2b1e',
  },
};
/** The frame an Allocate RPC's descriptor rides (Session.sendTransfer). */
const TRANSFER: DaemonFrame = { transfer: { id: '4321', allocationId: '98765', size: '2097152' } };
const PING: ClientFrame = { request: '1235', ping: {} };
const PONG: DaemonFrame = { request: '1235', pong: { nonce: '' } };

// The reference: protobufjs's converters, on a root of their own.
const root = new protobuf.Root();
root.resolvePath = (_origin, target) => (path.isAbsolute(target) ? target : path.join(PROTO_DIR, target));
root.loadSync('vmmd/v1/session.proto', { keepCase: false });
root.resolveAll();
const TO_OBJECT: protobuf.IConversionOptions = { longs: String, enums: String, defaults: true, oneofs: true };
const reference = (name: string) => {
  const type = root.lookupType(name);
  type.setup();
  return {
    encode: (frame: object) => Buffer.from(type.encode(type.fromObject(frame)).finish()),
    decode: (bytes: Buffer) => type.toObject(type.decode(bytes), TO_OBJECT),
  };
};
const CLIENT = reference('vmmd.v1.ClientFrame');
const DAEMON = reference('vmmd.v1.DaemonFrame');

interface Case {
  name: string;
  /** The session codec's call. */
  run: () => unknown;
  /** The same through protobufjs's converters. */
  reference: () => unknown;
}

function clientFrame(name: string, frame: ClientFrame): Case[] {
  const bytes = encodeClientFrame(frame);
  return [
    { name: `encode ${name} (client)`, run: () => encodeClientFrame(frame), reference: () => CLIENT.encode(frame) },
    { name: `decode ${name} (daemon)`, run: () => decodeClientFrame(bytes), reference: () => CLIENT.decode(bytes) },
  ];
}

function daemonFrame(name: string, frame: DaemonFrame): Case[] {
  const bytes = encodeDaemonFrame(frame);
  return [
    { name: `encode ${name} (daemon)`, run: () => encodeDaemonFrame(frame), reference: () => DAEMON.encode(frame) },
    { name: `decode ${name} (client)`, run: () => decodeDaemonFrame(bytes), reference: () => DAEMON.decode(bytes) },
  ];
}

const CASES: Case[] = [
  ...clientFrame('allocate', ALLOCATE),
  ...daemonFrame('allocated', ALLOCATED),
  ...daemonFrame('transfer', TRANSFER),
  ...clientFrame('ping', PING),
  ...daemonFrame('pong', PONG),
];

/** CPU µs per call of `run` over `iterations` calls. */
function cpuMicros(run: () => unknown, iterations: number): number {
  let sink = 0;
  const start = process.cpuUsage();
  for (let i = 0; i < iterations; i++) if (run() !== undefined) sink++;
  const used = process.cpuUsage(start);
  if (sink !== iterations) throw new Error('a codec call returned nothing');
  return (used.user + used.system) / iterations;
}

function median(values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)];
}

function main(): void {
  const iterations = Number(option('iterations', '20000'));
  const rounds = Number(option('rounds', '7'));
  // Warm-up: every case through the optimizing compiler before the first round counts.
  for (const one of CASES) {
    cpuMicros(one.run, iterations);
    cpuMicros(one.reference, iterations);
  }
  const codec = new Map<string, number[]>(CASES.map((one) => [one.name, []]));
  const converters = new Map<string, number[]>(CASES.map((one) => [one.name, []]));
  // Rounds alternate the cases and the two codecs, so that drift of the machine hits every row alike.
  for (let round = 0; round < rounds; round++) {
    for (const one of CASES) {
      codec.get(one.name)!.push(cpuMicros(one.run, iterations));
      converters.get(one.name)!.push(cpuMicros(one.reference, iterations));
    }
  }
  const rows = CASES.map((one) => ({
    name: one.name,
    cpuMicros: Number(median(codec.get(one.name)!).toFixed(3)),
    convertersCpuMicros: Number(median(converters.get(one.name)!).toFixed(3)),
  }));
  // A round trip is four codec calls: the request's encode and decode, the answer's encode and decode.
  const sum = (names: string[], key: 'cpuMicros' | 'convertersCpuMicros') =>
    Number(rows.reduce((total, row) => total + (names.includes(row.name.split(' (')[0]) ? row[key] : 0), 0).toFixed(3));
  const ALLOCATE_TRIP = ['encode allocate', 'decode allocate', 'encode allocated', 'decode allocated'];
  const PING_TRIP = ['encode ping', 'decode ping', 'encode pong', 'decode pong'];
  const totals = {
    allocateRoundTrip: sum(ALLOCATE_TRIP, 'cpuMicros'),
    pingRoundTrip: sum(PING_TRIP, 'cpuMicros'),
    convertersAllocateRoundTrip: sum(ALLOCATE_TRIP, 'convertersCpuMicros'),
    convertersPingRoundTrip: sum(PING_TRIP, 'convertersCpuMicros'),
  };
  process.stdout.write(
    markdownTable(
      rows.map((row) => ({
        frame: row.name,
        'session codec, CPU µs per call': row.cpuMicros.toFixed(3),
        'protobufjs converters, CPU µs per call': row.convertersCpuMicros.toFixed(3),
      })),
    ) + '\n',
  );
  process.stdout.write(
    `allocate round trip (4 codec calls): ${totals.allocateRoundTrip} µs (converters ${totals.convertersAllocateRoundTrip}); ` +
      `ping round trip: ${totals.pingRoundTrip} µs (converters ${totals.convertersPingRoundTrip})\n`,
  );
  const result = { bench: 'codec', iterations, rounds, rows, totals };
  const json = option('json', '');
  if (json !== '') fs.writeFileSync(json, JSON.stringify(result, null, 2) + '\n');
  process.stdout.write(JSON.stringify(result) + '\n');
}

main();
