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
 * creator's own, freeing the memory under its holders. Callers wait for `idle` before they look at the
 * references, then call `drop` in the same turn.
 */
import type { Backend } from '../backends/backend';
import type { AllocationRecord } from './records';

const ignore = (): undefined => undefined;

export class RetainedReferences {
  // Invariant: the drop in flight per allocation (one at most), removed when it settles.
  private readonly dropping = new Map<AllocationRecord, Promise<void>>();
  // Invariant: every release step in flight that began with a driver drop (settled either way), removed when it settles.
  private readonly steps = new Set<Promise<unknown>>();

  constructor(private readonly backend: Backend) {}

  /**
   * Resolves once no drop is in flight for the allocation; undefined (no
   * turn taken) when none is.
   */
  idle(allocation: AllocationRecord): Promise<void> | undefined {
    if (!this.dropping.has(allocation)) return undefined;
    return (async () => {
      for (let pending = this.dropping.get(allocation); pending !== undefined; pending = this.dropping.get(allocation)) {
        await pending.catch(ignore);
      }
    })();
  }

  /**
   * Drops `count` of the holder's references. The driver's retained ones go
   * first: when one fails, the holder keeps its references and a retry drops
   * the rest (the driver references already dropped are not dropped twice).
   * Synchronous (undefined) when no driver reference is to be dropped, the
   * usual case, so that a Release followed at once by a Create on the session
   * socket has started its free before the Create's quota check sees it.
   * Call only when `idle(allocation)` is undefined.
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
   * Keeps a release step that waits on the driver (its drop, then the start
   * of its free) in sight until it settles; returns it.
   */
  track<T>(step: Promise<T>): Promise<T> {
    const settled = step.catch(ignore);
    this.steps.add(settled);
    void settled.then(() => this.steps.delete(settled));
    return step;
  }

  /**
   * Resolves once every step in flight now has settled: by then each has
   * started its free, which the quotas see. Undefined (no turn taken) when
   * none is in flight.
   */
  settled(): Promise<unknown> | undefined {
    if (this.steps.size === 0) return undefined;
    return Promise.allSettled([...this.steps]);
  }
}
