/**
 * What the session socket's codec costs: CPU microseconds (process.cpuUsage,
 * user plus system, so that a busy machine's waiting is not counted) per
 * encode and per decode of the frames on the allocate path and of ping, in
 * this process, no daemon. The frames are the ones the client and the daemon
 * send: the client's allocate request, the daemon's answer (the descriptor
 * attached: transfer_id 0) and the transfer frame an Allocate RPC's
 * descriptor rides, ping and pong.
 *   node dist/bench/codec.js [--iterations 20000] [--rounds 7] [--json FILE]
 * Prints a table and one JSON line: each row's median over the rounds.
 */
import * as fs from 'node:fs';
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

interface Case {
  name: string;
  run: () => unknown;
}

const CASES: Case[] = [
  { name: 'encode allocate (client)', run: () => encodeClientFrame(ALLOCATE) },
  {
    name: 'decode allocate (daemon)',
    run: (
      (bytes) => () =>
        decodeClientFrame(bytes)
    )(encodeClientFrame(ALLOCATE)),
  },
  { name: 'encode allocated (daemon)', run: () => encodeDaemonFrame(ALLOCATED) },
  {
    name: 'decode allocated (client)',
    run: (
      (bytes) => () =>
        decodeDaemonFrame(bytes)
    )(encodeDaemonFrame(ALLOCATED)),
  },
  { name: 'encode transfer (daemon)', run: () => encodeDaemonFrame(TRANSFER) },
  {
    name: 'decode transfer (client)',
    run: (
      (bytes) => () =>
        decodeDaemonFrame(bytes)
    )(encodeDaemonFrame(TRANSFER)),
  },
  { name: 'encode ping (client)', run: () => encodeClientFrame(PING) },
  {
    name: 'decode ping (daemon)',
    run: (
      (bytes) => () =>
        decodeClientFrame(bytes)
    )(encodeClientFrame(PING)),
  },
  { name: 'encode pong (daemon)', run: () => encodeDaemonFrame(PONG) },
  {
    name: 'decode pong (client)',
    run: (
      (bytes) => () =>
        decodeDaemonFrame(bytes)
    )(encodeDaemonFrame(PONG)),
  },
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
  for (const one of CASES) cpuMicros(one.run, iterations);
  const samples = new Map<string, number[]>(CASES.map((one) => [one.name, []]));
  // Rounds alternate the cases, so that drift of the machine hits every row alike.
  for (let round = 0; round < rounds; round++) for (const one of CASES) samples.get(one.name)!.push(cpuMicros(one.run, iterations));
  const rows = CASES.map((one) => ({ name: one.name, cpuMicros: Number(median(samples.get(one.name)!).toFixed(3)) }));
  // A round trip is four codec calls: the request's encode and decode, the answer's encode and decode.
  const sum = (names: string[]) => Number(rows.reduce((total, row) => total + (names.includes(row.name.split(' (')[0]) ? row.cpuMicros : 0), 0).toFixed(3));
  const totals = {
    allocateRoundTrip: sum(['encode allocate', 'decode allocate', 'encode allocated', 'decode allocated']),
    pingRoundTrip: sum(['encode ping', 'decode ping', 'encode pong', 'decode pong']),
  };
  process.stdout.write(markdownTable(rows.map((row) => ({ frame: row.name, 'CPU µs per call (median of rounds)': row.cpuMicros.toFixed(3) }))) + '\n');
  process.stdout.write(`allocate round trip (4 codec calls): ${totals.allocateRoundTrip} µs; ping round trip: ${totals.pingRoundTrip} µs\n`);
  const result = { bench: 'codec', iterations, rounds, rows, totals };
  const json = option('json', '');
  if (json !== '') fs.writeFileSync(json, JSON.stringify(result, null, 2) + '\n');
  process.stdout.write(JSON.stringify(result) + '\n');
}

main();
