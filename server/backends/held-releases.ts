/**
 * Frees held back to run later: a release nobody waits for (a session
 * socket's, answered before its free) waits here until its owner (the stock,
 * server/backends/stock.ts) runs them all, when the daemon is quiet or a
 * refill burst starts, or until RELEASE_HOLD_MAX (or more than the device's
 * byte bound, at least RELEASE_HOLD_MIN_BYTES) wait. A free is driver work that serializes with the driver work of every
 * client (the driver's own lock): one beside a client's import and map slows
 * it (issue 18: a client allocating and freeing back to back met the one
 * process's speed only with the daemon's frees held until it stopped). Run,
 * they go RELEASE_PARALLEL at a time: the driver threads stay free for other
 * work, and their completions come to the event loop spread out. Whoever
 * waits for a free calls hurry() (Backend.hurry).
 */
import type { BackendHandle } from './backend';

/** At most this many releases are held; one more and they all run. */
export const RELEASE_HOLD_MAX = 256;
/** The byte bound of a device is never below this (a small device's share of it would hold next to nothing). */
export const RELEASE_HOLD_MIN_BYTES = 64n << 20n;
/** Held releases run this many at a time. */
export const RELEASE_PARALLEL = 2;

/** What a held release frees: the backend's release arguments. */
export type ReleaseCall = (handle: BackendHandle, size: bigint, imported: boolean, device: number) => Promise<void>;

interface Held {
  handle: BackendHandle;
  size: bigint;
  imported: boolean;
  device: number;
  resolve(): void;
  reject(error: unknown): void;
}

const max = (a: bigint, b: bigint) => (a > b ? a : b);

export class HeldReleases {
  // Invariant: the releases not yet started, oldest first; `bytes` sums their sizes per device.
  private readonly held: Held[] = [];
  private readonly bytes = new Map<number, bigint>();
  // Invariant: the releases let go and not yet started (at most RELEASE_PARALLEL run), oldest first.
  private readonly queue: Held[] = [];
  private running = 0;
  // A hurry() is still to look again at the next turn (releases on their way through the registry's adaptors).
  private hurrying = false;

  /** @param limitBytes the most bytes of a device held before they all run */
  constructor(
    private readonly release: ReleaseCall,
    private readonly limitBytes: (device: number) => bigint = () => BigInt(Number.MAX_SAFE_INTEGER),
  ) {}

  /** Releases held, not yet let go. */
  get size(): number {
    return this.held.length;
  }

  /** Holds a release; resolves (or rejects) once it ran. Lets them all go past RELEASE_HOLD_MAX or the device's byte bound. */
  hold(handle: BackendHandle, size: bigint, imported: boolean, device: number): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      this.held.push({ handle, size, imported, device, resolve, reject });
      const bytes = (this.bytes.get(device) ?? 0n) + size;
      this.bytes.set(device, bytes);
      if (this.held.length >= RELEASE_HOLD_MAX || bytes > max(this.limitBytes(device), RELEASE_HOLD_MIN_BYTES)) this.runAll();
    });
  }

  /** Lets every held release go now (they start RELEASE_PARALLEL at a time). */
  runAll(): void {
    this.queue.push(...this.held.splice(0));
    this.bytes.clear();
    this.startNext();
  }

  /** Starts every held and queued release now, all at once (the owner closes: the backend goes next). */
  startAll(): void {
    this.queue.push(...this.held.splice(0));
    this.bytes.clear();
    for (const next of this.queue.splice(0)) this.release(next.handle, next.size, next.imported, next.device).then(next.resolve, next.reject);
  }

  /** Lets the held releases go now, and those that reach hold() later in this turn. */
  hurry(): void {
    this.runAll();
    if (this.hurrying) return;
    this.hurrying = true;
    setImmediate(() => {
      this.hurrying = false;
      this.runAll();
    });
  }

  private startNext(): void {
    while (this.running < RELEASE_PARALLEL && this.queue.length > 0) {
      const next = this.queue.shift()!;
      this.running++;
      this.release(next.handle, next.size, next.imported, next.device)
        .then(next.resolve, next.reject)
        .finally(() => {
          this.running--;
          this.startNext();
        });
    }
  }
}
