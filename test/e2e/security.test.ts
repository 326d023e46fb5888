/**
 * Operations over the real sockets: socket modes, a peer of another uid served
 * when its gid is allowed, sd_notify, and the TLS-only TCP listener. (Refusals,
 * isolation, transfer ids, read-only stores and quotas are in the reliability
 * suite: test/reliability/security.test.ts.)
 */
import * as grpc from '@grpc/grpc-js';
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { VmmdClient } from '../../client';
import { socketPaths } from '../../common/paths';
import { loadProtos } from '../../common/proto';
import { addon } from '../../native';
import { SeqpacketConnection, SeqpacketMessage } from '../../native/seqpacket';
import { call, eventually, Peer, TestDaemon } from './harness';

const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;
let daemon: TestDaemon | undefined;
const clients: VmmdClient[] = [];

afterEach(async () => {
  for (const client of clients.splice(0)) client.close();
  await daemon?.stop();
  daemon = undefined;
});

describe('sockets and peers', () => {
  it('creates the socket directory and sockets owner-only by default', async () => {
    const parent = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-modes-'));
    const dir = path.join(parent, 'run');
    daemon = await TestDaemon.start(['--socket-dir', dir]);
    expect(fs.statSync(dir).mode & 0o777).toBe(0o700);
    for (const socket of Object.values(socketPaths(dir))) expect(fs.statSync(socket).mode & 0o777).toBe(0o600);
    await daemon.stop();
    daemon = undefined;
    fs.rmSync(parent, { recursive: true, force: true });
  });

  (isRoot ? it : it.skip)('serves another uid when its gid is allowed', async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-uids', '0', '--allow-gids', String(NOBODY)]);
    const other = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
    expect(await other.do({ op: 'call', api: 'devices', method: 'listDevices' })).toMatchObject({ backend: 'host' });
    await other.stop();
  });

  // usermod -aG and Kubernetes' supplementalGroups add a supplementary group, not the primary one.
  (isRoot ? it : it.skip)('serves a uid whose supplementary group, not its primary, is allowed: on the session socket and over gRPC', async () => {
    daemon = await TestDaemon.start(['--socket-group', '2000', '--allow-uids', '0', '--allow-gids', '2000']);
    const other = await Peer.start(daemon.dir, { uid: 1000, gid: 1000, groups: [2000] });
    expect(await other.do({ op: 'call', api: 'devices', method: 'listDevices' })).toMatchObject({ backend: 'host' });
    await other.stop();
  });

  (isRoot ? it : it.skip)('refuses a uid none of whose groups is allowed, naming the groups it saw', async () => {
    daemon = await TestDaemon.start(['--socket-group', '2000', '--allow-uids', '0', '--allow-gids', '4000']);
    await expect(Peer.start(daemon.dir, { uid: 1000, gid: 1000, groups: [2000, 3000] })).rejects.toThrow(
      /uid 1000 \(gid 1000, groups 2000, 3000\) is not allowed: allowed uids \[0\], gids \[4000\]/,
    );
  });

  (isRoot ? it : it.skip)('makes an admin of a uid whose supplementary group is in --admin-gids', async () => {
    daemon = await TestDaemon.start(['--socket-group', '3000', '--admin-gids', '2000']);
    const member = await Peer.start(daemon.dir, { uid: 1000, gid: 1000, groups: [3000, 2000] });
    expect(await member.do({ op: 'call', api: 'admin', method: 'clearCaches' })).toMatchObject({ transfersClosed: expect.anything() });
    await member.stop();
    const outsider = await Peer.start(daemon.dir, { uid: 1001, gid: 1001, groups: [3000] });
    await expect(outsider.do({ op: 'call', api: 'admin', method: 'clearCaches' })).rejects.toThrow(/uid 1001 \(gid 1001, groups 3000\) is not one/);
    await outsider.stop();
  });
});

describe('sd_notify', () => {
  it('sends READY=1 once serving, WATCHDOG=1 while running, STOPPING=1 on SIGTERM', async () => {
    const socket = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-notify-')), 'notify.sock');
    const fd = addon.unixDgramBind(socket);
    const listener = new SeqpacketConnection(fd);
    const messages: string[] = [];
    listener.on('message', (message: SeqpacketMessage) => messages.push(message.data.toString()));
    daemon = await TestDaemon.start([], 'host', { NOTIFY_SOCKET: socket, WATCHDOG_USEC: '200000' });
    await eventually(() => (messages.some((m) => m.startsWith('READY=1')) ? true : undefined));
    expect(messages.find((m) => m.startsWith('READY=1'))).toMatch(/MAINPID=\d+/);
    await eventually(() => (messages.filter((m) => m === 'WATCHDOG=1').length >= 3 ? true : undefined), 20_000, 'three watchdog pings');
    await daemon.stop();
    daemon = undefined;
    await eventually(() => (messages.includes('STOPPING=1') ? true : undefined));
    listener.close();
    fs.rmSync(path.dirname(socket), { recursive: true, force: true });
  });
});

describe('the TCP listener', () => {
  const certs = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-tls-'));
  const file = (name: string) => path.join(certs, name);
  beforeAll(() => {
    const run = (...args: string[]) => execFileSync('openssl', args, { stdio: 'ignore' });
    run('req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-days', '1', '-subj', '/CN=vmmd test CA', '-keyout', file('ca.key'), '-out', file('ca.pem'));
    for (const name of ['server', 'client']) {
      run(
        'req',
        '-newkey',
        'rsa:2048',
        '-nodes',
        '-subj',
        `/CN=${name === 'server' ? 'localhost' : 'vmmd client'}`,
        '-keyout',
        file(`${name}.key`),
        '-out',
        file(`${name}.csr`),
      );
      fs.writeFileSync(file(`${name}.ext`), name === 'server' ? 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' : 'extendedKeyUsage=clientAuth\n');
      run(
        'x509',
        '-req',
        '-in',
        file(`${name}.csr`),
        '-CA',
        file('ca.pem'),
        '-CAkey',
        file('ca.key'),
        '-CAcreateserial',
        '-days',
        '1',
        '-extfile',
        file(`${name}.ext`),
        '-out',
        file(`${name}.pem`),
      );
    }
  });
  afterAll(() => fs.rmSync(certs, { recursive: true, force: true }));

  function tcpClient(port: number, withClientCert: boolean): any {
    const credentials = grpc.credentials.createSsl(
      fs.readFileSync(file('ca.pem')),
      withClientCert ? fs.readFileSync(file('client.key')) : null,
      withClientCert ? fs.readFileSync(file('client.pem')) : null,
    );
    return new (loadProtos().proto.vmmd.v1.Devices)(`localhost:${port}`, credentials);
  }

  it('serves TLS only, refuses session tokens and, with a CA, clients without a certificate', async () => {
    const port = 20000 + Math.floor(Math.random() * 20000);
    daemon = await TestDaemon.start([
      '--tcp-listen',
      `127.0.0.1:${port}`,
      '--tls-cert',
      file('server.pem'),
      '--tls-key',
      file('server.key'),
      '--tls-ca',
      file('ca.pem'),
    ]);
    const trusted = tcpClient(port, true);
    expect((await call(trusted, 'ListDevices', {})).backend).toBe('host');
    const metadata = new grpc.Metadata();
    metadata.set('vmmd-session-token', 'a'.repeat(64));
    await expect(call(trusted, 'ListDevices', {}, metadata)).rejects.toMatchObject({
      code: grpc.status.UNAUTHENTICATED,
      details: expect.stringMatching(/only over the Unix socket/),
    });
    trusted.close();
    const anonymous = tcpClient(port, false);
    await expect(call(anonymous, 'ListDevices', {})).rejects.toMatchObject({ code: grpc.status.UNAVAILABLE });
    anonymous.close();
  });
});
