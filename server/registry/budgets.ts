/**
 * Budgets: how much of one resource a uid (or a session) may make the daemon
 * hold at once. Every resource a client can make the daemon hold on its
 * behalf (mappings, address space, stores, streams, connections, descriptors
 * in flight) is counted in one of these, so that no uid can take the share
 * that others need. Past a budget the request is refused before anything is
 * done: RESOURCE_EXHAUSTED, code BUDGET_EXCEEDED, naming the budget, what the
 * holder uses and the limit.
 */
import { resourceExhausted, RpcError } from '../errors';

/** What a holder is called in a refusal ("uid 1000", "session 7"). */
export type Holder = number | string;

/** One resource counted per holder, with one limit for every holder (0: no limit). */
export class Budget {
  // Invariant: every value is > 0; a holder that holds nothing has no entry.
  private readonly used = new Map<Holder, number>();

  constructor(
    /** The budget's name as refusals, metrics and docs say it ("mappings per uid"). */
    readonly name: string,
    /** The most one holder may hold; 0: no limit. */
    public limit: number,
    /** The unit a refusal names after a number ('' for counts, ' bytes'). */
    readonly unit = '',
  ) {}

  /**
   * Counts `amount` more against `holder`, or refuses with nothing counted;
   * with `anyway`, counts it past the limit too (something held already, that cannot be refused).
   * @throws RpcError RESOURCE_EXHAUSTED BUDGET_EXCEEDED
   */
  take(holder: Holder, amount = 1, anyway = false): void {
    const now = this.used.get(holder) ?? 0;
    if (!anyway && this.limit > 0 && now + amount > this.limit) throw this.refusal(holder, now, amount);
    if (now + amount > 0) this.used.set(holder, now + amount);
  }

  /** Whether `amount` more would fit, without counting it. */
  fits(holder: Holder, amount = 1): boolean {
    return this.limit <= 0 || (this.used.get(holder) ?? 0) + amount <= this.limit;
  }

  /** Gives back what `take` counted; never below zero. */
  give(holder: Holder, amount = 1): void {
    const left = (this.used.get(holder) ?? 0) - amount;
    if (left > 0) this.used.set(holder, left);
    else this.used.delete(holder);
  }

  /** What `holder` holds now. */
  usedBy(holder: Holder): number {
    return this.used.get(holder) ?? 0;
  }

  /** Every holder that holds something, for metrics and reports. */
  holders(): IterableIterator<[Holder, number]> {
    return this.used.entries();
  }

  /** The refusal `take` throws, for callers that check before they count. */
  refusal(holder: Holder, used = this.usedBy(holder), amount = 1): RpcError {
    const who = typeof holder === 'number' ? `uid ${holder}` : holder;
    return resourceExhausted(
      'BUDGET_EXCEEDED',
      `${this.name}: ${who} holds ${used}${this.unit} of at most ${this.limit}${this.unit}; this request needs ${amount}${this.unit} more`,
    );
  }
}
