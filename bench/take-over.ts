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
import { packageRoot } from './lib/daemon';
import { firstServed, makeObjects, median, onLogLines, option, parkedDaemonArgs, report } from './lib/parked-objects';

/** A daemon process and the hand-over it reported, once it has. */
function startDaemon(args: string[]): { child: ChildProcess; handOverMs: Promise<number> } {
  const child = spawn(process.execPath, [path.join(packageRoot, 'bin', 'vmmd.js'), ...args], { stdio: ['ignore', 'pipe', 'inherit'] });
  const handOverMs = new Promise<number>((resolve) => onLogLines(child.stdout!, 'took over: serving', (line) => resolve(line.ms as number)));
  return { child, handOverMs };
}

async function main(): Promise<void> {
  const backend = option('backend', 'host');
  const objects = Number(option('objects', '10000'));
  const rounds = Number(option('rounds', '3'));
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-take-over-bench-'));
  const args = ['--park', 'held', ...parkedDaemonArgs(backend, dir, objects)];
  let daemon = startDaemon(args);
  const client = await firstServed(dir);
  await makeObjects(client, backend, objects);
  client.close();
  const handOverMs: number[] = [];
  const spawnToServedMs: number[] = [];
  for (let round = 0; round < rounds; round++) {
    const old = daemon.child;
    const spawnedAt = process.hrtime.bigint();
    daemon = startDaemon([...args, '--take-over', 'on']);
    // Once the old one has exited, whoever answers is the new one.
    await new Promise((resolve) => old.once('exit', resolve));
    const again = await firstServed(dir);
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
  report({
    backend,
    objects,
    rounds,
    handOverMs,
    spawnToServedMs,
    medianHandOverMs: median(handOverMs),
    medianSpawnToServedMs: median(spawnToServedMs),
  });
}

main().catch((error) => {
  process.stderr.write(`${(error as Error).stack}\n`);
  process.exit(1);
});
