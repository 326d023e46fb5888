/**
 * The cuda backend: the driver's VMM API through the addon. Device memory and
 * host (NUMA) memory, POSIX descriptors always, fabric handles where a probe
 * at start shows the host permits them.
 */
import type { Logger } from 'pino';
import { addon, CU_HANDLE, CU_LOCATION, CudaDeviceInfo, isNativeError } from '../../native';
import { AccessGrant, Backend, BackendHandle, codedError, DeviceInfo, HandleKind, ImportedHandle, ImportSource, MemLocation, MemoryInfo } from './backend';
import { memfdIdentity } from './client-memfd';
import { closeLater } from '../../common/close-later';
import { defaultExportCacheLimit, ExportedDescriptors } from './exported-descriptors';

const locationType = (location: MemLocation) => CU_LOCATION[location.type];

function handleBits(kinds: HandleKind[]): number {
  return kinds.reduce((bits, kind) => bits | CU_HANDLE[kind], 0);
}

/**
 * Page-locking for the daemon's staging buffers (server/stores/staging.ts): portable
 * registrations (every device's context sees them), on a driver thread.
 */
export const CUDA_STAGING_PINNING = {
  pin: (address: bigint, size: bigint): Promise<void> => addon.cudaPinHost(0, address, size),
  unpin: (address: bigint): Promise<void> => addon.cudaUnpinHost(0, address),
};

export class CudaBackend implements Backend {
  readonly name = 'cuda' as const;
  readonly capabilities = { hostNumaNodes: true, gpuMemory: true, readOnlyExports: false, descriptors: 'cuda' } as const;
  // NOTE: the driver refuses to export memory that was itself imported from a
  // descriptor (CUDA_ERROR_INVALID_VALUE, seen on driver 580), so an import
  // keeps a duplicate of its descriptor and exports hand out duplicates of it.
  // Invariant: one descriptor per imported handle not yet released.
  private readonly importedFds = new Map<bigint, number>();
  // The daemon's own memory exported once: later exports are dups (server/backends/exported-descriptors.ts).
  private readonly exported = new ExportedDescriptors(defaultExportCacheLimit());

  private constructor(private readonly deviceList: DeviceInfo[]) {}

  /**
   * Opens the driver and probes every device once (granularity, fabric).
   * @throws an error with code CUDA_UNAVAILABLE saying why, when the driver cannot be used
   */
  static async open(log: Logger): Promise<CudaBackend> {
    const loaded = addon.cudaLoad();
    if (!loaded.loaded) throw codedError('CUDA_UNAVAILABLE', loaded.reason);
    const devices: DeviceInfo[] = [];
    for (const device of addon.cudaDevices()) {
      if (!device.vmm || !device.posixFd) {
        throw codedError(
          'CUDA_UNAVAILABLE',
          `device ${device.index} (${device.name}) lacks ${device.vmm ? 'POSIX descriptor handles' : 'virtual memory management'}; vmmd needs both`,
        );
      }
      const granularity = (recommended: boolean) => addon.cudaGranularity(CU_LOCATION.DEVICE, device.index, CU_HANDLE.POSIX_FD, recommended);
      const minimum = granularity(false);
      const fabric = await CudaBackend.probeFabric(device, minimum);
      log.info({ device: device.index, name: device.name, fabric: fabric.status }, 'cuda device');
      devices.push({
        index: device.index,
        name: device.name,
        kind: 'CUDA',
        uuid: device.uuid,
        totalBytes: device.totalBytes,
        granularityMinimum: minimum,
        granularityRecommended: granularity(true),
        handleTypes: fabric.usable ? ['POSIX_FD', 'FABRIC'] : ['POSIX_FD'],
        computeCapability: device.computeCapability,
        fabricUsable: fabric.usable,
        fabricStatus: fabric.status,
        hostNumaId: device.hostNumaId,
      });
    }
    return new CudaBackend(devices);
  }

  /**
   * A device may report fabric support and still refuse it (no IMEX channel):
   * only a real creation and export tell.
   */
  private static async probeFabric(device: CudaDeviceInfo, size: bigint): Promise<{ usable: boolean; status: string }> {
    if (!device.fabric) return { usable: false, status: 'the device does not report fabric handle support' };
    let handle: bigint;
    try {
      handle = await addon.cudaCreate(device.index, CU_LOCATION.DEVICE, device.index, size, CU_HANDLE.POSIX_FD | CU_HANDLE.FABRIC);
    } catch (error) {
      return { usable: false, status: `cuMemCreate with a fabric handle failed: ${(error as Error).message}` };
    }
    try {
      await addon.cudaExportFabric(device.index, handle);
      return { usable: true, status: 'usable' };
    } catch (error) {
      return { usable: false, status: `fabric export failed: ${(error as Error).message}` };
    } finally {
      await addon.cudaRelease(device.index, handle);
    }
  }

  devices(): DeviceInfo[] {
    return this.deviceList;
  }

  memoryInfo(device: number): MemoryInfo {
    const info = addon.cudaMemGetInfo(device);
    return { freeBytes: info.free, totalBytes: info.total };
  }

  granularity(location: MemLocation): { minimum: bigint; recommended: bigint } {
    const type = locationType(location);
    return {
      minimum: addon.cudaGranularity(type, location.id, CU_HANDLE.POSIX_FD, false),
      recommended: addon.cudaGranularity(type, location.id, CU_HANDLE.POSIX_FD, true),
    };
  }

  canAccessPeer(device: number, owner: number): boolean {
    if (device >= this.deviceList.length) return false;
    return addon.cudaCanAccessPeer(device, owner);
  }

  reserve(size: bigint, alignment: bigint, hint: bigint): bigint {
    return addon.cudaReserve(size, alignment, hint);
  }

  freeAddress(address: bigint, size: bigint): void {
    addon.cudaFreeAddress(address, size);
  }

  async create(device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    try {
      return await addon.cudaCreate(device, locationType(location), location.id, size, handleBits(handleTypes));
    } catch (error) {
      if (isNativeError(error, 'CUDA_ERROR_OUT_OF_MEMORY')) {
        const free = location.type === 'DEVICE' ? addon.cudaMemGetInfo(device).free : undefined;
        throw Object.assign(
          new Error(`CUDA_ERROR_OUT_OF_MEMORY: cuMemCreate: requested ${size} bytes` + (free === undefined ? '' : `, ${free} bytes free on device ${device}`)),
          { code: 'CUDA_ERROR_OUT_OF_MEMORY', result: error.result, requested: size, free },
        );
      }
      throw error;
    }
  }

  async createExported(device: number, location: MemLocation, size: bigint): Promise<{ handle: BackendHandle; fd: number }> {
    return addon.cudaCreateExported(device, locationType(location), location.id, size, handleBits(['POSIX_FD']));
  }

  async release(handle: BackendHandle, _size: bigint, _imported: boolean, device: number): Promise<void> {
    // Out before the driver frees the handle: a handle value it hands out again never meets this descriptor.
    const exported = this.exported.remove(BigInt(handle));
    try {
      await addon.cudaRelease(device, BigInt(handle));
    } catch (error) {
      if (exported !== undefined) this.exported.restore(BigInt(handle), exported);
      throw error;
    }
    if (exported !== undefined) await this.exported.close(exported);
    // Only once the driver has freed it: a release that fails keeps the handle exportable.
    const fd = this.importedFds.get(BigInt(handle));
    if (fd !== undefined) {
      this.importedFds.delete(BigInt(handle));
      closeLater(fd);
    }
  }

  retainHandle(address: bigint): BackendHandle {
    return addon.cudaRetainHandle(address);
  }

  releaseReference(handle: BackendHandle, device: number): Promise<void> {
    return addon.cudaRelease(device, BigInt(handle));
  }

  map(address: bigint, size: bigint, handle: BackendHandle, offset: bigint): Promise<void> {
    return addon.cudaMap(address, size, offset, BigInt(handle));
  }

  unmap(address: bigint, size: bigint, device: number): Promise<void> {
    return addon.cudaUnmap(device, address, size);
  }

  setAccess(address: bigint, size: bigint, grants: AccessGrant[]): Promise<void> {
    return addon.cudaSetAccess(
      address,
      size,
      grants.map((grant) => ({ type: locationType(grant.location), id: grant.location.id, flags: grant.access })),
    );
  }

  async exportHandle(handle: BackendHandle, device: number): Promise<number> {
    const fd = this.importedFds.get(BigInt(handle));
    if (fd !== undefined) return addon.dup(fd);
    const kept = this.exported.duplicate(BigInt(handle));
    if (kept !== undefined) return kept;
    const made = await addon.cudaExportFd(device, BigInt(handle));
    this.exported.keep(BigInt(handle), made);
    return made;
  }

  // NOTE: CUDA has no seal: read-only stores reach importers with read-only access flags (the client library's).
  sealReadOnly(): void {}

  // NOTE: each handle is its own memory here, an import too: the daemon's own memory imported back
  // is counted again (never less than it is), and memory from elsewhere counts by its size, which
  // importHandle checks is the allocation's own (a trial map: the driver maps an allocation only whole).
  memoryIdentity(handle: BackendHandle, device: number): string {
    return `cuda:${device}:${handle}`;
  }

  // A SYSMEM store's memfd is host memory: no GPU capacity to count it against (quotas still do).
  async holdClientMemfd(fd: number): Promise<string> {
    return memfdIdentity(addon.hostFdInfo(fd));
  }

  dropClientMemfd(): void {}

  exportFabric(handle: BackendHandle, device: number): Promise<Buffer> {
    return addon.cudaExportFabric(device, BigInt(handle));
  }

  /**
   * The parked descriptor is an export of this memory: imported again, it
   * names the same physical memory. Imported on the calling thread: a
   * restore runs at start, before the daemon serves, where a hop to a driver
   * thread per object would be most of the restart. Its size is the one its
   * record says, written by the daemon that exported it: no trial map checks
   * it (a client's descriptor is checked, below).
   */
  restoreHandle(fd: number, size: bigint): Promise<ImportedHandle> {
    return this.importDescriptor({ fd }, size, true);
  }

  importHandle(source: ImportSource, size: bigint): Promise<ImportedHandle> {
    return this.importDescriptor(source, size, false);
  }

  /** @param parked a descriptor this daemon parked (restoreHandle), else a client's */
  private async importDescriptor(source: ImportSource, size: bigint, parked: boolean): Promise<ImportedHandle> {
    let handle: bigint;
    try {
      handle = 'fd' in source ? await addon.cudaImportFd(source.fd, parked) : await addon.cudaImportFabric(source.fabric);
    } catch (error) {
      if ('fd' in source) addon.close(source.fd);
      if (isNativeError(error, 'CUDA_ERROR_OUT_OF_MEMORY')) throw error;
      throw codedError('BAD_DESCRIPTOR', `the ${'fd' in source ? 'descriptor' : 'fabric handle'} is not CUDA memory: ${(error as Error).message}`);
    }
    // Kept for exports (see importedFds); released with the handle.
    if ('fd' in source) this.importedFds.set(handle, source.fd);
    const properties = addon.cudaAllocationProperties(handle);
    const location: MemLocation =
      properties.locationType === CU_LOCATION.DEVICE
        ? { type: 'DEVICE', id: properties.locationId }
        : { type: properties.locationType === CU_LOCATION.HOST ? 'HOST' : 'HOST_NUMA', id: properties.locationId };
    const device = location.type === 'DEVICE' ? location.id : 0;
    const granularity = this.granularity(location).minimum;
    if (size === 0n || size % granularity !== 0n) {
      await this.release(handle, size, true, device);
      throw codedError('BAD_DESCRIPTOR', `importing CUDA memory needs its size, a positive multiple of ${granularity}; got ${size}`);
    }
    if (parked) return { handle, size, device, location };
    // The size is what the import is charged by, so it must be the memory's own: a client
    // importing 1 GiB as "2 MiB" would keep 1 GiB alive on a 2 MiB charge.
    const exact = await addon.cudaHandleHasSize(device, handle, size).catch(async (error: unknown) => {
      await this.release(handle, size, true, device);
      throw error;
    });
    if (!exact) {
      await this.release(handle, size, true, device);
      throw codedError(
        'BAD_DESCRIPTOR',
        `the imported CUDA memory is not ${size} bytes: an import must state the allocation's own size (the driver maps it only whole, and the import is charged by it)`,
      );
    }
    return { handle, size, device, location };
  }

  readBytes(address: bigint, length: number, device: number, into?: Buffer): Promise<Buffer> {
    return addon.cudaCopyFromDevice(device, address, BigInt(length), into);
  }

  writeBytes(address: bigint, data: Buffer, device: number): Promise<void> {
    return addon.cudaCopyToDevice(device, address, data);
  }

  close(): void {
    this.exported.clear();
  }
}
