import { status } from '@grpc/grpc-js';
import { ALL_UIDS, derivedLimits, UidBudgets } from '../../server/registry/uid-budgets';

describe('the budgets of a uid', () => {
  it('derive their defaults from vm.max_map_count and the descriptor limit, keeping a reserve for the daemon', () => {
    // The kernel's default vm.max_map_count, and a daemon limited to 20,000 descriptors.
    const { perUid, totals } = derivedLimits({ maxMapCount: 65_530, descriptors: 20_000 });
    // The daemon keeps an eighth of each for itself; a uid gets a quarter of the rest.
    expect(totals).toEqual({ mapEntries: 65_530 - 8_191, addressSpace: 2 ** 46, descriptors: 20_000 - 2_500 });
    expect(perUid).toEqual({
      mappingsPerUid: 4_778,
      reservationsPerUid: 4_778,
      addressSpacePerUid: 2 ** 44,
      storesPerUid: 2_187,
      allocationsPerUid: 2_187,
    });
    // At worst a mapping splits a reservation's map entry in three: a uid's mappings and reservations fit its quarter.
    expect(2 * perUid.mappingsPerUid + perUid.reservationsPerUid).toBeLessThanOrEqual(totals.mapEntries / 4);
    expect(perUid.allocationsPerUid + perUid.storesPerUid).toBeLessThanOrEqual(totals.descriptors / 4);
  });

  it('are capped where the system limits are far above what the daemon should hold (a GPU host)', () => {
    const { perUid, totals } = derivedLimits({ maxMapCount: 8_249_672, descriptors: 1_048_576 });
    expect(totals.mapEntries).toBe(1 << 18);
    expect(totals.descriptors).toBe(1 << 18);
    expect(perUid.mappingsPerUid).toBe(21_845);
    expect(perUid.allocationsPerUid).toBe(32_768);
  });

  it('never derive 0 (no limit) from a tiny system limit', () => {
    const { perUid } = derivedLimits({ maxMapCount: 8, descriptors: 8 });
    for (const limit of Object.values(perUid)) expect(limit).toBeGreaterThan(0);
  });

  it('count an object against its owner’s uid and the totals, all or nothing, and give it back once', () => {
    const uids = new Map<bigint, number>([
      [1n, 1000],
      [2n, 1000],
      [3n, 2000],
    ]);
    const budgets = new UidBudgets(
      { mappingsPerUid: 2, reservationsPerUid: 5, addressSpacePerUid: 100, storesPerUid: 1, allocationsPerUid: 3 },
      { mapEntries: 7, addressSpace: 1000, descriptors: 100 },
      (session) => uids.get(session),
    );
    const first = budgets.take(1n, { mappings: 1 })!;
    budgets.take(2n, { mappings: 1 });
    // Another session of the same uid: the uid's budget is full.
    expect(() => budgets.take(2n, { mappings: 1 })).toThrow(
      expect.objectContaining({
        status: status.RESOURCE_EXHAUSTED,
        code: 'BUDGET_EXCEEDED',
        message: expect.stringMatching(/^mappings per uid: uid 1000 holds 2 of at most 2/),
      }),
    );
    // A store costs a mapping too: refused whole, nothing counted.
    expect(() => budgets.take(1n, { stores: 1, mappings: 1 })).toThrow(expect.objectContaining({ code: 'BUDGET_EXCEEDED' }));
    expect(budgets.stores.usedBy(1000)).toBe(0);
    // Uid 2000 fits its own budget, but all clients together have 4 of 7 map entries: one mapping more fits, then a reservation does not.
    budgets.take(3n, { mappings: 1 });
    expect(() => budgets.take(3n, { mappings: 1, reservations: 1 })).toThrow(
      expect.objectContaining({
        message: expect.stringContaining(`the daemon's map entries for clients: ${ALL_UIDS} holds 6 of at most 7; this request needs 3 more`),
      }),
    );
    first.give();
    first.give();
    expect(budgets.mappings.usedBy(1000)).toBe(1);
    expect(budgets.mapEntries.usedBy(ALL_UIDS)).toBe(4);
    // The daemon's own objects (no uid) are not counted.
    expect(budgets.take(0n, { allocations: 50 })).toBeUndefined();
    expect(budgets.allocations.usedBy(1000)).toBe(0);
  });
});
