/**
 * Local mapping: memory put into this process's address space, written once
 * per memory kind and used by the client and the daemon alike. Host memory
 * (a memfd): reserve, map, protect. CUDA memory (a handle): reserve, map, set
 * access, in this process's primary context of a device. A map undoes its
 * own steps when one fails; an unmap that fails resumes at that step the next
 * time. Errors are the addon's (a string `code`); callers translate them.
 */
import { addon, CU_LOCATION, HOST_ACCESS } from './index';

/** `size` rounded up to a multiple of `granularity`: the one rounding rule of local mappings. */
export function roundUp(size: bigint, granularity: bigint): bigint {
  return ((size + granularity - 1n) / granularity) * granularity;
}

/** This process's page size, the granularity of host mappings. */
export function pageSize(): bigint {
  return BigInt(addon.pageSize());
}

/**
 * After a failed map: runs each undo step (last step's first), whatever the
 * one before did, then rethrows the map's own failure, the one to report.
 */
async function rollBack(failure: unknown, undo: Array<() => unknown>): Promise<never> {
  for (const step of undo) {
    try {
      await step();
    } catch {
      // The map's own failure is what the caller hears about.
    }
  }
  throw failure;
}

/** The same, for undo steps that are all synchronous (host memory). */
function rollBackNow(failure: unknown, undo: Array<() => unknown>): never {
  for (const step of undo) {
    try {
      step();
    } catch {
      // as above
    }
  }
  throw failure;
}

/** Host memory (a memfd's pages) mapped here: [address, address + size). */
export class HostMapping {
  // What unmap() has still to undo: a failed step is tried again by the next unmap().
  private mapped = true;
  private reserved = true;

  private constructor(
    readonly address: bigint,
    readonly size: bigint,
  ) {}

  /**
   * Reserves `size` bytes (a multiple of `alignment`) aligned to `alignment`,
   * maps the memfd there shared, and opens it read-only or read-write. The
   * caller keeps `fd`: the mapping holds the pages by itself.
   * @throws the addon's error (ENOMEM; EACCES or EPERM for sealed memory asked writable); nothing stays mapped
   */
  static map(fd: number, size: bigint, alignment: bigint, readOnly: boolean): HostMapping {
    const address = addon.hostReserve(size, alignment, 0n);
    let mapped = false;
    try {
      addon.hostMap(address, size, fd, 0n);
      mapped = true;
      addon.hostProtect(address, size, readOnly ? HOST_ACCESS.READ : HOST_ACCESS.READWRITE);
      return new HostMapping(address, size);
    } catch (error) {
      return rollBackNow(error, [() => mapped && addon.hostUnmap(address, size), () => addon.hostFreeAddress(address, size)]);
    }
  }

  /** False once unmap() has undone every step. */
  get isMapped(): boolean {
    return this.reserved;
  }

  /** An ArrayBuffer over the pages; detach it with detachView() before unmap(). */
  view(): ArrayBuffer {
    return addon.hostArrayBuffer(this.address, Number(this.size));
  }

  /**
   * Unmaps and frees the address range. After a failure the next call
   * resumes at the step that failed; once done, a call does nothing.
   * @throws the addon's error
   */
  unmap(): void {
    if (this.mapped) {
      addon.hostUnmap(this.address, this.size);
      this.mapped = false;
    }
    if (this.reserved) {
      addon.hostFreeAddress(this.address, this.size);
      this.reserved = false;
    }
  }
}

/** Detaches a view made by view(): a view left attached to unmapped pages would crash the process on access. */
export function detachView(view: ArrayBuffer): void {
  addon.hostDetachArrayBuffer(view);
}

/** Who gets access to a CUDA mapping: its device always, and the CPU for host memory of a NUMA node. */
export interface DeviceAccess {
  readOnly: boolean;
  /** Host memory of this NUMA node opens to the CPU at the same address. */
  hostNuma?: number;
  /**
   * unmap() synchronizes the context first, as cuMemFree does: for memory
   * this process's own kernels may still use (the client's mappings).
   */
  synchronizeUnmap?: boolean;
  /**
   * Map and set access on the calling thread, not a driver thread: for a
   * client's own mappings, where no other session waits on this event loop
   * and the hop to a driver thread costs more than the calls (H100: +40-90 us
   * each, doubling a client's import + map + access). The daemon leaves it off.
   */
  inline?: boolean;
}

/** CUDA memory mapped here, in the primary context of `device`. */
export class DeviceMapping {
  // What unmap() has still to undo: a failed step is tried again by the next unmap().
  private mapped = true;
  private reserved = true;

  private constructor(
    readonly device: number,
    readonly address: bigint,
    readonly size: bigint,
    private readonly synchronizeUnmap: boolean,
  ) {}

  /**
   * Reserves `size` bytes aligned to `granularity`, maps `handle` there and
   * sets access for `device` (and the host NUMA node, if named). The caller
   * keeps its handle reference: the mapping holds one of its own.
   * @throws the addon's error (CUDA_ERROR_*); nothing stays mapped or reserved
   */
  static async map(device: number, handle: bigint, size: bigint, granularity: bigint, access: DeviceAccess): Promise<DeviceMapping> {
    const address = addon.cudaReserve(size, granularity, 0n);
    let mapped = false;
    try {
      await addon.cudaMap(address, size, 0n, handle, access.inline ?? false);
      mapped = true;
      const flags = access.readOnly ? 1 : 3;
      const descriptors: Array<{ type: number; id: number; flags: number }> = [{ type: CU_LOCATION.DEVICE, id: device, flags }];
      if (access.hostNuma !== undefined) descriptors.push({ type: CU_LOCATION.HOST_NUMA, id: access.hostNuma, flags });
      await addon.cudaSetAccess(address, size, descriptors, access.inline ?? false);
      return new DeviceMapping(device, address, size, access.synchronizeUnmap ?? false);
    } catch (error) {
      // Nothing ran on the range yet: no synchronization needed.
      return rollBack(error, [() => mapped && addon.cudaUnmap(device, address, size, false), () => addon.cudaFreeAddress(address, size)]);
    }
  }

  /** False once unmap() has undone every step. */
  get isMapped(): boolean {
    return this.reserved;
  }

  /** An ArrayBuffer over the memory: only for host (NUMA) memory mapped with CPU access. */
  view(): ArrayBuffer {
    return addon.hostArrayBuffer(this.address, Number(this.size));
  }

  /**
   * Unmaps and frees the address range. After a failure the next call
   * resumes at the step that failed; once done, a call does nothing.
   * @throws the addon's error
   */
  async unmap(): Promise<void> {
    if (this.mapped) {
      await addon.cudaUnmap(this.device, this.address, this.size, this.synchronizeUnmap);
      this.mapped = false;
    }
    if (this.reserved) {
      addon.cudaFreeAddress(this.address, this.size);
      this.reserved = false;
    }
  }
}
