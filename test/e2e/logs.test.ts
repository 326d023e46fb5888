/**
 * What the daemon's log tells an operator: a clean close
 * and a crash read differently and say what was reclaimed; store create and
 * detach at info; sessions listed with command name and cgroup; an existing
 * socket directory is made owner-only.
 */
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { connect } from '../../client';
import { socketPaths } from '../../common/paths';
import { encodeClientFrame, PROTOCOL_VERSION } from '../../common/protocol';
import { addon } from '../../native';
import { eventually, MiB, Peer, sleep, TestDaemon } from './harness';

/** The daemon's JSON log lines with this message prefix. */
function lines(daemon: TestDaemon, prefix: string): Array<Record<string, any>> {
  return daemon.logs
    .filter((line) => line.startsWith('{'))
    .map((line) => JSON.parse(line))
    .filter((entry) => typeof entry.msg === 'string' && entry.msg.startsWith(prefix));
}

describe('the daemon log', () => {
  let daemon: TestDaemon;

  beforeAll(async () => {
    daemon = await TestDaemon.start(['--log-level', 'info']);
  });

  afterAll(async () => {
    expect(await daemon.stop()).toBe(0);
  });

  test('a clean close: info, closed by the client, with what was reclaimed', async () => {
    const client = await connect({ socketDir: daemon.dir });
    const id = String(client.session.id);
    await client.vmm.create({ size: 2n * MiB });
    await client.vmm.create({ size: 4n * MiB });
    await client.vmm.reserve({ size: 8n * MiB });
    client.close();
    const [entry] = await eventually(() => {
      const found = lines(daemon, 'session closed by the client').filter((e) => e.session === id);
      return found.length > 0 ? found : undefined;
    });
    expect(entry).toMatchObject({ level: 30, end: 'closed', reclaimed: { allocations: 2, bytes: String(6n * MiB), reservations: 1 }, peerPid: process.pid });
    expect(entry.msg).toBe(`session closed by the client; reclaimed 2 allocation(s), ${6n * MiB} bytes`);
  });

  test('kill -9: a warning naming the signal where the daemon saw the process die, else ended without closing; with what was reclaimed', async () => {
    const peer = await Peer.start(daemon.dir);
    const { session } = await peer.do({ op: 'connect' });
    await peer.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    peer.process.kill('SIGKILL');
    await peer.exited;
    const [entry] = await eventually(() => {
      const found = lines(daemon, 'session ').filter((e) => e.session === String(session) && e.end !== undefined);
      return found.length > 0 ? found : undefined;
    });
    // The exit signal is readable only while the process is still exiting when its socket hangs up;
    // reaped by then (its parent was quick), it is gone without a trace, and the line says only that.
    const crashed = entry.end === 'crashed';
    expect(entry).toMatchObject({ level: crashed ? 40 : 30, reclaimed: { allocations: 1, bytes: String(2n * MiB), reservations: 0 }, command: 'node' });
    expect(entry.msg).toMatch(
      crashed
        ? /^session lost: the client process ended by SIGKILL without closing it; reclaimed 1 allocation\(s\), 2097152 bytes$/
        : /^session ended without closing: the client process ended without close\(\); reclaimed 1 allocation\(s\), 2097152 bytes$/,
    );
  });

  test('a script that exits without close(): info, ended without closing, no warning', async () => {
    const client = path.resolve(__dirname, '..', '..', 'dist', 'client', 'index.js');
    const script = `require(${JSON.stringify(client)}).connect({ socketDir: ${JSON.stringify(daemon.dir)} }).then((c) => { console.log(c.session.id); process.exit(0); })`;
    const session = execFileSync(process.execPath, ['-e', script], { encoding: 'utf8' }).trim();
    const [entry] = await eventually(() => {
      const found = lines(daemon, 'session ').filter((e) => e.session === session && e.end !== undefined);
      return found.length > 0 ? found : undefined;
    });
    expect(entry).toMatchObject({
      level: 30,
      end: 'process-gone',
      msg: expect.stringMatching(/^session ended without closing: the client process ended without close\(\); reclaimed 0 allocation/),
    });
  });

  test('sessions the daemon closes as it stops are logged as closed by the daemon', async () => {
    const stopping = await TestDaemon.start(['--log-level', 'info']);
    const client = await connect({ socketDir: stopping.dir });
    const id = String(client.session.id);
    stopping.process.kill('SIGINT');
    expect(await stopping.stop()).toBe(0);
    const entry = lines(stopping, 'session ').find((e) => e.session === id && e.end !== undefined);
    expect(entry).toMatchObject({ level: 30, end: 'closed-by-daemon', msg: expect.stringMatching(/^session closed by the daemon \(stopping\); reclaimed/) });
    client.close();
  });

  test('store create, detach and release at info', async () => {
    const client = await connect({ socketDir: daemon.dir });
    const allocation = await client.vmm.create({ size: 2n * MiB });
    const store = await client.stores.createStore({ allocationId: allocation.id, name: 'logged' });
    await client.stores.detach('logged');
    const find = (prefix: string) => lines(daemon, prefix).find((e) => e.store === String(store.id));
    await eventually(() => find('store released'));
    expect(find('store created')).toMatchObject({ level: 30, name: 'logged', size: String(2n * MiB), by: `session ${client.session.id}` });
    expect(find('store detached')).toMatchObject({ level: 30, name: 'logged', opens: 0 });
    client.close();
  });

  test('ListSessions and the session-opened line name the command and the cgroup', async () => {
    const client = await connect({ socketDir: daemon.dir });
    const { sessions } = await client.admin.listSessions();
    const own = sessions.find((s) => s.id === String(client.session.id))!;
    const expectedCgroup =
      fs
        .readFileSync(`/proc/${process.pid}/cgroup`, 'utf8')
        .split('\n')
        .find((line) => line.startsWith('0::'))
        ?.slice(3) ?? '';
    expect(own).toMatchObject({ pid: process.pid, command: fs.readFileSync(`/proc/${process.pid}/comm`, 'utf8').trim(), cgroup: expectedCgroup });
    expect(own.command).not.toBe('');
    // The line is written when the session opens, and reaches the test's reader a moment later.
    const opened = await eventually(() => lines(daemon, 'session opened').find((e) => e.session === own.id), 10_000, 'the "session opened" line');
    expect(opened).toMatchObject({ command: own.command, cgroup: own.cgroup, peerPid: process.pid });
    client.close();
  });
});

describe('the socket directory', () => {
  test('an existing 0755 directory is made 0700, and the log says what it was', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-open-dir-'));
    fs.chmodSync(dir, 0o755);
    const daemon = await TestDaemon.start(['--socket-dir', dir]);
    try {
      expect((fs.statSync(dir).mode & 0o777).toString(8)).toBe('700');
      expect(lines(daemon, 'socket directory mode corrected')).toEqual([expect.objectContaining({ was: '755', now: '700', socketDir: dir })]);
    } finally {
      await daemon.stop();
    }
  });
});

describe('what a peer can make the daemon log', () => {
  test('sessions closed with unread answers: a bounded number of lines per uid, not one each', async () => {
    const daemon = await TestDaemon.start(['--log-level', 'info']);
    try {
      const SESSIONS = 60;
      for (let i = 0; i < SESSIONS; i++) {
        // A raw session: the greeting and the pongs are never read, and the socket is closed under them.
        const fd = addon.seqpacketConnect(socketPaths(daemon.dir).session);
        addon.seqpacketSend(fd, encodeClientFrame({ hello: { protocol: PROTOCOL_VERSION } }), -1);
        for (let ping = 1; ping <= 4; ping++) addon.seqpacketSend(fd, encodeClientFrame({ request: String(ping), ping: {} }), -1);
        await sleep(10);
        addon.close(fd);
      }
      await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 20_000, 'the sessions to close');
      const failed = lines(daemon, 'the session socket failed');
      expect(failed.length).toBeGreaterThan(0);
      expect(failed.length).toBeLessThanOrEqual(20);
      // Nothing else a session can cause came out once for each of them either.
      const perSession = daemon.logs.filter((line) => line.includes('"session"'));
      expect(perSession.length).toBeLessThanOrEqual(4 * 20);
    } finally {
      await daemon.stop();
    }
  });
});
