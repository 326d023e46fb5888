/**
 * A new daemon taking over from a running one, with many objects held:
 *   node dist/bench/take-over.js [--backend host|cuda] [--objects N] [--rounds R] [--json FILE]
 * A daemon started with `--park held` holds N objects (allocations, one in ten
 * a store of its own allocation); each round a new daemon process is started
 * with `--take-over on` on the same directory and the previous one hands
 * everything over. Measured: the hand-over as the new daemon counts it (its
 * request → serving: the old one's drain, the descriptors' transfer, the
 * restore, the bind) and the wall time from spawning the new process to a
 * new client's first request answered by it (its own start included).
 */
import { ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { connect } from '../client';
import { addon } from '../native';
import { packageRoot } from './lib/daemon';

function option(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at > 0 ? process.argv[at + 1] : fallback;
}

/** A daemon process and the hand-over it reported, once it has. */
function startDaemon(args: string[]): { child: ChildProcess; handOverMs: Promise<number> } {
  const child = spawn(process.execPath, [path.join(packageRoot, 'bin', 'vmmd.js'), ...args], { stdio: ['ignore', 'pipe', 'inherit'] });
  let pending = '';
  const handOverMs = new Promise<number>((resolve) =>
    child.stdout!.on('data', (chunk: Buffer) => {
      pending += chunk.toString();
      const lines = pending.split('\n');
      pending = lines.pop()!;
      for (const line of lines) if (line.includes('took over: serving')) resolve(JSON.parse(line).ms);
    }),
  );
  return { child, handOverMs };
}

async function main(): Promise<void> {
  const backend = option('backend', 'host');
  const objects = Number(option('objects', '10000'));
  const rounds = Number(option('rounds', '3'));
  const size = 64n << 10n;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-take-over-bench-'));
  const hostArgs = backend === 'host' ? ['--host-granularity', '64KiB', '--host-capacity', String(BigInt(objects + 64) * size)] : [];
  const args = [
    '--park',
    'held',
    '--backend',
    backend,
    '--socket-dir',
    dir,
    '--log-level',
    'info',
    '--stock',
    'none',
    '--parked-grace-ms',
    '3600000',
    '--max-allocations-per-uid',
    String(objects * 2),
    '--max-stores-per-uid',
    String(objects),
    ...hostArgs,
  ];
  let daemon = startDaemon(args);
  const ready = async () => {
    for (;;) {
      try {
        const client = await connect({ socketDir: dir });
        await client.session.ping();
        return client;
      } catch {
        await new Promise((resolve) => setTimeout(resolve, 2));
      }
    }
  };
  const client = await ready();
  const granularity = backend === 'host' ? size : 2n << 20n;
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
  client.close();
  const handOverMs: number[] = [];
  const spawnToServedMs: number[] = [];
  for (let round = 0; round < rounds; round++) {
    const old = daemon.child;
    const spawnedAt = process.hrtime.bigint();
    daemon = startDaemon([...args, '--take-over', 'on']);
    // Once the old one has exited, whoever answers is the new one.
    await new Promise((resolve) => old.once('exit', resolve));
    const again = await ready();
    spawnToServedMs.push(Number(process.hrtime.bigint() - spawnedAt) / 1e6);
    handOverMs.push(await daemon.handOverMs);
    const stores = (await again.stores.list()).length;
    again.close();
    process.stderr.write(
      `round ${round + 1}: hand-over ${handOverMs[round].toFixed(0)} ms, spawn to served ${spawnToServedMs[round].toFixed(0)} ms; ${stores} stores listed\n`,
    );
  }
  daemon.child.kill('SIGTERM');
  await new Promise((resolve) => daemon.child.once('exit', resolve));
  fs.rmSync(dir, { recursive: true, force: true });
  const median = (values: number[]) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];
  const summary = {
    backend,
    objects,
    rounds,
    handOverMs,
    spawnToServedMs,
    medianHandOverMs: median(handOverMs),
    medianSpawnToServedMs: median(spawnToServedMs),
  };
  process.stdout.write(`${JSON.stringify(summary, null, 2)}\n`);
  const out = process.argv.indexOf('--json');
  if (out > 0) fs.writeFileSync(process.argv[out + 1], JSON.stringify(summary, null, 2));
}

main().catch((error) => {
  process.stderr.write(`${(error as Error).stack}\n`);
  process.exit(1);
});
