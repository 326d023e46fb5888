/**
 * Descriptors of the daemon's own memory already exported once, kept so that
 * the next export of the same memory (Export, a store's Open) is a dup() on
 * the event loop instead of a driver call on a driver thread
 * (cuMemExportToShareableHandle with its hop to the thread costs more than a
 * whole session-socket round trip). Bounded: at most `limit` descriptors, the
 * least recently used closed first. The backend takes a handle's descriptor
 * out before it releases the handle, so a handle value the driver hands out
 * again never meets a descriptor of the memory it named before.
 */
import { close as fsClose } from 'node:fs';
import { closeLater } from '../../common/close-later';
import { addon } from '../../native';

/** What the cache needs of the system; tests count the calls. */
export interface DescriptorCalls {
  dup(fd: number): number;
  close(fd: number): void;
  /** Closes off the event loop and resolves once closed (without it: close(), then resolved). */
  closeAwaited?(fd: number): Promise<void>;
}

// Closed off the event loop: a kept descriptor is usually the memory's last, whose close frees the driver's export object.
/** The process's own dup and close. */
export const SYSTEM_DESCRIPTORS: DescriptorCalls = {
  dup: (fd) => addon.dup(fd),
  close: (fd) => closeLater(fd),
  closeAwaited: (fd) => new Promise<void>((resolve, reject) => fsClose(fd, (error) => (error ? reject(error) : resolve()))),
};

/** The default bound: 1024, or a sixteenth of the descriptor limit where that is less. */
export function defaultExportCacheLimit(): number {
  return Math.max(0, Math.min(1024, Math.floor(addon.descriptorLimit().soft / 16)));
}

export class ExportedDescriptors {
  // Invariant: at most `limit` entries, least recently used first; each descriptor is the cache's own.
  private readonly kept = new Map<bigint, number>();

  constructor(
    readonly limit: number,
    private readonly calls: DescriptorCalls = SYSTEM_DESCRIPTORS,
  ) {}

  get size(): number {
    return this.kept.size;
  }

  /**
   * A new descriptor of the handle's memory (the caller's to close), or
   * undefined when none is kept.
   * @throws the dup's error (EMFILE): nothing changes
   */
  duplicate(handle: bigint): number | undefined {
    const fd = this.kept.get(handle);
    if (fd === undefined) return undefined;
    const copy = this.calls.dup(fd);
    // Used now: the last to go.
    this.kept.delete(handle);
    this.kept.set(handle, fd);
    return copy;
  }

  /**
   * Keeps a duplicate of `fd`, a descriptor just exported for the handle (the
   * caller keeps `fd`). Nothing is kept when one is already (two exports at
   * once), when the bound is 0, or when the dup fails (out of descriptors:
   * the next export asks the driver again).
   */
  keep(handle: bigint, fd: number): void {
    if (this.limit <= 0 || this.kept.has(handle)) return;
    let copy: number;
    try {
      copy = this.calls.dup(fd);
    } catch {
      return;
    }
    this.kept.set(handle, copy);
    for (const [oldest, old] of this.kept) {
      if (this.kept.size <= this.limit) break;
      this.kept.delete(oldest);
      this.calls.close(old);
    }
  }

  /** Takes the handle's descriptor out (its memory is being released); give it back with restore() if the release fails, else close it. */
  remove(handle: bigint): number | undefined {
    const fd = this.kept.get(handle);
    this.kept.delete(handle);
    return fd;
  }

  /** Puts back what remove() took, after a release that failed (the memory lives on). */
  restore(handle: bigint, fd: number): void {
    if (this.kept.has(handle)) this.calls.close(fd);
    else this.kept.set(handle, fd);
  }

  /**
   * Closes a descriptor remove() took out, once the release it was taken out
   * for succeeded; resolves once it is closed, off the event loop. A CUDA
   * allocation lives while a descriptor of it is open: the release resolves
   * only after this, so that a create retried after a free (out of memory)
   * finds the memory gone. A failed close is a warning, never the release's error.
   */
  async close(fd: number): Promise<void> {
    if (this.calls.closeAwaited === undefined) return this.calls.close(fd);
    await this.calls.closeAwaited(fd).catch((error: Error) => process.emitWarning(`vmmd: closing kept descriptor ${fd} failed: ${error.message}`));
  }

  /** Closes every kept descriptor (the backend closes). */
  clear(): void {
    for (const fd of this.kept.values()) this.calls.close(fd);
    this.kept.clear();
  }
}
