/**
 * Store names (server/stores/store-names.ts through StoreRegistry): a name
 * names at most one store not detached, whatever the order of creates,
 * detaches, failed creates and session ends; a detached store's name is free
 * again and finds nothing; two creates of one name racing cannot both win.
 */
import { Registry } from '../../server/registry';
import { StoreRegistry } from '../../server/stores/stores';
import { FakeBackend, GRANULARITY, MiB } from './fake-backend';

const SESSION = 1n;
const DEVICE0 = { type: 'DEVICE' as const, id: 0 };

function storeRegistry() {
  const registry = new Registry(new FakeBackend({ capacity: 256n * MiB }));
  const registryOfStores = new StoreRegistry(registry);
  const allocation = async () => (await registry.create(SESSION, { size: GRANULARITY, location: DEVICE0, handleType: 'POSIX_FD' })).id;
  const create = async (name: string) =>
    registryOfStores.create(SESSION, { allocationId: await allocation(), name, readOnly: false, handOver: false, size: 0n });
  return { registry, stores: registryOfStores, create };
}

describe('store names', () => {
  it('find a store by name until it is detached; the name is free again after', async () => {
    const { stores: named, create } = storeRegistry();
    const first = await create('weights');
    expect(named.find({ id: 0n, name: 'weights' })).toBe(first);
    await expect(create('weights')).rejects.toMatchObject({ code: 'NAME_TAKEN' });
    await named.detach(SESSION, first);
    expect(() => named.find({ id: 0n, name: 'weights' })).toThrow(expect.objectContaining({ code: 'UNKNOWN_STORE' }));
    const second = await create('weights');
    expect(named.find({ id: 0n, name: 'weights' })).toBe(second);
    // By id, the detached one is still there until it is released; by name, only the live one.
    expect(named.find({ id: second.id, name: '' })).toBe(second);
  });

  it('let only one of two racing creates of one name win, and the loser changes nothing', async () => {
    const { stores: named, create } = storeRegistry();
    const outcomes = await Promise.allSettled([create('racy'), create('racy'), create('racy')]);
    expect(outcomes.filter((outcome) => outcome.status === 'fulfilled')).toHaveLength(1);
    expect(outcomes.filter((outcome) => outcome.status === 'rejected').map((outcome) => (outcome as PromiseRejectedResult).reason.code)).toEqual([
      'NAME_TAKEN',
      'NAME_TAKEN',
    ]);
    expect(named.list().filter((store) => store.name === 'racy')).toHaveLength(1);
  });

  it('free the name of a create that failed', async () => {
    const { stores: named, create } = storeRegistry();
    await expect(named.create(SESSION, { allocationId: 999n, name: 'lost', readOnly: false, handOver: false, size: 0n })).rejects.toMatchObject({
      code: 'UNKNOWN_ALLOCATION',
    });
    expect((await create('lost')).name).toBe('lost');
  });

  it("free every name of a session's stores when the session ends", async () => {
    const { stores: named, create } = storeRegistry();
    for (let i = 0; i < 50; i++) await create(`s${i}`);
    await named.reclaim(SESSION);
    for (let i = 0; i < 50; i++) expect(() => named.find({ id: 0n, name: `s${i}` })).toThrow(expect.objectContaining({ code: 'UNKNOWN_STORE' }));
    for (let i = 0; i < 50; i++) expect((await create(`s${i}`)).name).toBe(`s${i}`);
  });

  it('never index anonymous stores', async () => {
    const { stores: named, create } = storeRegistry();
    await create('');
    await create('');
    expect(named.list()).toHaveLength(2);
    expect(() => named.find({ id: 0n, name: '' })).toThrow(expect.objectContaining({ code: 'UNKNOWN_STORE' }));
  });
});
