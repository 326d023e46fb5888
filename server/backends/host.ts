/**
 * The host backend: memfd-backed memory with the semantics of the CUDA VMM
 * API, for machines without a GPU. It is a product feature, not a mock: the
 * daemon's policy runs unchanged on it, and clients map the same pages.
 */
import { addon, HOST_ACCESS, isNativeError, MEMFD_SEALS } from '../../native';
import { AccessGrant, Backend, BackendHandle, codedError, DeviceInfo, ImportedHandle, ImportSource, MemLocation, MemoryInfo } from './backend';
import { admitClientMemfd, memfdIdentity } from './client-memfd';

export interface HostBackendOptions {
  /** Bytes the backend may create in all; creation past it is OUT_OF_MEMORY. */
  capacity: bigint;
  /** Allocation granularity: a power of two, a multiple of the page size. */
  granularity: bigint;
}

export class HostBackend implements Backend {
  readonly name = 'host' as const;
  readonly capabilities = { hostNumaNodes: false, gpuMemory: false, readOnlyExports: true, descriptors: 'memfd' } as const;
  // Invariant: every memfd the backend holds (created, imported, a client's held for a SYSMEM store), by
  // identity (its file), with the holds that name it; usedBytes is the sum of their sizes, each counted once.
  private readonly live = new Map<string, { size: bigint; holds: number }>();
  private usedBytes = 0n;
  // Invariant: the identity of every handle (memfd) created or imported and not yet released.
  private readonly identities = new Map<number, string>();

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
    // What is alive, physically: a memfd imported again, or held by a store too, counts once.
    return { totalBytes: this.options.capacity, freeBytes: this.options.capacity - this.usedBytes };
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
    this.checkCapacity(size, `requested ${size} bytes`);
    const fd = addon.hostMemfdCreate(`vmmd:${location.type.toLowerCase()}${location.id}`, size);
    let identity: string;
    try {
      identity = memfdIdentity(addon.hostFdInfo(fd));
    } catch (error) {
      addon.close(fd);
      throw error;
    }
    this.hold(identity, size);
    this.identities.set(fd, identity);
    return fd;
  }

  async createExported(device: number, location: MemLocation, size: bigint): Promise<{ handle: BackendHandle; fd: number }> {
    const handle = await this.create(device, location, size);
    return { handle, fd: addon.dup(Number(handle)) };
  }

  async release(handle: BackendHandle): Promise<void> {
    addon.close(Number(handle));
    const identity = this.identities.get(Number(handle));
    this.identities.delete(Number(handle));
    if (identity !== undefined) this.dropClientMemfd(identity);
  }

  memoryIdentity(handle: BackendHandle): string {
    const identity = this.identities.get(Number(handle));
    if (identity === undefined) throw new Error(`host backend: handle ${handle} is not a live memfd of this backend`);
    return identity;
  }

  async holdClientMemfd(fd: number, size: bigint): Promise<string> {
    const identity = memfdIdentity(addon.hostFdInfo(fd));
    if (!this.live.has(identity)) this.checkCapacity(size, `a client's memfd of ${size} bytes`);
    this.hold(identity, size);
    return identity;
  }

  dropClientMemfd(identity: string): void {
    const memory = this.live.get(identity);
    if (memory === undefined) return;
    if (--memory.holds > 0) return;
    this.live.delete(identity);
    this.usedBytes -= memory.size;
  }

  /**
   * @throws OUT_OF_MEMORY when `size` more bytes would take the backend past its capacity.
   * A sparse memfd counts by its size: its pages can be written at any time.
   */
  private checkCapacity(size: bigint, what: string): void {
    const used = this.usedBytes;
    if (used + size > this.options.capacity) {
      throw codedError('OUT_OF_MEMORY', `out of memory: ${what}, ${used} of ${this.options.capacity} bytes in use (host capacity)`, {
        requested: size,
        used,
        limit: this.options.capacity,
      });
    }
  }

  private hold(identity: string, size: bigint): void {
    const memory = this.live.get(identity);
    if (memory !== undefined) {
      memory.holds++;
      return;
    }
    this.live.set(identity, { size, holds: 1 });
    this.usedBytes += size;
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
    try {
      addon.hostProtect(address, size, access === 3 ? HOST_ACCESS.READWRITE : access === 1 ? HOST_ACCESS.READ : HOST_ACCESS.NONE);
    } catch (error) {
      // Every descriptor the daemon maps allows writes, so a refused write is a seal added since, through a descriptor the daemon exported.
      if (access === 3 && (isNativeError(error, 'EACCES') || isNativeError(error, 'EPERM'))) {
        throw codedError(
          'MEMORY_SEALED',
          `the memory at 0x${address.toString(16)} cannot be mapped writable: it was sealed against writes (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE) through a descriptor of it (${(error as Error).message})`,
        );
      }
      throw error;
    }
  }

  async exportHandle(handle: BackendHandle): Promise<number> {
    return addon.dup(Number(handle));
  }

  sealReadOnly(handle: BackendHandle): void {
    try {
      addon.hostMemfdSealReadOnly(Number(handle));
    } catch (error) {
      // The daemon's memfds take seals: F_SEAL_SEAL was added since, through a descriptor the daemon exported.
      if (!isNativeError(error, 'EPERM')) throw error;
      throw codedError(
        'MEMORY_SEALED',
        `the memory cannot be sealed read-only: its seals are frozen (F_SEAL_SEAL), by a client through a descriptor of it or by the daemon when it went writable to a share key's holder (${(error as Error).message})`,
      );
    }
  }

  freezeSeals(handle: BackendHandle): void {
    try {
      addon.hostMemfdAddSeals(Number(handle), MEMFD_SEALS.SEAL);
    } catch (error) {
      // Frozen already (by the daemon, or by a client through a descriptor of it): what was asked holds.
      if (!isNativeError(error, 'EPERM')) throw error;
    }
  }

  async exportFabric(): Promise<Buffer> {
    throw codedError('UNSUPPORTED_HANDLE_TYPE', 'the host backend has no fabric handles');
  }

  async importHandle(source: ImportSource, size: bigint): Promise<ImportedHandle> {
    if (!('fd' in source)) throw codedError('BAD_DESCRIPTOR', 'the host backend imports descriptors, not fabric handles');
    const fd = source.fd;
    try {
      // Mapped writable later (SetAccess READWRITE), copied from by the daemon: the rules of client memfds.
      const info = admitClientMemfd(fd, { what: 'an imported descriptor', writable: true, handedOut: true });
      if (info.size === 0n || info.size % this.options.granularity !== 0n) {
        throw codedError('BAD_DESCRIPTOR', `the descriptor's size ${info.size} is not a positive multiple of the granularity ${this.options.granularity}`);
      }
      if (size !== 0n && size !== info.size) {
        throw codedError('BAD_DESCRIPTOR', `the descriptor holds ${info.size} bytes, not the ${size} the request says`);
      }
      // Memory the backend holds already (its own export, imported back) counts once; other memory by its size.
      const identity = memfdIdentity(info);
      if (!this.live.has(identity)) this.checkCapacity(info.size, `importing a memfd of ${info.size} bytes`);
      this.hold(identity, info.size);
      this.identities.set(fd, identity);
      return { handle: fd, size: info.size, device: 0, location: { type: 'DEVICE', id: 0 } };
    } catch (error) {
      addon.close(fd);
      if (isNativeError(error, 'BAD_DESCRIPTOR') || isNativeError(error, 'OUT_OF_MEMORY')) throw error;
      throw codedError('BAD_DESCRIPTOR', `the descriptor cannot be imported: ${(error as Error).message}`);
    }
  }

  async restoreHandle(fd: number, size: bigint): Promise<ImportedHandle> {
    try {
      const info = addon.hostFdInfo(fd);
      if (info.size !== size) throw codedError('BAD_DESCRIPTOR', `the parked memfd holds ${info.size} bytes, not the ${size} its record says`);
      // Counted as before the restart; not checked against the capacity: it was within it then.
      const identity = memfdIdentity(info);
      this.hold(identity, size);
      this.identities.set(fd, identity);
      return { handle: fd, size, device: 0, location: { type: 'DEVICE', id: 0 } };
    } catch (error) {
      addon.close(fd);
      throw error;
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
