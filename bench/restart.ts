/**
 * Daemon SIGKILL to first request served again, with many objects parked:
 *   node dist/bench/restart.js [--backend host|cuda] [--objects N] [--rounds R] [--json FILE]
 * A daemon under vmmd's keeper holds N objects (allocations, one in ten a
 * store of its own allocation); the serving process is killed with SIGKILL and
 * the time until a new client's first request is answered is measured, from
 * the kill (the keeper's restart, the daemon's start, the restore of every
 * parked object and the client's connect all inside). The target: ≤ 1 s plus
 * the CUDA context's creation with 10,000 objects.
 */
import { spawn } from 'node:child_process';
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

/** The serving daemon: the keeper's only child. */
function servingPid(keeper: number): number | undefined {
  const children = fs.readFileSync(`/proc/${keeper}/task/${keeper}/children`, 'utf8').trim();
  return children === '' ? undefined : Number(children.split(' ')[0]);
}

async function main(): Promise<void> {
  const backend = option('backend', 'host');
  const objects = Number(option('objects', '10000'));
  const rounds = Number(option('rounds', '3'));
  const size = 64n << 10n;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-restart-bench-'));
  const hostArgs = backend === 'host' ? ['--host-granularity', '64KiB', '--host-capacity', String(BigInt(objects + 64) * size)] : [];
  const keeper = spawn(
    process.execPath,
    [
      path.join(packageRoot, 'bin', 'vmmd.js'),
      '--keeper',
      'on',
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
    ],
    {
      stdio: ['ignore', 'pipe', 'inherit'],
    },
  );
  // The daemon's own account of each restore (objects taken back, its milliseconds).
  const restores: Array<{ allocations: number; stores: number; ms: number }> = [];
  let pending = '';
  keeper.stdout!.on('data', (chunk: Buffer) => {
    pending += chunk.toString();
    const lines = pending.split('\n');
    pending = lines.pop()!;
    for (const line of lines) if (line.includes('parked memory taken back')) restores.push(JSON.parse(line));
  });
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
  // Objects: allocations and stores together; one allocation in ten becomes a store.
  for (let made = 0; made < objects; made++) {
    const allocated = await client.session.allocate(granularity);
    addon.close(allocated.fd);
    if (made % 10 === 9 && made + 1 < objects) {
      await client.stores.createStore({ allocationId: allocated.message.allocationId, name: `bench-${made}`, handOver: true });
      made++;
    }
  }
  process.stderr.write(`${objects} objects made in ${Date.now() - started} ms\n`);
  const results: number[] = [];
  for (let round = 0; round < rounds; round++) {
    const serving = servingPid(keeper.pid!)!;
    const killedAt = process.hrtime.bigint();
    process.kill(serving, 'SIGKILL');
    // Wait for the socket of the old process to be gone, so that the first answer is the new one's.
    while (servingPid(keeper.pid!) === serving) await new Promise((resolve) => setTimeout(resolve, 1));
    const again = await ready();
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
  const sorted = [...results].sort((a, b) => a - b);
  const summary = { backend, objects, rounds, killToServedMs: results, medianMs: sorted[Math.floor(sorted.length / 2)], restores };
  process.stdout.write(`${JSON.stringify(summary, null, 2)}\n`);
  const out = process.argv.indexOf('--json');
  if (out > 0) fs.writeFileSync(process.argv[out + 1], JSON.stringify(summary, null, 2));
}

main().catch((error) => {
  process.stderr.write(`${(error as Error).stack}\n`);
  process.exit(1);
});
