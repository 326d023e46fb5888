/**
 * Where the allocation part gets physical memory: the backend, seen through
 * adaptors in the style of RMM's resource adaptors (server/registry/quotas.ts charges,
 * server/registry/statistics.ts counts, server/registry/allocation-budget.ts
 * counts per uid), composed by the daemon (server/app/daemon.ts). Every
 * adaptor passes each call to its upstream and undoes its own step when the
 * upstream fails. What the registry tells the chain are facts (whether a
 * caller waits for a free); what to do about them (a free held back for a
 * quiet moment, or started now) is decided behind it.
 */
import type { Backend, BackendHandle, HandleKind, ImportedHandle, ImportSource, MemLocation } from '../backends/backend';

/** What an adaptor sees of an allocation being freed. */
export interface SourcedAllocation {
  readonly owner: bigint;
  readonly handle: BackendHandle;
  readonly size: bigint;
  readonly device: number;
  readonly imported: boolean;
  /** Where the memory lives, where known (the registry's records). */
  readonly location?: MemLocation;
}

/** A client's memfd held through the chain (a SYSMEM store's memory): charged and counted until `release()`. */
export interface HeldMemfd {
  /** The memory's identity (Backend.memoryIdentity's words). */
  readonly identity: string;
  /** Drops this hold and what each adaptor took for it; once only. */
  release(): void;
}

export interface AllocationSource {
  /**
   * New physical memory for `owner`, with one backend reference. An adaptor
   * takes what it needs (a quota's bytes) before it awaits its upstream, and
   * gives it back if the upstream fails: concurrent creates see each other.
   * @throws RESOURCE_EXHAUSTED QUOTA_EXCEEDED (quota adaptor); the backend's OUT_OF_MEMORY
   */
  create(owner: bigint, device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle>;
  /**
   * Memory another process handed over (a received descriptor, fabric bytes), adopted for `owner`.
   * @throws the backend's BAD_DESCRIPTOR
   */
  adopt(owner: bigint, source: ImportSource, size: bigint): Promise<ImportedHandle>;
  /**
   * A client's memfd (taken as it is: admitted by the caller) that the daemon
   * maps outside the registry, held for `owner` like an adoption: against the
   * backend's capacity and the owner's quotas.
   * @throws RESOURCE_EXHAUSTED OUT_OF_MEMORY (the backend's capacity), QUOTA_EXCEEDED (quota adaptor)
   */
  holdClientMemfd(owner: bigint, fd: number, size: bigint): Promise<HeldMemfd>;
  /**
   * Frees the handle's last reference; memory made by create() or adopt().
   * `awaited`: the caller waits for the free (else it was answered before it, and the free may wait for a quiet moment).
   */
  release(allocation: SourcedAllocation, awaited: boolean): Promise<void>;
  /**
   * A fact: the allocation passed to the daemon (its owner's session ended,
   * or let go of it while a store handed over keeps it). Nothing is made or freed.
   */
  passedToDaemon?(allocation: SourcedAllocation): void;
  /**
   * Someone waits for the frees in flight (a request over its quota or out
   * of memory, a reclaim, the daemon stopping): resolves once every release
   * given to the source before the call has settled (never rejects); frees
   * held back for a quiet moment start now.
   */
  settle(): Promise<void>;
  /**
   * Memory an earlier daemon process parked, taken back with the counts and
   * charges it had then: never refused for a quota (it fit when it came).
   * @throws the backend's BAD_DESCRIPTOR
   */
  restore(memory: RestoredMemory): Promise<ImportedHandle>;
}

/** Parked memory coming back: its descriptor (owned by the source from then on), and whom it was charged to. */
export interface RestoredMemory {
  readonly fd: number;
  readonly size: bigint;
  readonly imported: boolean;
  readonly charged?: { session: bigint; uid: number };
  /** The name its descriptor is parked under (server/lifecycle/). */
  readonly parkedAs?: string;
}

/** The backend itself, at the bottom of the chain. */
export class BackendSource implements AllocationSource {
  constructor(private readonly backend: Backend) {}

  create(_owner: bigint, device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    return this.backend.create(device, location, size, handleTypes);
  }

  adopt(_owner: bigint, source: ImportSource, size: bigint): Promise<ImportedHandle> {
    return this.backend.importHandle(source, size);
  }

  restore(memory: RestoredMemory): Promise<ImportedHandle> {
    if (this.backend.restoreHandle === undefined) throw new Error(`the ${this.backend.name} backend cannot take parked memory back`);
    return this.backend.restoreHandle(memory.fd, memory.size);
  }

  async holdClientMemfd(_owner: bigint, fd: number, size: bigint): Promise<HeldMemfd> {
    const identity = await this.backend.holdClientMemfd(fd, size);
    return { identity, release: once(() => this.backend.dropClientMemfd(identity)) };
  }

  release(allocation: SourcedAllocation, awaited: boolean): Promise<void> {
    return this.backend.release(allocation.handle, allocation.size, allocation.imported, allocation.device, awaited);
  }

  settle(): Promise<void> {
    return this.backend.settleReleases?.() ?? Promise.resolve();
  }
}

/**
 * Where an adaptor starts: every call passed to the upstream unchanged. An
 * adaptor overrides the calls it takes a step in (undoing that step when the
 * upstream fails) and inherits the rest.
 */
export class PassThroughSource implements AllocationSource {
  constructor(protected readonly upstream: AllocationSource) {}

  create(owner: bigint, device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    return this.upstream.create(owner, device, location, size, handleTypes);
  }

  adopt(owner: bigint, source: ImportSource, size: bigint): Promise<ImportedHandle> {
    return this.upstream.adopt(owner, source, size);
  }

  holdClientMemfd(owner: bigint, fd: number, size: bigint): Promise<HeldMemfd> {
    return this.upstream.holdClientMemfd(owner, fd, size);
  }

  release(allocation: SourcedAllocation, awaited: boolean): Promise<void> {
    return this.upstream.release(allocation, awaited);
  }

  passedToDaemon(allocation: SourcedAllocation): void {
    this.upstream.passedToDaemon?.(allocation);
  }

  settle(): Promise<void> {
    return this.upstream.settle();
  }

  restore(memory: RestoredMemory): Promise<ImportedHandle> {
    return this.upstream.restore(memory);
  }
}

/** `action`, run the first time the returned function is called only. */
export function once(action: () => void): () => void {
  let done = false;
  return () => {
    if (done) return;
    done = true;
    action();
  };
}
