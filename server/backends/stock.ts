/**
 * Memory created and exported ahead of time: a backend in front of another
 * that keeps, per device and size, a few allocations already created, each
 * with its descriptor already exported. A Create of a stocked size (device
 * memory, descriptor handles) takes one from the shelf and its first Export
 * returns the ready descriptor, so a cold Allocate costs neither driver call
 * on its path; the shelf refills after the reply, off the request's path.
 *
 * Stocked memory is the daemon's, not any session's: it is not in the
 * registry and counts against no quota until a Create takes it. It is given
 * back when memory runs short (a refill stops below REFILL_HEADROOM free
 * sizes, a failed Create empties every shelf of its device) and at close().
 */
import type { Logger } from 'pino';
import { addon } from '../../native';
import type {
  AccessGrant,
  Backend,
  BackendHandle,
  DeviceInfo,
  HandleKind,
  ImportedHandle,
  ImportSource,
  MemLocation,
  MemoryInfo,
} from './backend';

export interface StockLevel {
  /** Bytes of each allocation (a multiple of the device's granularity). */
  size: bigint;
  /** How many the shelf holds when full. */
  depth: number;
}

interface Item {
  handle: BackendHandle;
  fd: number;
}

interface Shelf {
  device: number;
  size: bigint;
  depth: number;
  items: Item[];
  refilling: boolean;
}

/** A refill stops when the device has less free than this many times the shelf's size. */
const REFILL_HEADROOM = 4n;
/** How long a device's free bytes are trusted before the backend is asked again. */
const FREE_BYTES_TTL_MS = 100;

export interface StockStats {
  levels: Array<{ device: number; size: string; depth: number; held: number }>;
  hits: number;
  misses: number;
  created: number;
  refillFailures: number;
}

const isOutOfMemory = (error: unknown) => {
  const code = (error as { code?: unknown })?.code;
  return code === 'CUDA_ERROR_OUT_OF_MEMORY' || code === 'OUT_OF_MEMORY' || code === 'ENOMEM';
};

export class StockedBackend implements Backend {
  // Invariant: one shelf per (device, size) of the levels; items are created, exported, and in no registry.
  private readonly shelves = new Map<string, Shelf>();
  // Invariant: the ready descriptor of every stocked handle handed out and not yet exported nor released.
  private readonly ready = new Map<BackendHandle, number>();
  private closed = false;
  // The last free bytes asked of each device, and when; refills count down what they take.
  private readonly free = new Map<number, { bytes: bigint; at: number }>();
  private readonly counters = { hits: 0, misses: 0, created: 0, refillFailures: 0 };

  /** @param closeDescriptor closes a descriptor the stock exported (tests give fakes their own) */
  constructor(
    private readonly inner: Backend,
    levels: StockLevel[],
    private readonly log: Logger,
    private readonly closeDescriptor: (fd: number) => void = (fd) => addon.close(fd),
  ) {
    for (const device of inner.devices()) {
      for (const level of levels) {
        if (level.depth <= 0 || level.size % device.granularityMinimum !== 0n) continue;
        this.shelves.set(`${device.index}:${level.size}`, { device: device.index, size: level.size, depth: level.depth, items: [], refilling: false });
      }
    }
  }

  get name() {
    return this.inner.name;
  }

  get capabilities() {
    return this.inner.capabilities;
  }

  /** Fills every shelf; resolves when they are full (or a refill gave up). */
  async fill(): Promise<void> {
    await Promise.all([...this.shelves.values()].map((shelf) => this.refill(shelf)));
  }

  stats(): StockStats {
    return {
      levels: [...this.shelves.values()].map((shelf) => ({ device: shelf.device, size: String(shelf.size), depth: shelf.depth, held: shelf.items.length })),
      ...this.counters,
    };
  }

  async create(device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    const shelf =
      location.type === 'DEVICE' && handleTypes.length === 1 && handleTypes[0] === 'POSIX_FD' ? this.shelves.get(`${device}:${size}`) : undefined;
    if (shelf !== undefined) {
      const item = shelf.items.pop();
      setImmediate(() => void this.refill(shelf));
      if (item !== undefined) {
        this.counters.hits++;
        this.ready.set(item.handle, item.fd);
        return item.handle;
      }
      this.counters.misses++;
    }
    try {
      return await this.inner.create(device, location, size, handleTypes);
    } catch (error) {
      // Stocked memory yields to sessions': the next Create finds it free.
      if (isOutOfMemory(error)) {
        this.empty(device);
        this.free.delete(device);
      }
      throw error;
    }
  }

  async exportHandle(handle: BackendHandle, device: number): Promise<number> {
    const fd = this.ready.get(handle);
    if (fd === undefined) return this.inner.exportHandle(handle, device);
    this.ready.delete(handle);
    return fd;
  }

  release(handle: BackendHandle, size: bigint, imported: boolean, device: number): Promise<void> {
    const fd = this.ready.get(handle);
    if (fd !== undefined) {
      this.ready.delete(handle);
      this.closeDescriptor(fd);
    }
    return this.inner.release(handle, size, imported, device);
  }

  close(): void {
    this.closed = true;
    for (const device of this.inner.devices()) this.empty(device.index);
    for (const fd of this.ready.values()) this.closeDescriptor(fd);
    this.ready.clear();
    this.inner.close();
  }

  /** Gives back every stocked allocation of a device. */
  private empty(device: number): void {
    for (const shelf of this.shelves.values()) {
      if (shelf.device !== device) continue;
      for (const item of shelf.items.splice(0)) this.discard(shelf, item);
    }
  }

  private discard(shelf: Shelf, item: Item): void {
    this.closeDescriptor(item.fd);
    this.inner.release(item.handle, shelf.size, false, shelf.device).catch((error) => this.log.error({ err: error }, 'stock: releasing stocked memory failed'));
  }

  private async refill(shelf: Shelf): Promise<void> {
    if (shelf.refilling) return;
    shelf.refilling = true;
    try {
      while (!this.closed && shelf.items.length < shelf.depth) {
        if (this.freeBytes(shelf.device) < REFILL_HEADROOM * shelf.size) return;
        // Created and exported on a driver thread: a refill costs the event loop nothing but this turn.
        const item = await this.inner.createExported(shelf.device, { type: 'DEVICE', id: shelf.device }, shelf.size);
        this.counters.created++;
        // What this refill took, until the driver is asked again.
        const known = this.free.get(shelf.device);
        if (known !== undefined) known.bytes -= shelf.size;
        if (this.closed) this.discard(shelf, item);
        else shelf.items.push(item);
      }
    } catch (error) {
      this.counters.refillFailures++;
      this.log.warn({ err: error, device: shelf.device, size: String(shelf.size) }, 'stock: a refill failed; the shelf stays short');
    } finally {
      shelf.refilling = false;
    }
  }

  /** The device's free bytes, asked of the backend at most every FREE_BYTES_TTL_MS (cuMemGetInfo is not cheap under load). */
  private freeBytes(device: number): bigint {
    const now = performance.now();
    const known = this.free.get(device);
    if (known !== undefined && now - known.at < FREE_BYTES_TTL_MS) return known.bytes;
    const bytes = this.inner.memoryInfo(device).freeBytes;
    this.free.set(device, { bytes, at: now });
    return bytes;
  }

  // ---- everything else is the inner backend's ----

  devices(): DeviceInfo[] {
    return this.inner.devices();
  }
  createExported(device: number, location: MemLocation, size: bigint): Promise<{ handle: BackendHandle; fd: number }> {
    return this.inner.createExported(device, location, size);
  }
  memoryInfo(device: number): MemoryInfo {
    return this.inner.memoryInfo(device);
  }
  granularity(location: MemLocation): { minimum: bigint; recommended: bigint } {
    return this.inner.granularity(location);
  }
  canAccessPeer(device: number, owner: number): boolean {
    return this.inner.canAccessPeer(device, owner);
  }
  reserve(size: bigint, alignment: bigint, hint: bigint): bigint {
    return this.inner.reserve(size, alignment, hint);
  }
  freeAddress(address: bigint, size: bigint): void {
    this.inner.freeAddress(address, size);
  }
  retainHandle(address: bigint, handle: BackendHandle): BackendHandle {
    return this.inner.retainHandle(address, handle);
  }
  releaseReference(handle: BackendHandle, device: number): Promise<void> {
    return this.inner.releaseReference(handle, device);
  }
  map(address: bigint, size: bigint, handle: BackendHandle, offset: bigint): Promise<void> {
    return this.inner.map(address, size, handle, offset);
  }
  unmap(address: bigint, size: bigint, device: number): Promise<void> {
    return this.inner.unmap(address, size, device);
  }
  setAccess(address: bigint, size: bigint, grants: AccessGrant[]): Promise<void> {
    return this.inner.setAccess(address, size, grants);
  }
  sealReadOnly(handle: BackendHandle): void {
    this.inner.sealReadOnly(handle);
  }
  memoryIdentity(handle: BackendHandle, device: number): string {
    return this.inner.memoryIdentity(handle, device);
  }
  holdClientMemfd(fd: number, size: bigint): string {
    return this.inner.holdClientMemfd(fd, size);
  }
  dropClientMemfd(identity: string): void {
    this.inner.dropClientMemfd(identity);
  }
  exportFabric(handle: BackendHandle, device: number): Promise<Buffer> {
    return this.inner.exportFabric(handle, device);
  }
  importHandle(source: ImportSource, size: bigint): Promise<ImportedHandle> {
    return this.inner.importHandle(source, size);
  }
  readBytes(address: bigint, length: number, device: number, into?: Buffer): Promise<Buffer> {
    return this.inner.readBytes(address, length, device, into);
  }
  writeBytes(address: bigint, data: Buffer, device: number): Promise<void> {
    return this.inner.writeBytes(address, data, device);
  }
}
