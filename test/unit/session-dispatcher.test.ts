/**
 * The session socket's dispatcher: each request frame's body goes to the
 * service method of its RPC, with the socket's context (the descriptor rides
 * the answer); frames that name no request are refused by name and change nothing.
 */
import pino from 'pino';
import { type ClientFrame, type ClientFrame__Output, decodeClientFrame, encodeClientFrame } from '../../common/protocol';
import { Registry } from '../../server/registry';
import { FREE_RETRY_MS } from '../../server/transport/session/session-dispatcher';
import { StoreRegistry } from '../../server/stores/stores';
import type { Session } from '../../server/transport/session/sessions';
import { socketDispatcher } from './socket-dispatcher';
import { RecordingBackend } from '../contracts/recording-backend';
import { FakeBackend, GRANULARITY } from './fake-backend';

const log = pino({ level: 'silent' });
// A session with room for every descriptor answer (the transport counts them; test/e2e/unread-descriptors.test.ts).
const session = { id: 7n, log, peer: { pid: 1, uid: 1000, gid: 1000 }, checkDescriptorRoom: () => undefined } as unknown as Session;

/** A frame as the transport hands it over: decoded from its bytes. */
const frame = (value: ClientFrame) => decodeClientFrame(encodeClientFrame(value)) as ClientFrame__Output;

const dispatcherOf = socketDispatcher;

function setup() {
  const backend = new FakeBackend();
  const registry = new Registry(backend);
  return { backend, registry, dispatcher: dispatcherOf(registry) };
}

describe('session dispatcher', () => {
  it.each<[string, ClientFrame, RegExp]>([
    ['an empty frame', {}, /names no request this daemon knows/],
    ['a second hello', { hello: { protocol: 2 } }, /hello comes once/],
    ["a transfer (the transport's own)", { transfer: { id: '1' } }, /names no request/],
    ['an allocate without a request id', { allocate: { size: '2097152' } }, /allocate: the frame's request id must be set/],
    ['a release without a request id', { release: { allocationId: '1' } }, /release: the frame's request id must be set/],
  ])('refuses %s as a frame (BAD_MESSAGE), with the reason, changing nothing', async (_what, value, reason) => {
    const { dispatcher, registry, backend } = setup();
    const before = registry.snapshot();
    await expect(dispatcher.answer(session, frame(value), -1)).rejects.toMatchObject({
      code: 'BAD_MESSAGE',
      messageRefused: true,
      message: expect.stringMatching(reason),
    });
    expect(registry.snapshot()).toEqual(before);
    expect(backend.calls).toEqual([]);
  });

  it('refuses a descriptor on anything but a transfer, before the registry is asked', async () => {
    const { dispatcher, backend } = setup();
    await expect(dispatcher.answer(session, frame({ request: '1', allocate: { size: String(GRANULARITY) } }), 5)).rejects.toMatchObject({
      code: 'UNEXPECTED_DESCRIPTOR',
      messageRefused: true,
    });
    expect(backend.calls).toEqual([]);
  });

  it('answers allocate with the allocation the registry made for the session, and its descriptor', async () => {
    const { dispatcher, registry } = setup();
    const answer = await dispatcher.answer(session, frame({ request: '3', allocate: { size: String(GRANULARITY) } }), -1);
    const [allocation] = registry.snapshot().allocations;
    expect(allocation).toMatchObject({ owner: '7', size: String(GRANULARITY) });
    // The Allocate RPC's ExportResponse, its descriptor attached instead of a transfer.
    expect(answer.reply).toEqual({
      request: '3',
      allocated: {
        transferId: '0',
        allocationId: allocation.id,
        size: String(GRANULARITY),
        device: 0,
        deviceUuid: registry.devices[0].uuid,
        granularity: String(GRANULARITY),
        location: { type: 'LOCATION_TYPE_DEVICE', id: 0, deviceUuid: '' },
        handleType: 'HANDLE_TYPE_POSIX_FD',
        fabricHandle: Buffer.alloc(0),
      },
    });
    expect(answer.fd).toBeGreaterThanOrEqual(0);
  });

  it("answers a refused allocate with the registry's own error (not a message refusal), changing nothing", async () => {
    const { dispatcher, registry } = setup();
    await expect(dispatcher.answer(session, frame({ request: '4', allocate: { size: '4096' } }), -1)).rejects.toMatchObject({
      code: 'NOT_ALIGNED',
    });
    expect(registry.snapshot().allocations).toEqual([]);
  });

  it.each<[string, ClientFrame, string]>([
    ['an allocate at an unknown location type', { request: '1', allocate: { size: '2097152', location: { type: 7 as never } } }, 'BAD_ENUM'],
    [
      'an allocate by a device UUID the daemon lacks',
      { request: '1', allocate: { size: '2097152', location: { type: 'LOCATION_TYPE_DEVICE', deviceUuid: 'GPU-nope' } } },
      'UNKNOWN_DEVICE',
    ],
    ['a release of an allocation nobody made', { request: '1', release: { allocationId: '99' } }, 'UNKNOWN_ALLOCATION'],
    ['a share of allocation 0', { request: '1', share: {} }, 'UNKNOWN_ALLOCATION'],
    ['an open naming no store', { request: '1', open: {} }, 'NO_STORE'],
  ])('refuses %s as its RPC would, changing nothing', async (_what, value, code) => {
    const { dispatcher, registry, backend } = setup();
    const before = registry.snapshot();
    await expect(dispatcher.answer(session, frame(value), -1)).rejects.toMatchObject({ code });
    expect(registry.snapshot()).toEqual(before);
    expect(backend.calls.filter((call) => call !== 'devices')).toEqual([]);
  });

  it('checks each request as the RPC of the same name before the registry is asked', async () => {
    const backend = new FakeBackend();
    const registry = new Registry(backend);
    const checked: string[] = [];
    const dispatcher = dispatcherOf(registry, {
      check: (_session, method) => {
        checked.push(method);
        if (method === 'Release') throw Object.assign(new Error('no'), { code: 'NOT_ALLOWED' });
      },
    });
    const allocation = (await dispatcher.answer(session, frame({ request: '1', allocate: { size: String(GRANULARITY) } }), -1)).reply.allocated!
      .allocationId as string;
    await expect(dispatcher.answer(session, frame({ request: '2', release: { allocationId: allocation } }), -1)).rejects.toMatchObject({ code: 'NOT_ALLOWED' });
    expect(registry.snapshot().allocations).toHaveLength(1);
    await dispatcher.answer(session, frame({ request: '3', share: { allocationId: allocation } }), -1);
    await dispatcher.answer(session, frame({ ping: {} }), -1);
    expect(checked).toEqual(['Allocate', 'Release', 'Share']);
  });

  it('answers release, share and export with what the registry did for the session', async () => {
    const { dispatcher, registry } = setup();
    const allocation = (await dispatcher.answer(session, frame({ request: '1', allocate: { size: String(GRANULARITY) } }), -1)).reply.allocated!
      .allocationId as string;
    const shared = await dispatcher.answer(session, frame({ request: '2', share: { allocationId: allocation } }), -1);
    expect(shared.reply).toEqual({ request: '2', shared: { shareKey: registry.allocation(BigInt(allocation))?.shareKey } });
    const exported = await dispatcher.answer(session, frame({ request: '3', export: { allocationId: allocation } }), -1);
    expect(exported.reply).toMatchObject({
      request: '3',
      exported: { transferId: '0', allocationId: allocation, size: String(GRANULARITY), handleType: 'HANDLE_TYPE_POSIX_FD' },
    });
    expect(exported.fd).toBeGreaterThanOrEqual(0);
    await expect(
      dispatcher.answer({ ...session, id: 8n } as Session, frame({ request: '4', release: { allocationId: allocation } }), -1),
    ).rejects.toMatchObject({ code: 'NOT_OWNER' });
    expect((await dispatcher.answer(session, frame({ request: '5', release: { allocationId: allocation } }), -1)).reply).toEqual({
      request: '5',
      released: { freed: true, handleReferences: 0, mappingCount: 0 },
    });
    expect(registry.snapshot().allocations).toEqual([]);
  });

  it('opens a store with the store rules of Stores.Open: a writable open by its writer only, others a read-only descriptor', async () => {
    const backend = new FakeBackend();
    const registry = new Registry(backend);
    const stores = new StoreRegistry(registry);
    const uids = new Map<bigint, { uid: number; admin: boolean }>([
      [7n, { uid: 1000, admin: false }],
      [8n, { uid: 1001, admin: false }],
      [9n, { uid: 1002, admin: true }],
    ]);
    const dispatcher = dispatcherOf(
      registry,
      {
        who: (caller) => ({ transport: 'unix', peer: { pid: 1, gid: 1, uid: uids.get(caller.id)!.uid }, mutualTls: false, admin: uids.get(caller.id)!.admin }),
      },
      stores,
    );
    const as = (id: bigint) => ({ ...session, id, peer: { uid: uids.get(id)!.uid } }) as unknown as Session;
    const allocation = (await dispatcher.answer(session, frame({ request: '1', allocate: { size: String(GRANULARITY) } }), -1)).reply.allocated!
      .allocationId as string;
    const store = await stores.create(7n, { allocationId: BigInt(allocation), name: 'weights', readOnly: false, handOver: false, size: 0n });
    store.creatorUid = 1000;
    // Another uid: refused writable, and read-only when it asks nothing more; nothing opened by the refusal.
    await expect(dispatcher.answer(as(8n), frame({ request: '2', open: { store: { name: 'weights' }, writable: true } }), -1)).rejects.toMatchObject({
      code: 'NOT_STORE_WRITER',
      message: expect.stringMatching(/written only by uid 1000, which made it, and admins; uid 1001 may read it/),
    });
    expect([...store.opens.values()]).toEqual([]);
    const reader = await dispatcher.answer(as(8n), frame({ request: '3', open: { store: { name: 'weights' } } }), -1);
    expect(reader.reply).toMatchObject({
      request: '3',
      opened: { transferId: '0', descriptorReadOnly: true, store: { name: 'weights', readOnly: false, opens: 1 } },
    });
    // Its maker's uid and an admin write it.
    expect((await dispatcher.answer(as(7n), frame({ request: '4', open: { store: { id: String(store.id) }, writable: true } }), -1)).reply).toMatchObject({
      opened: { descriptorReadOnly: false },
    });
    expect((await dispatcher.answer(as(9n), frame({ request: '5', open: { store: { name: 'weights' }, writable: true } }), -1)).reply).toMatchObject({
      opened: { descriptorReadOnly: false },
    });
    // No store named: NO_STORE, as the RPC.
    await expect(dispatcher.answer(as(7n), frame({ request: '6', open: {} }), -1)).rejects.toMatchObject({ code: 'NO_STORE' });
  });

  it('answers ping with pong and the nonce, cut to 64 characters', async () => {
    const { dispatcher } = setup();
    expect((await dispatcher.answer(session, frame({ request: '2', ping: { nonce: 'x'.repeat(100) } }), -1)).reply).toEqual({
      request: '2',
      pong: { nonce: 'x'.repeat(64) },
    });
  });

  it('reclaims a closed session in order, each step whatever the one before did', async () => {
    const { registry } = setup();
    const steps: string[] = [];
    const dispatcher = dispatcherOf(registry, {
      reclaimers: [
        async () => {
          steps.push('stores');
          throw new Error('stores failed');
        },
        async () => {
          steps.push('staging');
        },
      ],
    });
    await registry.create(7n, { size: GRANULARITY, location: { type: 'DEVICE', id: 0 }, handleType: 'POSIX_FD' });
    const quiet = { ...session, log: { error: () => steps.push('logged') } } as unknown as Session;
    await dispatcher.reclaim(quiet);
    expect(steps).toEqual(['stores', 'logged', 'staging']);
    expect(registry.snapshot().allocations).toEqual([]);
  });

  it("answers release before the backend's free, which runs after; a free that fails then is logged and told, and the allocation stays until freed (here: the reclaim, before the daemon's retry)", async () => {
    const backend = new RecordingBackend(new FakeBackend());
    const registry = new Registry(backend);
    const dispatcher = dispatcherOf(registry);
    const logged: string[] = [];
    const told: unknown[] = [];
    const watched = {
      ...session,
      log: { error: (_fields: unknown, message: string) => logged.push(message) },
      trySend: (message: unknown) => void told.push(message),
    } as unknown as Session;
    const allocate = async (request: string) =>
      (await dispatcher.answer(watched, frame({ request, allocate: { size: String(GRANULARITY) } }), -1)).reply.allocated!.allocationId as string;
    const first = await allocate('1');
    let open!: () => void;
    backend.releaseGate = new Promise<void>((resolve) => (open = resolve));
    expect((await dispatcher.answer(watched, frame({ request: '2', release: { allocationId: first } }), -1)).reply).toMatchObject({
      released: { freed: true, handleReferences: 0 },
    });
    // Answered while the free waits on its driver call.
    expect(backend.liveHandles).toBe(1);
    open();
    await registry.settleFrees();
    expect(backend.liveHandles).toBe(0);
    backend.releaseGate = undefined;
    const second = await allocate('3');
    backend.failOnce('release', new Error('injected: cuMemRelease failed'));
    expect((await dispatcher.answer(watched, frame({ request: '4', release: { allocationId: second } }), -1)).reply).toMatchObject({
      released: { freed: true },
    });
    await registry.settleFrees();
    expect(logged).toEqual([expect.stringMatching(/freeing the memory failed after the answer/)]);
    expect(told).toEqual([{ error: expect.objectContaining({ code: 'FREE_FAILED' }) }]);
    expect(registry.snapshot().allocations.map((allocation) => allocation.id)).toEqual([second]);
    await dispatcher.reclaim(watched);
    expect({ allocations: registry.snapshot().allocations, handles: backend.liveHandles }).toEqual({ allocations: [], handles: 0 });
  });
});

describe('a free that fails after its release was answered', () => {
  /** A fake whose next `failures` releases fail with EIO. */
  class FailingFrees extends FakeBackend {
    failures = 0;
    override async release(handle: Parameters<FakeBackend['release']>[0]): Promise<void> {
      if (this.failures > 0) {
        this.failures--;
        throw Object.assign(new Error('EIO: the free failed'), { code: 'EIO' });
      }
      return super.release(handle);
    }
  }

  beforeEach(() => jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] }));
  afterEach(() => jest.useRealTimers());

  it('is told to the session once, and tried again by the daemon until it frees the memory', async () => {
    const backend = new FailingFrees();
    const registry = new Registry(backend);
    const dispatcher = dispatcherOf(registry);
    const sent: unknown[] = [];
    const owner = {
      id: 7n,
      log,
      peer: session.peer,
      checkDescriptorRoom: () => undefined,
      trySend: (message: unknown) => void sent.push(message),
    } as unknown as Session;
    const allocated = await dispatcher.answer(owner, frame({ request: '1', allocate: { size: String(GRANULARITY) } }), -1);
    const id = allocated.reply.allocated!.allocationId as string;
    backend.failures = 2;
    const released = await dispatcher.answer(owner, frame({ request: '2', release: { allocationId: id } }), -1);
    expect(released.reply).toMatchObject({ released: { freed: true } });
    await jest.advanceTimersByTimeAsync(0);
    // Back in the registry, charged; the session heard of it once, with the allocation named.
    expect(registry.snapshot().allocations.map((allocation) => allocation.id)).toEqual([id]);
    expect(sent).toEqual([{ error: expect.objectContaining({ code: 'FREE_FAILED', message: expect.stringContaining(`allocation ${id}`) }) }]);
    // The first retry fails too, the second frees it: no Release, no session end needed.
    await jest.advanceTimersByTimeAsync(FREE_RETRY_MS[0]);
    expect(registry.snapshot().allocations).toHaveLength(1);
    await jest.advanceTimersByTimeAsync(FREE_RETRY_MS[1]);
    expect(registry.snapshot().allocations).toEqual([]);
    expect(backend.memoryInfo().freeBytes).toBe(backend.memoryInfo().totalBytes);
    expect(sent).toHaveLength(1);
  });
});
