/**
 * Frees held back to run later: a release nobody waits for (a session
 * socket's, answered before its free) waits here until its owner (the stock,
 * server/backends/stock.ts) lets them all go, when the daemon is quiet or a
 * refill burst starts, or once RELEASE_HOLD_MAX wait (or more bytes of a
 * device than its bound, at least RELEASE_HOLD_MIN_BYTES). A free is driver
 * work that serializes with the driver work of every client (the driver's
 * own lock): one beside a client's import and map slows it (a client
 * allocating and freeing back to back meets one process's speed only with
 * the daemon's frees held until it stops). Let go, they start
 * RELEASE_START_BATCH a turn, none waiting for another to end (started two
 * at a time instead, under the cuda load test's 32 clients they fell behind
 * and the daemon's heap grew to its cap). A free someone waits for, or
 * someone waiting for every free in flight (Backend.release's `awaited`,
 * Backend.settleReleases), lets them go at once.
 */
import type { BackendHandle } from './backend';

/** At most this many releases are held; one more and they all run. */
export const RELEASE_HOLD_MAX = 256;
/** Let go, held releases start this many a turn of the event loop (each start is an addon call: 256 in one turn were 2-4 ms of it). */
export const RELEASE_START_BATCH = 16;
/** The byte bound of a device is never below this (a small device's share of it would hold next to nothing). */
export const RELEASE_HOLD_MIN_BYTES = 64n << 20n;

/** What a held release frees: the backend's release arguments. */
export type ReleaseCall = (handle: BackendHandle, size: bigint, imported: boolean, device: number) => Promise<void>;

interface Held {
  handle: BackendHandle;
  size: bigint;
  imported: boolean;
  device: number;
  resolve(): void;
  reject(error: unknown): void;
  /** Settles once the release ran. */
  done: Promise<void>;
}

const max = (a: bigint, b: bigint) => (a > b ? a : b);

export class HeldReleases {
  // Invariant: the releases not yet started, oldest first; `bytes` sums their sizes per device.
  private readonly held: Held[] = [];
  private readonly bytes = new Map<number, bigint>();
  // Invariant: the releases let go and not yet started, oldest first; while any waits, a turn's start is due.
  private readonly letGo: Held[] = [];
  private starting: NodeJS.Immediate | undefined;
  // Invariant: the releases started and not yet settled.
  private readonly running = new Set<Promise<void>>();
  // A hurry() is still to look again at the next turn (releases on their way through the registry's adaptors).
  private hurrying = false;

  /** @param limitBytes the most bytes of a device held before they all run */
  constructor(
    private readonly release: ReleaseCall,
    private readonly limitBytes: (device: number) => bigint = () => BigInt(Number.MAX_SAFE_INTEGER),
  ) {}

  /** Whether any release is held, let go or running. */
  get busy(): boolean {
    return this.held.length > 0 || this.letGo.length > 0 || this.running.size > 0;
  }

  /** Releases held, not yet let go. */
  get size(): number {
    return this.held.length;
  }

  /** Holds a release; resolves (or rejects) once it ran. Lets them all go past RELEASE_HOLD_MAX or the device's byte bound. */
  hold(handle: BackendHandle, size: bigint, imported: boolean, device: number): Promise<void> {
    let resolve!: () => void;
    let reject!: (error: unknown) => void;
    const done = new Promise<void>((res, rej) => ((resolve = res), (reject = rej)));
    this.held.push({ handle, size, imported, device, resolve, reject, done });
    const bytes = (this.bytes.get(device) ?? 0n) + size;
    this.bytes.set(device, bytes);
    if (this.held.length >= RELEASE_HOLD_MAX || bytes > max(this.limitBytes(device), RELEASE_HOLD_MIN_BYTES)) this.runAll();
    return done;
  }

  /**
   * Every release not yet run starts now; resolves once they all, and those
   * already running, have settled (their memory is back, or their failure is
   * their callers'). What a request that ran out of memory waits for.
   * @returns undefined when no release is held, let go or running
   */
  drain(): Promise<void> | undefined {
    const waiting = [...this.held, ...this.letGo].map((release) => release.done);
    if (waiting.length === 0 && this.running.size === 0) return undefined;
    waiting.push(...this.running);
    this.runAll(true);
    return Promise.allSettled(waiting).then(() => undefined);
  }

  /**
   * Lets every held release go: RELEASE_START_BATCH start now, as many more at
   * each following turn. With `allNow` (the owner closes), every release not
   * yet started, held or let go earlier, starts now.
   */
  runAll(allNow = false): void {
    this.bytes.clear();
    this.letGo.push(...this.held.splice(0));
    this.startSome(allNow ? this.letGo.length : RELEASE_START_BATCH);
  }

  private startSome(count: number): void {
    clearImmediate(this.starting);
    this.starting = undefined;
    for (const next of this.letGo.splice(0, count)) {
      const run = this.release(next.handle, next.size, next.imported, next.device).then(next.resolve, next.reject);
      this.running.add(run);
      void run.finally(() => this.running.delete(run));
    }
    if (this.letGo.length > 0) this.starting = setImmediate(() => this.startSome(RELEASE_START_BATCH));
  }

  /**
   * Lets every release held, let go or running now go (hurry), and resolves
   * once they have all settled, done or failed.
   */
  settle(): Promise<void> {
    const waiting: Array<Promise<void>> = [...this.held, ...this.letGo].map((release) => release.done);
    waiting.push(...this.running);
    this.hurry();
    return Promise.allSettled(waiting).then(() => undefined);
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
}
