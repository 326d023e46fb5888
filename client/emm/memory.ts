/**
 * The memory objects of NBEP 7 (Numba's External Memory Management plugin
 * interface), with its constructor shapes: (context, pointer, size, owner,
 * finalizer). A finalizer runs at most once: on free(), on dispose, or when
 * the garbage collector finds the object dropped.
 */
import { status as Status } from '@grpc/grpc-js';
import { VmmdError } from '../errors';

/** What a memory manager is bound to: one device, through one client. */
export interface ManagerContext {
  /** The device index (the daemon's numbering). */
  readonly device: number;
  /** The daemon's backend: where device memory lives and how host memory is pinned. */
  readonly backend: 'host' | 'cuda';
}

/** NBEP 7's MemoryInfo. */
export interface MemoryInfo {
  free: bigint;
  total: bigint;
}

/** What frees memory: a function, or an object whose run() does (one allocation where a closure pair would be two). */
export type Finalizer = (() => void | Promise<void>) | { run(): void | Promise<void> };

const runFinalizer = (finalizer: Finalizer) => (typeof finalizer === 'function' ? finalizer() : finalizer.run());

// Dropped pointers free through this registry; a pointer is its own unregister token (held weakly).
const dropped = new FinalizationRegistry<Finalizer>((finalizer) => {
  try {
    void Promise.resolve(runFinalizer(finalizer)).catch((error) => finalizerErrors(error));
  } catch (error) {
    finalizerErrors(error);
  }
});

// Pointers not yet registered: registration waits for the next turn of the event
// loop, so that the many pointers freed as soon as they are made (temporaries)
// never pay for register and unregister (most of a pooled allocation's cost).
// Until then the set holds them, so none can be collected unregistered.
const young = new Set<MemoryPointer>();
let registering = false;

function registerYoung(): void {
  registering = false;
  for (const pointer of young) pointer.register();
  young.clear();
}

/** Called when a finalizer run by the garbage collector fails: there is no caller to tell. */
let finalizerErrors: (error: unknown) => void = (error) => process.emitWarning(`vmmd: a finalizer failed: ${(error as Error)?.message ?? error}`);

export function onFinalizerError(handler: (error: unknown) => void): void {
  finalizerErrors = handler;
}

/**
 * Device memory: NBEP 7's MemoryPointer. `pointer` is a device address (a
 * bigint); `owner` keeps what the memory lives in alive.
 */
export class MemoryPointer implements Disposable {
  private finalizer: Finalizer | undefined;
  private released = false;

  constructor(
    readonly context: ManagerContext,
    readonly pointer: bigint,
    readonly size: bigint,
    readonly owner?: unknown,
    finalizer?: Finalizer,
  ) {
    this.finalizer = finalizer;
    if (finalizer !== undefined) {
      young.add(this);
      if (!registering) {
        registering = true;
        setImmediate(registerYoung);
      }
    }
  }

  /** Puts the pointer under the garbage collector's watch (after its first turn of the event loop). */
  register(): void {
    if (this.finalizer !== undefined) dropped.register(this, this.finalizer, this);
  }

  /** NBEP 7's device_pointer. */
  get devicePointer(): bigint {
    return this.pointer;
  }

  /** True once free() ran. */
  get freed(): boolean {
    return this.released;
  }

  /**
   * Runs the finalizer now (once); later calls do nothing.
   * @returns what the finalizer returns (a promise for async finalizers)
   */
  free(): void | Promise<void> {
    if (this.released) return;
    this.released = true;
    const finalizer = this.finalizer;
    this.finalizer = undefined;
    if (finalizer === undefined) return;
    if (!young.delete(this)) dropped.unregister(this);
    return runFinalizer(finalizer);
  }

  /**
   * A pointer to [start, stop) of this memory that keeps this one alive and
   * frees nothing itself (Numba's view()).
   * @throws VmmdError OUT_OF_RANGE
   */
  view(start: bigint, stop: bigint = this.size): MemoryPointer {
    if (start < 0n || stop > this.size || start > stop) {
      throw new VmmdError('BEYOND_ALLOCATION', Status.OUT_OF_RANGE, `view [${start}, ${stop}) is outside ${this.size} bytes`);
    }
    return new MemoryPointer(this.context, this.pointer + start, stop - start, this);
  }

  [Symbol.dispose](): void {
    void this.free();
  }
}

/**
 * Host memory mapped into the device's address space (NBEP 7's MappedMemory):
 * `hostPointer` for the CPU, `pointer` for the device, `buffer` when this
 * process can see the bytes.
 */
export class MappedMemory extends MemoryPointer {
  constructor(
    context: ManagerContext,
    readonly hostPointer: bigint,
    size: bigint,
    owner?: unknown,
    finalizer?: Finalizer,
    readonly buffer?: ArrayBuffer,
    devicePointer: bigint = hostPointer,
  ) {
    super(context, devicePointer, size, owner, finalizer);
  }
}

/** Page-locked host memory that the device cannot address directly (NBEP 7's PinnedMemory). */
export class PinnedMemory extends MemoryPointer {
  constructor(
    context: ManagerContext,
    readonly hostPointer: bigint,
    size: bigint,
    owner?: unknown,
    finalizer?: Finalizer,
    readonly buffer?: ArrayBuffer,
  ) {
    super(context, hostPointer, size, owner, finalizer);
  }
}

/**
 * What another process needs to open memory of this one (NBEP 7's IpcHandle):
 * plain data, serializable with JSON.
 */
export interface IpcHandle {
  allocationId: string;
  offset: string;
  size: string;
  device: number;
  deviceUuid: string;
  shareKey: string;
}
