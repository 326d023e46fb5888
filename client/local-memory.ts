/**
 * Memory mapped into this process from what the daemon exported: a memfd on
 * the host backend (shared pages with an ArrayBuffer view), or CUDA memory
 * mapped into this process's own CUDA context (a device pointer).
 */
import { status as Status } from '@grpc/grpc-js';
import { closeLater } from '../common/close-later';
import { traceMark } from '../common/trace';
import { native } from '../native/client';
import { detachView, DeviceMapping, HostMapping } from '../native/mapping';
import { VmmdError } from './errors';
import { InFlight } from './in-flight';

/**
 * Why mapping memory here failed, with the status that fits: memory sealed
 * read-only (it backs a read-only store) refuses write access with EPERM or
 * EACCES; running out of memory or map slots is RESOURCE_EXHAUSTED.
 */
function localMapFailed(error: unknown, readOnly: boolean): VmmdError {
  const code = String((error as { code?: unknown })?.code ?? '');
  const message = `cannot map the exported memory here: ${(error as Error).message}`;
  if (!readOnly && (code === 'EPERM' || code === 'EACCES')) {
    return new VmmdError(
      'LOCAL_MAP_FAILED',
      Status.PERMISSION_DENIED,
      `${message} (the memory is sealed read-only: it backs a read-only store; import it with readOnly)`,
    );
  }
  if (code === 'ENOMEM' || code === 'EMFILE' || code === 'CUDA_ERROR_OUT_OF_MEMORY')
    return new VmmdError('LOCAL_MAP_FAILED', Status.RESOURCE_EXHAUSTED, message);
  return new VmmdError('LOCAL_MAP_FAILED', Status.INTERNAL, message);
}

/**
 * An allocation mapped into this process. `address` is valid until close():
 * a host address on the host backend, a device pointer in this process's
 * context on the cuda backend.
 */
export abstract class ImportedMemory implements AsyncDisposable {
  protected closed = false;
  /** The CPU view of the pages, where there is one. */
  protected view: ArrayBuffer | undefined;
  private closing: Promise<void> | undefined;
  // The unmap may be gathered with others (close({ gather: true })).
  private gather = false;
  private readonly copies = new InFlight();
  // True between suspend() and resume(): the range is reserved, nothing is mapped in it.
  private asleep = false;

  constructor(
    /** The daemon's allocation mapped here; a wake (resume()) maps a new one at the same address. */
    public allocationId: bigint,
    readonly address: bigint,
    readonly size: bigint,
    readonly device: number,
    readonly readOnly: boolean,
  ) {}

  get isClosed(): boolean {
    return this.closed;
  }

  /** True while the memory sleeps: its address is kept, nothing is mapped there. */
  get isAsleep(): boolean {
    return this.asleep;
  }

  /**
   * Unmaps the memory here once every copy started on it has finished, and
   * keeps its address range reserved (no other mapping of this process gets
   * it); copies fail ASLEEP until resume(). The allocation itself is the
   * caller's to release. On cuda the context is synchronized first.
   * @throws VmmdError FAILED_PRECONDITION CLOSED; the unmap's error (still mapped then)
   */
  async suspend(): Promise<void> {
    this.checkOpen();
    if (this.asleep) return;
    if (!this.copies.idle) await this.copies.drain();
    if (this.view !== undefined) detachView(this.view);
    this.view = undefined;
    await this.suspendHere();
    this.asleep = true;
  }

  /**
   * Maps `allocationId`'s memory (a descriptor of the same size, taken over
   * and closed here) at the address this memory kept while asleep.
   * @throws VmmdError FAILED_PRECONDITION CLOSED; LOCAL_MAP_FAILED (still asleep then)
   */
  async resume(allocationId: bigint, fd: number): Promise<void> {
    if (this.closed || !this.asleep) {
      native.close(fd);
      this.checkOpen();
      throw new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, `allocation ${this.allocationId} is not asleep here`);
    }
    try {
      await this.resumeHere(fd);
    } catch (error) {
      throw localMapFailed(error, this.readOnly);
    } finally {
      native.close(fd);
    }
    this.allocationId = allocationId;
    this.asleep = false;
  }

  /** Unmaps, keeping the range; memory that cannot sleep refuses. */
  protected suspendHere(): Promise<void> {
    return Promise.reject(
      new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, `allocation ${this.allocationId} cannot sleep: it is not a mapping of this process`),
    );
  }

  /** Maps the descriptor at the kept range (the caller closes fd). */
  protected resumeHere(_fd: number): Promise<void> {
    return Promise.reject(
      new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, `allocation ${this.allocationId} cannot wake: it is not a mapping of this process`),
    );
  }

  /**
   * The mapped bytes as an ArrayBuffer (host backend only).
   * @throws VmmdError FAILED_PRECONDITION CLOSED, NO_HOST_VIEW
   */
  get buffer(): ArrayBuffer {
    this.checkOpen();
    throw new VmmdError('NO_HOST_VIEW', Status.FAILED_PRECONDITION, 'device memory has no host view; use read() and write()');
  }

  /** A byte view of `buffer` (host backend only). */
  bytes(): Uint8Array {
    return new Uint8Array(this.buffer);
  }

  /**
   * Copies `length` bytes at `offset` out of the memory.
   * @throws VmmdError OUT_OF_RANGE BEYOND_ALLOCATION, FAILED_PRECONDITION CLOSED
   */
  async read(offset: number | bigint, length: number | bigint): Promise<Buffer> {
    this.checkRange(BigInt(offset), BigInt(length));
    return this.copies.ordered('read', BigInt(offset), BigInt(length), () => this.copyOut(BigInt(offset), BigInt(length)));
  }

  /**
   * As read(), into `into` (its whole length): no new buffer, for callers
   * that copy repeatedly (through page-locked buffers on cuda: a DMA).
   * @returns `into`, as a Buffer
   * @throws VmmdError OUT_OF_RANGE BEYOND_ALLOCATION, FAILED_PRECONDITION CLOSED
   */
  async readInto(offset: number | bigint, into: Uint8Array): Promise<Buffer> {
    this.checkRange(BigInt(offset), BigInt(into.byteLength));
    return this.copies.ordered('read', BigInt(offset), BigInt(into.byteLength), () =>
      this.copyOut(BigInt(offset), BigInt(into.byteLength), Buffer.from(into.buffer, into.byteOffset, into.byteLength)),
    );
  }

  /**
   * Copies bytes into the memory at `offset`; resolves once they are in the
   * memory (on cuda: the copy engine has written them, not merely staged them).
   * @throws VmmdError FAILED_PRECONDITION READ_ONLY, CLOSED; OUT_OF_RANGE BEYOND_ALLOCATION
   */
  async write(offset: number | bigint, data: Uint8Array): Promise<void> {
    this.checkRange(BigInt(offset), BigInt(data.byteLength));
    if (this.readOnly) throw new VmmdError('READ_ONLY', Status.FAILED_PRECONDITION, `allocation ${this.allocationId} is mapped read-only here`);
    return this.copies.ordered('write', BigInt(offset), BigInt(data.byteLength), () =>
      this.copyIn(BigInt(offset), Buffer.from(data.buffer, data.byteOffset, data.byteLength)),
    );
  }

  /**
   * Unmaps the memory from this process, once every read and write started on
   * it has finished (they are never cut off by the unmap); reads and writes
   * started after close() fail with CLOSED. Every call returns the same promise.
   * @param options.gather the caller does not wait: the unmap may wait a moment to go to the
   *   driver with this process's other unmaps (native/unmap-batch.ts; NBEP 7 frees). The first call decides.
   */
  close(options: { gather?: boolean } = {}): Promise<void> {
    if (this.closing === undefined) {
      this.closed = true;
      this.gather = options.gather ?? false;
      // Nothing in flight: unmap now, in this turn, as callers that do not await close() expect.
      this.closing = this.copies.idle ? this.unmapHere() : this.copies.drain().then(() => this.unmapHere());
    }
    return this.closing;
  }

  /** Unmaps and frees the address range; called once, with no copy in flight. */
  protected abstract unmapHere(): Promise<void>;

  /** What unmapHere() does with a mapping of native/mapping.ts: the view goes first. */
  protected async unmapView(mapping: HostMapping | DeviceMapping): Promise<void> {
    // Detach first: a view left attached to unmapped pages would crash the process on access.
    if (this.view !== undefined) detachView(this.view);
    this.view = undefined;
    await mapping.unmap(this.gather);
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }

  /** Copies out of the memory into `into` when given (at least `length` bytes), else into a new Buffer. */
  protected abstract copyOut(offset: bigint, length: bigint, into?: Buffer): Promise<Buffer>;
  protected abstract copyIn(offset: bigint, data: Buffer): Promise<void>;

  protected checkOpen(): void {
    if (this.closed) throw new VmmdError('CLOSED', Status.FAILED_PRECONDITION, `allocation ${this.allocationId} was unmapped here`);
    if (this.asleep) throw new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, `the memory at 0x${this.address.toString(16)} sleeps: wake its pool first`);
  }

  private checkRange(offset: bigint, length: bigint): void {
    this.checkOpen();
    if (offset < 0n || length < 0n || offset + length > this.size) {
      throw new VmmdError(
        'BEYOND_ALLOCATION',
        Status.OUT_OF_RANGE,
        `[${offset}, ${offset + length}) is outside allocation ${this.allocationId} of ${this.size} bytes`,
      );
    }
  }
}

/** Host backend: shared pages of a memfd, viewed by an ArrayBuffer. */
export class HostImportedMemory extends ImportedMemory {
  /**
   * Maps a memfd (native/mapping.ts: reserve, map, protect, rolled back on
   * failure). Takes ownership of fd: the mapping keeps the pages, so the
   * descriptor is closed once mapped.
   * @throws VmmdError LOCAL_MAP_FAILED (PERMISSION_DENIED for sealed memory asked writable, RESOURCE_EXHAUSTED, INTERNAL)
   */
  static map(allocationId: bigint, fd: number, size: bigint, granularity: bigint, readOnly: boolean): HostImportedMemory {
    try {
      return new HostImportedMemory(allocationId, HostMapping.map(fd, size, granularity, readOnly), readOnly);
    } catch (error) {
      throw localMapFailed(error, readOnly);
    } finally {
      native.close(fd);
    }
  }

  private constructor(
    allocationId: bigint,
    private readonly mapping: HostMapping,
    readOnly: boolean,
  ) {
    super(allocationId, mapping.address, mapping.size, 0, readOnly);
  }

  protected unmapHere(): Promise<void> {
    return this.unmapView(this.mapping);
  }

  protected override async suspendHere(): Promise<void> {
    this.mapping.suspend();
  }

  protected override async resumeHere(fd: number): Promise<void> {
    this.mapping.resume(fd, this.readOnly);
  }

  // Made on first use: V8 counts an external buffer's bytes as memory pressure,
  // and a large one would make every cold allocation pay for a garbage collection.
  override get buffer(): ArrayBuffer {
    this.checkOpen();
    this.view ??= this.mapping.view();
    return this.view;
  }

  protected async copyOut(offset: bigint, length: bigint, into?: Buffer): Promise<Buffer> {
    const bytes = new Uint8Array(this.buffer, Number(offset), Number(length));
    if (into === undefined) return Buffer.from(bytes);
    into.set(bytes);
    return into;
  }

  protected async copyIn(offset: bigint, data: Buffer): Promise<void> {
    new Uint8Array(this.buffer).set(data, Number(offset));
  }
}

/** The source of CUDA memory to map: a received descriptor, or fabric bytes. */
export type CudaSource = { fd: number } | { fabric: Buffer };

/** Cuda backend: the allocation mapped into this process's primary context of `device`. */
export class CudaImportedMemory extends ImportedMemory {
  /**
   * Imports the handle into this process's CUDA context, reserves, maps and
   * sets access for `device`; the descriptor is closed and the handle
   * released once mapped (the mapping keeps the memory). Rolls back on failure.
   * @throws VmmdError FAILED_PRECONDITION NO_CUDA; LOCAL_MAP_FAILED (see HostImportedMemory.map)
   */
  static async map(
    allocationId: bigint,
    source: CudaSource,
    size: bigint,
    granularity: bigint,
    device: number,
    readOnly: boolean,
    hostNuma?: number,
  ): Promise<CudaImportedMemory> {
    const loaded = native.cudaLoad();
    if (!loaded.loaded) {
      if ('fd' in source) native.close(source.fd);
      throw new VmmdError('NO_CUDA', Status.FAILED_PRECONDITION, `this process cannot use CUDA: ${loaded.reason}`);
    }
    // On this thread: no other session waits on a client's event loop (see DeviceAccess.inline).
    // Host (NUMA) memory also opens to the CPU at the same address: a view sees the bytes.
    // Unmaps synchronize first, as cuMemFree does: this process's kernels may still use the range.
    const access = { readOnly, hostNuma, synchronizeUnmap: true, inline: true };
    let handle: bigint | undefined;
    let mapping: DeviceMapping | undefined;
    try {
      if ('fd' in source) {
        // Imported, mapped and opened in one driver call, the imported handle released there too.
        mapping = await DeviceMapping.importDescriptor(device, source.fd, size, granularity, access);
      } else {
        handle = await native.cudaImportFabric(source.fabric, true);
        mapping = await DeviceMapping.map(device, handle, size, granularity, access);
      }
      return new CudaImportedMemory(allocationId, mapping, readOnly, hostNuma);
    } catch (error) {
      await mapping?.unmap().catch(() => undefined);
      throw localMapFailed(error, readOnly);
    } finally {
      // Closed on a libuv thread: the last close of a CUDA descriptor frees the driver's export
      // object in the kernel, tens of microseconds the caller need not wait for.
      if ('fd' in source) closeLater(source.fd);
      traceMark('mark:descriptor close queued');
      // The mapping holds the memory: the handle's release need not be waited for (a driver thread does it).
      if (handle !== undefined) {
        native.cudaRelease(device, handle).catch((error: Error) => process.emitWarning(`vmmd: releasing an imported handle failed: ${error.message}`));
      }
    }
  }

  private constructor(
    allocationId: bigint,
    private readonly mapping: DeviceMapping,
    readOnly: boolean,
    /** Host memory of this NUMA node, mapped with CPU access too (a view), or undefined. */
    private readonly hostNuma: number | undefined,
  ) {
    super(allocationId, mapping.address, mapping.size, mapping.device, readOnly);
  }

  protected unmapHere(): Promise<void> {
    return this.unmapView(this.mapping);
  }

  protected override suspendHere(): Promise<void> {
    return this.mapping.suspend();
  }

  protected override async resumeHere(fd: number): Promise<void> {
    await this.mapping.resume(fd, { readOnly: this.readOnly, hostNuma: this.hostNuma, synchronizeUnmap: true, inline: true });
  }

  /**
   * Host-located memory mapped with host access has a CPU view, made on first use (memory past what an
   * ArrayBuffer can view, 4 GiB, maps and copies all the same); device memory has none.
   * @throws VmmdError FAILED_PRECONDITION NO_HOST_VIEW (device memory, or host memory too large for a view)
   */
  override get buffer(): ArrayBuffer {
    this.checkOpen();
    if (this.hostNuma === undefined) return super.buffer;
    if (this.view === undefined) {
      try {
        this.view = this.mapping.view();
      } catch (error) {
        throw new VmmdError(
          'NO_HOST_VIEW',
          Status.FAILED_PRECONDITION,
          `host memory of ${this.size} bytes has no view here (${(error as Error).message}); use read() and write()`,
        );
      }
    }
    return this.view;
  }

  protected copyOut(offset: bigint, length: bigint, into?: Buffer): Promise<Buffer> {
    return native.cudaCopyFromDevice(this.device, this.address + offset, length, into);
  }

  protected copyIn(offset: bigint, data: Buffer): Promise<void> {
    return native.cudaCopyToDevice(this.device, this.address + offset, data);
  }
}

/**
 * Maps CUDA memory from fabric bytes (ExportResponse.fabric_handle) into this
 * process, with no session and no descriptor.
 * @throws VmmdError FAILED_PRECONDITION NO_CUDA; LOCAL_MAP_FAILED (see HostImportedMemory.map)
 */
export function mapFabricHandle(
  fabric: Buffer,
  size: bigint,
  granularity: bigint,
  device: number,
  options: { allocationId?: bigint; readOnly?: boolean } = {},
): Promise<CudaImportedMemory> {
  return CudaImportedMemory.map(options.allocationId ?? 0n, { fabric }, size, granularity, device, options.readOnly ?? false);
}
