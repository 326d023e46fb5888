/**
 * Numba's deferred deallocation strategy (numba.cuda's _PendingDeallocs):
 * frees queue up and run together once more than `count` are pending or their
 * bytes pass `ratio` of the device's memory; while a deferCleanup() hold is
 * active, nothing runs. A batch runs after beforeBatch(), as Numba's frees
 * (cuMemFree) wait for the device's work.
 */

export interface DeferredFreeSettings {
  /** Flush when more than this many frees are pending (Numba: CUDA_DEALLOCS_COUNT, 10). */
  count: number;
  /** Flush when pending bytes pass this share of the device's memory (Numba: CUDA_DEALLOCS_RATIO, 0.2). */
  ratio: number;
}

export const DEFAULT_DEFERRED_FREE: DeferredFreeSettings = { count: 10, ratio: 0.2 };

/** A queued free: a function, or an object whose release() frees (pooled blocks queue themselves: nothing to allocate). */
export type PendingFree = (() => void | Promise<void>) | { release(): void | Promise<void> };

interface Pending {
  free: PendingFree;
  size: number;
}

const DONE: Promise<void> = Promise.resolve();

export class PendingDeallocations {
  // Invariant: bytes is the sum of the sizes in queue (a number: the hot path allocates no bigint).
  private queue: Pending[] = [];
  private bytes = 0;
  private maxPendingBytes = 0;
  private holds = 0;
  private flushing: Promise<void> = Promise.resolve();

  private deviceBytes: bigint;
  /**
   * Awaited once before each batch of frees runs: the manager waits there for the
   * work queued on the memory (a free carries no stream, and a block back in the
   * pool goes to the next memalloc at once).
   */
  beforeBatch?: () => Promise<void>;

  constructor(
    private readonly settings: DeferredFreeSettings,
    /** The device's memory in bytes: the base of `ratio`. */
    capacity: bigint,
  ) {
    this.deviceBytes = capacity;
    this.capacity = capacity;
  }

  get capacity(): bigint {
    return this.deviceBytes;
  }

  set capacity(bytes: bigint) {
    this.deviceBytes = bytes;
    this.maxPendingBytes = Math.floor(Number(bytes) * this.settings.ratio);
  }

  get pendingCount(): number {
    return this.queue.length;
  }

  get pendingBytes(): bigint {
    return BigInt(this.bytes);
  }

  get held(): boolean {
    return this.holds > 0;
  }

  /** Queues a free; flushes when a limit is passed and no hold is active. */
  add(free: PendingFree, size: bigint | number): Promise<void> {
    const bytes = Number(size);
    this.queue.push({ free, size: bytes });
    this.bytes += bytes;
    if (this.queue.length > this.settings.count || this.bytes > this.maxPendingBytes) return this.flush();
    return DONE;
  }

  /** Runs every queued free, in order, unless a hold is active. */
  flush(): Promise<void> {
    if (this.held) return Promise.resolve();
    const batch = this.queue;
    this.queue = [];
    this.bytes = 0;
    if (batch.length === 0) return this.flushing;
    this.flushing = this.flushing.then(async () => {
      if (this.beforeBatch) await this.beforeBatch();
      for (const item of batch) {
        const done = typeof item.free === 'function' ? item.free() : item.free.release();
        // Pooled blocks go back synchronously; only frees that reach the daemon are awaited.
        if (done !== undefined) await done;
      }
    });
    return this.flushing;
  }

  /** Holds flushing until the returned object is disposed (`using hold = …`). */
  hold(): Disposable {
    this.holds++;
    let released = false;
    return {
      [Symbol.dispose]: () => {
        if (released) return;
        released = true;
        this.holds--;
      },
    };
  }

  /** Drops every queued free without running it (reset: the memory goes another way). */
  discard(): void {
    this.queue = [];
    this.bytes = 0;
  }
}
