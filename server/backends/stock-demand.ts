/**
 * What clients ask the stock for (server/backends/stock.ts), and how deep a
 * shelf each size should have for it. Two measures of the demand per device:
 *
 * - how often: the sizes of its last DEMAND_WINDOW stockable requests. A size
 *   asked DEMAND_MIN_COUNT times there gets a shelf of its own, one deeper per
 *   as many asks again, up to DEMAND_MAX_DEPTH;
 * - how many at once: the requests of each size between two quiet moments (a
 *   burst). Any shelf, configured or not, gets as deep as the largest of its
 *   size's last BURST_MEMORY bursts (of DEMAND_MIN_COUNT or more) times
 *   BURST_HEADROOM (at most BURST_MAX_DEPTH; forgotten once the device is
 *   idle for BURST_IDLE_MS), so that a burst like it is served from the shelf without
 *   a refill: the daemon's creates and frees then wait for the quiet after it,
 *   away from the clients' imports and maps, which they slow (a client
 *   allocating back to back, cold, meets one process's speed only with no
 *   driver work of the daemon's beside its loop).
 *
 * Beyond the configured depths, everything the demand adds on a device holds
 * at most its total bytes / DEMAND_SHARE, the most asked sizes first.
 */

/** Stockable requests (device memory, a descriptor handle) remembered per device: the demand the stock follows. */
export const DEMAND_WINDOW = 64;
/** A size asked this many times in the window gets a shelf of depth 1, and one more per as many again. */
export const DEMAND_MIN_COUNT = 4;
/** Shelves the demand may add per device, beside the configured ones. */
export const DEMAND_MAX_SHELVES = 4;
/** The deepest a shelf gets by how often its size is asked. */
export const DEMAND_MAX_DEPTH = 8;
/** What the demand adds to a device's shelves holds at most the device's total bytes divided by this. */
export const DEMAND_SHARE = 32n;
/** Bursts remembered per size: the largest of them sets the shelf's depth (a smaller run of bursts forgets a large one). */
export const BURST_MEMORY = 8;
/** A shelf is this many times the burst deep: after such a burst it holds more than a quarter (no refill at once). */
export const BURST_HEADROOM = 1.5;
/** The deepest a shelf gets by bursts. */
export const BURST_MAX_DEPTH = 512;
/** A device asked nothing stockable for this long forgets its bursts: what they added goes back (the stock keeps no deep shelves for an idle device). */
export const BURST_IDLE_MS = 10_000;

/** A shelf as the plan sees it: its size, and the depth configured for it (0: the demand added it). */
export interface PlannedShelf {
  size: bigint;
  floor: number;
}

export class StockDemand {
  // Invariant: per device, the sizes of its last DEMAND_WINDOW stockable requests, oldest first, and how often each occurs there.
  private readonly windows = new Map<number, { sizes: bigint[]; counts: Map<bigint, number> }>();
  // Invariant: per device and size in that device's window, the requests since the last quiet moment and the last BURST_MEMORY bursts (each > 0), oldest first.
  private readonly bursts = new Map<string, { current: number; recent: number[] }>();

  /** Counts a stockable request of `size` on `device`; returns how often the window now holds that size. */
  note(device: number, size: bigint): number {
    let window = this.windows.get(device);
    if (window === undefined) this.windows.set(device, (window = { sizes: [], counts: new Map() }));
    window.sizes.push(size);
    window.counts.set(size, (window.counts.get(size) ?? 0) + 1);
    if (window.sizes.length > DEMAND_WINDOW) {
      const oldest = window.sizes.shift()!;
      const left = window.counts.get(oldest)! - 1;
      if (left > 0) window.counts.set(oldest, left);
      else {
        // Gone from the window: forgotten, bursts and all (what is remembered stays bounded, whatever sizes clients ask).
        window.counts.delete(oldest);
        this.bursts.delete(burstKey(device, oldest));
      }
    }
    const key = burstKey(device, size);
    let burst = this.bursts.get(key);
    if (burst === undefined) this.bursts.set(key, (burst = { current: 0, recent: [] }));
    burst.current++;
    return window.counts.get(size) ?? 0;
  }

  /** Sizes whose bursts are remembered, over all devices (bounded by the windows). */
  get remembered(): number {
    return this.bursts.size;
  }

  /** A quiet moment: the requests of each size since the last one are a burst of it. */
  quiet(): void {
    for (const burst of this.bursts.values()) {
      if (burst.current === 0) continue;
      burst.recent.push(burst.current);
      if (burst.recent.length > BURST_MEMORY) burst.recent.shift();
      burst.current = 0;
    }
  }

  /** Forgets every burst (the device has been idle): shelves go back to what the configuration and the counts ask. */
  forgetBursts(): void {
    for (const burst of this.bursts.values()) burst.recent.length = 0;
  }

  /** The depth the bursts of `size` ask for (0: none remembered, or none of DEMAND_MIN_COUNT requests or more). */
  burstDepth(device: number, size: bigint): number {
    const largest = Math.max(0, ...(this.bursts.get(burstKey(device, size))?.recent ?? []));
    return largest < DEMAND_MIN_COUNT ? 0 : Math.min(BURST_MAX_DEPTH, Math.ceil(largest * BURST_HEADROOM));
  }

  /**
   * The depth of every shelf a device should have now: each of `shelves` (a
   * configured one at least its floor; a demand one absent when no longer
   * wanted) and the sizes the demand adds, within the device's budget.
   * @param granularity the device's: other sizes get no shelf of the demand's
   */
  plan(device: number, totalBytes: bigint, granularity: bigint, shelves: PlannedShelf[]): Map<bigint, number> {
    const counts = this.windows.get(device)?.counts ?? new Map<bigint, number>();
    const floors = new Map(shelves.filter((shelf) => shelf.floor > 0).map((shelf) => [shelf.size, shelf.floor]));
    const added = [...counts]
      .filter(([size, count]) => count >= DEMAND_MIN_COUNT && size % granularity === 0n && !floors.has(size))
      .sort(byCount)
      .slice(0, DEMAND_MAX_SHELVES);
    // Configured shelves take part too (by how often they are asked): bursts deepen them.
    const candidates = [...added, ...[...floors.keys()].map((size): [bigint, number] => [size, counts.get(size) ?? 0])].sort(byCount);
    const depths = new Map(floors);
    let budget = totalBytes / DEMAND_SHARE;
    for (const [size, count] of candidates) {
      const floor = floors.get(size) ?? 0;
      const byCountDepth = floor > 0 ? 0 : Math.min(DEMAND_MAX_DEPTH, Math.floor(count / DEMAND_MIN_COUNT));
      // Beyond the floor, only what the budget left holds.
      const depth = Math.min(Math.max(floor, byCountDepth, this.burstDepth(device, size)), floor + Number(budget / size));
      if (depth === 0) continue;
      depths.set(size, depth);
      budget -= BigInt(depth - floor) * size;
    }
    return depths;
  }
}

const burstKey = (device: number, size: bigint) => `${device}:${size}`;

/** Most asked first; of as many asks, the smaller size. */
function byCount([sizeA, countA]: [bigint, number], [sizeB, countB]: [bigint, number]): number {
  return countB - countA || (sizeA < sizeB ? -1 : sizeA > sizeB ? 1 : 0);
}
