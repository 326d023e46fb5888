/**
 * Statistics: an adaptor around the allocation source that counts live
 * allocations and their bytes (created and adopted, in total and per device)
 * as they come and go, so that Admin's stats and GetMemoryInfo never walk
 * the registry. A SYSMEM store's memfd is the store's, not an allocation: not counted here.
 */
import type { BackendHandle, HandleKind, ImportedHandle, ImportSource, MemLocation } from '../backends/backend';
import { PassThroughSource, type RestoredMemory, type SourcedAllocation } from './source';

export interface AllocationTotals {
  allocations: number;
  createdBytes: bigint;
  importedBytes: bigint;
}

export class AllocationStatistics extends PassThroughSource {
  // Invariant: counts exactly the allocations made by create()/adopt() whose release has not started (or failed).
  private readonly counted: AllocationTotals = { allocations: 0, createdBytes: 0n, importedBytes: 0n };
  // Invariant: bytes of created (not adopted) allocations by device; no entry holds 0.
  private readonly createdByDevice = new Map<number, bigint>();
  // Invariant: the largest createdBytes + importedBytes held at once since start.
  private peak = 0n;

  override async create(owner: bigint, device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    // Counted once the memory exists: a create in flight is not an allocation yet.
    const handle = await this.upstream.create(owner, device, location, size, handleTypes);
    this.count(device, size, false, 1);
    return handle;
  }

  override async adopt(owner: bigint, source: ImportSource, size: bigint): Promise<ImportedHandle> {
    const imported = await this.upstream.adopt(owner, source, size);
    this.count(imported.device, imported.size, true, 1);
    return imported;
  }

  override async restore(memory: RestoredMemory): Promise<ImportedHandle> {
    const restored = await this.upstream.restore(memory);
    this.count(restored.device, restored.size, memory.imported, 1);
    return restored;
  }

  /**
   * Uncounted when its free starts, as the registry forgets it then (a
   * session-socket release is answered, and the stock may hold the free a
   * moment): counted again if the free fails, as the registry keeps it.
   * The device's own free bytes (GetMemoryInfo) and the quotas still see
   * the memory until it is freed.
   */
  override async release(allocation: SourcedAllocation, awaited: boolean): Promise<void> {
    this.count(allocation.device, allocation.size, allocation.imported, -1);
    try {
      await this.upstream.release(allocation, awaited);
    } catch (error) {
      this.count(allocation.device, allocation.size, allocation.imported, 1);
      throw error;
    }
  }

  totals(): AllocationTotals {
    return { ...this.counted };
  }

  /** The most bytes of live allocations (created and adopted) held at once since start. */
  peakBytes(): bigint {
    return this.peak;
  }

  /** Bytes of live allocations the daemon created on a device. */
  createdBytes(device: number): bigint {
    return this.createdByDevice.get(device) ?? 0n;
  }

  private count(device: number, size: bigint, imported: boolean, sign: 1 | -1): void {
    const bytes = sign === 1 ? size : -size;
    this.counted.allocations += sign;
    if (imported) this.counted.importedBytes += bytes;
    else this.counted.createdBytes += bytes;
    const live = this.counted.createdBytes + this.counted.importedBytes;
    if (live > this.peak) this.peak = live;
    if (imported) return;
    const total = (this.createdByDevice.get(device) ?? 0n) + bytes;
    if (total === 0n) this.createdByDevice.delete(device);
    else this.createdByDevice.set(device, total);
  }
}
