/**
 * A fake backend for policy tests: it keeps memory in Buffers, records every
 * call, and checks the driver's own preconditions so that a registry bug that
 * lets misuse through fails loudly here instead of being undefined behaviour.
 */
import {
  AccessGrant,
  Backend,
  BackendHandle,
  DeviceInfo,
  HandleKind,
  ImportedHandle,
  ImportSource,
  MemLocation,
  MemoryInfo,
} from '../../server/backends/backend';

export const MiB = 1n << 20n;
export const GRANULARITY = 2n * MiB;

interface FakeMapping {
  address: bigint;
  size: bigint;
  memory: Buffer;
  access: number;
}

export interface FakeBackendOptions {
  devices?: number;
  capacity?: bigint;
  handleTypes?: HandleKind[];
}

function fail(code: string, message: string): never {
  throw Object.assign(new Error(message), { code });
}

export class FakeBackend implements Backend {
  readonly name = 'host' as const;
  readonly capabilities = { hostNumaNodes: false, gpuMemory: false, readOnlyExports: false, descriptors: 'memfd' } as const;
  readonly calls: string[] = [];
  /** Resolves pending unmaps when set: tests use it to hold an unmap in flight. */
  unmapGate?: Promise<void>;
  private nextAddress = 0x7f00_0000_0000n;
  private nextHandle = 100;
  private used = 0n;
  // Invariant: `memory` holds exactly the live (unreleased) handles.
  readonly memory = new Map<number, { size: bigint; buffer: Buffer; imported: boolean }>();
  readonly reservations = new Map<bigint, bigint>();
  readonly mappings: FakeMapping[] = [];
  private readonly options: Required<FakeBackendOptions>;

  constructor(options: FakeBackendOptions = {}) {
    this.options = { devices: 1, capacity: 64n * MiB, handleTypes: ['POSIX_FD'], ...options };
  }

  devices(): DeviceInfo[] {
    return Array.from({ length: this.options.devices }, (_, index) => ({
      index,
      name: `fake ${index}`,
      kind: 'HOST' as const,
      uuid: '',
      totalBytes: this.options.capacity,
      granularityMinimum: GRANULARITY,
      granularityRecommended: GRANULARITY,
      handleTypes: this.options.handleTypes,
      computeCapability: '',
      fabricUsable: false,
      fabricStatus: 'the fake backend has no fabric handles',
      hostNumaId: -1,
    }));
  }

  memoryInfo(): MemoryInfo {
    return { totalBytes: this.options.capacity, freeBytes: this.options.capacity - this.used };
  }

  granularity(): { minimum: bigint; recommended: bigint } {
    return { minimum: GRANULARITY, recommended: GRANULARITY };
  }

  canAccessPeer(): boolean {
    return true;
  }

  retainHandle(_address: bigint, handle: BackendHandle): BackendHandle {
    this.calls.push('retainHandle');
    return handle;
  }

  async releaseReference(): Promise<void> {
    this.calls.push('releaseReference');
  }

  sealReadOnly(): void {
    this.calls.push('seal');
  }

  memoryIdentity(handle: BackendHandle): string {
    return `fake:${handle}`;
  }

  async holdClientMemfd(fd: number, _size?: bigint): Promise<string> {
    return `fake-memfd:${fd}`;
  }

  dropClientMemfd(): void {}

  async exportFabric(): Promise<Buffer> {
    fail('UNSUPPORTED_HANDLE_TYPE', 'the fake backend has no fabric handles');
  }

  reserve(size: bigint, alignment: bigint): bigint {
    this.calls.push('reserve');
    const address = ((this.nextAddress + alignment - 1n) / alignment) * alignment;
    this.nextAddress = address + size + GRANULARITY;
    this.reservations.set(address, size);
    return address;
  }

  freeAddress(address: bigint, size: bigint): void {
    this.calls.push('freeAddress');
    if (this.reservations.get(address) !== size) fail('EINVAL', 'freeAddress of a range that is not a reservation');
    if (this.mappings.some((m) => m.address >= address && m.address < address + size)) {
      fail('EBUSY', 'freeAddress with mappings left');
    }
    this.reservations.delete(address);
  }

  /** While set, creates wait for it once their memory is made: tests use it to hold creates in flight. */
  createGate?: Promise<void>;
  /** Creates started and not yet settled. */
  createsInFlight = 0;

  async create(device: number, location: MemLocation, size: bigint): Promise<BackendHandle> {
    this.calls.push('create');
    this.createsInFlight++;
    try {
      const handle = this.createNow(size);
      if (this.createGate) await this.createGate;
      return handle;
    } finally {
      this.createsInFlight--;
    }
  }

  private createNow(size: bigint): BackendHandle {
    if (this.used + size > this.options.capacity) {
      fail('OUT_OF_MEMORY', `out of memory: requested ${size} bytes, ${this.used} of ${this.options.capacity} bytes in use`);
    }
    this.used += size;
    const handle = this.nextHandle++;
    this.memory.set(handle, { size, buffer: Buffer.alloc(Number(size)), imported: false });
    return handle;
  }

  async createExported(device: number, location: MemLocation, size: bigint): Promise<{ handle: BackendHandle; fd: number }> {
    const handle = await this.create(device, location, size);
    return { handle, fd: await this.exportHandle(handle) };
  }

  async release(handle: BackendHandle): Promise<void> {
    this.calls.push('release');
    const memory = this.memory.get(Number(handle));
    if (memory === undefined) fail('EBADF', 'release of an unknown handle');
    if (this.mappings.some((m) => m.memory === memory.buffer)) fail('EBUSY', 'release of mapped memory');
    if (!memory.imported) this.used -= memory.size;
    this.memory.delete(Number(handle));
  }

  async map(address: bigint, size: bigint, handle: BackendHandle, offset: bigint): Promise<void> {
    this.calls.push('map');
    const memory = this.memory.get(Number(handle));
    if (memory === undefined) fail('EBADF', 'map of an unknown handle');
    if (offset !== 0n || size > memory.size) fail('EINVAL', 'map beyond the allocation');
    if (this.mappings.some((m) => address < m.address + m.size && m.address < address + size)) {
      fail('EINVAL', 'map over a mapping');
    }
    this.mappings.push({ address, size, memory: memory.buffer, access: 0 });
  }

  async unmap(address: bigint, size: bigint): Promise<void> {
    this.calls.push('unmap');
    if (this.unmapGate) await this.unmapGate;
    const index = this.mappings.findIndex((m) => m.address === address && m.size === size);
    if (index < 0) fail('EINVAL', 'unmap of a range that is not one mapping');
    this.mappings.splice(index, 1);
  }

  async setAccess(address: bigint, size: bigint, grants: AccessGrant[]): Promise<void> {
    this.calls.push('setAccess');
    const access = grants.reduce((widest, grant) => Math.max(widest, grant.access), 0);
    for (let cursor = address; cursor < address + size;) {
      const mapping = this.mappings.find((m) => m.address <= cursor && cursor < m.address + m.size);
      if (mapping === undefined) fail('EINVAL', 'setAccess on unmapped memory');
      mapping.access = access;
      cursor = mapping.address + mapping.size;
    }
  }

  async exportHandle(handle: BackendHandle): Promise<number> {
    this.calls.push('export');
    if (!this.memory.has(Number(handle))) fail('EBADF', 'export of an unknown handle');
    return 1000 + Number(handle);
  }

  async importHandle(_source: ImportSource, _size: bigint): Promise<ImportedHandle> {
    this.calls.push('import');
    const handle = this.nextHandle++;
    this.memory.set(handle, { size: GRANULARITY, buffer: Buffer.alloc(Number(GRANULARITY)), imported: true });
    return { handle, size: GRANULARITY, device: 0, location: { type: 'DEVICE', id: 0 } };
  }

  private bytesAt(address: bigint, length: number, needed: number): Array<{ buffer: Buffer; start: number; count: number }> {
    const pieces = [];
    for (let cursor = address; cursor < address + BigInt(length);) {
      const mapping = this.mappings.find((m) => m.address <= cursor && cursor < m.address + m.size);
      if (mapping === undefined || (mapping.access & needed) !== needed) fail('SIGSEGV', `access to ${cursor} would fault`);
      const end = address + BigInt(length) < mapping.address + mapping.size ? address + BigInt(length) : mapping.address + mapping.size;
      pieces.push({ buffer: mapping.memory, start: Number(cursor - mapping.address), count: Number(end - cursor) });
      cursor = end;
    }
    return pieces;
  }

  async readBytes(address: bigint, length: number, _device = 0, into?: Buffer): Promise<Buffer> {
    this.calls.push('read');
    const bytes = Buffer.concat(this.bytesAt(address, length, 1).map((p) => p.buffer.subarray(p.start, p.start + p.count)));
    if (into === undefined) return bytes;
    bytes.copy(into);
    return into;
  }

  async writeBytes(address: bigint, data: Buffer, _device = 0): Promise<void> {
    this.calls.push('write');
    let offset = 0;
    for (const piece of this.bytesAt(address, data.length, 3)) {
      data.copy(piece.buffer, piece.start, offset, offset + piece.count);
      offset += piece.count;
    }
  }

  close(): void {}
}
