import { status } from '@grpc/grpc-js';
import { Budget } from '../../server/registry/budgets';

describe('Budget', () => {
  it('counts per holder and refuses past the limit with nothing counted', () => {
    const budget = new Budget('mappings per uid', 3);
    budget.take(1000, 2);
    budget.take(2000, 3);
    expect(() => budget.take(1000, 2)).toThrow(
      expect.objectContaining({
        status: status.RESOURCE_EXHAUSTED,
        code: 'BUDGET_EXCEEDED',
        message: 'mappings per uid: uid 1000 holds 2 of at most 3; this request needs 2 more',
      }),
    );
    expect(budget.usedBy(1000)).toBe(2);
    expect(budget.usedBy(2000)).toBe(3);
    budget.take(1000);
    expect(budget.fits(1000)).toBe(false);
  });

  it('gives back without going below zero and forgets an empty holder', () => {
    const budget = new Budget('address space per uid', 100, ' bytes');
    budget.take('session 7', 60);
    budget.give('session 7', 80);
    expect(budget.usedBy('session 7')).toBe(0);
    expect([...budget.holders()]).toEqual([]);
    expect(budget.refusal('session 7', 90, 20).message).toBe(
      'address space per uid: session 7 holds 90 bytes of at most 100 bytes; this request needs 20 bytes more',
    );
  });

  it('has no limit at 0', () => {
    const budget = new Budget('stores per uid', 0);
    budget.take(1, 1e9);
    expect(budget.fits(1, 1e9)).toBe(true);
  });
});
