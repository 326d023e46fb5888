/**
 * Where a cold cross-process memalloc's time goes: a diagnostic run, not a
 * benchmark section. It starts a daemon, makes cold memallocs through the
 * NBEP 7 manager (nothing pooled, frees at once) in four schedules, and
 * writes each call's begin and end (CLOCK_MONOTONIC, as the addon's driver
 * trace) to a JSON file. Run with VMMD_DRIVER_TRACE=1 and stderr kept: the
 * daemon's and this process's driver calls are then on the same clock, and
 * bench/cold_timeline.py lines them up (which driver calls of which
 * process overlap each memalloc, and the gaps between the client's steps).
 *   VMMD_DRIVER_TRACE=1 node dist/bench/cold-probe.js --backend cuda --out DIR 2> DIR/client-trace.txt
 * (--profile PROFILE_DIR: the daemon writes a V8 CPU profile there)
 * First 1 s busy (the CPU at work, as in the benchmark) and session pings,
 * the round trip's floor in the same state. Schedules, each after the one before:
 *   back-to-back  free, then the next memalloc at once (as the cold section);
 *   overlapped    free without waiting for its answer, then the next memalloc at once;
 *   settled       free, wait for the unmap here, then 0.5 ms busy (no sleep);
 *   apart         free, then 2 ms asleep (as the cold section's "2 ms apart");
 *   settled-apart free, wait for the unmap, then 2 ms asleep.
 */
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { connectWhenReady, packageRoot } from './lib/daemon';
import { manager, sizeName } from './sections/allocations';

const MiB = 1n << 20n;

function option(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at > 0 ? process.argv[at + 1] : fallback;
}

const now = () => process.hrtime.bigint();

function spin(microseconds: number): void {
  const until = now() + BigInt(microseconds * 1000);
  while (now() < until) {
    // busy: the CPU stays awake, the event loop does not turn
  }
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

async function main(): Promise<void> {
  const backend = option('backend', 'host');
  const iterations = Number(option('iterations', '400'));
  const out = option('out', fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-probe-')));
  fs.mkdirSync(out, { recursive: true });
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-probe-sock-'));
  const daemonErr = fs.openSync(path.join(out, 'daemon-trace.txt'), 'w');
  const profile = process.argv.includes('--profile') ? option('profile', '') : '';
  const child = spawn(
    process.execPath,
    [
      ...(profile ? ['--cpu-prof', `--cpu-prof-dir=${profile}`] : []),
      path.join(packageRoot, 'bin', 'vmmd.js'),
      '--backend',
      backend,
      '--socket-dir',
      dir,
      '--log-level',
      'warn',
    ],
    {
      stdio: ['ignore', 'inherit', daemonErr],
    },
  );
  const client = await connectWhenReady(dir, child);
  const emm = await manager(client, true);
  // The CPU at work first, as in the benchmark (the cold section runs after the pooled one).
  spin(1_000_000);
  const pings: Array<{ begin: string; end: string }> = [];
  for (let i = -20; i < iterations; i++) {
    const begin = now();
    await client.session.ping();
    if (i >= 0) pings.push({ begin: String(begin), end: String(now()) });
  }
  const calls: Array<{ schedule: string; size: string; i: number; begin: string; end: string; freed: string }> = [];
  const schedules: Array<[string, (size: bigint) => Promise<void>]> = [
    ['back-to-back', async () => undefined],
    ['overlapped', async () => undefined],
    [
      'settled',
      async () => {
        await emm.flush();
        spin(500);
      },
    ],
    [
      'apart',
      async () => {
        await sleep(2);
      },
    ],
    [
      'settled-apart',
      async () => {
        await emm.flush();
        await sleep(2);
      },
    ],
  ];
  try {
    for (const size of [2n * MiB, 64n * MiB]) {
      for (const [schedule, between] of schedules) {
        const count = size === 2n * MiB ? iterations : Math.ceil(iterations / 2);
        for (let i = -20; i < count; i++) {
          const begin = now();
          const pointer = await emm.memalloc(size);
          const end = now();
          // overlapped: the free's answer is not waited for (as when a release answers before the free), so
          // the daemon's release and this process's unmap overlap the next memalloc.
          if (schedule === 'overlapped') void Promise.resolve(pointer.free()).catch((error: Error) => process.stderr.write(`free failed: ${error.message}\n`));
          else await pointer.free();
          const freed = now();
          if (i >= 0) calls.push({ schedule, size: sizeName(size), i, begin: String(begin), end: String(end), freed: String(freed) });
          await between(size);
        }
        await emm.flush();
        await sleep(20);
      }
    }
  } finally {
    await emm.reset();
    client.close();
    child.kill('SIGTERM');
    await new Promise((resolve) => child.once('exit', resolve));
    fs.rmSync(dir, { recursive: true, force: true });
  }
  fs.writeFileSync(path.join(out, 'calls.json'), JSON.stringify({ pid: process.pid, daemonPid: child.pid, backend, calls, pings }));
  process.stdout.write(`probe: ${calls.length} memallocs, client pid ${process.pid}, daemon pid ${child.pid}; results in ${out}\n`);
}

main().catch((error) => {
  process.stderr.write(`probe failed: ${(error as Error).stack}\n`);
  process.exit(1);
});
