/**
 * What an idle daemon costs: a daemon started with no client at all, its
 * user plus system CPU time (/proc/PID/stat) over a window, as a share of
 * one core. Target: at most 1% over 60 s.
 *   node dist/bench/idle-cpu.js [--seconds 60] [--backend host|cuda] [--daemon-args 'ARGS']
 * Prints one JSON line.
 */
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';

const DAEMON = path.resolve(__dirname, '..', '..', 'bin', 'vmmd.js');
/** USER_HZ: the unit of utime and stime in /proc/PID/stat. */
const TICKS_PER_SECOND = 100;
/** The start's own work (lazy compilation, the collector) settles before the window opens. */
const SETTLE_MS = 3_000;

function option(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at > 0 ? process.argv[at + 1] : fallback;
}

function cpuSeconds(pid: number): number {
  const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return (Number(fields[11]) + Number(fields[12])) / TICKS_PER_SECOND;
}

function voluntarySwitches(pid: number): number {
  return Number(/voluntary_ctxt_switches:\s+(\d+)/.exec(fs.readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1] ?? NaN);
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

async function main(): Promise<void> {
  const seconds = Number(option('seconds', '60'));
  const backend = option('backend', 'host');
  const extra = option('daemon-args', '')
    .split(' ')
    .filter((arg) => arg !== '');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-idle-bench-'));
  const daemon = spawn(process.execPath, [DAEMON, '--backend', backend, '--socket-dir', dir, '--log-level', 'info', ...extra], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  let output = '';
  daemon.stdout!.on('data', (chunk) => (output += chunk));
  try {
    for (let waited = 0; !output.includes('vmmd serving'); waited += 100) {
      if (daemon.exitCode !== null || waited > 120_000) throw new Error(`the daemon did not start: ${output}`);
      await sleep(100);
    }
    await sleep(SETTLE_MS);
    const pid = daemon.pid!;
    const [cpu0, switches0, t0] = [cpuSeconds(pid), voluntarySwitches(pid), process.hrtime.bigint()];
    await sleep(seconds * 1000);
    const [cpu1, switches1, t1] = [cpuSeconds(pid), voluntarySwitches(pid), process.hrtime.bigint()];
    const elapsed = Number(t1 - t0) / 1e9;
    const share = (cpu1 - cpu0) / elapsed;
    process.stdout.write(
      `${JSON.stringify({
        section: 'idle-cpu',
        backend,
        daemonArgs: extra.join(' '),
        seconds: Number(elapsed.toFixed(1)),
        cpuSeconds: Number((cpu1 - cpu0).toFixed(2)),
        coreShare: Number(share.toFixed(4)),
        wakeupsPerSecond: Number(((switches1 - switches0) / elapsed).toFixed(1)),
        target: 0.01,
        met: share <= 0.01,
      })}\n`,
    );
  } finally {
    daemon.kill('SIGTERM');
    await new Promise((resolve) => daemon.once('exit', resolve));
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((error) => {
  process.stderr.write(`${(error as Error).message}\n`);
  process.exit(1);
});
