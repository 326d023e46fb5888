/** Who acts on the daemon's objects: the daemon, and only the callers the registry's owner rule admits (the daemon admits admins' sessions). */
import { DAEMON_OWNER, Registry } from '../../server/registry';
import { FakeBackend, GRANULARITY } from './fake-backend';

const ADMIN = 1n;
const OTHER = 2n;
const DEVICE0 = { type: 'DEVICE' as const, id: 0 };

describe("the daemon's objects", () => {
  it('are acted on by the daemon and the callers it admits; anyone else is refused NOT_OWNER and nothing changes', async () => {
    const registry = new Registry(new FakeBackend(), undefined, (caller) => caller === ADMIN);
    const allocation = await registry.create(DAEMON_OWNER, { size: GRANULARITY, location: DEVICE0, handleType: 'POSIX_FD' });
    const reservation = registry.reserve(DAEMON_OWNER, { size: GRANULARITY, alignment: 0n, address: 0n });
    const own = await registry.create(OTHER, { size: GRANULARITY, location: DEVICE0, handleType: 'POSIX_FD' });
    const before = registry.stats();
    const refusals = [
      () => registry.release(OTHER, allocation.id),
      () => registry.share(OTHER, allocation.id),
      () => registry.exportHandle(OTHER, { allocationId: allocation.id, handleType: 'POSIX_FD', shareKey: '' }),
      () => registry.holdAllocation(OTHER, allocation.id, 1n << 62n),
      () => registry.map(OTHER, { address: reservation.address, size: GRANULARITY, offset: 0n, allocationId: own.id }),
      () => registry.freeAddress(OTHER, reservation.address, GRANULARITY),
    ];
    for (const refused of refusals) {
      await expect((async () => refused())()).rejects.toMatchObject({ code: 'NOT_OWNER', message: expect.stringMatching(/belongs to the daemon/) });
    }
    expect(registry.stats()).toEqual(before);
    // The admitted caller may.
    await registry.map(ADMIN, { address: reservation.address, size: GRANULARITY, offset: 0n, allocationId: allocation.id });
    expect(registry.share(ADMIN, allocation.id)).toMatch(/./);
    await registry.unmap(ADMIN, reservation.address, GRANULARITY);
    await registry.freeAddress(ADMIN, reservation.address, GRANULARITY);
    await registry.release(ADMIN, allocation.id);
    await registry.release(OTHER, own.id);
    expect(registry.stats().allocations).toBe(0);
  });

  it('are open to every caller of a bare registry (the default)', async () => {
    const registry = new Registry(new FakeBackend());
    const allocation = await registry.create(DAEMON_OWNER, { size: GRANULARITY, location: DEVICE0, handleType: 'POSIX_FD' });
    await registry.release(OTHER, allocation.id);
    expect(registry.stats().allocations).toBe(0);
  });
});
