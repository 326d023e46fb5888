/**
 * Drops the handle references a holder has in the registry, the driver's
 * retained ones (RetainHandle) first, one drop at a time per allocation, and
 * keeps in sight the release steps in flight that wait on the driver, so that
 * a create can wait for them before its quota check.
 *
 * Why one at a time: a drop computes how many retained references it gives
 * back to the driver from `backendRetains`, which only goes down once the
 * driver has answered; two drops at once (two Releases sent together) would
 * both count the same retained reference and the second would drop the
 * creator's own, freeing the memory under its holders.
 */
import type { Backend } from '../backends/backend';
import type { AllocationRecord } from './records';

const ignore = (): undefined => undefined;

/**
 * The drops in flight per allocation and the release steps waiting on them.
 * A release step (a Release, a reclaim's or a store's drop) runs through
 * run(): after every drop of its allocation in flight, and kept in sight
 * until it has started its free, so that settled() lets a create's quota
 * check see that free.
 */
export class RetainedReferences {
  // Invariant: the drop in flight per allocation (one at most), removed when it settles.
  private readonly dropping = new Map<AllocationRecord, Promise<void>>();
  // Invariant: every release step not yet at the start of its free (waiting for a drop, dropping), settled either way; removed when it settles.
  private readonly steps = new Set<Promise<unknown>>();

  constructor(private readonly backend: Backend) {}

  /**
   * Runs a release step: `begin` looks at the references, may call drop(),
   * and returns (or resolves to) what it started once its free has started.
   * It runs once no drop of the allocation is in flight, checked again after
   * each wait (another step may have started one first); in this turn when
   * none is, so that a step that drops nothing on the driver starts its free
   * before the next request is looked at. A step that waits or drops is
   * tracked (settled()) from its first wait to its end.
   * @throws (or rejects with) what `begin` throws
   */
  run<T extends object>(allocation: AllocationRecord, begin: () => T | Promise<T>): T | Promise<T> {
    if (!this.dropping.has(allocation)) {
      const outcome = begin();
      return outcome instanceof Promise ? this.track(outcome) : outcome;
    }
    return this.track(
      (async () => {
        for (let pending = this.dropping.get(allocation); pending !== undefined; pending = this.dropping.get(allocation)) {
          await pending.catch(ignore);
        }
        return begin();
      })(),
    );
  }

  /**
   * Drops `count` of the holder's references. The driver's retained ones go
   * first: when one fails, the holder keeps its references and a retry drops
   * the rest (the driver references already dropped are not dropped twice).
   * Synchronous (undefined) when no driver reference is to be dropped, the
   * usual case. Only from a run() step's `begin`.
   * @throws Error when a drop of the allocation is in flight (run() rules that out: a bug if seen)
   */
  drop(allocation: AllocationRecord, holder: bigint, count: number): Promise<void> | undefined {
    if (this.dropping.has(allocation)) throw new Error(`a drop of allocation ${allocation.id}'s references is already in flight`);
    const forget = () => {
      const left = (allocation.references.get(holder) ?? 0) - count;
      if (left <= 0) allocation.references.delete(holder);
      else allocation.references.set(holder, left);
    };
    const retained = Math.min(count, allocation.backendRetains);
    if (retained === 0) return void forget();
    const dropping = (async () => {
      for (let i = 0; i < retained; i++) {
        await this.backend.releaseReference(allocation.handle, allocation.device);
        allocation.backendRetains--;
      }
      forget();
    })();
    this.dropping.set(allocation, dropping);
    void dropping.catch(ignore).then(() => this.dropping.delete(allocation));
    return dropping;
  }

  /**
   * Resolves once every release step in flight now has started its free
   * (or failed); undefined (no turn taken) when none is in flight.
   */
  settled(): Promise<unknown> | undefined {
    if (this.steps.size === 0) return undefined;
    return Promise.allSettled([...this.steps]);
  }

  private track<T>(step: Promise<T>): Promise<T> {
    const settled = step.catch(ignore);
    this.steps.add(settled);
    void settled.then(() => this.steps.delete(settled));
    return step;
  }
}
