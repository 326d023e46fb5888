/**
 * Sessions over the real sockets: tokens, calls without a session, descriptors
 * sent by the client, protocol errors, and reclaim when a session closes.
 */
import * as grpc from '@grpc/grpc-js';
import * as fs from 'node:fs';
import { connect, VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import type { AccessDescriptor } from '../../generated/vmmd/v1/AccessDescriptor';
import { addon, HOST_ACCESS } from '../../native';
import { SeqpacketConnection } from '../../native/seqpacket';
import { call, eventually, MiB, RawSession, sleep, TestDaemon } from './harness';

const RW: AccessDescriptor[] = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];

let daemon: TestDaemon;
const clients: VmmdClient[] = [];

beforeAll(async () => {
  daemon = await TestDaemon.start();
});

afterAll(async () => {
  expect(await daemon.stop()).toBe(0);
});

afterEach(async () => {
  for (const client of clients.splice(0)) client.close();
  // The next test counts the daemon's descriptors: the closed clients' sockets must be gone from it first.
  await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'the sessions to close');
  await eventually(
    async () => {
      const now = daemon.openFds();
      await sleep(50);
      return daemon.openFds() === now ? true : undefined;
    },
    10_000,
    "the daemon's descriptors to settle",
  );
});

async function client(): Promise<VmmdClient> {
  const connected = await connect({ socketDir: daemon.dir });
  clients.push(connected);
  return connected;
}

/** The daemon's objects and bytes: what a refused or reclaimed request must leave as it was. */
function objectsOf(stats: Awaited<ReturnType<TestDaemon['stats']>>) {
  const { reservations, allocations, mappings, reservedBytes, allocatedBytes, importedBytes, mappedBytes, pendingTransfers } = stats;
  return { reservations, allocations, mappings, reservedBytes, allocatedBytes, importedBytes, mappedBytes, pendingTransfers };
}

async function settled(): Promise<void> {
  await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'sessions to close');
}

/** A memfd with bytes written into it, as a client would share its own memory. */
function memfdWith(text: string, size = 2n * MiB): number {
  const fd = addon.hostMemfdCreate('client', size);
  const address = addon.hostReserve(size, size, 0n);
  addon.hostMap(address, size, fd, 0n);
  addon.hostProtect(address, size, HOST_ACCESS.READWRITE);
  const view = addon.hostArrayBuffer(address, Number(size));
  Buffer.from(view).write(text);
  addon.hostDetachArrayBuffer(view);
  addon.hostUnmap(address, size);
  addon.hostFreeAddress(address, size);
  return fd;
}

describe('calls without a session', () => {
  it('create daemon-owned objects that outlive sessions, and cannot receive descriptors', async () => {
    const created = await call(daemon.raw.vmm, 'Create', { size: String(2n * MiB) });
    expect(created.ownerSession).toBe('0');
    await expect(call(daemon.raw.vmm, 'Export', { allocationId: created.id })).rejects.toMatchObject({
      code: grpc.status.FAILED_PRECONDITION,
      details: expect.stringMatching(/Export needs a session/),
    });
    await expect(call(daemon.raw.vmm, 'Import', { transferId: '1' })).rejects.toMatchObject({ code: grpc.status.FAILED_PRECONDITION });
    const session = await client();
    session.close();
    await settled();
    expect((await call(daemon.raw.vmm, 'GetProperties', { allocationId: created.id })).id).toBe(created.id);
    expect(await call(daemon.raw.vmm, 'Release', { allocationId: created.id })).toMatchObject({ freed: true });
  });

  it('refuses an unknown session token with UNAUTHENTICATED', async () => {
    const metadata = new grpc.Metadata();
    metadata.set(SESSION_METADATA_KEY, 'f'.repeat(64));
    await expect(call(daemon.raw.devices, 'ListDevices', {}, metadata)).rejects.toMatchObject({ code: grpc.status.UNAUTHENTICATED });
  });
});

describe('refusals over the wire', () => {
  it('carry the status, the rule code in trailers and a message naming the value; nothing changes', async () => {
    const before = objectsOf(await daemon.stats());
    const error = await call(daemon.raw.vmm, 'Reserve', { size: '1000' }).catch((e) => e);
    expect(error.code).toBe(grpc.status.INVALID_ARGUMENT);
    expect(error.metadata.get('vmmd-error-code')).toEqual(['NOT_ALIGNED']);
    expect(error.details).toBe('reservation size 1000 is not a multiple of the granularity 2097152');
    await expect(call(daemon.raw.vmm, 'Reserve', { size: '18446744073709551615' })).rejects.toMatchObject({
      code: grpc.status.INVALID_ARGUMENT,
    });
    await expect(call(daemon.raw.vmm, 'Create', { size: String(2n * MiB), location: { type: 9 } })).rejects.toMatchObject({
      code: grpc.status.INVALID_ARGUMENT,
      details: expect.stringMatching(/location.type 9 is not a LocationType/),
    });
    await expect(call(daemon.raw.vmm, 'Create', { size: String(512n * MiB) })).rejects.toMatchObject({
      code: grpc.status.RESOURCE_EXHAUSTED,
      details: expect.stringMatching(/requested 536870912 bytes, 0 of 268435456 bytes in use/),
    });
    await expect(call(daemon.raw.devices, 'GetMemoryInfo', { device: 4 })).rejects.toMatchObject({ code: grpc.status.OUT_OF_RANGE });
    await expect(
      call(daemon.raw.vmm, 'Create', { size: String(2n * MiB), location: { type: 'LOCATION_TYPE_DEVICE', deviceUuid: 'GPU-nope' } }),
    ).rejects.toMatchObject({ code: grpc.status.OUT_OF_RANGE, details: expect.stringMatching(/"GPU-nope" names no device/) });
    expect(objectsOf(await daemon.stats())).toEqual(before);
  });

  it('reach the client library as VmmdError with a string code and the gRPC status', async () => {
    const session = await client();
    const error = await session.vmm.create({ size: 1n }).catch((e) => e);
    expect(error).toMatchObject({ name: 'VmmdError', code: 'NOT_ALIGNED', status: grpc.status.INVALID_ARGUMENT, statusName: 'INVALID_ARGUMENT' });
  });
});

describe('descriptors from the client', () => {
  it("imports a client's memfd: the daemon maps and reads the client's bytes, and releases the descriptor", async () => {
    const session = await client();
    // Its gRPC connection first: the client's channel is its own (its own reconnection backoff), not the harness's.
    await session.devices.getGranularity();
    const fdsBefore = daemon.openFds();
    const fd = memfdWith('bytes from the client');
    const allocation = await session.vmm.importDescriptor(fd);
    addon.close(fd);
    expect(allocation).toMatchObject({ imported: true, size: String(2n * MiB), ownerSession: session.session.id });
    const reservation = await session.vmm.reserve({ size: 2n * MiB });
    await session.vmm.map({ address: reservation.address, size: 2n * MiB, allocationId: allocation.id });
    await session.vmm.setAccess({ address: reservation.address, size: 2n * MiB, descriptors: RW });
    expect((await session.vmm.read(reservation.address, 21)).toString()).toBe('bytes from the client');
    await session.vmm.unmap({ address: reservation.address, size: 2n * MiB });
    await session.vmm.freeAddress({ address: reservation.address, size: 2n * MiB });
    expect(await session.vmm.release({ allocationId: allocation.id })).toMatchObject({ freed: true });
    expect(daemon.openFds()).toBe(fdsBefore);
  });

  it('refuses a descriptor that is not memory with INVALID_ARGUMENT and keeps no descriptor', async () => {
    const session = await client();
    const before = objectsOf(await daemon.stats());
    // Its gRPC connection first: the client's channel is its own (its own reconnection backoff), not the harness's.
    await session.devices.getGranularity();
    const fdsBefore = daemon.openFds();
    const file = fs.openSync(__filename, 'r');
    await expect(session.vmm.importDescriptor(file)).rejects.toMatchObject({ code: 'BAD_DESCRIPTOR', status: grpc.status.INVALID_ARGUMENT });
    fs.closeSync(file);
    const odd = addon.hostMemfdCreate('odd', 4096n);
    await expect(session.vmm.importDescriptor(odd)).rejects.toMatchObject({
      code: 'BAD_DESCRIPTOR',
      message: expect.stringMatching(/size 4096 is not a positive multiple of the granularity/),
    });
    addon.close(odd);
    expect(objectsOf(await daemon.stats())).toEqual(before);
    expect(daemon.openFds()).toBe(fdsBefore);
  });

  it('uses a transfer id once', async () => {
    const session = await client();
    const fd = memfdWith('once');
    const transferId = session.session.sendDescriptor(fd);
    addon.close(fd);
    await session.vmm.importTransfer({ transferId });
    await expect(session.vmm.importTransfer({ transferId })).rejects.toMatchObject({
      code: 'TRANSFER_USED',
      status: grpc.status.FAILED_PRECONDITION,
    });
  });

  it('gives up on a transfer that never arrives', async () => {
    const session = await client();
    await expect(session.vmm.importTransfer({ transferId: '99' })).rejects.toMatchObject({
      code: 'TRANSFER_NOT_RECEIVED',
      status: grpc.status.DEADLINE_EXCEEDED,
    });
  }, 15_000);
});

describe('the session socket protocol', () => {
  let session: RawSession;
  let raw: SeqpacketConnection;
  const next = () => session.next();

  beforeEach(async () => {
    session = new RawSession(daemon.dir);
    raw = session.connection;
    expect(await next()).toMatchObject({
      type: 'hello',
      protocol: 2,
      pid: process.pid,
      uid: process.getuid!(),
      capabilities: ['CAPABILITY_MEMFD_DESCRIPTORS', 'CAPABILITY_READ_ONLY_DESCRIPTORS'],
    });
  });

  afterEach(() => session.close());

  it('answers ping with pong, the nonce and the request id', async () => {
    session.send({ request: '5', ping: { nonce: 'n1' } });
    expect(await next()).toEqual({ type: 'pong', request: '5', nonce: 'n1' });
  });

  it('answers bad frames with an error and keeps the session', async () => {
    const fdsBefore = daemon.openFds();
    // Not protobuf: a hello whose length runs past the frame.
    raw.send(Buffer.from([0x12, 0x05, 0x01]));
    expect(await next()).toMatchObject({ type: 'error', code: 'BAD_MESSAGE', status: grpc.status.INVALID_ARGUMENT });
    // A body this daemon does not know (field 12), and a frame with no body at all.
    raw.send(Buffer.from([0x08, 0x07, 0x62, 0x00]));
    expect(await next()).toMatchObject({ type: 'error', code: 'BAD_MESSAGE', message: expect.stringContaining('no request this daemon knows') });
    session.send({ request: '8' });
    expect(await next()).toMatchObject({ type: 'error', code: 'BAD_MESSAGE', request: '8' });
    raw.send(Buffer.alloc(10_000, 0x20));
    expect(await next()).toMatchObject({ type: 'error', code: 'MESSAGE_TOO_LARGE' });
    session.send({ transfer: { id: '5' } });
    expect(await next()).toMatchObject({ type: 'error', code: 'NO_DESCRIPTOR', transfer: '5' });
    const fd = addon.hostMemfdCreate('stray', 2n * MiB);
    session.send({ ping: {} }, fd);
    expect(await next()).toMatchObject({ type: 'error', code: 'UNEXPECTED_DESCRIPTOR' });
    session.send({ transfer: { id: '0' } }, fd);
    expect(await next()).toMatchObject({ type: 'error', code: 'BAD_MESSAGE' });
    session.send({ hello: { protocol: 2 } });
    expect(await next()).toMatchObject({ type: 'error', code: 'BAD_MESSAGE', message: expect.stringContaining('hello comes once') });
    addon.close(fd);
    session.send({ request: '9', ping: { nonce: 'still here' } });
    expect(await next()).toEqual({ type: 'pong', request: '9', nonce: 'still here' });
    expect(daemon.openFds()).toBe(fdsBefore);
  });

  it('echoes the request id of an allocate it refuses, whenever the frame named one', async () => {
    const fdsBefore = daemon.openFds();
    // A location type the daemon does not know: Create's own refusal, naming the request.
    session.send({ request: '42', allocate: { size: '2097152', location: { type: 9 as never } } });
    expect(await next()).toMatchObject({ type: 'error', code: 'BAD_ENUM', request: '42', status: grpc.status.INVALID_ARGUMENT });
    // With a descriptor attached: UNEXPECTED_DESCRIPTOR naming the request, the descriptor closed.
    const fd = addon.hostMemfdCreate('stray', 2n * MiB);
    session.send({ request: '43', allocate: { size: '2097152' } }, fd);
    expect(await next()).toMatchObject({ type: 'error', code: 'UNEXPECTED_DESCRIPTOR', request: '43' });
    addon.close(fd);
    // A request without an id is refused: its answer could not be told apart.
    session.send({ allocate: { size: '2097152' } });
    expect(await next()).toMatchObject({ type: 'error', code: 'BAD_MESSAGE', request: '0' });
    expect((await daemon.stats()).allocations).toBe('0');
    expect(daemon.openFds()).toBe(fdsBefore);
  });

  it('refuses a transfer id that does not increase, and closes its descriptor', async () => {
    const fdsBefore = daemon.openFds();
    const fd = addon.hostMemfdCreate('replayed', 2n * MiB);
    session.send({ transfer: { id: '7' } }, fd);
    session.send({ transfer: { id: '7' } }, fd);
    expect(await next()).toMatchObject({ type: 'error', code: 'TRANSFER_USED', transfer: '7' });
    session.send({ transfer: { id: '3' } }, fd);
    expect(await next()).toMatchObject({ type: 'error', code: 'TRANSFER_USED', transfer: '3' });
    addon.close(fd);
    expect((await daemon.stats()).pendingTransfers).toBe(1);
    expect(daemon.openFds()).toBe(fdsBefore + 1);
  });

  it('closes unclaimed descriptors when the session ends', async () => {
    const fdsBefore = daemon.openFds();
    const fd = addon.hostMemfdCreate('unclaimed', 2n * MiB);
    session.send({ transfer: { id: '1' } }, fd);
    addon.close(fd);
    await eventually(async () => ((await daemon.stats()).pendingTransfers === 1 ? true : undefined), 20_000, 'the transfer to arrive');
    raw.close();
    await eventually(async () => ((await daemon.stats()).pendingTransfers === 0 ? true : undefined), 20_000, 'the transfer to be closed');
    await eventually(() => (daemon.openFds() <= fdsBefore - 1 ? true : undefined), 20_000, 'the daemon to close the descriptor');
  });
});

describe('a client of session protocol 1', () => {
  /** What a client of protocol 1 reads first, its hello: here the daemon's refusal, in JSON. */
  const firstJson = async (session: RawSession) => JSON.parse((await session.nextRaw()).data.toString('utf8'));
  const closed = (session: RawSession) => eventually(() => (session.connection.isClosed ? true : undefined), 20_000, 'the daemon to close the connection');

  it('that waits for the daemon to speak first is told, in JSON, the protocol it needs, and the daemon serves on', async () => {
    const old = new RawSession(daemon.dir, false);
    expect(await firstJson(old)).toEqual({
      type: 'error',
      code: 'PROTOCOL_VERSION',
      status: grpc.status.FAILED_PRECONDITION,
      protocol: 2,
      message: expect.stringMatching(/speaks session protocol 2 .*upgrade this client to one of protocol 2/),
    });
    await closed(old);
    const current = await client();
    await current.session.ping();
  });

  it('that sends a JSON frame is told the same at once', async () => {
    const old = new RawSession(daemon.dir, false);
    old.connection.send(Buffer.from(JSON.stringify({ type: 'ping', nonce: 'n1' })));
    expect(await firstJson(old)).toMatchObject({ type: 'error', code: 'PROTOCOL_VERSION', message: expect.stringContaining('sent a JSON frame') });
    await closed(old);
  });

  it("whose hello names another version gets PROTOCOL_VERSION naming the daemon's", async () => {
    const old = new RawSession(daemon.dir, false);
    old.send({ hello: { protocol: 1 } });
    expect(await old.next()).toMatchObject({
      type: 'error',
      code: 'PROTOCOL_VERSION',
      protocol: 2,
      message: expect.stringContaining('speaks session protocol 2, not 1'),
    });
    await closed(old);
  });
});

describe('the client session', () => {
  it('settles a ping in flight when the session closes: SESSION_LOST, never a promise left hanging', async () => {
    const c = await client();
    await c.session.ping();
    const pending = c.session.ping();
    c.session.close();
    await expect(pending).rejects.toMatchObject({ code: 'SESSION_LOST' });
    await expect(c.session.ping()).rejects.toMatchObject({ code: 'SESSION_LOST' });
  });
});

describe('the lease', () => {
  it("reclaims a closed session's objects, even with a Read in flight", async () => {
    await settled();
    const before = objectsOf(await daemon.stats());
    const session = await client();
    const allocation = await session.vmm.create({ size: 64n * MiB });
    const reservation = await session.vmm.reserve({ size: 64n * MiB });
    await session.vmm.map({ address: reservation.address, size: 64n * MiB, allocationId: allocation.id });
    await session.vmm.setAccess({ address: reservation.address, size: 64n * MiB, descriptors: RW });
    const reading = session.vmm.read(reservation.address, 64n * MiB).catch((error) => error);
    await new Promise((resolve) => setImmediate(resolve));
    session.close();
    await reading;
    await settled();
    expect(objectsOf(await daemon.stats())).toEqual(before);
    // The daemon still serves.
    const other = await client();
    expect((await other.devices.listDevices()).backend).toBe('host');
  });
});
