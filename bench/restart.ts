/**
 * Daemon SIGKILL to first request served again, with many objects parked:
 *   node dist/bench/restart.js [--backend host|cuda] [--objects N] [--rounds R] [--json FILE] [--profile DIR]
 * A daemon under vmmd's keeper holds N objects (allocations, one in ten a
 * store of its own allocation); the serving process is killed with SIGKILL and
 * the time until a new client's first request is answered is measured, from
 * the kill (the keeper's restart, the daemon's start, the restore of every
 * parked object and the client's connect all inside). The target: ≤ 1 s plus
 * the CUDA context's creation with 10,000 objects. --profile writes a CPU
 * profile of the keeper and of each daemon it starts that exits cleanly (the
 * last: the restores of every round before it were SIGKILLed) into DIR.
 */
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { packageRoot } from './lib/daemon';
import { firstServed, makeObjects, median, onLogLines, option, parkedDaemonArgs, report } from './lib/parked-objects';

/** The serving daemon: the keeper's only child. */
function servingPid(keeper: number): number | undefined {
  const children = fs.readFileSync(`/proc/${keeper}/task/${keeper}/children`, 'utf8').trim();
  return children === '' ? undefined : Number(children.split(' ')[0]);
}

async function main(): Promise<void> {
  const backend = option('backend', 'host');
  const objects = Number(option('objects', '10000'));
  const rounds = Number(option('rounds', '3'));
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-restart-bench-'));
  const profile = option('profile', '');
  // The keeper starts each daemon with its own Node options: the profiler's among them.
  const nodeArgs = profile === '' ? [] : ['--cpu-prof', `--cpu-prof-dir=${path.resolve(profile)}`, '--cpu-prof-interval=100'];
  const keeper = spawn(
    process.execPath,
    [...nodeArgs, path.join(packageRoot, 'bin', 'vmmd.js'), '--keeper', 'on', ...parkedDaemonArgs(backend, dir, objects)],
    {
      stdio: ['ignore', 'pipe', 'inherit'],
    },
  );
  // The daemon's own account of each restore (objects taken back, its milliseconds).
  const restores: Array<Record<string, unknown>> = [];
  onLogLines(keeper.stdout!, 'parked memory taken back', (line) => restores.push(line));
  const client = await firstServed(dir);
  await makeObjects(client, backend, objects);
  const results: number[] = [];
  for (let round = 0; round < rounds; round++) {
    const serving = servingPid(keeper.pid!)!;
    const killedAt = process.hrtime.bigint();
    process.kill(serving, 'SIGKILL');
    // Wait for the socket of the old process to be gone, so that the first answer is the new one's.
    while (servingPid(keeper.pid!) === serving) await new Promise((resolve) => setTimeout(resolve, 1));
    const again = await firstServed(dir);
    const ms = Number(process.hrtime.bigint() - killedAt) / 1e6;
    const stores = (await again.stores.list()).length;
    again.close();
    results.push(ms);
    process.stderr.write(`round ${round + 1}: first request served ${ms.toFixed(0)} ms after SIGKILL; ${stores} stores listed\n`);
  }
  client.close();
  keeper.kill('SIGTERM');
  await new Promise((resolve) => keeper.once('exit', resolve));
  fs.rmSync(dir, { recursive: true, force: true });
  report({ backend, objects, rounds, killToServedMs: results, medianMs: median(results), restores });
}

main().catch((error) => {
  process.stderr.write(`${(error as Error).stack}\n`);
  process.exit(1);
});
