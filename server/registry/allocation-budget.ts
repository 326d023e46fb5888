/**
 * An adaptor around the allocation source that counts allocations (created
 * and adopted) against their owner's uid's budget and the daemon's
 * descriptors for clients, beside the quota's bytes: a uid that makes many
 * small allocations cannot take the daemon's descriptors (a memfd each on the
 * host) however little memory they hold. A create is counted before the
 * upstream is awaited, an adoption once its memory is there (check and count
 * are one synchronous step either way: concurrent requests never overshoot);
 * the count is given back once the memory is freed. A SYSMEM store's memfd
 * counts as its store (server/stores/stores.ts), not as an allocation.
 */
import type { BackendHandle, HandleKind, ImportedHandle, ImportSource, MemLocation } from '../backends/backend';
import { type AllocationSource, PassThroughSource, type RestoredMemory, type SourcedAllocation } from './source';
import type { Charge, UidBudgets } from './uid-budgets';

export class AllocationBudget extends PassThroughSource {
  // Invariant: the charge of every live handle created or adopted through this adaptor for an owner with a uid.
  private readonly charges = new Map<BackendHandle, Charge>();

  constructor(
    private readonly budgets: UidBudgets,
    upstream: AllocationSource,
  ) {
    super(upstream);
  }

  /** @throws RESOURCE_EXHAUSTED BUDGET_EXCEEDED (nothing is created); the upstream's errors */
  override async create(owner: bigint, device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    const charge = this.budgets.take(owner, { allocations: 1 });
    let handle: BackendHandle;
    try {
      handle = await this.upstream.create(owner, device, location, size, handleTypes);
    } catch (error) {
      charge?.give();
      throw error;
    }
    if (charge !== undefined) this.charges.set(handle, charge);
    return handle;
  }

  /** @throws RESOURCE_EXHAUSTED BUDGET_EXCEEDED (the adopted memory is released again); the upstream's errors */
  override async adopt(owner: bigint, source: ImportSource, size: bigint): Promise<ImportedHandle> {
    const imported = await this.upstream.adopt(owner, source, size);
    let charge: Charge | undefined;
    try {
      charge = this.budgets.take(owner, { allocations: 1 });
    } catch (error) {
      await this.upstream.release({ owner, handle: imported.handle, size: imported.size, device: imported.device, imported: true }, true);
      throw error;
    }
    if (charge !== undefined) this.charges.set(imported.handle, charge);
    return imported;
  }

  /** Counted against the uid it counted for before (none: the daemon's, not counted). */
  override async restore(memory: RestoredMemory): Promise<ImportedHandle> {
    const restored = await this.upstream.restore(memory);
    const charge = memory.charged === undefined ? undefined : this.budgets.restore(memory.charged.uid, { allocations: 1 });
    if (charge !== undefined) this.charges.set(restored.handle, charge);
    return restored;
  }

  override async release(allocation: SourcedAllocation, awaited: boolean): Promise<void> {
    // Taken out before the upstream frees the handle: a handle number reused at once (a memfd's) must not meet this charge.
    const charge = this.charges.get(allocation.handle);
    this.charges.delete(allocation.handle);
    try {
      await this.upstream.release(allocation, awaited);
    } catch (error) {
      // Not freed: still counted, and the next release tries again.
      if (charge !== undefined && !this.charges.has(allocation.handle)) this.charges.set(allocation.handle, charge);
      throw error;
    }
    charge?.give();
  }
}
