/**
 * A Release that answers before the free (so that a client's free costs no
 * driver time: the session socket's
 * release answers once the references are dropped and the free has
 * started), as a contract on the fake, host and cuda backends: the memory
 * is gone for callers at once but stays charged until the backend has freed
 * it; a create over the quota while its holder has frees in flight waits for
 * them rather than being refused, and never holds more than the quota at any
 * moment; a free that fails after the answer leaves the allocation recorded
 * and charged for the next Release or the reclaim; the reclaim and
 * settleFrees wait for frees in flight.
 */
import { status as Status } from '@grpc/grpc-js';
import { Backend } from '../../server/backends/backend';
import { RpcError } from '../../server/errors';
import { QuotaLimits, Quotas } from '../../server/registry/quotas';
import { DAEMON_OWNER, Registry } from '../../server/registry';
import { RecordingBackend } from './recording-backend';

const A = 1n;
const B = 2n;
const UID = 1000;
const DEVICE0 = { type: 'DEVICE' as const, id: 0 };

/** A gate a test opens by hand: the backend's frees wait on it while it is set. */
function gate(): { promise: Promise<void>; open: () => void } {
  let open!: () => void;
  const promise = new Promise<void>((resolve) => (open = resolve));
  return { promise, open };
}

/** Whether a promise has settled, after every microtask and one turn of the event loop. */
async function settled(promise: Promise<unknown>): Promise<boolean> {
  let done = false;
  promise.then(
    () => (done = true),
    () => (done = true),
  );
  await new Promise((resolve) => setImmediate(resolve));
  return done;
}

export function releaseEarlyContract(makeBackend: () => Backend | Promise<Backend>): void {
  let backend: RecordingBackend;
  let registry: Registry;
  let quotas: Quotas;
  let GRANULARITY: bigint;

  /** A registry with the daemon's quota adaptor, its limits in granules; A and B are sessions of one uid. */
  async function setUp(granules: Partial<QuotaLimits> = {}): Promise<void> {
    backend = new RecordingBackend(await makeBackend());
    GRANULARITY = backend.devices()[0].granularityMinimum;
    const limits = { perUid: (granules.perUid ?? 0n) * GRANULARITY, perSession: (granules.perSession ?? 0n) * GRANULARITY };
    quotas = new Quotas(limits, (session) => (session === A || session === B ? UID : undefined));
    registry = new Registry(backend, (upstream) => quotas.around(upstream, (handle, device) => backend.memoryIdentity(handle, device)));
  }

  const create = (caller = A) => registry.create(caller, { size: GRANULARITY, location: DEVICE0, handleType: 'POSIX_FD' });
  const charged = () => quotas.used();

  afterEach(async () => {
    if (backend === undefined) return;
    backend.releaseGate = undefined;
    backend.releaseReferenceGate = undefined;
    for (const owner of [A, B, DAEMON_OWNER]) await registry.reclaim(owner);
    expect({ handles: backend.liveHandles, charged: charged() }).toEqual({ handles: 0, charged: { byUid: {}, bySession: {} } });
    await backend.close();
  });

  it('answers once the references are dropped: the memory is gone for callers, still charged, and freed after', async () => {
    await setUp({ perSession: 4n });
    const made = await create();
    const held = gate();
    backend.releaseGate = held.promise;
    const { result, freeing } = await registry.releaseAnswering(A, made.id);
    expect(result).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
    // Gone for callers at once (a second Release, an export, the snapshot) ...
    expect(() => registry.allocation(made.id)).toThrow(/does not exist/);
    expect(registry.snapshot().allocations).toEqual([]);
    // ... but alive, and charged, until the backend has freed it.
    expect(await settled(freeing)).toBe(false);
    expect(backend.liveHandles).toBe(1);
    expect(charged().bySession).toEqual({ [String(A)]: String(GRANULARITY) });
    held.open();
    await freeing;
    expect(backend.liveHandles).toBe(0);
    expect(charged().bySession).toEqual({});
  });

  it('the Release RPC (release) still answers after the free', async () => {
    await setUp();
    const made = await create();
    const held = gate();
    backend.releaseGate = held.promise;
    const releasing = registry.release(A, made.id);
    expect(await settled(releasing)).toBe(false);
    held.open();
    expect(await releasing).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
    expect(backend.liveHandles).toBe(0);
  });

  it('a create over the session quota while a free of the session is in flight waits for it, then is made', async () => {
    await setUp({ perSession: 1n });
    const first = await create();
    const held = gate();
    backend.releaseGate = held.promise;
    await registry.releaseAnswering(A, first.id);
    const creates = backend.calls.filter((call) => call === 'create').length;
    const second = create();
    // Waiting, not refused, and not made: the quota still holds the first's bytes.
    expect(await settled(second)).toBe(false);
    expect(backend.calls.filter((call) => call === 'create').length).toBe(creates);
    held.open();
    expect((await second).size).toBe(GRANULARITY);
    expect(backend.maxLiveHandles).toBe(1);
    expect(quotas.refusals).toBe(0);
  });

  it("a create over the uid's quota waits for a free in flight of another session of that uid", async () => {
    await setUp({ perUid: 1n });
    const first = await create(A);
    const held = gate();
    backend.releaseGate = held.promise;
    await registry.releaseAnswering(A, first.id);
    const second = create(B);
    expect(await settled(second)).toBe(false);
    held.open();
    expect((await second).owner).toBe(B);
    expect(backend.maxLiveHandles).toBe(1);
  });

  it('a create at the quota while a reclaim drops the last references, retained ones among them, waits for the driver and the free', async () => {
    await setUp({ perSession: 1n });
    const reservation = registry.reserve(DAEMON_OWNER, { size: GRANULARITY, alignment: 0n, address: 0n });
    const first = await create(A);
    await registry.map(A, { address: reservation.address, size: GRANULARITY, offset: 0n, allocationId: first.id });
    registry.retainHandle(B, reservation.address);
    registry.retainHandle(B, reservation.address);
    await registry.unmap(DAEMON_OWNER, reservation.address, GRANULARITY);
    await registry.freeAddress(DAEMON_OWNER, reservation.address, GRANULARITY);
    // A's release drops one of the driver's two retained references; B holds the last two references, one retained.
    expect((await registry.releaseAnswering(A, first.id)).result).toEqual({ freed: false, handleReferences: 2, mappingCount: 0 });
    // B goes (its process died): its reclaim waits for the driver to drop the retained reference; A allocates meanwhile.
    const held = gate();
    backend.releaseReferenceGate = held.promise;
    const drops = () => backend.calls.filter((call) => call === 'releaseReference').length;
    const dropped = drops();
    const reclaiming = registry.reclaim(B);
    for (let turn = 0; drops() === dropped && turn < 100; turn++) await new Promise((resolve) => setImmediate(resolve));
    expect(drops()).toBe(dropped + 1);
    const second = create(A);
    const early = await settled(second);
    held.open();
    expect(early).toBe(false);
    await reclaiming;
    expect((await second).size).toBe(GRANULARITY);
    expect({ refusals: quotas.refusals, maxLive: backend.maxLiveHandles, retains: backend.liveRetains.size }).toEqual({ refusals: 0, maxLive: 1, retains: 0 });
  });

  it('a create over the quota with no free of its holder in flight is refused at once, nothing charged or made', async () => {
    await setUp({ perSession: 1n });
    await create(A);
    const other = await setUpOther();
    const held = gate();
    backend.releaseGate = held.promise;
    // B's free in flight is no reason for A to wait: A's own quota is what is full.
    await registry.releaseAnswering(B, other.id);
    const calls = backend.calls.length;
    const error = await create(A).catch((caught: unknown) => caught);
    expect(error).toBeInstanceOf(RpcError);
    expect({ status: (error as RpcError).status, code: (error as RpcError).code }).toEqual({ status: Status.RESOURCE_EXHAUSTED, code: 'QUOTA_EXCEEDED' });
    expect(backend.calls.slice(calls)).toEqual([]);
    expect(charged().bySession[String(A)]).toBe(String(GRANULARITY));
    held.open();
  });

  async function setUpOther() {
    return create(B);
  }

  it('attack: release then allocate at the quota, frees delayed, never holds more than the quota and is never refused', async () => {
    await setUp({ perSession: 2n });
    const live = [await create(), await create()];
    // Every free takes a few turns of the event loop, as a driver thread's would.
    const delayed = () => new Promise<void>((resolve) => setImmediate(() => setImmediate(resolve)));
    for (let round = 0; round < 40; round++) {
      backend.releaseGate = delayed();
      const victim = live.shift()!;
      const { result } = await registry.releaseAnswering(A, victim.id);
      expect(result.freed).toBe(true);
      live.push(await create());
      expect(backend.liveHandles).toBeLessThanOrEqual(2);
      expect(BigInt(charged().bySession[String(A)])).toBeLessThanOrEqual(2n * GRANULARITY);
    }
    expect(backend.maxLiveHandles).toBeLessThanOrEqual(2);
    expect(quotas.refusals).toBe(0);
  });

  it('a release and a create sent together at the quota (the create not waiting for the answer) is never refused', async () => {
    await setUp({ perSession: 1n });
    let live = await create();
    for (let round = 0; round < 10; round++) {
      backend.releaseGate = new Promise<void>((resolve) => setImmediate(resolve));
      const releasing = registry.releaseAnswering(A, live.id);
      const creating = create();
      expect((await releasing).result.freed).toBe(true);
      live = await creating;
    }
    expect(backend.maxLiveHandles).toBe(1);
    expect(quotas.refusals).toBe(0);
  });

  it('a free that fails after the answer leaves the allocation recorded and charged; the next Release frees it', async () => {
    await setUp({ perSession: 4n });
    const made = await create();
    backend.failOnce('release', Object.assign(new Error('CUDA_ERROR_UNKNOWN: cuMemRelease'), { code: 'CUDA_ERROR_UNKNOWN' }));
    const { result, freeing } = await registry.releaseAnswering(A, made.id);
    expect(result.freed).toBe(true);
    await expect(freeing).rejects.toThrow(/cuMemRelease/);
    expect(registry.allocation(made.id).id).toBe(made.id);
    expect(registry.snapshot().allocations.map((allocation) => allocation.id)).toEqual([String(made.id)]);
    expect(charged().bySession).toEqual({ [String(A)]: String(GRANULARITY) });
    expect(backend.liveHandles).toBe(1);
    const again = await registry.releaseAnswering(A, made.id);
    expect(again.result).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
    await again.freeing;
    expect(backend.liveHandles).toBe(0);
    expect(charged().bySession).toEqual({});
  });

  it("a session's reclaim waits for its frees in flight, and frees what failed after the answer", async () => {
    await setUp({ perSession: 4n });
    const [first, second] = [await create(), await create()];
    const held = gate();
    backend.releaseGate = held.promise;
    await registry.releaseAnswering(A, first.id);
    backend.releaseGate = undefined;
    backend.failOnce('release', new Error('injected: the driver refused the free'));
    const failing = (await registry.releaseAnswering(A, second.id)).freeing;
    await expect(failing).rejects.toThrow(/injected/);
    backend.releaseGate = held.promise;
    const reclaiming = registry.reclaim(A);
    expect(await settled(reclaiming)).toBe(false);
    held.open();
    await reclaiming;
    expect(backend.liveHandles).toBe(0);
    expect(charged().bySession).toEqual({});
  });

  it('settleFrees (the daemon stopping) resolves only once every free in flight has settled', async () => {
    await setUp();
    const made = await create();
    const held = gate();
    backend.releaseGate = held.promise;
    await registry.releaseAnswering(A, made.id);
    const settling = registry.settleFrees();
    expect(await settled(settling)).toBe(false);
    held.open();
    await settling;
    expect(backend.liveHandles).toBe(0);
  });
}
