/**
 * Memory mapped into this process from a descriptor the daemon exported.
 * On the host backend the pages are shared with the daemon and every other
 * importer, and an ArrayBuffer views them.
 */
import { status as Status } from '@grpc/grpc-js';
import { addon, HOST_ACCESS } from '../native';
import { VmmdError } from './errors';

/**
 * Maps a host-backend descriptor: reserve, map, set access, as the daemon
 * does. Takes ownership of fd (the mapping keeps the memory alive, so the
 * descriptor is closed once mapped). Rolls back on failure.
 */
export function mapHostDescriptor(fd: number, size: bigint, granularity: bigint, readOnly: boolean): { address: bigint; view: ArrayBuffer } {
  let address = 0n;
  let mapped = false;
  try {
    address = addon.hostReserve(size, granularity, 0n);
    addon.hostMap(address, size, fd, 0n);
    mapped = true;
    addon.hostProtect(address, size, readOnly ? HOST_ACCESS.READ : HOST_ACCESS.READWRITE);
    return { address, view: addon.hostArrayBuffer(address, Number(size)) };
  } catch (error) {
    if (mapped) addon.hostUnmap(address, size);
    if (address !== 0n) addon.hostFreeAddress(address, size);
    throw new VmmdError('LOCAL_MAP_FAILED', Status.INTERNAL, `cannot map the exported memory here: ${(error as Error).message}`);
  } finally {
    addon.close(fd);
  }
}

/**
 * An allocation mapped into this process. `address` is valid until close();
 * on the host backend `buffer` views the same bytes the daemon and other
 * importers see.
 */
export class ImportedMemory implements Disposable {
  private view: ArrayBuffer | undefined;
  private closed = false;

  constructor(
    readonly allocationId: bigint,
    readonly address: bigint,
    readonly size: bigint,
    readonly readOnly: boolean,
    view: ArrayBuffer | undefined,
  ) {
    this.view = view;
  }

  /**
   * The mapped bytes (host backend only).
   * @throws VmmdError FAILED_PRECONDITION CLOSED, NO_HOST_VIEW
   */
  get buffer(): ArrayBuffer {
    if (this.closed) throw new VmmdError('CLOSED', Status.FAILED_PRECONDITION, `allocation ${this.allocationId} was unmapped here`);
    if (this.view === undefined) {
      throw new VmmdError('NO_HOST_VIEW', Status.FAILED_PRECONDITION, 'device memory has no host view; copy it instead');
    }
    return this.view;
  }

  /** A byte view of `buffer`. */
  bytes(): Uint8Array {
    return new Uint8Array(this.buffer);
  }

  get isClosed(): boolean {
    return this.closed;
  }

  /** Unmaps the memory from this process; the views become detached (length 0). */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    // Detach first: a view left attached to unmapped pages would crash the process on access.
    if (this.view !== undefined) addon.hostDetachArrayBuffer(this.view);
    this.view = undefined;
    addon.hostUnmap(this.address, this.size);
    addon.hostFreeAddress(this.address, this.size);
  }

  [Symbol.dispose](): void {
    this.close();
  }
}
