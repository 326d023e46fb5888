/**
 * The hot operations on the session socket: release, share,
 * export and open, each one round trip, over a real daemon. Each keeps the
 * rules of its RPC: the same refusals with the same status and code, quotas
 * charged and refunded, other sessions' objects refused, nothing changed by
 * a refusal, and everything reclaimed with the session.
 */
import * as grpc from '@grpc/grpc-js';
import * as http from 'node:http';
import { connect, VmmdClient } from '../../client';
import { addon } from '../../native';
import { SeqpacketConnection } from '../../native/seqpacket';
import { flushUnmaps, unmapGathered } from '../../native/unmap-batch';
import { call, eventually, freePort, MiB, objectsOf, stopWhenClean, RawSession, TestDaemon } from './harness';

let daemon: TestDaemon;
const clients: VmmdClient[] = [];

beforeAll(async () => {
  daemon = await TestDaemon.start(['--quota-per-session', '6MiB']);
});

afterAll(async () => {
  await stopWhenClean(daemon, clients);
});

afterEach(async () => {
  for (const connected of clients.splice(0)) connected.close();
  await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'the sessions to close');
});

async function client(): Promise<VmmdClient> {
  const connected = await connect({ socketDir: daemon.dir });
  clients.push(connected);
  return connected;
}

describe('release on the session socket', () => {
  it('drops the reference as the Release RPC does, and refunds the quota', async () => {
    const c = await client();
    const before = objectsOf(await daemon.stats());
    const a = await c.vmm.create({ size: 4n * MiB });
    const b = await c.vmm.create({ size: 2n * MiB });
    // The quota (6 MiB) is full: a third is refused until a release refunds it.
    await expect(c.session.allocate(2n * MiB)).rejects.toMatchObject({ code: 'QUOTA_EXCEEDED', status: grpc.status.RESOURCE_EXHAUSTED });
    expect(await c.session.release(a.id)).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
    const { message, fd } = await c.session.allocate(2n * MiB);
    addon.close(fd);
    // The library's release() takes the socket and answers as the RPC.
    await expect(c.vmm.release({ allocationId: b.id })).resolves.toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
    await c.vmm.release({ allocationId: message.allocationId });
    expect(objectsOf(await daemon.stats())).toEqual(before);
  });

  it('release then allocate at the quota, over and over, is never refused: the answer comes before the free, the next allocate waits for it', async () => {
    const c = await client();
    const live: string[] = [];
    for (let i = 0; i < 3; i++) {
      const made = await c.session.allocate(2n * MiB);
      addon.close(made.fd);
      live.push(made.message.allocationId);
    }
    for (let round = 0; round < 30; round++) {
      // Not awaited: the allocate goes out right behind the release, as a client freeing and allocating at once does.
      const released = c.session.release(live.shift()!);
      const made = await c.session.allocate(2n * MiB);
      addon.close(made.fd);
      expect(await released).toMatchObject({ freed: true });
      live.push(made.message.allocationId);
    }
    const report = JSON.parse((await call(daemon.raw.admin, 'GetReport', {})).json);
    expect(Object.values(report.quotas.bySession as Record<string, string>).map(BigInt)).toEqual([6n * MiB]);
    for (const id of live) await c.session.release(id);
  });

  it('keeps mapped memory alive: released, not freed, until the last mapping goes', async () => {
    const c = await client();
    const allocation = await c.vmm.create({ size: 2n * MiB });
    const reservation = await c.vmm.reserve({ size: 2n * MiB });
    await c.vmm.map({ address: reservation.address, size: 2n * MiB, allocationId: allocation.id });
    expect(await c.session.release(allocation.id)).toMatchObject({ freed: false, handleReferences: 0, mappingCount: 1 });
    await expect(c.session.release(allocation.id)).rejects.toMatchObject({ code: 'ALREADY_RELEASED', status: grpc.status.FAILED_PRECONDITION });
    await c.vmm.unmap({ address: reservation.address, size: 2n * MiB });
    await c.vmm.freeAddress({ address: reservation.address, size: 2n * MiB });
    expect((await daemon.stats()).allocations).toBe('0');
  });

  it("refuses another session's allocation and unknown ones, changing nothing", async () => {
    const owner = await client();
    const other = await client();
    const allocation = await owner.vmm.create({ size: 2n * MiB });
    const before = objectsOf(await daemon.stats());
    await expect(other.session.release(allocation.id)).rejects.toMatchObject({ code: 'NOT_OWNER', status: grpc.status.PERMISSION_DENIED });
    await expect(other.session.release(999_999n)).rejects.toMatchObject({ code: 'UNKNOWN_ALLOCATION', status: grpc.status.NOT_FOUND });
    await expect(other.session.release(0n)).rejects.toMatchObject({ code: 'UNKNOWN_ALLOCATION', status: grpc.status.NOT_FOUND });
    expect(objectsOf(await daemon.stats())).toEqual(before);
    expect((await owner.vmm.getProperties({ allocationId: allocation.id })).released).toBe(false);
  });
});

describe("the client's own driver work while an answer is on its way", () => {
  it('sends the allocate even when the unmaps cannot go: their failure is theirs, the allocate is answered', async () => {
    const c = await client();
    const spy = jest.spyOn(addon, 'cudaUnmapMany').mockImplementationOnce(() => {
      throw new Error('no CUDA driver in this process');
    });
    try {
      const unmapped = expect(unmapGathered(0, 0x7f0000000000n, 2n * MiB)).rejects.toThrow('no CUDA driver');
      const { message, fd } = await c.session.allocate(2n * MiB);
      addon.close(fd);
      await unmapped;
      await c.session.release(message.allocationId);
    } finally {
      spy.mockRestore();
    }
  });

  it('hands its waiting unmaps to the driver as an allocate goes out, not beside the import that follows the answer', async () => {
    const c = await client();
    const spy = jest.spyOn(addon, 'cudaUnmapMany').mockImplementation(async (_device, addresses) => addresses.map(() => null));
    try {
      // Only requests whose answer leads to an import flush: a ping sent in the unmap's turn does not.
      const first = unmapGathered(0, 0x7f0000000000n, 2n * MiB);
      const pinged = c.session.ping();
      expect(spy).not.toHaveBeenCalled();
      // The unmap went at the end of the turn it came in.
      await pinged;
      expect(spy).toHaveBeenCalledTimes(1);
      await first;
      const second = unmapGathered(0, 0x7f0000200000n, 2n * MiB);
      const made = c.session.allocate(2n * MiB);
      // Sent and flushed in the same call: the unmap's job started before the answer can come.
      expect(spy).toHaveBeenCalledTimes(2);
      await second;
      const { message, fd } = await made;
      addon.close(fd);
      await c.session.release(message.allocationId);
    } finally {
      flushUnmaps();
      spy.mockRestore();
    }
  });
});

describe('share and export on the session socket', () => {
  it("exports the session's own allocation with its descriptor attached, and another's only with its share key", async () => {
    const owner = await client();
    const other = await client();
    const made = await owner.vmm.allocate({ size: 2n * MiB });
    made.bytes().fill(0x5a);
    // Own allocation: the descriptor comes with the answer.
    const own = await owner.session.export(made.allocationId);
    expect(own.message).toMatchObject({
      transferId: '0',
      allocationId: String(made.allocationId),
      size: String(2n * MiB),
      granularity: String(2n * MiB),
      device: 0,
    });
    expect(addon.hostFdInfo(own.fd)).toMatchObject({ memfd: true, size: 2n * MiB });
    addon.close(own.fd);
    // The daemon closes its copy of an answer's descriptor right after sendmsg, which can be after the answer
    // reached us: a ping answered after it settles that before the count (it failed once under load).
    await owner.session.ping();
    const fds = daemon.openFds();
    // Another session's: refused without the key, or with a wrong one; nothing is sent.
    await expect(other.session.export(made.allocationId)).rejects.toMatchObject({ code: 'NOT_OWNER', status: grpc.status.PERMISSION_DENIED });
    await expect(other.session.export(made.allocationId, 'not-the-key')).rejects.toMatchObject({
      code: 'BAD_SHARE_KEY',
      status: grpc.status.PERMISSION_DENIED,
    });
    await expect(other.session.share(made.allocationId)).rejects.toMatchObject({ code: 'NOT_OWNER', status: grpc.status.PERMISSION_DENIED });
    await expect(owner.session.share(123_456n)).rejects.toMatchObject({ code: 'UNKNOWN_ALLOCATION', status: grpc.status.NOT_FOUND });
    expect(daemon.openFds()).toBe(fds);
    // With the key the owner got on the socket, the other maps the same memory (the library's import takes the socket).
    const shareKey = await owner.session.share(made.allocationId);
    expect(shareKey).toBe((await owner.vmm.share({ allocationId: made.allocationId })).shareKey);
    const imported = await other.vmm.import(made.allocationId, { shareKey });
    expect(imported.bytes()[4321]).toBe(0x5a);
    await imported.close();
    await made.close();
    await owner.vmm.release({ allocationId: made.allocationId });
    // Freed (nothing mapped it any more): gone, as for the RPC.
    await expect(owner.session.export(made.allocationId)).rejects.toMatchObject({ code: 'UNKNOWN_ALLOCATION', status: grpc.status.NOT_FOUND });
  });

  it('reclaims with the session what was exported on the socket', async () => {
    const before = objectsOf(await daemon.stats());
    const fds = daemon.openFds();
    const c = await client();
    const { message, fd } = await c.session.allocate(2n * MiB);
    addon.close(fd);
    const exported = await c.session.export(message.allocationId);
    addon.close(exported.fd);
    c.close();
    await eventually(
      async () => (JSON.stringify(objectsOf(await daemon.stats())) === JSON.stringify(before) ? true : undefined),
      10_000,
      'objects back to the baseline',
    );
    await eventually(() => (daemon.openFds() === fds ? true : undefined), 10_000, `daemon fds back to ${fds}`);
  });
});

describe('open on the session socket', () => {
  it('opens a store by name or id with its descriptor attached, counted as an open, with the rules of Stores.Open', async () => {
    const owner = await client();
    const allocation = await owner.vmm.create({ size: 2n * MiB });
    const store = await owner.stores.createStore({ allocationId: allocation.id, name: 'socket-open', readOnly: true });
    const fds = daemon.openFds();
    const byName = await owner.session.open({ name: 'socket-open' }, false);
    expect(byName.message).toMatchObject({
      transferId: '0',
      store: {
        id: store.id,
        name: 'socket-open',
        readOnly: true,
        state: 'STORE_STATE_LIVE',
        opens: 1,
        allocationId: allocation.id,
        target: 'STORE_TARGET_SYSMEM',
      },
      granularity: expect.any(String),
      mappedSize: String(2n * MiB),
    });
    expect(addon.hostFdInfo(byName.fd)).toMatchObject({ memfd: true });
    addon.close(byName.fd);
    const byId = await owner.session.open({ id: store.id }, false);
    addon.close(byId.fd);
    expect(byId.message.store?.opens).toBe(2);
    // Refusals as Stores.Open gives them, and no descriptor sent.
    await expect(owner.session.open({ name: 'socket-open' }, true)).rejects.toMatchObject({ code: 'STORE_READ_ONLY', status: grpc.status.FAILED_PRECONDITION });
    await expect(owner.session.open({ name: 'nothing-by-this-name' }, false)).rejects.toMatchObject({ code: 'UNKNOWN_STORE', status: grpc.status.NOT_FOUND });
    await expect(owner.session.open({ id: '999999' }, false)).rejects.toMatchObject({ code: 'UNKNOWN_STORE', status: grpc.status.NOT_FOUND });
    expect(daemon.openFds()).toBe(fds);
    expect((await owner.stores.list()).find((listed) => listed.id === store.id)?.opens).toBe(2);
    // The library's open() takes the socket and maps the store.
    const other = await client();
    const opened = await other.stores.open('socket-open');
    expect(opened.store).toMatchObject({ id: store.id, name: 'socket-open', opens: 3 });
    expect(opened.memory.readOnly).toBe(true);
    await opened.close();
    // Both of the owner's opens go with its session, and the store with them.
    await owner.stores.detach('socket-open');
    owner.close();
    await eventually(async () => ((await other.stores.list()).some((listed) => listed.id === store.id) ? undefined : true), 10_000, 'the store to go');
  });

  it('refuses an open without a store as NO_STORE', async () => {
    const c = await client();
    // The raw frame, without the library's spelling of the store.
    await expect((c.session as any).request('opened', { open: {} }, 5_000)).rejects.toMatchObject({ code: 'NO_STORE', status: grpc.status.INVALID_ARGUMENT });
  });
});

describe('malformed requests on the session socket', () => {
  let session: RawSession;
  let raw: SeqpacketConnection;
  const next = () => session.next();

  beforeEach(async () => {
    session = new RawSession(daemon.dir);
    raw = session.connection;
    expect(await next()).toMatchObject({ type: 'hello' });
  });

  afterEach(() => session.close());

  it('refuses a request without an id, one with a descriptor attached, and a body only the daemon sends, naming the request', async () => {
    const fds = daemon.openFds();
    session.send({ release: { allocationId: '1' } });
    expect(await next()).toMatchObject({
      type: 'error',
      code: 'BAD_MESSAGE',
      request: '0',
      message: expect.stringMatching(/release: the frame's request id must be set/),
    });
    const fd = addon.hostMemfdCreate('stray', 2n * MiB);
    session.send({ request: '21', release: { allocationId: '1' } }, fd);
    expect(await next()).toMatchObject({ type: 'error', code: 'UNEXPECTED_DESCRIPTOR', request: '21' });
    session.send({ request: '22', open: { store: { name: 'x' } } }, fd);
    expect(await next()).toMatchObject({ type: 'error', code: 'UNEXPECTED_DESCRIPTOR', request: '22' });
    addon.close(fd);
    // A DaemonFrame's error (field 15) sent by a client: no body a ClientFrame has.
    raw.send(Buffer.from([0x08, 0x17, 0x7a, 0x00]));
    expect(await next()).toMatchObject({ type: 'error', code: 'BAD_MESSAGE', request: '23', message: expect.stringMatching(/no request this daemon knows/) });
    // Well-formed requests the service refuses: their RPC's status and code, the request named.
    session.send({ request: '24', release: { allocationId: '424242' } });
    expect(await next()).toMatchObject({ type: 'error', code: 'UNKNOWN_ALLOCATION', status: grpc.status.NOT_FOUND, request: '24' });
    session.send({ request: '25', open: { store: { id: '0', name: '' } } });
    expect(await next()).toMatchObject({ type: 'error', code: 'UNKNOWN_STORE', status: grpc.status.NOT_FOUND, request: '25' });
    session.send({ request: '26', ping: { nonce: 'alive' } });
    expect(await next()).toEqual({ type: 'pong', request: '26', nonce: 'alive' });
    expect(daemon.openFds()).toBe(fds);
    expect((await daemon.stats()).allocations).toBe('0');
  });
});

describe('the daemon counts socket requests and its own turns', () => {
  // By CPU time too unless --turn-cpu off: its clock read costs something every turn, which a slow VM may not want to pay.
  it.each([
    ['CPU time too, by default', []],
    ['wall clock only, with --turn-cpu off', ['--turn-cpu', 'off']],
  ])('reports socket requests under their RPC names, and its turns in GetStats and Prometheus metrics: %s', async (_name, flags) => {
    const port = await freePort();
    const byCpu = flags.length === 0;
    const observed = await TestDaemon.start(['--metrics-port', String(port), ...flags]);
    const c = await connect({ socketDir: observed.dir });
    try {
      const { message, fd } = await c.session.allocate(2n * MiB);
      addon.close(fd);
      await expect(c.session.share('999999')).rejects.toMatchObject({ code: 'UNKNOWN_ALLOCATION' });
      await c.session.release(message.allocationId);
      await c.session.ping();
      const stats = await observed.stats();
      expect(Number(stats.eventLoopTurns)).toBeGreaterThan(0);
      expect(Number(stats.eventLoopTurnMaxUs)).toBeGreaterThan(0);
      expect(Number(stats.eventLoopTurnP99Us)).toBeLessThanOrEqual(Number(stats.eventLoopTurnMaxUs));
      // The collector's pauses beside the turns: counted, and never more of the longest turn than the turn itself.
      expect(stats.gcPauses).toMatch(/^\d+$/);
      expect(Number(stats.gcPauseMaxUs) > 0).toBe(Number(stats.gcPauses) > 0);
      expect(Number(stats.eventLoopTurnMaxGcUs)).toBeLessThanOrEqual(Number(stats.eventLoopTurnMaxUs) + 1);
      if (byCpu) {
        // The same turns by the daemon thread's CPU time: not longer than by wall clock, give or take the two clocks' accounting.
        expect(Number(stats.eventLoopTurnCpuMaxUs)).toBeGreaterThan(0);
        expect(Number(stats.eventLoopTurnCpuMaxUs)).toBeLessThanOrEqual(Number(stats.eventLoopTurnMaxUs) * 1.1 + 100);
        expect(['session', 'grpc', 'completion']).toContain(stats.eventLoopTurnCpuMaxKind);
        // What it was: a session message's type, a gRPC method or a backend call, after the kind.
        expect(stats.eventLoopTurnCpuMaxWhat).toMatch(
          /^(session (hello|allocate|share|release|ping)|grpc \w+|completion \w+)( \(\+\d+ entr(y|ies) inside it\))?$/,
        );
        expect(stats.eventLoopTurnCpuMaxWhat.startsWith(stats.eventLoopTurnCpuMaxKind)).toBe(true);
      } else {
        expect(stats).toMatchObject({ eventLoopTurnCpuMaxUs: '0', eventLoopTurnCpuP99Us: '0', eventLoopTurnCpuMaxKind: '', eventLoopTurnCpuMaxWhat: '' });
      }
      const text = await new Promise<string>((resolve, reject) =>
        http
          .get({ host: '127.0.0.1', port, path: '/metrics' }, (response) => {
            let body = '';
            response.on('data', (chunk) => (body += chunk));
            response.on('end', () => resolve(body));
          })
          .on('error', reject),
      );
      expect(text).toMatch(/vmmd_rpc_duration_seconds_count\{service="vmmd.session",method="Allocate",status="OK"\} 1/);
      expect(text).toMatch(/vmmd_rpc_duration_seconds_count\{service="vmmd.session",method="Release",status="OK"\} 1/);
      expect(text).toMatch(/vmmd_rpc_duration_seconds_count\{service="vmmd.session",method="Share",status="NOT_FOUND"\} 1/);
      expect(text).toMatch(/vmmd_event_loop_turn_seconds_count\{kind="session"\} [1-9]/);
      expect(text).toMatch(/vmmd_event_loop_turn_seconds_count\{kind="grpc"\} [1-9]/);
      expect(text).toMatch(/vmmd_event_loop_turn_max_seconds [0-9.e-]+/);
      if (byCpu) expect(text).toMatch(/vmmd_event_loop_turn_cpu_seconds_count\{kind="session"\} [1-9]/);
      else expect(text).not.toMatch(/vmmd_event_loop_turn_cpu_seconds_count/);
      // GC pauses are the other part of the event loop's delay: exported beside the turns (OPERATIONS.md).
      expect(text).toMatch(/# TYPE vmmd_nodejs_gc_duration_seconds histogram/);
    } finally {
      c.close();
      await stopWhenClean(observed, []);
    }
  });
});
