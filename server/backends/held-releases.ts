/**
 * Frees held back to run together: a release nobody waits for (a session
 * socket's, answered before its free) waits here until its owner (the
 * stock, server/backends/stock.ts) runs them all, when the daemon is quiet
 * or a refill burst starts, or until RELEASE_BATCH wait. A free is driver
 * work that serializes with the driver work of every client (the driver's
 * own lock): spread out, one met nearly every cold allocation of a client
 * allocating back to back (issue 18's probe: 396 of 400); gathered, most
 * meet none. Whoever waits for a free calls hurry() (Backend.hurry).
 */
import type { BackendHandle } from './backend';

/** At most this many releases are held; one more and they all run. */
export const RELEASE_BATCH = 16;

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

export class HeldReleases {
  // Invariant: the releases not yet started, oldest first.
  private readonly held: Held[] = [];
  // A hurry() is still to look again at the next turn (releases on their way through the registry's adaptors).
  private hurrying = false;

  constructor(private readonly release: ReleaseCall) {}

  get size(): number {
    return this.held.length;
  }

  /** Holds a release; resolves (or rejects) once it ran. Runs them all when RELEASE_BATCH are held. */
  hold(handle: BackendHandle, size: bigint, imported: boolean, device: number): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      this.held.push({ handle, size, imported, device, resolve, reject });
      if (this.held.length >= RELEASE_BATCH) this.runAll();
    });
  }

  /** Starts every held release now. */
  runAll(): void {
    for (const held of this.held.splice(0)) this.release(held.handle, held.size, held.imported, held.device).then(held.resolve, held.reject);
  }

  /** Starts the held releases now, and those that reach hold() later in this turn. */
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
