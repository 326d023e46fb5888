/**
 * What the registry tells its observer (the parked state) around an export:
 * an export changes nothing the parked record holds, so the observer hears
 * of an allocation when it is made and when it changes, not again for each
 * descriptor handed out; a release during an export is still recorded, and
 * the memory freed once the export is over.
 */
import { Registry } from '../../server/registry';
import { FakeBackend, MiB } from './fake-backend';

const OWNER = 7n;
const ARGS = { size: 2n * MiB, location: { type: 'DEVICE' as const, id: 0 }, handleType: 'POSIX_FD' as const };

function observed(registry: Registry): { changed: bigint[]; gone: bigint[] } {
  const heard = { changed: [] as bigint[], gone: [] as bigint[] };
  registry.allocations.observer = { changed: (allocation) => heard.changed.push(allocation.id), gone: (allocation) => heard.gone.push(allocation.id) };
  return heard;
}

describe("the registry's observer around an export", () => {
  it('hears of an allocated-and-exported allocation once, and not again for a second export', async () => {
    const registry = new Registry(new FakeBackend({ capacity: 64n * MiB }));
    const heard = observed(registry);
    const { allocation } = await registry.createExported(OWNER, ARGS, (error) => {
      throw error;
    });
    expect(heard.changed).toEqual([allocation.id]);
    await registry.exportHandle(OWNER, { allocationId: allocation.id, handleType: 'POSIX_FD', shareKey: '' });
    expect(heard.changed).toEqual([allocation.id]);
    expect(heard.gone).toEqual([]);
  });

  it('records a release that comes while an export is in flight, and frees the memory once the export is over', async () => {
    const backend = new FakeBackend({ capacity: 64n * MiB });
    const registry = new Registry(backend);
    const heard = observed(registry);
    const made = await registry.create(OWNER, ARGS);
    const exporting = registry.exportHandle(OWNER, { allocationId: made.id, handleType: 'POSIX_FD', shareKey: '' });
    const released = await registry.release(OWNER, made.id);
    // Pinned by the export: not freed yet, the dropped reference recorded.
    expect(released.freed).toBe(false);
    expect(heard.changed).toEqual([made.id, made.id]);
    await exporting;
    expect(heard.gone).toEqual([made.id]);
    expect([...registry.allocations.all()]).toEqual([]);
  });
});
