import { AllocationBudget } from '../../server/registry/allocation-budget';
import { UidBudgets } from '../../server/registry/uid-budgets';

const location = { type: 'DEVICE' as const, id: 0 };

function budgetsOf(): UidBudgets {
  return new UidBudgets(
    { mappingsPerUid: 0, reservationsPerUid: 0, addressSpacePerUid: 0, storesPerUid: 0, allocationsPerUid: 1 },
    { mapEntries: 0, addressSpace: 0, descriptors: 0 },
    (session) => (session === 0n ? undefined : 1000),
  );
}

describe('the allocation budget around the allocation source', () => {
  it('refuses a create past the budget before the upstream makes anything, and counts until the memory is really freed', async () => {
    const calls: string[] = [];
    let next = 10n;
    let failRelease = true;
    const upstream = {
      create: async () => (calls.push('create'), next++),
      adopt: async () => (calls.push('adopt'), { handle: next++, size: 2n, device: 0, location }),
      restore: async () => (calls.push('restore'), { handle: next++, size: 2n, device: 0, location }),
      release: async () => {
        calls.push('release');
        if (failRelease) throw Object.assign(new Error('driver says no'), { code: 'CUDA_ERROR_UNKNOWN' });
      },
      holdClientMemfd: async () => ({ identity: 'memfd', release: () => {} }),
      settle: async () => {},
    };
    const budgets = budgetsOf();
    const source = new AllocationBudget(budgets, upstream);
    const handle = await source.create(1n, 0, location, 2n, ['POSIX_FD']);
    await expect(source.create(1n, 0, location, 2n, ['POSIX_FD'])).rejects.toMatchObject({ code: 'BUDGET_EXCEEDED' });
    expect(calls).toEqual(['create']);
    // A free that failed leaves the memory, and its count, in place.
    await expect(source.release({ owner: 1n, handle, size: 2n, device: 0, imported: false }, true)).rejects.toThrow('driver says no');
    expect(budgets.allocations.usedBy(1000)).toBe(1);
    failRelease = false;
    await source.release({ owner: 1n, handle, size: 2n, device: 0, imported: false }, true);
    expect(budgets.allocations.usedBy(1000)).toBe(0);
  });

  it('gives adopted memory past the budget back upstream, and does not count the daemon’s own', async () => {
    const calls: string[] = [];
    let next = 10n;
    const upstream = {
      create: async () => (calls.push('create'), next++),
      adopt: async () => (calls.push('adopt'), { handle: next++, size: 2n, device: 0, location }),
      restore: async () => (calls.push('restore'), { handle: next++, size: 2n, device: 0, location }),
      release: async () => void calls.push('release'),
      holdClientMemfd: async () => ({ identity: 'memfd', release: () => {} }),
      settle: async () => {},
    };
    const budgets = budgetsOf();
    const source = new AllocationBudget(budgets, upstream);
    await source.create(1n, 0, location, 2n, ['POSIX_FD']);
    calls.length = 0;
    await expect(source.adopt(1n, { fd: 3 }, 2n)).rejects.toMatchObject({ code: 'BUDGET_EXCEEDED' });
    expect(calls).toEqual(['adopt', 'release']);
    await source.create(0n, 0, location, 2n, ['POSIX_FD']);
    expect(budgets.allocations.usedBy(1000)).toBe(1);
  });
});
