/**
 * Reclaim and inspection: what the registry holds, seen whole. Reclaim frees
 * everything one owner (a closed session) holds, trying every object even
 * when some fail; the snapshot and stats are what Admin and the metrics show.
 */
import type { AddressSpace } from './address-space';
import type { Allocations } from './allocations';
import { breathe, hex } from './records';
import type { AllocationStatistics } from './statistics';

export interface RegistryStats {
  reservations: number;
  allocations: number;
  mappings: number;
  reservedBytes: bigint;
  allocatedBytes: bigint;
  importedBytes: bigint;
  mappedBytes: bigint;
}

/** A plain, comparable picture of the registry, for tests and reports. */
export interface RegistrySnapshot {
  reservations: Array<{
    id: string;
    owner: string;
    address: string;
    size: string;
    mappings: Array<{ address: string; size: string; allocation: string; access: Record<string, number> }>;
  }>;
  allocations: Array<{
    id: string;
    owner: string;
    size: string;
    references: Record<string, number>;
    mappingCount: number;
    imported: boolean;
    shared: boolean;
  }>;
}

export class Inspection {
  constructor(
    private readonly space: AddressSpace,
    private readonly allocations: Allocations,
    private readonly statistics: AllocationStatistics,
  ) {}

  /**
   * Reclaims everything an owner holds: its creates in flight (abandoned, their
   * memory released as it arrives), its mappings and reservations, its handle
   * references, after every free in flight has settled. Its allocations still mapped elsewhere or referenced by others
   * pass to the daemon.
   * @throws AggregateError of every object that could not be freed (the others are)
   */
  async reclaim(owner: bigint): Promise<void> {
    // Every object is tried: one that fails (ENOMEM from munmap at vm.max_map_count, a driver error)
    // must not leave the others behind. The failures are reported together at the end.
    const failures: unknown[] = [];
    const attempt = async (body: () => Promise<void>) => {
      try {
        await body();
      } catch (error) {
        failures.push(error);
      }
    };
    await this.allocations.abandonCreates(owner);
    // Frees that Releases answered before are waited for: one that failed is back in the records for the loop below.
    await this.allocations.settleFrees();
    let done = 0;
    for (const reservation of this.space.all().filter((candidate) => candidate.owner === owner)) {
      await breathe(++done);
      await attempt(() => this.space.reclaim(reservation));
    }
    for (const allocation of [...this.allocations.all()]) {
      await breathe(++done);
      await attempt(() => this.allocations.reclaimFrom(owner, allocation));
    }
    if (failures.length > 0) {
      throw new AggregateError(
        failures,
        `reclaiming owner ${owner}: ${failures.length} object(s) could not be freed (first: ${(failures[0] as Error)?.message})`,
      );
    }
  }

  stats(): RegistryStats {
    const counted = this.statistics.totals();
    const stats: RegistryStats = {
      reservations: this.space.all().length,
      allocations: counted.allocations,
      mappings: 0,
      reservedBytes: 0n,
      allocatedBytes: counted.createdBytes,
      importedBytes: counted.importedBytes,
      mappedBytes: 0n,
    };
    for (const reservation of this.space.all()) {
      stats.reservedBytes += reservation.size;
      stats.mappings += reservation.mappings.length;
      for (const mapping of reservation.mappings) stats.mappedBytes += mapping.size;
    }
    return stats;
  }

  snapshot(): RegistrySnapshot {
    return {
      reservations: [...this.space.all()]
        .sort((a, b) => (a.id < b.id ? -1 : 1))
        .map((reservation) => ({
          id: String(reservation.id),
          owner: String(reservation.owner),
          address: hex(reservation.address),
          size: String(reservation.size),
          mappings: reservation.mappings.map((mapping) => ({
            address: hex(mapping.address),
            size: String(mapping.size),
            allocation: String(mapping.allocation.id),
            access: Object.fromEntries(mapping.access),
          })),
        })),
      allocations: [...this.allocations.all()].map((allocation) => ({
        id: String(allocation.id),
        owner: String(allocation.owner),
        size: String(allocation.size),
        references: Object.fromEntries([...allocation.references].map(([holder, count]) => [String(holder), count])),
        mappingCount: allocation.mappingCount,
        imported: allocation.imported,
        shared: allocation.shareKey !== undefined,
      })),
    };
  }
}
