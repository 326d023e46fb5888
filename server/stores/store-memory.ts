/**
 * A store's memory as the daemon reaches it: a registry allocation mapped
 * through the registry (the backend), or a client's memfd mapped through the
 * local-mapping module (native/mapping.ts), never through a side door. The
 * staging buffers use the memfd kind too.
 */
import * as fs from 'node:fs';
import { promisify } from 'node:util';
import { addon } from '../../native';
import { HostMapping, pageSize, roundUp } from '../../native/mapping';
import { failedPrecondition } from '../errors';
import { AllocationRecord, DAEMON_OWNER, Registry } from '../registry';

// fs.open's callback form: a plain descriptor (closed with the addon's close like every other), opened off the event loop.
const openFile = promisify(fs.open) as (path: string, flags: number) => Promise<number>;

/**
 * The same memfd open O_RDONLY: its holder can neither write(2) it nor map it
 * writable (mprotect gives EACCES). The open runs on libuv's threads, not the
 * event loop (a path lookup in /proc). The daemon reopens its own memfds
 * (mode 0600, its own), and clients' where their mode lets other uids read
 * them (the vmmd libraries make them 0644). Takes ownership of `fd`, closed
 * either way.
 */
async function reopenReadOnly(fd: number): Promise<number> {
  try {
    return await openFile(`/proc/self/fd/${fd}`, fs.constants.O_RDONLY);
  } catch (error) {
    if ((error as { code?: unknown }).code !== 'EACCES') throw error;
    throw failedPrecondition(
      'NOT_REOPENABLE',
      `the store's memory cannot be opened read-only for this caller: the daemon reopens it through /proc/self/fd and its owner's mode forbids the daemon to read it (${(error as Error).message}); its owner may fchmod it 0644, or open it as a writer`,
    );
  } finally {
    addon.close(fd);
  }
}

/**
 * The read-only descriptor a store keeps for its non-writers' opens: each
 * open gets a dup of it (still O_RDONLY: the access mode is the open file
 * description's), not a new reopen. Closed when the store's memory is released.
 */
class ReadOnlyDescriptor {
  // Invariant: undefined, or an O_RDONLY descriptor of the store's memory owned by this object; undefined for good once closed.
  private fd: number | undefined;
  private closed = false;

  /** A dup of the kept descriptor, else `reopen()`'s (a new O_RDONLY descriptor, handed out), a dup of which is kept. */
  async take(reopen: () => Promise<number>): Promise<number> {
    if (this.fd !== undefined) return addon.dup(this.fd);
    const fd = await reopen();
    if (this.fd === undefined && !this.closed) {
      try {
        this.fd = addon.dup(fd);
      } catch {
        // Out of descriptors: nothing kept, the next open reopens.
      }
    }
    return fd;
  }

  close(): void {
    this.closed = true;
    if (this.fd === undefined) return;
    addon.close(this.fd);
    this.fd = undefined;
  }
}

/** A store's memory as the daemon reaches it: mapped in the daemon, exportable as a descriptor. */
export interface StoreMemory {
  readonly allocationId: bigint;
  readonly granularity: bigint;
  /** Bytes an opener maps: the allocation's whole size. */
  readonly mappedSize: bigint;
  /** A descriptor of the memory for an opener; with `readOnly`, one that cannot write it where the memory allows (a memfd). */
  exportFd(readOnly?: boolean): Promise<number>;
  read(offset: bigint, length: number): Promise<Buffer>;
  write(offset: bigint, data: Buffer): Promise<void>;
  /** Undoes what the daemon holds, step by step; after a failure, a repeat resumes at the step that failed. */
  release(): Promise<void>;
}

/** A registry allocation, mapped by the daemon with READ or READWRITE access for its device. */
export class AllocationMemory implements StoreMemory {
  // What release has still to undo (a failed release resumes here).
  private mapped = true;
  private reserved = true;
  private readonly readOnlyFd = new ReadOnlyDescriptor();

  private constructor(
    private readonly registry: Registry,
    private readonly allocation: AllocationRecord,
    private readonly holder: bigint,
    private readonly address: bigint,
  ) {}

  get allocationId(): bigint {
    return this.allocation.id;
  }

  get granularity(): bigint {
    return this.allocation.granularity;
  }

  get mappedSize(): bigint {
    return this.allocation.size;
  }

  /**
   * Maps the allocation in a daemon-owned reservation. Everything is done as
   * the store's holder: it holds a reference to the allocation, and anyone may
   * act on daemon-owned reservations.
   */
  static async map(registry: Registry, allocation: AllocationRecord, holder: bigint, readOnly: boolean): Promise<AllocationMemory> {
    const size = allocation.size;
    const reservation = registry.reserve(DAEMON_OWNER, { size, alignment: 0n, address: 0n });
    try {
      await registry.map(holder, { address: reservation.address, size, offset: 0n, allocationId: allocation.id });
      await registry.setAccess(holder, reservation.address, size, [{ location: { type: 'DEVICE', id: allocation.device }, access: readOnly ? 1 : 3 }]);
    } catch (error) {
      await registry.unmap(holder, reservation.address, size).catch(() => undefined);
      await registry.freeAddress(holder, reservation.address, size).catch(() => undefined);
      throw error;
    }
    return new AllocationMemory(registry, allocation, holder, reservation.address);
  }

  /** Writable: the registry's export (a dup of the descriptor the backend's export cache keeps). Read-only where the memory allows: a dup of the store's own reopened descriptor. */
  async exportFd(readOnly = false): Promise<number> {
    const exported = async () =>
      (await this.registry.exportHandle(this.holder, { allocationId: this.allocation.id, handleType: 'POSIX_FD', shareKey: '' })).fd!;
    if (!readOnly || !this.registry.backend.capabilities.readOnlyExports) return exported();
    return this.readOnlyFd.take(async () => reopenReadOnly(await exported()));
  }

  async read(offset: bigint, length: number): Promise<Buffer> {
    const chunks: Buffer[] = [];
    for await (const chunk of this.registry.read(this.holder, this.address + offset, BigInt(length))) chunks.push(chunk.data);
    return chunks.length === 1 ? chunks[0] : Buffer.concat(chunks);
  }

  write(offset: bigint, data: Buffer): Promise<void> {
    return this.registry.write(this.holder, this.address + offset, data);
  }

  async release(): Promise<void> {
    this.readOnlyFd.close();
    if (this.mapped) {
      await this.registry.unmap(this.holder, this.address, this.allocation.size);
      this.mapped = false;
    }
    if (this.reserved) {
      await this.registry.freeAddress(this.holder, this.address, this.allocation.size);
      this.reserved = false;
    }
    await this.registry.dropHolder(this.holder, this.allocation.id);
  }
}

/**
 * A memfd of a client's (an attached store, a staging buffer), mapped by the
 * daemon through the local-mapping module (native/mapping.ts).
 */
export class MemfdMemory implements StoreMemory {
  readonly allocationId = 0n;
  // Whether the descriptor is still the daemon's to close (a failed release resumes here).
  private open = true;
  private readonly readOnlyFd = new ReadOnlyDescriptor();

  private constructor(
    private readonly fd: number,
    private readonly mapping: HostMapping,
    readonly granularity: bigint,
  ) {}

  /** Where the daemon mapped it. */
  get address(): bigint {
    return this.mapping.address;
  }

  get mappedSize(): bigint {
    return this.mapping.size;
  }

  /** An ArrayBuffer over the mapped pages (detach it with detachView() before release()). */
  view(): ArrayBuffer {
    return this.mapping.view();
  }

  /**
   * Maps `size` bytes (rounded up to pages) of a memfd, sealed against writes for good when read-only.
   * Takes ownership of fd: closed on failure too.
   * @throws the addon's error (nothing stays mapped)
   */
  static map(fd: number, size: bigint, readOnly: boolean): MemfdMemory {
    const page = pageSize();
    let mapping: HostMapping | undefined;
    try {
      // A reservation of its own: the daemon maps few, long-lived memfds, whose address space goes back with them.
      mapping = HostMapping.map(fd, roundUp(size, page), page, readOnly, { ownReservation: true });
      if (readOnly) addon.hostMemfdSealReadOnly(fd);
      return new MemfdMemory(fd, mapping, page);
    } catch (error) {
      try {
        mapping?.unmap();
      } finally {
        addon.close(fd);
      }
      throw error;
    }
  }

  async exportFd(readOnly = false): Promise<number> {
    if (!readOnly) return addon.dup(this.fd);
    return this.readOnlyFd.take(() => reopenReadOnly(addon.dup(this.fd)));
  }

  read(offset: bigint, length: number): Promise<Buffer> {
    return addon.hostCopyFromAddress(this.address + offset, length);
  }

  write(offset: bigint, data: Buffer): Promise<void> {
    return addon.hostCopyToAddress(this.address + offset, data);
  }

  async release(): Promise<void> {
    this.readOnlyFd.close();
    this.mapping.unmap();
    if (this.open) {
      this.open = false;
      addon.close(this.fd);
    }
  }
}

/** A store's memory that was charged (a SYSMEM attachment): the charge goes once the memory is freed. */
export class ChargedMemory implements StoreMemory {
  private charged = true;

  constructor(
    private readonly inner: StoreMemory,
    private readonly uncharge: () => void,
  ) {}

  get allocationId(): bigint {
    return this.inner.allocationId;
  }

  get granularity(): bigint {
    return this.inner.granularity;
  }

  get mappedSize(): bigint {
    return this.inner.mappedSize;
  }

  exportFd(readOnly?: boolean): Promise<number> {
    // `readOnly` passed on: without it a non-writer's open of a writable SYSMEM attachment would get a writable descriptor.
    return this.inner.exportFd(readOnly);
  }

  read(offset: bigint, length: number): Promise<Buffer> {
    return this.inner.read(offset, length);
  }

  write(offset: bigint, data: Buffer): Promise<void> {
    return this.inner.write(offset, data);
  }

  async release(): Promise<void> {
    await this.inner.release();
    if (!this.charged) return;
    this.charged = false;
    this.uncharge();
  }
}
