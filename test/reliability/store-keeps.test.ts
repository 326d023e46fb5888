/**
 * A store handed to the daemon outlives its maker: once the maker lets go of
 * the allocation under it (Release, or its session's end), the allocation is
 * the daemon's and its memory is charged to the maker's uid alone, as
 * memory without a session is; no session is charged for memory it no
 * longer holds. A store its session keeps stays that session's, charged to
 * it. Host backend, the daemon's parts without its transports.
 */
import { HostBackend } from '../../server/backends/host';
import { Quotas } from '../../server/registry/quotas';
import { DAEMON_OWNER, Registry } from '../../server/registry';
import { StoreRegistry } from '../../server/stores/stores';

const MiB = 1n << 20n;
const SIZE = 2n * MiB;
const MAKER = 7n;
const OTHER = 8n;
const UID_OF = new Map<bigint, number>([
  [MAKER, 1000],
  [OTHER, 1000],
]);

function world() {
  const backend = new HostBackend({ capacity: 64n * MiB, granularity: SIZE });
  const quotas = new Quotas({ perSession: 0n, perUid: 0n }, (id) => UID_OF.get(id));
  const registry = new Registry(backend, (upstream) => quotas.around(upstream, (handle) => backend.memoryIdentity(handle)));
  const stores = new StoreRegistry(registry);
  const create = () => registry.create(MAKER, { size: SIZE, location: { type: 'DEVICE', id: 0 }, handleType: 'POSIX_FD' });
  const end = async (session: bigint) => {
    await stores.reclaim(session);
    await registry.reclaim(session);
  };
  return { backend, quotas, registry, stores, create, end };
}

describe("a store's allocation once its maker lets go", () => {
  it('passes to the daemon when the maker releases it, charged to the maker’s uid and no session', async () => {
    const { quotas, registry, stores, create, backend } = world();
    const allocation = await create();
    const store = await stores.create(MAKER, { allocationId: allocation.id, name: 'weights', readOnly: false, handOver: true, size: 0n, creatorUid: 1000 });
    // Still the maker's while it holds its handle: it may share and export it.
    expect(allocation.owner).toBe(MAKER);
    expect(quotas.used()).toEqual({ bySession: { [String(MAKER)]: String(SIZE) }, byUid: { 1000: String(SIZE) } });
    await registry.release(MAKER, allocation.id);
    expect(registry.allocation(allocation.id).owner).toBe(DAEMON_OWNER);
    expect(quotas.used()).toEqual({ bySession: {}, byUid: { 1000: String(SIZE) } });
    // The maker's end changes nothing more; the store's detach frees it and its charge.
    await stores.reclaim(MAKER);
    await registry.reclaim(MAKER);
    expect(quotas.used()).toEqual({ bySession: {}, byUid: { 1000: String(SIZE) } });
    await stores.detach(DAEMON_OWNER, store);
    expect(quotas.used()).toEqual({ bySession: {}, byUid: {} });
    expect(backend.memoryInfo().freeBytes).toBe(64n * MiB);
  });

  it("passes to the daemon at its maker's end, charged to the maker's uid and no session", async () => {
    const { quotas, registry, stores, create, end } = world();
    const allocation = await create();
    const store = await stores.create(MAKER, { allocationId: allocation.id, name: 'weights', readOnly: false, handOver: true, size: 0n, creatorUid: 1000 });
    await end(MAKER);
    expect(registry.allocation(allocation.id).owner).toBe(DAEMON_OWNER);
    expect(quotas.used()).toEqual({ bySession: {}, byUid: { 1000: String(SIZE) } });
    await stores.detach(DAEMON_OWNER, store);
    expect(quotas.used()).toEqual({ bySession: {}, byUid: {} });
  });

  it('stays its session’s, charged to it, when the store is the session’s own', async () => {
    const { quotas, registry, stores, create, end } = world();
    const allocation = await create();
    await stores.create(MAKER, { allocationId: allocation.id, name: 'scratch', readOnly: false, handOver: false, size: 0n, creatorUid: 1000 });
    await registry.release(MAKER, allocation.id);
    expect(registry.allocation(allocation.id).owner).toBe(MAKER);
    expect(quotas.used()).toEqual({ bySession: { [String(MAKER)]: String(SIZE) }, byUid: { 1000: String(SIZE) } });
    await end(MAKER);
    expect(quotas.used()).toEqual({ bySession: {}, byUid: {} });
  });

  it('stays its maker’s while another reference of the maker’s is left, and passes with the last', async () => {
    const { quotas, registry, stores, create } = world();
    const allocation = await create();
    await stores.create(MAKER, { allocationId: allocation.id, name: 'weights', readOnly: false, handOver: true, size: 0n, creatorUid: 1000 });
    // A second handle reference of the maker's (RetainHandle's kind), held through the registry's own hold.
    registry.holdAllocation(MAKER, allocation.id, MAKER);
    await registry.release(MAKER, allocation.id);
    expect(registry.allocation(allocation.id).owner).toBe(MAKER);
    expect(quotas.used().bySession).toEqual({ [String(MAKER)]: String(SIZE) });
    await registry.release(MAKER, allocation.id);
    expect(registry.allocation(allocation.id).owner).toBe(DAEMON_OWNER);
    expect(quotas.used()).toEqual({ bySession: {}, byUid: { 1000: String(SIZE) } });
  });
});
