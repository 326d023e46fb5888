/**
 * A new daemon takes over from a running one (`vmmd --take-over`, the old
 * one started with `--park held`): everything it held comes over and its
 * clients carry on; and each way it can fail: the new daemon going away in
 * the middle, the old one going away, a second take-over at the same time,
 * no daemon at all, another uid, a daemon whose memory is not its own to give.
 */
import { ChildProcess, spawn } from 'node:child_process';
import { once } from 'node:events';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { call, eventually, freePort, healthCheck, MiB, packageRoot, Peer, scrapeMetrics, sleep, TestDaemon } from '../e2e/harness';
import { addon } from '../../native';
import { checksums, expectIntact, observed, populate } from './parked-objects';
import { HAND_OVER, killedAndServedAgain, successorKilledScenario, takingAll } from './take-over-scenario';

const DAEMON = path.join(packageRoot(), 'bin', 'vmmd.js');

/** `vmmd --take-over` on `dir`: the process, and its exit status and what it said once it ends. */
function startTakeOver(dir: string, extra: string[] = []): { child: ChildProcess; result: Promise<{ code: number | null; output: string }> } {
  const child = spawn(process.execPath, [DAEMON, '--backend', 'host', '--socket-dir', dir, '--take-over', 'on', '--log-level', 'warn', ...extra], {
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  child.stdout!.on('data', (chunk) => (output += chunk));
  child.stderr!.on('data', (chunk) => (output += chunk));
  const timer = setTimeout(() => child.kill('SIGKILL'), 60_000);
  const result = new Promise<{ code: number | null; output: string }>((resolve) =>
    child.once('exit', (code) => {
      clearTimeout(timer);
      resolve({ code, output });
    }),
  );
  return { child, result };
}

const takeOverRun = (dir: string, extra: string[] = []) => startTakeOver(dir, extra).result;

/** A peer on a hand-over socket speaking the protocol by hand (a daemon that stops half-way). */
class RawEnd {
  constructor(readonly fd: number) {}

  static connect(dir: string): RawEnd {
    return new RawEnd(addon.seqpacketConnect(path.join(dir, HAND_OVER)));
  }

  send(message: object, fds: number[] = []): void {
    addon.unixDgramSendFds(this.fd, Buffer.from(JSON.stringify(message)), fds);
  }

  /** The next message and its descriptors; null at EOF. */
  async next(timeoutMs = 30_000): Promise<{ message: any; fds: number[] } | null> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const got = addon.unixDgramRecvFds(this.fd, 65_536);
      if (got !== null) return got.data.length === 0 && got.fds.length === 0 ? null : { message: JSON.parse(got.data.toString()), fds: got.fds };
      if (Date.now() > deadline) throw new Error('no hand-over message');
      await sleep(5);
    }
  }

  close(): void {
    addon.close(this.fd);
  }
}

describe('vmmd --take-over', () => {
  const daemons: TestDaemon[] = [];
  const peers: Peer[] = [];
  afterEach(async () => {
    for (const peer of peers.splice(0)) await peer.kill().catch(() => undefined);
    // Only the daemon serving last owns the directory; the others have exited (or are stopped here).
    for (const daemon of daemons.splice(0).reverse()) {
      if (daemon.process.exitCode === null && daemon.process.signalCode === null) await daemon.stop();
    }
  });

  const held = ['--park', 'held', '--quota-per-uid', '64MiB', '--parked-grace-ms', '600000'];

  it('hands every store, byte, allocation, owner, share key, quota charge and session to a new daemon; the old exits 0; the new can be taken over in turn', async () => {
    const old = await TestDaemon.start(held);
    daemons.push(old);
    const made = await populate(old, peers);
    const sums = await checksums(old.dir);
    const before = await observed(old);
    const next = await TestDaemon.takeOver(old, held);
    daemons.push(next);
    expect(await old.exitStatus).toBe(0);
    await expectIntact(next, before, sums, made);
    // And again, from the daemon that took over.
    const third = await TestDaemon.takeOver(next, held);
    daemons.push(third);
    expect(await next.exitStatus).toBe(0);
    await expectIntact(third, before, sums, made);
    expect(fs.statSync(path.join(third.dir, HAND_OVER)).mode & 0o777).toBe(0o600);
  }, 240_000);

  it("its metrics and health ports: closed for the hand-over, open again where the old one serves again, then the successor's", async () => {
    const withPorts = [...held, '--metrics-port', String(await freePort()), '--health-port', String(await freePort())];
    const [metricsPort, healthPort] = [Number(withPorts.at(-3)), Number(withPorts.at(-1))];
    const answering = async () => ({
      health: await healthCheck(healthPort, 'vmmd.v1.VirtualMemory'),
      metrics: (await scrapeMetrics(metricsPort)).includes('vmmd_build_info'),
    });
    const old = await TestDaemon.start(withPorts);
    daemons.push(old);
    expect(await answering()).toEqual({ health: 'SERVING', metrics: true });
    const successor = await takingAll(old);
    await expect(scrapeMetrics(metricsPort)).rejects.toMatchObject({ code: 'ECONNREFUSED' });
    await killedAndServedAgain(old, successor);
    expect(await answering()).toEqual({ health: 'SERVING', metrics: true });
    const next = await TestDaemon.takeOver(old, withPorts);
    daemons.push(next);
    expect(await old.exitStatus).toBe(0);
    expect(await answering()).toEqual({ health: 'SERVING', metrics: true });
  }, 240_000);

  it('serving again that fails on a taken port gives back every port it opened: a later take-over binds them all', async () => {
    const withPorts = [...held, '--metrics-port', String(await freePort()), '--health-port', String(await freePort())];
    const [metricsPort, healthPort] = [Number(withPorts.at(-3)), Number(withPorts.at(-1))];
    const old = await TestDaemon.start(withPorts);
    daemons.push(old);
    const successor = await takingAll(old);
    // Someone takes the health port while the old one is quiesced: serving again fails after the metrics port opened.
    const squatter = net.createServer().listen(healthPort, '127.0.0.1');
    await once(squatter, 'listening');
    successor.kill('SIGKILL');
    await eventually(() => (old.logs.some((line) => line.includes('serving again failed')) ? true : undefined), 20_000, 'serving again to fail');
    await new Promise((resolve) => squatter.close(resolve));
    const next = await TestDaemon.takeOver(old, withPorts);
    daemons.push(next);
    expect(await old.exitStatus).toBe(0);
    expect(await healthCheck(healthPort, 'vmmd.v1.VirtualMemory')).toBe('SERVING');
    expect(await scrapeMetrics(metricsPort)).toContain('vmmd_build_info');
  }, 240_000);

  it('a new daemon SIGKILLed before it serves: the old one serves again with everything, its clients resume, and it can be taken over later', async () => {
    const served = await successorKilledScenario('host', held, daemons, peers);
    process.stdout.write(`successor SIGKILLed → the old daemon serving again: ${served} ms\n`);
  }, 240_000);

  it('an old daemon that goes away before it sent everything: the new one takes nothing and does not start; one that sent everything is served from', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-take-over-'));
    try {
      for (const sendsEnd of [false, true]) {
        const listener = addon.seqpacketListen(path.join(dir, HAND_OVER), 4);
        const run = startTakeOver(dir);
        const accepted = await eventually(() => addon.seqpacketAccept(listener) ?? undefined, 30_000, 'the new daemon to connect');
        const fake = new RawEnd(accepted.fd);
        expect((await fake.next())!.message.take).toBeDefined();
        const memfd = addon.hostMemfdCreate('vmmd-test', 2n * MiB);
        fake.send({ names: ['m1'] }, [memfd]);
        addon.close(memfd);
        if (sendsEnd) fake.send({ end: { descriptors: 1, pid: process.pid } });
        fake.close();
        addon.close(listener);
        fs.rmSync(path.join(dir, HAND_OVER), { force: true });
        if (!sendsEnd) {
          const { code, output } = await run.result;
          expect(code).toBe(1);
          expect(output).toContain('went away in the middle of the hand-over: nothing was taken over');
          expect(fs.existsSync(path.join(dir, 'vmmd.sock'))).toBe(false);
        } else {
          // Everything came (a descriptor no journal names, dropped as at any restore): the new daemon serves.
          await eventually(async () => (fs.existsSync(path.join(dir, 'vmmd.sock')) ? true : undefined), 60_000, 'the new daemon to serve');
          run.child.kill('SIGTERM');
          expect((await run.result).code).toBe(0);
        }
      }
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  }, 240_000);

  it('a second take-over while one is under way is refused, and nothing changes', async () => {
    const old = await TestDaemon.start(held);
    daemons.push(old);
    const made = await populate(old, peers);
    const before = await observed(old);
    const first = RawEnd.connect(old.dir);
    try {
      // The first has connected and not asked yet: it holds the hand-over socket.
      await sleep(200);
      const { code, output } = await takeOverRun(old.dir, held);
      expect(code).toBe(1);
      expect(output).toMatch(/refused the take-over: a take-over by pid \d+ is under way/);
    } finally {
      first.close();
    }
    expect(await observed(old)).toEqual(before);
    const fresh = await made.maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    expect(fresh.id).toBeDefined();
  }, 240_000);

  it('with no daemon running says so plainly, and leaves the directory as it was', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-take-over-'));
    try {
      const { code, output } = await takeOverRun(dir);
      expect(code).toBe(1);
      expect(output).toContain(`no vmmd is running on ${dir}`);
      expect(fs.readdirSync(dir)).toEqual([]);
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  }, 120_000);

  it('refuses another uid (SO_PEERCRED) even where the socket was opened to it, and nothing changes', async () => {
    const old = await TestDaemon.start(held);
    daemons.push(old);
    await populate(old, peers);
    const before = await observed(old);
    fs.chmodSync(old.dir, 0o711);
    fs.chmodSync(path.join(old.dir, HAND_OVER), 0o666);
    const script = `const { addon } = require(${JSON.stringify(path.join(packageRoot(), 'dist', 'native'))});
      const fd = addon.seqpacketConnect(${JSON.stringify(path.join(old.dir, HAND_OVER))});
      addon.unixDgramSendFds(fd, Buffer.from('{"take":{"pid":1,"version":"x"}}'), []);
      const poll = () => { const got = addon.unixDgramRecvFds(fd, 65536); if (got === null) return setTimeout(poll, 5); process.stdout.write(got.data.toString()); };
      poll();`;
    const reply = await new Promise<string>((resolve, reject) => {
      const child = spawn('setpriv', ['--reuid=65534', '--regid=65534', '--clear-groups', '--', process.execPath, '-e', script], {
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let out = '';
      let err = '';
      child.stdout!.on('data', (chunk) => (out += chunk));
      child.stderr!.on('data', (chunk) => (err += chunk));
      child.once('exit', (code) => (code === 0 ? resolve(out) : reject(new Error(`exit ${code}: ${err}`))));
    });
    expect(JSON.parse(reply).refused).toMatch(/^uid 65534 may not take over this daemon \(uid 0\): only its own uid or root may/);
    expect(await call(old.raw.devices, 'ListDevices', {})).toBeDefined();
    expect(await observed(old)).toEqual(before);
  }, 240_000);

  it('a daemon whose memory is not its own to give refuses, and one under systemd is named: nothing changes', async () => {
    const plain = await TestDaemon.start([]);
    daemons.push(plain);
    const refused = await takeOverRun(plain.dir);
    expect(refused.code).toBe(1);
    expect(refused.output).toContain('refused the take-over: this daemon holds no parked state to hand over (it was started without --park held)');
    expect(await call(plain.raw.devices, 'ListDevices', {})).toBeDefined();
    // Under a service manager's store (here a stand-in of systemd's notify socket) the upgrade is its restart.
    const manager = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-notify-'));
    const notify = addon.unixDgramBind(path.join(manager, 'notify'));
    try {
      const managed = await TestDaemon.start([], 'host', { NOTIFY_SOCKET: path.join(manager, 'notify') });
      daemons.push(managed);
      const underSystemd = await takeOverRun(managed.dir);
      expect(underSystemd.code).toBe(1);
      expect(underSystemd.output).toContain('takes no hand-over: it runs under systemd');
      expect(await call(managed.raw.devices, 'ListDevices', {})).toBeDefined();
      await managed.stop();
    } finally {
      addon.close(notify);
      fs.rmSync(manager, { recursive: true, force: true });
    }
  }, 240_000);

  it("takes over from vmmd's keeper (another binary): the keeper stops its daemon, hands everything over and exits 0", async () => {
    const keeper = await TestDaemon.start(['--keeper', 'on', '--quota-per-uid', '64MiB', '--parked-grace-ms', '600000']);
    daemons.push(keeper);
    const made = await populate(keeper, peers);
    const sums = await checksums(keeper.dir);
    const before = await observed(keeper);
    const next = await TestDaemon.takeOver(keeper, held);
    daemons.push(next);
    expect(await keeper.exitStatus).toBe(0);
    await expectIntact(next, before, sums, made);
  }, 240_000);

  it('a new daemon that goes away in the middle of a take-over from the keeper: the keeper serves again with everything', async () => {
    const keeper = await TestDaemon.start(['--keeper', 'on', '--quota-per-uid', '64MiB', '--parked-grace-ms', '600000']);
    daemons.push(keeper);
    const made = await populate(keeper, peers);
    const sums = await checksums(keeper.dir);
    const before = await observed(keeper);
    const dying = RawEnd.connect(keeper.dir);
    dying.send({ take: { pid: process.pid, version: 'test' } });
    for (;;) {
      const next = await dying.next();
      if (next === null || next.message.end !== undefined) break;
      for (const fd of next.fds) addon.close(fd);
    }
    dying.close();
    await eventually(
      async () =>
        await call(keeper.raw.devices, 'ListDevices', {}).then(
          () => true,
          () => undefined,
        ),
      60_000,
      'the keeper to serve again',
    );
    expect(keeper.process.exitCode).toBeNull();
    await expectIntact(keeper, before, sums, made);
  }, 240_000);
});
