/**
 * External allocations in the style of legate::ExternalAllocation: memory
 * this process owns, described (target, device, size, read-only) and attached
 * to the daemon as a store, with an optional deleter that runs exactly once,
 * when the daemon says the store is gone and nobody uses it.
 */
import { status as Status } from '@grpc/grpc-js';
import { native } from '../native/client';
import type { VmmdClient } from './connection';
import { VmmdError } from './errors';
import { LocalDeviceMemory, SharedHostMemory } from './shared-memory';
import type { Store__Output } from '../generated/vmmd/v1/Store';

type Target = 'SYSMEM' | 'ZCMEM' | 'FBMEM';

export interface ExternalOptions {
  readOnly?: boolean;
  /** Runs exactly once, when the store is gone and nobody uses it. A deleter that throws is logged, never rerun. */
  deleter?: () => void | Promise<void>;
}

/** What a deleter failure is reported to (default: a process warning). */
let deleterErrors: (error: unknown) => void = (error) =>
  process.emitWarning(`vmmd: an external allocation's deleter failed: ${(error as Error)?.message ?? error}`);

export function onDeleterError(handler: (error: unknown) => void): void {
  deleterErrors = handler;
}

const invalid = (message: string) => new VmmdError('INVALID_ARGUMENT', Status.INVALID_ARGUMENT, message);

export class ExternalAllocation {
  private deleterRan = false;

  private constructor(
    private readonly kind: Target,
    private readonly device: number,
    private readonly memory: SharedHostMemory | LocalDeviceMemory,
    private readonly bytes: bigint,
    private readonly readOnlyFlag: boolean,
    private readonly deleter?: () => void | Promise<void>,
  ) {}

  /**
   * Host memory (a memfd from SharedHostMemory).
   * @throws VmmdError INVALID_ARGUMENT for missing or empty memory, or a size beyond it
   */
  static createSysmem(memory: SharedHostMemory | null | undefined, size: bigint | number, options: ExternalOptions = {}): ExternalAllocation {
    ExternalAllocation.checkMemory(memory, size);
    return new ExternalAllocation('SYSMEM', 0, memory!, BigInt(size), options.readOnly ?? false, options.deleter);
  }

  /** Zero-copy memory: host memory the device reaches (LocalDeviceMemory with hostNuma). */
  static createZcmem(device: number, memory: LocalDeviceMemory | null | undefined, size: bigint | number, options: ExternalOptions = {}): ExternalAllocation {
    ExternalAllocation.checkMemory(memory, size);
    return new ExternalAllocation('ZCMEM', device, memory!, BigInt(size), options.readOnly ?? false, options.deleter);
  }

  /** Framebuffer memory of a device (LocalDeviceMemory). */
  static createFbmem(device: number, memory: LocalDeviceMemory | null | undefined, size: bigint | number, options: ExternalOptions = {}): ExternalAllocation {
    ExternalAllocation.checkMemory(memory, size);
    return new ExternalAllocation('FBMEM', device, memory!, BigInt(size), options.readOnly ?? false, options.deleter);
  }

  private static checkMemory(memory: { size: bigint; isClosed?: boolean } | null | undefined, size: bigint | number): void {
    if (memory === null || memory === undefined) throw invalid('an external allocation needs memory, not null');
    if (BigInt(size) <= 0n) throw invalid(`an external allocation of ${size} bytes is empty`);
    if (memory.isClosed) throw invalid('the memory was freed');
    if (BigInt(size) > memory.size) throw invalid(`size ${size} is beyond the memory's ${memory.size} bytes`);
  }

  readOnly(): boolean {
    return this.readOnlyFlag;
  }

  target(): Target {
    return this.kind;
  }

  /** The address of the memory in this process. */
  ptr(): bigint {
    return this.memory.address;
  }

  size(): bigint {
    return this.bytes;
  }

  /**
   * Attaches the memory as a store. Checks first, as Legate does: a device the
   * daemon lacks is OUT_OF_RANGE; ZCMEM and FBMEM need the cuda backend.
   * @throws VmmdError OUT_OF_RANGE UNKNOWN_DEVICE, FAILED_PRECONDITION NO_CUDA_BACKEND
   */
  async attach(client: VmmdClient, options: { name?: string } = {}): Promise<AttachedStore> {
    if (this.kind !== 'SYSMEM' && !client.session.capabilities.has('CAPABILITY_ATTACH_DEVICE_MEMORY')) {
      throw new VmmdError(
        'NO_CUDA_BACKEND',
        Status.FAILED_PRECONDITION,
        `${this.kind} needs a daemon that attaches device memory (the cuda backend); this one has ${client.backend} descriptors`,
      );
    }
    const { devices } = await client.devices.listDevices();
    if (this.device >= devices.length) {
      throw new VmmdError('UNKNOWN_DEVICE', Status.OUT_OF_RANGE, `device ${this.device} does not exist (the daemon has ${devices.length})`);
    }
    const fd = this.memory instanceof SharedHostMemory ? native.dup(this.memory.fd) : await this.memory.exportFd();
    let store: Store__Output;
    try {
      store = await client.stores.attachDescriptor(fd, {
        target: `STORE_TARGET_${this.kind}`,
        device: this.device,
        size: this.bytes,
        readOnly: this.readOnlyFlag,
        name: options.name,
        hasDeleter: this.deleter !== undefined,
      });
    } finally {
      native.close(fd);
    }
    const attached = new AttachedStore(store, this);
    attached.watch(client);
    return attached;
  }

  /** @internal Runs the deleter once; a throwing deleter is reported and never run again. */
  async runDeleter(): Promise<void> {
    if (this.deleterRan || this.deleter === undefined) return;
    this.deleterRan = true;
    try {
      await this.deleter();
    } catch (error) {
      deleterErrors(error);
    }
  }

  get deleterHasRun(): boolean {
    return this.deleterRan;
  }
}

/** An attached store: detach() stops new opens and waits for the daemon's operations on it. */
export class AttachedStore {
  private lastSequence = 0n;
  private cancel?: () => void;
  private released?: () => void;
  /** Resolves once the daemon released the store (and the deleter ran). */
  readonly gone: Promise<void>;

  constructor(
    readonly store: Store__Output,
    readonly allocation: ExternalAllocation,
  ) {
    this.gone = new Promise((resolve) => (this.released = resolve));
  }

  /**
   * Listens for the store's release on `client`: call again with a new client
   * after reconnecting, and the events missed meanwhile are replayed.
   */
  watch(client: VmmdClient): void {
    this.cancel?.();
    const { events, cancel } = client.stores.watch(this.lastSequence);
    this.cancel = cancel;
    void (async () => {
      try {
        for await (const event of events) {
          this.lastSequence = BigInt(event.sequence);
          if (event.kind === 'KIND_RELEASED' && event.store?.id === this.store.id) {
            cancel();
            await this.allocation.runDeleter();
            this.released?.();
            return;
          }
        }
      } catch {
        // The session went away: watch() again once reconnected.
      }
    })();
  }

  detach(client: VmmdClient): Promise<Store__Output> {
    return client.stores.detach(BigInt(this.store.id));
  }

  /** Stops listening (the deleter then never runs in this process). */
  stopWatching(): void {
    this.cancel?.();
  }
}
