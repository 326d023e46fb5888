/** How the daemon starts: backend choice without a driver, bad configuration, a second daemon. */
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { addon } from '../../native';
import { TestDaemon } from './harness';

const DAEMON = path.resolve(__dirname, '..', '..', 'bin', 'vmmd.js');
const noDriver = !addon.cudaLoad().loaded;

/** Runs the daemon until it exits or `until` matches its output; returns code and output. */
function runDaemon(args: string[], until?: RegExp): Promise<{ code: number | null; output: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [DAEMON, ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
    let output = '';
    let stopped = false;
    const onData = (chunk: Buffer) => {
      output += chunk;
      if (!stopped && until?.test(output)) {
        stopped = true;
        child.kill('SIGTERM');
      }
    };
    child.stdout.on('data', onData);
    child.stderr.on('data', onData);
    child.once('exit', (code) => resolve({ code, output }));
  });
}

let dir: string;
beforeEach(() => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-start-'));
});
afterEach(() => fs.rmSync(dir, { recursive: true, force: true }));

(noDriver ? describe : describe.skip)('without a CUDA driver', () => {
  it('--backend cuda fails fast with an actionable error', async () => {
    const { code, output } = await runDaemon(['--backend', 'cuda', '--socket-dir', dir]);
    expect(code).toBe(1);
    expect(output).toMatch(/--backend cuda: libcuda\.so\.1 not found .*run on a host with the NVIDIA driver, or use --backend host/);
  });

  it('--backend auto serves on the host backend and says why in one log line', async () => {
    const { code, output } = await runDaemon(['--backend', 'auto', '--socket-dir', dir], /vmmd serving/);
    expect(code).toBe(0);
    const reasons = output.split('\n').filter((line) => line.includes('using the host backend'));
    expect(reasons).toHaveLength(1);
    expect(JSON.parse(reasons[0]).reason).toMatch(/libcuda\.so\.1 not found/);
    expect(output).toMatch(/"backend":"host".*"msg":"vmmd serving"/);
  });
});

describe('configuration and sockets', () => {
  it('refuses invalid configuration at start, naming the key', async () => {
    const { code, output } = await runDaemon(['--host-capacity', 'plenty', '--socket-dir', dir]);
    expect(code).toBe(2);
    expect(output).toMatch(/^vmmd: --host-capacity: "plenty" is not a byte count/);
  });

  it('refuses a second daemon on a live socket, and replaces a stale one', async () => {
    const first = await TestDaemon.start();
    const { code, output } = await runDaemon(['--backend', 'host', '--socket-dir', first.dir]);
    expect(code).toBe(1);
    expect(output).toMatch(/another vmmd is serving/);
    await first.stop();
    fs.mkdirSync(dir, { recursive: true });
    fs.writeFileSync(path.join(dir, 'vmmd.sock'), 'stale');
    fs.writeFileSync(path.join(dir, 'vmmd.session.sock'), 'stale');
    const restarted = await runDaemon(['--backend', 'host', '--socket-dir', dir], /vmmd serving/);
    expect(restarted.code).toBe(0);
  });
});

/** Whether a process runs (a zombie does not count). */
function running(pid: number): boolean {
  try {
    return !/^\S+ \(.*\) Z/.test(fs.readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return false;
  }
}

describe('started through npm', () => {
  const ROOT = path.resolve(__dirname, '..', '..');
  /** A project that depends on vmmd, as npm install would leave it (the package linked, its bins in node_modules/.bin). */
  function project(): string {
    const at = path.join(dir, 'project');
    fs.mkdirSync(path.join(at, 'node_modules', '.bin'), { recursive: true });
    fs.writeFileSync(path.join(at, 'package.json'), JSON.stringify({ name: 'uses-vmmd', version: '1.0.0', dependencies: { vmmd: `file:${ROOT}` } }));
    fs.symlinkSync(ROOT, path.join(at, 'node_modules', 'vmmd'));
    fs.symlinkSync('../vmmd/bin/vmmd.js', path.join(at, 'node_modules', '.bin', 'vmmd'));
    return at;
  }
  const ways: Array<[string, string, string[], () => string]> = [
    ['npm start', 'npm', ['start', '--', '--backend', 'host'], () => ROOT],
    ['npx vmmd', 'npx', ['--no-install', 'vmmd', '--backend', 'host'], project],
  ];
  it.each(ways)(
    'SIGTERM to `%s`, the root of the process tree, stops the daemon and frees its socket',
    async (_what, tool, args, cwd) => {
      const sockets = path.join(dir, 'sockets');
      const started = spawn(tool, args, { cwd: cwd(), env: { ...process.env, VMMD_SOCKET_DIR: sockets }, stdio: ['ignore', 'pipe', 'pipe'] });
      let output = '';
      started.stdout.on('data', (chunk) => (output += chunk));
      started.stderr.on('data', (chunk) => (output += chunk));
      let daemonPid = 0;
      try {
        for (let waited = 0; !/"msg":"vmmd serving"/.test(output); waited += 100) {
          if (started.exitCode !== null || waited > 60_000) throw new Error(`${tool} ${args.join(' ')} did not serve: ${output}`);
          await new Promise((resolve) => setTimeout(resolve, 100));
        }
        daemonPid = Number(/"pid":(\d+)/.exec(output)![1]);
        expect(daemonPid).not.toBe(started.pid);
        started.kill('SIGTERM');
        const deadline = Date.now() + 20_000;
        while (running(daemonPid) && Date.now() < deadline) await new Promise((resolve) => setTimeout(resolve, 100));
        expect({ daemonRunning: running(daemonPid) }).toEqual({ daemonRunning: false });
        const again = await runDaemon(['--backend', 'host', '--socket-dir', sockets], /vmmd serving/);
        expect({ code: again.code, refused: /another vmmd is serving/.test(again.output) }).toEqual({ code: 0, refused: false });
      } finally {
        if (daemonPid > 0 && running(daemonPid)) process.kill(daemonPid, 'SIGKILL');
        if (started.exitCode === null) started.kill('SIGKILL');
      }
    },
    120_000,
  );
});

describe('start errors a person reads', () => {
  it('a flag error is its one line and where to look, not the whole usage', async () => {
    const { code, output } = await runDaemon(['--no-such-flag']);
    expect(code).toBe(2);
    expect(output.trim().split('\n')).toEqual([expect.stringMatching(/^vmmd: Unknown option '--no-such-flag'/), 'see vmmd --help']);
  });

  it('a socket directory under a parent where nothing can be made fails at once, plainly, on stderr', async () => {
    const child = spawn(process.execPath, [DAEMON, '--backend', 'host', '--socket-dir', '/proc/nope'], { stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (chunk) => (stdout += chunk));
    child.stderr.on('data', (chunk) => (stderr += chunk));
    const timer = setTimeout(() => child.kill('SIGKILL'), 20_000);
    const code = await new Promise((resolve) => child.once('exit', (exitCode, signal) => resolve(exitCode ?? signal)));
    clearTimeout(timer);
    expect(code).toBe(1);
    expect(stdout).not.toMatch(/"level":60/);
    expect(stderr).toMatch(/^vmmd cannot start: cannot create the socket directory \/proc\/nope: /);
    expect(stderr).not.toMatch(/\n\s+at /);
  }, 30_000);

  (process.getuid?.() === 0 ? it : it.skip)(
    "the image's user facing a root-owned socket directory is told the command that fixes it",
    async () => {
      fs.chmodSync(dir, 0o755);
      const child = spawn(
        'setpriv',
        ['--reuid=10001', '--regid=2000', '--clear-groups', '--', process.execPath, DAEMON, '--backend', 'host', '--socket-dir', dir, '--socket-group', '2000'],
        { stdio: ['ignore', 'pipe', 'pipe'] },
      );
      let stderr = '';
      child.stderr.on('data', (chunk) => (stderr += chunk));
      expect(await new Promise((resolve) => child.once('exit', resolve))).toBe(1);
      expect(stderr).toContain(`vmmd cannot start: `);
      expect(stderr).toContain(`install -d -o 10001 -g 2000 -m 0750 ${dir}`);
    },
    30_000,
  );
});
