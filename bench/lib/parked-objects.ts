/**
 * What the lifecycle benches (restart.ts, take-over.ts) share: their command
 * line, the daemon settings that let one uid hold N objects, the objects
 * themselves (allocations, one in ten a store of its own allocation), the
 * wait for the first request served, the daemon's JSON log lines, and the
 * summary they print and write.
 */
import * as fs from 'node:fs';
import type { Readable } from 'node:stream';
import { connect, type VmmdClient } from '../../client';
import { addon } from '../../native';

/** `--name VALUE` from the command line, or `fallback`. */
export function option(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at > 0 ? process.argv[at + 1] : fallback;
}

/** Each host object's size (the host backend's granularity is set to it); cuda objects are 2 MiB. */
const HOST_OBJECT_BYTES = 64n << 10n;

/** Daemon settings for `objects` objects of one uid on `backend` in `dir`, parked for an hour, no stock. */
export function parkedDaemonArgs(backend: string, dir: string, objects: number): string[] {
  const hostArgs = backend === 'host' ? ['--host-granularity', '64KiB', '--host-capacity', String(BigInt(objects + 64) * HOST_OBJECT_BYTES)] : [];
  return [
    ...['--backend', backend, '--socket-dir', dir, '--log-level', 'info', '--stock', 'none', '--parked-grace-ms', '3600000'],
    ...['--max-allocations-per-uid', String(objects * 2), '--max-stores-per-uid', String(objects)],
    ...hostArgs,
  ];
}

/** A client whose first request was answered by the daemon serving `dir`, asked for every 2 ms until one is. */
export async function firstServed(dir: string): Promise<VmmdClient> {
  for (;;) {
    try {
      const client = await connect({ socketDir: dir });
      await client.session.ping();
      return client;
    } catch {
      await new Promise((resolve) => setTimeout(resolve, 2));
    }
  }
}

/** Makes `objects` objects: allocations, one in ten made a store of its own allocation. */
export async function makeObjects(client: VmmdClient, backend: string, objects: number): Promise<void> {
  const granularity = backend === 'host' ? HOST_OBJECT_BYTES : 2n << 20n;
  const started = Date.now();
  for (let made = 0; made < objects; made++) {
    const allocated = await client.session.allocate(granularity);
    addon.close(allocated.fd);
    if (made % 10 === 9 && made + 1 < objects) {
      await client.stores.createStore({ allocationId: allocated.message.allocationId, name: `bench-${made}`, handOver: true });
      made++;
    }
  }
  process.stderr.write(`${objects} objects made in ${Date.now() - started} ms\n`);
}

/** Calls `each` with every JSON log line of `stream` that contains `text`. */
export function onLogLines(stream: Readable, text: string, each: (line: Record<string, unknown>) => void): void {
  let pending = '';
  stream.on('data', (chunk: Buffer) => {
    pending += chunk.toString();
    const lines = pending.split('\n');
    pending = lines.pop()!;
    for (const line of lines) if (line.includes(text)) each(JSON.parse(line));
  });
}

/** The middle value of `values` (the upper one of an even count). */
export function median(values: number[]): number {
  return [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];
}

/** Prints the summary and writes it to `--json FILE` where given. */
export function report(summary: object): void {
  process.stdout.write(`${JSON.stringify(summary, null, 2)}\n`);
  const out = process.argv.indexOf('--json');
  if (out > 0) fs.writeFileSync(process.argv[out + 1], JSON.stringify(summary, null, 2));
}
