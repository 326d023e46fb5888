/**
 * The host backend: memfd-backed memory with the semantics of the CUDA VMM
 * API, for machines without a GPU. It is a product feature, not a mock: the
 * daemon's policy runs unchanged on it, and clients map the same pages.
 */
import { addon, HOST_ACCESS, isNativeError } from '../../native';
import {
  AccessGrant,
  Backend,
  BackendHandle,
  codedError,
  DeviceInfo,
  ImportedHandle,
  ImportSource,
  MemLocation,
  MemoryInfo,
} from './backend';
import { admitClientMemfd } from '../client-memfd';

export interface HostBackendOptions {
  /** Bytes the backend may create in all; creation past it is OUT_OF_MEMORY. */
  capacity: bigint;
  /** Allocation granularity: a power of two, a multiple of the page size. */
  granularity: bigint;
}


export class HostBackend implements Backend {
  readonly name = 'host' as const;
  readonly capabilities = { hostNumaNodes: false, gpuMemory: false, readOnlyExports: true } as const;
  // Invariant: createdBytes is the sum of the sizes of created (not imported), unreleased memfds.
  private createdBytes = 0n;

  constructor(private readonly options: HostBackendOptions) {}

  devices(): DeviceInfo[] {
    return [
      {
        index: 0,
        name: 'host memory (memfd)',
        kind: 'HOST',
        uuid: '',
        totalBytes: this.options.capacity,
        granularityMinimum: this.options.granularity,
        granularityRecommended: this.options.granularity,
        handleTypes: ['POSIX_FD'],
        computeCapability: '',
        fabricUsable: false,
        fabricStatus: 'the host backend has no fabric handles',
        hostNumaId: -1,
      },
    ];
  }

  memoryInfo(): MemoryInfo {
    return { totalBytes: this.options.capacity, freeBytes: this.options.capacity - this.createdBytes };
  }

  granularity(): { minimum: bigint; recommended: bigint } {
    return { minimum: this.options.granularity, recommended: this.options.granularity };
  }

  canAccessPeer(): boolean {
    return true;
  }

  reserve(size: bigint, alignment: bigint, hint: bigint): bigint {
    return addon.hostReserve(size, alignment, hint);
  }

  freeAddress(address: bigint, size: bigint): void {
    addon.hostFreeAddress(address, size);
  }

  // memfd_create and ftruncate cost a few microseconds: done on the event loop, the promise settled.
  async create(_device: number, location: MemLocation, size: bigint): Promise<BackendHandle> {
    const used = this.createdBytes;
    if (used + size > this.options.capacity) {
      throw codedError(
        'OUT_OF_MEMORY',
        `out of memory: requested ${size} bytes, ${used} of ${this.options.capacity} bytes in use (host capacity)`,
        { requested: size, used, limit: this.options.capacity },
      );
    }
    const fd = addon.hostMemfdCreate(`vmmd:${location.type.toLowerCase()}${location.id}`, size);
    this.createdBytes += size;
    return fd;
  }

  async createExported(device: number, location: MemLocation, size: bigint): Promise<{ handle: BackendHandle; fd: number }> {
    const handle = await this.create(device, location, size);
    return { handle, fd: addon.dup(Number(handle)) };
  }

  async release(handle: BackendHandle, size: bigint, imported: boolean): Promise<void> {
    addon.close(Number(handle));
    if (!imported) this.createdBytes -= size;
  }

  // The memfd is its own reference count: mappings hold the pages, so a retained
  // handle needs no second descriptor.
  retainHandle(_address: bigint, handle: BackendHandle): BackendHandle {
    return handle;
  }

  async releaseReference(): Promise<void> {}

  async map(address: bigint, size: bigint, handle: BackendHandle, offset: bigint): Promise<void> {
    addon.hostMap(address, size, Number(handle), offset);
  }

  async unmap(address: bigint, size: bigint): Promise<void> {
    addon.hostUnmap(address, size);
  }

  async setAccess(address: bigint, size: bigint, grants: AccessGrant[]): Promise<void> {
    // Every location of the host backend is the CPU: the widest grant wins.
    const access = grants.reduce((widest, grant) => Math.max(widest, grant.access), 0);
    addon.hostProtect(address, size, access === 3 ? HOST_ACCESS.READWRITE : access === 1 ? HOST_ACCESS.READ : HOST_ACCESS.NONE);
  }

  async exportHandle(handle: BackendHandle): Promise<number> {
    return addon.dup(Number(handle));
  }

  sealReadOnly(handle: BackendHandle): void {
    addon.hostMemfdSealReadOnly(Number(handle));
  }

  async exportFabric(): Promise<Buffer> {
    throw codedError('UNSUPPORTED_HANDLE_TYPE', 'the host backend has no fabric handles');
  }

  async importHandle(source: ImportSource, size: bigint): Promise<ImportedHandle> {
    if (!('fd' in source)) throw codedError('BAD_DESCRIPTOR', 'the host backend imports descriptors, not fabric handles');
    const fd = source.fd;
    try {
      // Mapped writable later (SetAccess READWRITE), copied from by the daemon: the rules of client memfds.
      const info = admitClientMemfd(fd, { what: 'an imported descriptor', writable: true });
      if (info.size === 0n || info.size % this.options.granularity !== 0n) {
        throw codedError(
          'BAD_DESCRIPTOR',
          `the descriptor's size ${info.size} is not a positive multiple of the granularity ${this.options.granularity}`,
        );
      }
      if (size !== 0n && size !== info.size) {
        throw codedError('BAD_DESCRIPTOR', `the descriptor holds ${info.size} bytes, not the ${size} the request says`);
      }
      return { handle: fd, size: info.size, device: 0, location: { type: 'DEVICE', id: 0 } };
    } catch (error) {
      addon.close(fd);
      if (isNativeError(error, 'BAD_DESCRIPTOR')) throw error;
      throw codedError('BAD_DESCRIPTOR', `the descriptor cannot be imported: ${(error as Error).message}`);
    }
  }

  readBytes(address: bigint, length: number, _device: number, into?: Buffer): Promise<Buffer> {
    return addon.hostCopyFromAddress(address, length, into);
  }

  writeBytes(address: bigint, data: Buffer): Promise<void> {
    return addon.hostCopyToAddress(address, data);
  }

  close(): void {}
}
