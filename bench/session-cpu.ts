/**
 * What the daemon's CPU spends per session-socket operation: the time the
 * daemon process's threads ran (/proc/PID/task/TID/schedstat, in nanoseconds:
 * /proc/PID/stat's ticks are too coarse for a few microseconds; with --keeper
 * on, the serving daemon's and the keeper's apart) over many allocates,
 * releases and pings, divided by their count. CPU time, not wall time, so that a busy
 * machine's waiting is not counted; ping is the floor every frame pays.
 * Busy polling is off on both sides (the daemon's --busy-poll-us 0, the
 * client's VMMD_CLIENT_BUSY_POLL_US=0): its spinning costs CPU in proportion
 * to the wait, which is not the work being counted.
 *   node dist/bench/session-cpu.js [--backend host|cuda] [--count 4000] [--batch 200] [--daemon-args 'ARGS'] [--profile DIR [--profile-interval-us 100]]
 * Prints one JSON line: CPU µs per operation for the daemon (and the keeper).
 */
import * as fs from 'node:fs';
import { addon } from '../native';
import { startDaemon } from './lib/daemon';

const MiB = 1n << 20n;

function option(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at > 0 ? process.argv[at + 1] : fallback;
}

/** CPU µs the process's threads have run so far (a thread that ended meanwhile is not counted: the daemon's live for its life). */
function cpuMicros(pid: number | undefined): number {
  if (pid === undefined) return 0;
  let nanos = 0;
  for (const tid of fs.readdirSync(`/proc/${pid}/task`)) {
    try {
      nanos += Number(fs.readFileSync(`/proc/${pid}/task/${tid}/schedstat`, 'utf8').split(' ')[0]);
    } catch {
      // the thread ended between the listing and the read
    }
  }
  return nanos / 1000;
}

/** The serving daemon: the process itself, or under --keeper on, the keeper's child that runs bin/vmmd.js. */
function servingPid(pid: number): { daemon: number; keeper?: number } {
  let children: string[] = [];
  try {
    children = fs.readFileSync(`/proc/${pid}/task/${pid}/children`, 'utf8').trim().split(/\s+/).filter(Boolean);
  } catch {
    // no children file: no keeper
  }
  const child = children.map(Number).find((one) => fs.readFileSync(`/proc/${one}/cmdline`, 'utf8').includes('vmmd'));
  return child === undefined ? { daemon: pid } : { daemon: child, keeper: pid };
}

async function main(): Promise<void> {
  const backend = option('backend', 'host');
  const count = Number(option('count', '4000'));
  const batch = Number(option('batch', '200'));
  const extra = option('daemon-args', '')
    .split(' ')
    .filter((arg) => arg !== '');
  process.env.VMMD_CLIENT_BUSY_POLL_US = '0';
  const profile = option('profile', '');
  // The profile's default interval (1 ms) sees too few samples of operations of some tens of µs.
  const interval = option('profile-interval-us', '100');
  const nodeArgs = profile === '' ? [] : [`--cpu-prof-interval=${interval}`];
  const daemon = await startDaemon(backend, ['--busy-poll-us', '0', ...extra], profile === '' ? undefined : profile, nodeArgs);
  try {
    const session = daemon.client.session;
    const { daemon: pid, keeper } = servingPid(daemon.pid);
    const spent = { allocate: [0, 0], release: [0, 0], ping: [0, 0] };
    const measure = async (name: keyof typeof spent, run: () => Promise<void>) => {
      const [daemon0, keeper0] = [cpuMicros(pid), cpuMicros(keeper)];
      await run();
      spent[name][0] += cpuMicros(pid) - daemon0;
      spent[name][1] += cpuMicros(keeper) - keeper0;
    };
    // Warm-up: the daemon's paths through the optimizing compiler before anything counts.
    for (let i = 0; i < 500; i++) {
      const made = await session.allocate(2n * MiB);
      addon.close(made.fd);
      await session.release(made.message.allocationId);
      await session.ping();
    }
    // Batches: allocations live at most `batch` at a time (a host's capacity is small), each operation counted alone.
    for (let done = 0; done < count; done += batch) {
      const made: string[] = [];
      await measure('allocate', async () => {
        for (let i = 0; i < batch; i++) {
          const one = await session.allocate(2n * MiB);
          addon.close(one.fd);
          made.push(one.message.allocationId);
        }
      });
      await measure('release', async () => {
        for (const id of made) await session.release(id);
      });
      await measure('ping', async () => {
        for (let i = 0; i < batch; i++) await session.ping();
      });
    }
    const per = (name: keyof typeof spent, which: 0 | 1) => Number((spent[name][which] / count).toFixed(1));
    const result = {
      bench: 'session-cpu',
      backend,
      daemonArgs: extra.join(' '),
      count,
      daemonCpuMicros: { allocate: per('allocate', 0), release: per('release', 0), ping: per('ping', 0) },
      ...(keeper === undefined ? {} : { keeperCpuMicros: { allocate: per('allocate', 1), release: per('release', 1), ping: per('ping', 1) } }),
    };
    process.stdout.write(JSON.stringify(result) + '\n');
  } finally {
    await daemon.stop();
  }
}

main().catch((error) => {
  process.stderr.write(`${(error as Error).stack ?? error}\n`);
  process.exit(1);
});
