/**
 * Memory this process makes itself and hands to vmmd or other processes:
 * SharedHostMemory (a memfd mapped here, with an ArrayBuffer view) and
 * LocalDeviceMemory (CUDA memory created and mapped here). Both map through
 * native/mapping.ts, the one local-mapping module.
 */
import { status as Status } from '@grpc/grpc-js';
import { native, CU_HANDLE, CU_LOCATION } from '../native/client';
import { detachView, DeviceMapping, HostMapping, pageSize, roundUp } from '../native/mapping';
import { VmmdError } from './errors';
import { InFlight } from './in-flight';

/**
 * Host memory that other processes can map: a memfd, mapped here, with an
 * ArrayBuffer view. What createSysmem and the staging buffers take.
 */
export class SharedHostMemory {
  private view: ArrayBuffer | undefined;

  private constructor(
    readonly fd: number,
    readonly size: bigint,
    private readonly mapping: HostMapping,
  ) {
    this.view = mapping.view();
  }

  /** @throws VmmdError INVALID_ARGUMENT ZERO_SIZE; the mapping's failure (RESOURCE_EXHAUSTED ENOMEM…) */
  static allocate(size: bigint | number): SharedHostMemory {
    const bytes = BigInt(size);
    if (bytes <= 0n) throw new VmmdError('ZERO_SIZE', Status.INVALID_ARGUMENT, `shared host memory of ${bytes} bytes`);
    const page = pageSize();
    const mapped = roundUp(bytes, page);
    // Written only by its owner; readable by others, so that the daemon (its own uid) can hand other uids read-only descriptors of it.
    const fd = native.hostMemfdCreate('vmmd:sysmem', mapped, 0o644);
    try {
      return new SharedHostMemory(fd, bytes, HostMapping.map(fd, mapped, page, false));
    } catch (error) {
      native.close(fd);
      throw VmmdError.from(error);
    }
  }

  /** Where the memory is mapped in this process. */
  get address(): bigint {
    return this.mapping.address;
  }

  get buffer(): ArrayBuffer {
    if (this.view === undefined) throw new VmmdError('CLOSED', Status.FAILED_PRECONDITION, 'the shared host memory was freed');
    return this.view;
  }

  get isClosed(): boolean {
    return this.view === undefined;
  }

  /** Unmaps and closes: other mappings of the pages keep them. */
  free(): void {
    if (this.view === undefined) return;
    detachView(this.view);
    this.view = undefined;
    try {
      this.mapping.unmap();
    } finally {
      native.close(this.fd);
    }
  }
}

/** CUDA memory this process made itself (cuMemCreate, exportable): what createFbmem and createZcmem take. */
export class LocalDeviceMemory {
  private readonly copies = new InFlight();

  private constructor(
    readonly device: number,
    readonly handle: bigint,
    readonly size: bigint,
    private readonly mapping: DeviceMapping,
  ) {}

  /**
   * Device memory (or, with hostNuma, host memory of that NUMA node) mapped here with read-write access for `device`.
   * @throws VmmdError FAILED_PRECONDITION NO_CUDA; the driver's error (nothing is kept)
   */
  static async allocate(device: number, size: bigint, options: { hostNuma?: number } = {}): Promise<LocalDeviceMemory> {
    const loaded = native.cudaLoad();
    if (!loaded.loaded) throw new VmmdError('NO_CUDA', Status.FAILED_PRECONDITION, `this process cannot use CUDA: ${loaded.reason}`);
    const type = options.hostNuma === undefined ? CU_LOCATION.DEVICE : CU_LOCATION.HOST_NUMA;
    const id = options.hostNuma ?? device;
    const granularity = native.cudaGranularity(type, id, CU_HANDLE.POSIX_FD, false);
    const rounded = roundUp(size, granularity);
    const handle = await native.cudaCreate(device, type, id, rounded, CU_HANDLE.POSIX_FD, true);
    try {
      return new LocalDeviceMemory(
        device,
        handle,
        rounded,
        await DeviceMapping.map(device, handle, rounded, granularity, { readOnly: false, synchronizeUnmap: true, inline: true }),
      );
    } catch (error) {
      await native.cudaRelease(device, handle).catch(() => undefined);
      throw error;
    }
  }

  /** Where the memory is mapped in this process (a device pointer). */
  get address(): bigint {
    return this.mapping.address;
  }

  exportFd(): Promise<number> {
    return native.cudaExportFd(this.device, this.handle);
  }

  /** Resolves once the bytes are in device memory. */
  write(offset: bigint, data: Buffer): Promise<void> {
    return this.copies.ordered('write', offset, BigInt(data.length), () => native.cudaCopyToDevice(this.device, this.address + offset, data));
  }

  read(offset: bigint, length: bigint): Promise<Buffer> {
    return this.copies.ordered('read', offset, length, () => native.cudaCopyFromDevice(this.device, this.address + offset, length));
  }

  /**
   * Unmaps (after every copy started here and this process's queued GPU work),
   * frees the range, releases; after a failure, a repeat resumes where it failed.
   */
  async free(): Promise<void> {
    await this.copies.drain();
    await this.mapping.unmap();
    await native.cudaRelease(this.device, this.handle);
  }
}
