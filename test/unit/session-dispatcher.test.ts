/**
 * The session socket's dispatcher: each request message checked and turned
 * straight into the registry's own arguments; refusals name the value and
 * the rule and change nothing.
 */
import pino from 'pino';
import { Registry } from '../../server/registry';
import { FREE_RETRY_MS, SessionDispatcher } from '../../server/transport/session/session-dispatcher';
import { StoreRegistry } from '../../server/stores/stores';
import type { RequestMessage, Session } from '../../server/transport/session/sessions';
import { RecordingBackend } from '../contracts/recording-backend';
import { FakeBackend, GRANULARITY } from './fake-backend';

const log = pino({ level: 'silent' });
// A session with room for every descriptor answer (the transport counts them; test/e2e/unread-descriptors.test.ts).
const session = { id: 7n, log, checkDescriptorRoom: () => undefined } as unknown as Session;

function setup() {
  const backend = new FakeBackend();
  const registry = new Registry(backend);
  return { backend, registry, dispatcher: new SessionDispatcher({ registry, stores: new StoreRegistry(registry), reclaimers: [] }) };
}

describe('session dispatcher', () => {
  it.each([
    ['{"type":"launch"}', 'BAD_MESSAGE', /unknown message type "launch"/],
    ['{"type":"hello"}', 'BAD_MESSAGE', /clients may not send "hello" messages/],
    ['{"type":"allocate","size":"2097152"}', 'BAD_MESSAGE', /allocate: request undefined is not a decimal uint64/],
    ['{"type":"allocate","request":"1","size":2097152}', 'BAD_MESSAGE', /allocate: size 2097152 is not a decimal uint64 string/],
    ['{"type":"allocate","request":"1","size":"-1"}', 'BAD_MESSAGE', /allocate: size "-1"/],
    ['{"type":"allocate","request":"1","size":"18446744073709551616"}', 'BAD_MESSAGE', /allocate: size/],
    ['{"type":"allocate","request":"1","size":"2097152","location":{"type":"HOST","id":0}}', 'BAD_MESSAGE', /location must be/],
    ['{"type":"allocate","request":"1","size":"2097152","location":{"type":"DEVICE","id":-1}}', 'BAD_MESSAGE', /location must be/],
    ['{"type":"allocate","request":"1","size":"2097152","location":null}', 'BAD_MESSAGE', /location must be/],
    ['{"type":"constructor"}', 'BAD_MESSAGE', /unknown message type "constructor"/],
  ])('refuses %s as a message (%s), with the reason, changing nothing', (text, code, reason) => {
    const { dispatcher, registry, backend } = setup();
    const before = registry.snapshot();
    expect(() => dispatcher.answer(session, JSON.parse(text) as RequestMessage, -1)).toThrow(expect.objectContaining({ code, messageRefused: true, message: expect.stringMatching(reason) }));
    expect(registry.snapshot()).toEqual(before);
    expect(backend.calls).toEqual([]);
  });

  it('refuses a descriptor on anything but a transfer, before the registry is asked', () => {
    const { dispatcher, backend } = setup();
    expect(() => dispatcher.answer(session, { type: 'allocate', request: '1', size: String(GRANULARITY) }, 5)).toThrow(
      expect.objectContaining({ code: 'UNEXPECTED_DESCRIPTOR', messageRefused: true }),
    );
    expect(backend.calls).toEqual([]);
  });

  it('answers allocate with the allocation the registry made for the session, and its descriptor', async () => {
    const { dispatcher, registry } = setup();
    const answer = await dispatcher.answer(session, { type: 'allocate', request: '3', size: String(GRANULARITY) }, -1);
    const [allocation] = registry.snapshot().allocations;
    expect(allocation).toMatchObject({ owner: '7', size: String(GRANULARITY) });
    expect(answer.reply).toEqual({
      type: 'allocated',
      request: '3',
      allocation: allocation.id,
      size: String(GRANULARITY),
      device: 0,
      deviceUuid: registry.devices[0].uuid,
      granularity: String(GRANULARITY),
      location: { type: 'DEVICE', id: 0 },
    });
    expect(answer.fd).toBeGreaterThanOrEqual(0);
  });

  it('answers a refused allocate with the registry\'s own error (not a message refusal), changing nothing', async () => {
    const { dispatcher, registry } = setup();
    await expect(Promise.resolve().then(() => dispatcher.answer(session, { type: 'allocate', request: '4', size: '4096' }, -1))).rejects.toMatchObject({
      code: 'NOT_ALIGNED',
    });
    expect(registry.snapshot().allocations).toEqual([]);
  });

  it.each([
    ['{"type":"release","request":"1","allocation":1}', /release: allocation 1 is not a decimal uint64 string/],
    ['{"type":"release","allocation":"1"}', /release: request undefined is not a decimal uint64 string above 0/],
    ['{"type":"share","request":"1"}', /share: allocation undefined/],
    ['{"type":"export","request":"1","allocation":"1","shareKey":["k"]}', /export: shareKey must be a string of at most 256 characters/],
    ['{"type":"open","request":"1","store":[]}', /open: store must be/],
    ['{"type":"open","request":"1","store":{"id":"01"}}', /open: store.id "01" is not a decimal uint64 string/],
    ['{"type":"opened","request":"1"}', /clients may not send "opened" messages/],
  ])('refuses the hot operation %s as a message, with the reason, changing nothing', (text, reason) => {
    const { dispatcher, registry, backend } = setup();
    const before = registry.snapshot();
    expect(() => dispatcher.answer(session, JSON.parse(text) as RequestMessage, -1)).toThrow(expect.objectContaining({ code: 'BAD_MESSAGE', messageRefused: true, message: expect.stringMatching(reason) }));
    expect(registry.snapshot()).toEqual(before);
    expect(backend.calls).toEqual([]);
  });

  it('checks each request as the RPC of the same name before the registry is asked', async () => {
    const backend = new FakeBackend();
    const registry = new Registry(backend);
    const checked: string[] = [];
    const dispatcher = new SessionDispatcher({
      registry,
      stores: new StoreRegistry(registry),
      reclaimers: [],
      check: (_session, method) => {
        checked.push(method);
        if (method === 'Release') throw Object.assign(new Error('no'), { code: 'NOT_ALLOWED' });
      },
    });
    const { allocation } = (await dispatcher.answer(session, { type: 'allocate', request: '1', size: String(GRANULARITY) }, -1)).reply as { allocation: string };
    expect(() => dispatcher.answer(session, { type: 'release', request: '2', allocation }, -1)).toThrow(expect.objectContaining({ code: 'NOT_ALLOWED' }));
    expect(registry.snapshot().allocations).toHaveLength(1);
    await dispatcher.answer(session, { type: 'share', request: '3', allocation }, -1);
    await dispatcher.answer(session, { type: 'ping' }, -1);
    expect(checked).toEqual(['Allocate', 'Release', 'Share']);
  });

  it('answers release, share and export with what the registry did for the session', async () => {
    const { dispatcher, registry } = setup();
    const { allocation } = (await dispatcher.answer(session, { type: 'allocate', request: '1', size: String(GRANULARITY) }, -1)).reply as { allocation: string };
    const shared = await dispatcher.answer(session, { type: 'share', request: '2', allocation }, -1);
    expect(shared.reply).toEqual({ type: 'shared', request: '2', allocation, shareKey: registry.allocation(BigInt(allocation))?.shareKey });
    const exported = await dispatcher.answer(session, { type: 'export', request: '3', allocation }, -1);
    expect(exported.reply).toMatchObject({ type: 'exported', request: '3', allocation, size: String(GRANULARITY) });
    expect(exported.fd).toBeGreaterThanOrEqual(0);
    await expect(Promise.resolve().then(() => dispatcher.answer({ ...session, id: 8n } as Session, { type: 'release', request: '4', allocation }, -1))).rejects.toMatchObject({ code: 'NOT_OWNER' });
    expect((await dispatcher.answer(session, { type: 'release', request: '5', allocation }, -1)).reply).toEqual({
      type: 'released',
      request: '5',
      allocation,
      freed: true,
      handleReferences: 0,
      mappingCount: 0,
    });
    expect(registry.snapshot().allocations).toEqual([]);
  });

  it("opens a store with the store rules of Stores.Open: a writable open by its writer only, others a read-only descriptor", async () => {
    const backend = new FakeBackend();
    const registry = new Registry(backend);
    const stores = new StoreRegistry(registry);
    const uids = new Map<bigint, { uid: number; admin: boolean }>([
      [7n, { uid: 1000, admin: false }],
      [8n, { uid: 1001, admin: false }],
      [9n, { uid: 1002, admin: true }],
    ]);
    const dispatcher = new SessionDispatcher({
      registry,
      stores,
      reclaimers: [],
      who: (caller) => ({ peer: { uid: uids.get(caller.id)!.uid }, admin: uids.get(caller.id)!.admin }),
    });
    const as = (id: bigint) => ({ ...session, id, peer: { uid: uids.get(id)!.uid } }) as unknown as Session;
    const { allocation } = (await dispatcher.answer(session, { type: 'allocate', request: '1', size: String(GRANULARITY) }, -1)).reply as { allocation: string };
    const store = await stores.create(7n, { allocationId: BigInt(allocation), name: 'weights', readOnly: false, handOver: false, size: 0n });
    store.creatorUid = 1000;
    // Another uid: refused writable, and read-only when it asks nothing more; nothing opened by the refusal.
    await expect(Promise.resolve().then(() => dispatcher.answer(as(8n), { type: 'open', request: '2', store: { name: 'weights' }, writable: true }, -1))).rejects.toMatchObject({
      code: 'NOT_STORE_WRITER',
      message: expect.stringMatching(/written only by uid 1000, which made it, and admins; uid 1001 may read it/),
    });
    expect([...store.opens.values()]).toEqual([]);
    const reader = await dispatcher.answer(as(8n), { type: 'open', request: '3', store: { name: 'weights' } }, -1);
    expect(reader.reply).toMatchObject({ type: 'opened', request: '3', descriptorReadOnly: true, store: { name: 'weights', readOnly: false, opens: 1 } });
    // Its maker's uid and an admin write it.
    expect((await dispatcher.answer(as(7n), { type: 'open', request: '4', store: { id: String(store.id) }, writable: true }, -1)).reply).toMatchObject({ descriptorReadOnly: false });
    expect((await dispatcher.answer(as(9n), { type: 'open', request: '5', store: { name: 'weights' }, writable: true }, -1)).reply).toMatchObject({ descriptorReadOnly: false });
    // No store named: NO_STORE, as the RPC.
    await expect(Promise.resolve().then(() => dispatcher.answer(as(7n), { type: 'open', request: '6' }, -1))).rejects.toMatchObject({ code: 'NO_STORE' });
  });

  it('answers ping with pong and the nonce, cut to 64 characters', async () => {
    const { dispatcher } = setup();
    expect((await dispatcher.answer(session, { type: 'ping', nonce: 'x'.repeat(100) }, -1)).reply).toEqual({ type: 'pong', nonce: 'x'.repeat(64) });
  });

  it('reclaims a closed session in order, each step whatever the one before did', async () => {
    const { registry } = setup();
    const steps: string[] = [];
    const dispatcher = new SessionDispatcher({
      registry,
      stores: new StoreRegistry(registry),
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
    const dispatcher = new SessionDispatcher({ registry, stores: new StoreRegistry(registry), reclaimers: [] });
    const logged: string[] = [];
    const told: unknown[] = [];
    const watched = { ...session, log: { error: (_fields: unknown, message: string) => logged.push(message) }, trySend: (message: unknown) => void told.push(message) } as unknown as Session;
    const allocate = async (request: string) =>
      ((await dispatcher.answer(watched, { type: 'allocate', request, size: String(GRANULARITY) }, -1)).reply as { allocation: string }).allocation;
    const first = await allocate('1');
    let open!: () => void;
    backend.releaseGate = new Promise<void>((resolve) => (open = resolve));
    expect((await dispatcher.answer(watched, { type: 'release', request: '2', allocation: first }, -1)).reply).toMatchObject({ freed: true, handleReferences: 0 });
    // Answered while the free waits on its driver call.
    expect(backend.liveHandles).toBe(1);
    open();
    await registry.settleFrees();
    expect(backend.liveHandles).toBe(0);
    backend.releaseGate = undefined;
    const second = await allocate('3');
    backend.failOnce('release', new Error('injected: cuMemRelease failed'));
    expect((await dispatcher.answer(watched, { type: 'release', request: '4', allocation: second }, -1)).reply).toMatchObject({ freed: true });
    await registry.settleFrees();
    expect(logged).toEqual([expect.stringMatching(/freeing the memory failed after the answer/)]);
    expect(told).toEqual([expect.objectContaining({ type: 'error', code: 'FREE_FAILED' })]);
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
    const dispatcher = new SessionDispatcher({ registry, stores: new StoreRegistry(registry), reclaimers: [] });
    const sent: unknown[] = [];
    const owner = { id: 7n, log, checkDescriptorRoom: () => undefined, trySend: (message: unknown) => void sent.push(message) } as unknown as Session;
    const allocated = await dispatcher.answer(owner, { type: 'allocate', request: '1', size: String(GRANULARITY) }, -1);
    const id = (allocated.reply as { allocation: string }).allocation;
    backend.failures = 2;
    const released = await dispatcher.answer(owner, { type: 'release', request: '2', allocation: id }, -1);
    expect(released.reply).toMatchObject({ type: 'released', freed: true });
    await jest.advanceTimersByTimeAsync(0);
    // Back in the registry, charged; the session heard of it once, with the allocation named.
    expect(registry.snapshot().allocations.map((allocation) => allocation.id)).toEqual([id]);
    expect(sent).toEqual([expect.objectContaining({ type: 'error', code: 'FREE_FAILED', message: expect.stringContaining(`allocation ${id}`) })]);
    // The first retry fails too, the second frees it: no Release, no session end needed.
    await jest.advanceTimersByTimeAsync(FREE_RETRY_MS[0]);
    expect(registry.snapshot().allocations).toHaveLength(1);
    await jest.advanceTimersByTimeAsync(FREE_RETRY_MS[1]);
    expect(registry.snapshot().allocations).toEqual([]);
    expect(backend.memoryInfo().freeBytes).toBe(backend.memoryInfo().totalBytes);
    expect(sent).toHaveLength(1);
  });
});
