/**
 * Security and operations over the real sockets: socket modes, peers refused
 * by uid, isolation between sessions, transfer ids bound to their session,
 * quotas under concurrent requests, sd_notify, and the TLS-only TCP listener.
 */
import * as grpc from '@grpc/grpc-js';
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { connect, VmmdClient } from '../../client';
import { socketPaths } from '../../common/paths';
import { loadProtos } from '../../common/proto';
import { addon } from '../../native';
import { SeqpacketConnection, SeqpacketMessage } from '../../native/seqpacket';
import { call, eventually, MiB, Peer, TestDaemon } from './harness';

const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;
let daemon: TestDaemon | undefined;
const clients: VmmdClient[] = [];

afterEach(async () => {
  for (const client of clients.splice(0)) client.close();
  await daemon?.stop();
  daemon = undefined;
});

async function client(dir: string): Promise<VmmdClient> {
  const connected = await connect({ socketDir: dir });
  clients.push(connected);
  return connected;
}

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

  (isRoot ? it : it.skip)('refuses a peer whose uid is not allowed, and serves one that is (run as root)', async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-uids', '0']);
    expect(fs.statSync(daemon.dir).mode & 0o777).toBe(0o750);
    expect(fs.statSync(socketPaths(daemon.dir).session).mode & 0o777).toBe(0o660);
    await expect(Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY })).rejects.toMatchObject({
      code: 'PERMISSION_DENIED',
      message: expect.stringMatching(/uid 65534 \(gid 65534\) is not allowed/),
    });
    const root = await client(daemon.dir);
    expect((await root.devices.listDevices()).backend).toBe('host');
  });

  (isRoot ? it : it.skip)('serves another uid when its gid is allowed', async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--allow-uids', '0', '--allow-gids', String(NOBODY)]);
    const other = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
    expect(await other.do({ op: 'call', api: 'devices', method: 'listDevices' })).toMatchObject({ backend: 'host' });
    await other.stop();
  });
});

describe('isolation between sessions', () => {
  it("denies a session every touch of another session's objects", async () => {
    daemon = await TestDaemon.start();
    const a = await client(daemon.dir);
    const b = await client(daemon.dir);
    const allocation = await a.vmm.create({ size: 2n * MiB });
    const reservation = await a.vmm.reserve({ size: 2n * MiB });
    await a.vmm.map({ address: reservation.address, size: 2n * MiB, allocationId: allocation.id });
    await a.vmm.setAccess({ address: reservation.address, size: 2n * MiB, descriptors: [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }] });
    const store = await a.stores.createStore({ allocationId: allocation.id });
    const denied = { status: grpc.status.PERMISSION_DENIED };
    await expect(b.vmm.read(reservation.address, 4)).rejects.toMatchObject(denied);
    await expect(b.vmm.write(reservation.address, Buffer.from('x'))).rejects.toMatchObject(denied);
    await expect(b.vmm.unmap({ address: reservation.address, size: 2n * MiB })).rejects.toMatchObject(denied);
    await expect(b.vmm.release({ allocationId: allocation.id })).rejects.toMatchObject(denied);
    await expect(b.vmm.export({ allocationId: allocation.id })).rejects.toMatchObject(denied);
    await expect(b.vmm.share({ allocationId: allocation.id })).rejects.toMatchObject(denied);
    await expect(b.vmm.freeAddress({ address: reservation.address, size: 2n * MiB })).rejects.toMatchObject(denied);
    await expect(b.stores.detach(BigInt(store.id))).rejects.toMatchObject(denied);
    expect((await a.vmm.read(reservation.address, 1)).length).toBe(1);
  });

  it('binds transfer ids to their session: another session cannot claim them', async () => {
    daemon = await TestDaemon.start(['--transfer-wait-ms', '300']);
    const a = await client(daemon.dir);
    const b = await client(daemon.dir);
    const fd = addon.hostMemfdCreate('a-only', 2n * MiB);
    const transferId = a.session.sendDescriptor(fd);
    addon.close(fd);
    await eventually(async () => ((await daemon!.stats()).pendingTransfers === 1 ? true : undefined));
    await expect(b.vmm.importTransfer({ transferId })).rejects.toMatchObject({ code: 'TRANSFER_NOT_RECEIVED', status: grpc.status.DEADLINE_EXCEEDED });
    expect((await a.vmm.importTransfer({ transferId })).imported).toBe(true);
    await expect(a.vmm.importTransfer({ transferId })).rejects.toMatchObject({ code: 'TRANSFER_USED' });
  });
});

describe('quotas', () => {
  it('hold under concurrent requests, per session and per uid, and say requested, used and limit', async () => {
    daemon = await TestDaemon.start(['--quota-per-session', '8MiB', '--quota-per-uid', '12MiB']);
    const a = await client(daemon.dir);
    const results = await Promise.allSettled(Array.from({ length: 10 }, () => a.vmm.create({ size: 2n * MiB })));
    const granted = results.filter((result) => result.status === 'fulfilled');
    const refused = results.filter((result): result is PromiseRejectedResult => result.status === 'rejected');
    expect(granted).toHaveLength(4);
    for (const refusal of refused) {
      expect(refusal.reason).toMatchObject({ code: 'QUOTA_EXCEEDED', status: grpc.status.RESOURCE_EXHAUSTED, errorCode: 3 });
      expect(refusal.reason.message).toMatch(/session \d+ quota: requested 2097152 bytes, 8388608 of 8388608 bytes in use/);
    }
    const b = await client(daemon.dir);
    await expect(b.vmm.create({ size: 6n * MiB })).rejects.toMatchObject({
      code: 'QUOTA_EXCEEDED',
      message: expect.stringMatching(/uid \d+ quota: requested 6291456 bytes, 8388608 of 12582912 bytes in use/),
    });
    await b.vmm.create({ size: 4n * MiB });
    // Freed memory gives its quota back.
    await a.vmm.release({ allocationId: (granted[0] as PromiseFulfilledResult<{ id: string }>).value.id });
    await a.vmm.create({ size: 2n * MiB });
    // The daemon's own (sessionless) calls are not limited.
    await expect(call(daemon.raw.vmm, 'Create', { size: String(16n * MiB) })).resolves.toMatchObject({ ownerSession: '0' });
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
    await eventually(() => (messages.filter((m) => m === 'WATCHDOG=1').length >= 3 ? true : undefined), 3_000, 'three watchdog pings');
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
      run('req', '-newkey', 'rsa:2048', '-nodes', '-subj', `/CN=${name === 'server' ? 'localhost' : 'vmmd client'}`, '-keyout', file(`${name}.key`), '-out', file(`${name}.csr`));
      fs.writeFileSync(file(`${name}.ext`), name === 'server' ? 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' : 'extendedKeyUsage=clientAuth\n');
      run('x509', '-req', '-in', file(`${name}.csr`), '-CA', file('ca.pem'), '-CAkey', file('ca.key'), '-CAcreateserial', '-days', '1', '-extfile', file(`${name}.ext`), '-out', file(`${name}.pem`));
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
      '--tcp-listen', `127.0.0.1:${port}`, '--tls-cert', file('server.pem'), '--tls-key', file('server.key'), '--tls-ca', file('ca.pem'),
    ]);
    const trusted = tcpClient(port, true);
    expect((await call(trusted, 'ListDevices', {})).backend).toBe('host');
    const metadata = new grpc.Metadata();
    metadata.set('vmmd-session-token', 'a'.repeat(64));
    await expect(call(trusted, 'ListDevices', {}, metadata)).rejects.toMatchObject({ code: grpc.status.UNAUTHENTICATED, details: expect.stringMatching(/only over the Unix socket/) });
    trusted.close();
    const anonymous = tcpClient(port, false);
    await expect(call(anonymous, 'ListDevices', {})).rejects.toMatchObject({ code: grpc.status.UNAVAILABLE });
    anonymous.close();
  });
});
