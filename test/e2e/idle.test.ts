/**
 * An idle daemon is idle: with no client connected it neither spins before
 * sleeping nor wakes its loop on a timer of its own; while a client is
 * connected busy polling and the event-loop delay sampler run as before.
 */
import { ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as http from 'node:http';
import * as os from 'node:os';
import * as path from 'node:path';
import { eventually, freePort, RawSession, sleep } from './harness';

const DAEMON = path.resolve(__dirname, '..', '..', 'bin', 'vmmd.js');
/** Clock ticks a second of /proc/PID/stat's utime and stime (USER_HZ: 100 on every Linux build that matters). */
const TICKS_PER_SECOND = 100;

/** The process's user plus system CPU time so far, in seconds. */
function cpuSeconds(pid: number): number {
  const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
  // Fields after the command name (which may hold spaces), counted from field 3 (state).
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return (Number(fields[11]) + Number(fields[12])) / TICKS_PER_SECOND;
}

/** One counter of the daemon's /metrics. */
function metric(port: number, name: string): Promise<number> {
  return new Promise((resolve, reject) =>
    http
      .get({ host: '127.0.0.1', port, path: '/metrics' }, (response) => {
        let body = '';
        response.on('data', (chunk) => (body += chunk));
        response.on('end', () => {
          const line = body.split('\n').find((l) => l.startsWith(`${name} `));
          if (line === undefined) reject(new Error(`no ${name} in /metrics`));
          else resolve(Number(line.split(' ')[1]));
        });
      })
      .on('error', reject),
  );
}

let dir: string;
let child: ChildProcess | undefined;

afterEach(async () => {
  if (child !== undefined && child.exitCode === null) {
    const exited = new Promise((resolve) => child!.once('exit', resolve));
    child.kill('SIGTERM');
    await exited;
  }
  child = undefined;
  fs.rmSync(dir, { recursive: true, force: true });
});

/** Starts a daemon on a fresh directory and waits for it to serve, without connecting to it. */
async function startUnwatched(extra: string[] = []): Promise<ChildProcess> {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-idle-'));
  const started = spawn(process.execPath, [DAEMON, '--backend', 'host', '--socket-dir', dir, '--host-capacity', '64MiB', '--log-level', 'info', ...extra], {
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  started.stdout!.on('data', (chunk) => (output += chunk));
  started.stderr!.on('data', (chunk) => (output += chunk));
  await eventually(
    () => {
      if (started.exitCode !== null) throw new Error(`vmmd exited ${started.exitCode}: ${output}`);
      return output.includes('vmmd serving') ? true : undefined;
    },
    60_000,
    'the daemon to serve',
  );
  return started;
}

test('a daemon with no client uses at most 5% of one core over 10 s (its default busy polling on)', async () => {
  child = await startUnwatched();
  // The start's own work (the collector, lazy compilation) settles first.
  await sleep(2_000);
  const before = cpuSeconds(child.pid!);
  const from = process.hrtime.bigint();
  await sleep(10_000);
  const used = cpuSeconds(child.pid!) - before;
  const elapsed = Number(process.hrtime.bigint() - from) / 1e9;
  expect(used / elapsed).toBeLessThanOrEqual(0.05);
}, 90_000);

test('busy polling runs while a session is open and stops once the last one closes', async () => {
  const port = await freePort();
  child = await startUnwatched(['--metrics-port', String(port)]);
  const spins = () => metric(port, 'vmmd_busy_poll_spins_total');
  const idleBefore = await spins();
  await sleep(500);
  expect(await spins()).toBe(idleBefore);

  const session = new RawSession(dir);
  expect((await session.next()).type).toBe('hello');
  const openFrom = await spins();
  await eventually(async () => ((await spins()) > openFrom ? true : undefined), 10_000, 'the daemon to spin while a session is open');

  session.close();
  await eventually(async () => ((await metric(port, 'vmmd_sessions')) === 0 ? true : undefined), 10_000, 'the session to close');
  const closedFrom = await spins();
  await sleep(1_000);
  expect(await spins()).toBe(closedFrom);
}, 90_000);
