/**
 * NBEP 7's two base classes. BaseMemoryManager is the interface a plugin
 * implements; HostOnlyMemoryManager implements the host half (memhostalloc,
 * mempin, reset, deferCleanup) so that a subclass adds device memory only.
 * The rules NBEP 7 gives subclasses hold here too: a subclass that overrides
 * reset() or deferCleanup() calls the base's.
 */
import { status as Status } from '@grpc/grpc-js';
import { native } from '../../native/client';
import { VmmdError } from '../errors';
import { SharedHostMemory } from '../shared-memory';
import { DEFAULT_DEFERRED_FREE, DeferredFreeSettings, PendingDeallocations } from './deallocations';
import { IpcHandle, ManagerContext, MappedMemory, MemoryInfo, MemoryPointer, PinnedMemory } from './memory';

export interface HostAllocOptions {
  /** Map into the device's address space (MappedMemory); else PinnedMemory. */
  mapped?: boolean;
  /** Usable from every context (always true with vmmd: memory is shareable). */
  portable?: boolean;
  /** Write-combined: accepted and recorded, but VMM host memory is never write-combined. */
  wc?: boolean;
}

export abstract class BaseMemoryManager {
  /** NBEP 7's interface_version. */
  readonly interfaceVersion = 1;

  constructor(readonly context: ManagerContext) {}

  /** Device memory of `size` bytes. @throws VmmdError (errorCode OUT_OF_MEMORY when none is left) */
  abstract memalloc(size: bigint | number): Promise<MemoryPointer>;
  /** Host memory the device can reach. */
  abstract memhostalloc(size: bigint | number, options?: HostAllocOptions): Promise<MappedMemory | PinnedMemory>;
  /** Page-locks memory this process already has. */
  abstract mempin(
    owner: ArrayBuffer | ArrayBufferView,
    pointer: bigint,
    size: bigint | number,
    options?: { mapped?: boolean },
  ): Promise<MappedMemory | PinnedMemory>;
  /** Prepares the manager; may be called many times and keeps state. */
  abstract initialize(): Promise<void>;
  /** A handle another process opens to reach `memory`. */
  abstract getIpcHandle(memory: MemoryPointer): Promise<IpcHandle>;
  abstract getMemoryInfo(): Promise<MemoryInfo>;
  /** Frees everything the manager holds; works before initialize(). */
  abstract reset(): Promise<void>;
  /** Holds deferred frees until the returned object is disposed (`using`). */
  abstract deferCleanup(): Disposable;
}

const toBigInt = (value: bigint | number) => BigInt(value);

/** `fn`, run at most once however often it is called. */
export function once<T>(fn: () => T): () => T | undefined {
  let done = false;
  return () => {
    if (done) return undefined;
    done = true;
    return fn();
  };
}

/**
 * Host memory for any device memory manager: memhostalloc gives memfd-backed
 * buffers (shareable with other processes), page-locked with mlock on the
 * host backend or registered with cuMemHostRegister on cuda; mempin locks or
 * registers memory the caller already has.
 */
export abstract class HostOnlyMemoryManager extends BaseMemoryManager {
  protected readonly deallocations: PendingDeallocations;
  // Invariant: the release of every host allocation and pin not yet finalized. It
  // holds releases, never the memory objects, so that dropped ones can be collected.
  protected readonly hostReleases = new Set<() => void>();

  constructor(context: ManagerContext, deferred: DeferredFreeSettings = DEFAULT_DEFERRED_FREE) {
    super(context);
    this.deallocations = new PendingDeallocations(deferred, 0n);
  }

  async memhostalloc(size: bigint | number, options: HostAllocOptions = {}): Promise<MappedMemory | PinnedMemory> {
    const bytes = toBigInt(size);
    if (bytes <= 0n) throw new VmmdError('ZERO_SIZE', Status.INVALID_ARGUMENT, `memhostalloc size ${bytes} must be greater than 0`);
    // A memfd, so the memory is shareable like any SYSMEM buffer.
    const shared = SharedHostMemory.allocate(bytes);
    try {
      return this.pin(shared.address, bytes, options.mapped ?? false, shared, shared.buffer, () => shared.free());
    } catch (error) {
      shared.free();
      throw error;
    }
  }

  async mempin(
    owner: ArrayBuffer | ArrayBufferView,
    pointer: bigint,
    size: bigint | number,
    options: { mapped?: boolean } = {},
  ): Promise<MappedMemory | PinnedMemory> {
    const bytes = toBigInt(size);
    const base = native.addressOf(owner);
    const length = BigInt(owner.byteLength);
    if (bytes <= 0n || pointer < base || pointer + bytes > base + length) {
      throw new VmmdError('BEYOND_ALLOCATION', Status.OUT_OF_RANGE, `mempin of [${pointer}, +${bytes}) is not inside its owner's ${length} bytes at ${base}`);
    }
    const buffer = owner instanceof ArrayBuffer ? owner : (owner.buffer as ArrayBuffer);
    return this.pin(pointer, bytes, options.mapped ?? false, owner, buffer, () => undefined);
  }

  /** Host memory needs no preparation; device managers override this (and may call it). */
  async initialize(): Promise<void> {}

  async reset(): Promise<void> {
    this.deallocations.discard();
    const live = [...this.hostReleases];
    this.hostReleases.clear();
    for (const release of live) release();
  }

  deferCleanup(): Disposable {
    return this.deallocations.hold();
  }

  /** Page-locks [address, +size): mlock on the host backend, cuMemHostRegister on cuda. */
  private pin(
    address: bigint,
    size: bigint,
    mapped: boolean,
    owner: unknown,
    buffer: ArrayBuffer | undefined,
    release: () => void,
  ): MappedMemory | PinnedMemory {
    let devicePointer = address;
    let unpin: () => void;
    try {
      if (this.context.backend === 'cuda') {
        devicePointer = native.cudaHostRegister(this.context.device, address, size, mapped);
        unpin = () => native.cudaHostUnregister(this.context.device, address);
      } else {
        native.hostLock(address, size);
        unpin = () => native.hostUnlock(address, size);
      }
    } catch (error) {
      // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, ENOMEM past RLIMIT_MEMLOCK…: named, with errorCode 2 or 3.
      throw VmmdError.from(error);
    }
    const releaseOnce = once(() => {
      unpin();
      release();
    });
    this.hostReleases.add(releaseOnce);
    const finalizer = () => {
      this.hostReleases.delete(releaseOnce);
      releaseOnce();
    };
    return mapped
      ? new MappedMemory(this.context, address, size, owner, finalizer, buffer, devicePointer)
      : new PinnedMemory(this.context, address, size, owner, finalizer, buffer);
  }
}
