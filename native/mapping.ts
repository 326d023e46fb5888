/**
 * Local mapping: memory put into this process's address space, written once
 * per memory kind and used by the client and the daemon alike. Host memory
 * (a memfd): take a range, map, protect. CUDA memory (a handle): take a
 * range, map, set access, in this process's primary context of a device.
 * Ranges come from this process's address arenas (native/address-arena.ts:
 * large reservations made once), and go back to them only once unmapped. A
 * map undoes its own steps when one fails; an unmap that fails resumes at
 * that step the next time. Errors are the addon's (a string `code`); callers
 * translate them.
 */
import { traceMark } from '../common/trace';
import { AddressArena, AddressSpace, ArenaStats } from './address-arena';
import { addon, CU_LOCATION, HOST_ACCESS } from './index';
import { join, PeerAccess, usedPeers } from './peers';
import { unmapGathered } from './unmap-batch';

export { roundUp } from './address-arena';
export { flushUnmaps, flushUnmapsIfIdle } from './unmap-batch';

const GiB = 1024n * 1024n * 1024n;

/**
 * Address space reserved at a time, per memory kind (and per device on
 * cuda): 64 GiB, a few thousandths of a 47-bit space. VMMD_ADDRESS_ARENA=off
 * reserves one range per mapping instead (the path before the arena, kept
 * for comparison).
 */
const RESERVATION_BYTES = 64n * GiB;
const RESERVATION_ALIGNMENT = 2n * 1024n * 1024n;
/** An empty reservation is freed after this long unused. */
const IDLE_MS = 1000;

/** Where a mapping's address range comes from and goes back to. */
interface AddressSource {
  take(size: bigint, alignment: bigint): bigint;
  give(address: bigint): void;
}

/** One reservation per mapping, freed with it (VMMD_ADDRESS_ARENA=off). */
class OwnReservations implements AddressSource {
  // Invariant: every range handed out and not yet given back, with its size.
  private readonly sizes = new Map<bigint, bigint>();

  constructor(private readonly space: AddressSpace) {}

  take(size: bigint, alignment: bigint): bigint {
    const address = this.space.reserve(size, alignment);
    this.sizes.set(address, size);
    return address;
  }

  give(address: bigint): void {
    this.space.free(address, this.sizes.get(address)!);
    this.sizes.delete(address);
  }
}

const HOST_SPACE: AddressSpace = {
  reserve: (size, alignment) => addon.hostReserve(size, alignment, 0n),
  free: (address, size) => addon.hostFreeAddress(address, size),
};

const CUDA_SPACE: AddressSpace = {
  reserve: (size, alignment) => addon.cudaReserve(size, alignment, 0n),
  free: (address, size) => addon.cudaFreeAddress(address, size),
};

// Invariant: one source per memory kind ('host', 'host:own', or 'cuda:' and the device) for the life of the process.
const sources = new Map<string, AddressSource>();

function source(kind: string, space: AddressSpace, own = false): AddressSource {
  let found = sources.get(kind);
  if (found === undefined) {
    found =
      own || process.env.VMMD_ADDRESS_ARENA === 'off'
        ? new OwnReservations(space)
        : new AddressArena(space, { reservationBytes: RESERVATION_BYTES, alignment: RESERVATION_ALIGNMENT, idleMs: IDLE_MS });
    sources.set(kind, found);
  }
  return found;
}

const hostSource = (own = false) => (own ? source('host:own', HOST_SPACE, true) : source('host', HOST_SPACE));
const deviceSource = (device: number) => source(`cuda:${device}`, CUDA_SPACE);

/**
 * What this process's address arenas hold: 'host', or 'cuda:' and a device.
 * Empty when nothing was mapped yet, or with VMMD_ADDRESS_ARENA=off.
 */
export function addressArenaStats(): Record<string, ArenaStats> {
  const out: Record<string, ArenaStats> = {};
  for (const [kind, found] of sources) if (found instanceof AddressArena) out[kind] = found.stats();
  return out;
}

/** Frees every empty reservation of this process's arenas now (they are otherwise freed after a second unused). */
export function trimAddressArenas(): number {
  let freed = 0;
  for (const found of sources.values()) if (found instanceof AddressArena) freed += found.trim();
  return freed;
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
    private readonly ownReservation: boolean,
  ) {}

  /**
   * Takes `size` bytes (a multiple of `alignment`) aligned to `alignment` of
   * address space, maps the memfd there shared, and opens it read-only or
   * read-write. The caller keeps `fd`: the mapping holds the pages by itself.
   * With `ownReservation`, the range is reserved for this mapping alone and
   * freed with it (the daemon's few long-lived views of client memfds: the
   * address space goes back to the kernel when the store goes), else it
   * comes from the process's arena.
   * @throws the addon's error (ENOMEM; EACCES or EPERM for sealed memory asked writable); nothing stays mapped
   */
  static map(fd: number, size: bigint, alignment: bigint, readOnly: boolean, options: { ownReservation?: boolean } = {}): HostMapping {
    const own = options.ownReservation ?? false;
    const space = hostSource(own);
    const address = space.take(size, alignment);
    let mapped = false;
    try {
      addon.hostMap(address, size, fd, 0n);
      mapped = true;
      addon.hostProtect(address, size, readOnly ? HOST_ACCESS.READ : HOST_ACCESS.READWRITE);
      return new HostMapping(address, size, own);
    } catch (error) {
      // The range goes back only once nothing is mapped in it: a failed unmap keeps it out of the arena.
      return rollBackNow(error, [
        () => {
          if (mapped) addon.hostUnmap(address, size);
          space.give(address);
        },
      ]);
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
   * Unmaps the pages but keeps the range (inaccessible, reserved): what a
   * sleeping mapping holds. resume() maps memory there again.
   * @throws the addon's error
   */
  suspend(): void {
    if (!this.mapped) return;
    addon.hostUnmap(this.address, this.size);
    this.mapped = false;
  }

  /**
   * Maps another memfd of the same size at the same address, after suspend().
   * @throws the addon's error; the range stays reserved and unmapped
   */
  resume(fd: number, readOnly: boolean): void {
    if (this.mapped || !this.reserved) throw new Error(`host mapping at 0x${this.address.toString(16)} is not suspended`);
    addon.hostMap(this.address, this.size, fd, 0n);
    try {
      addon.hostProtect(this.address, this.size, readOnly ? HOST_ACCESS.READ : HOST_ACCESS.READWRITE);
    } catch (error) {
      rollBackNow(error, [() => addon.hostUnmap(this.address, this.size)]);
    }
    this.mapped = true;
  }

  /**
   * Unmaps and gives the address range back to the arena. After a failure
   * the next call resumes at the step that failed; once done, a call does nothing.
   * @throws the addon's error
   */
  unmap(): void {
    if (this.mapped) {
      addon.hostUnmap(this.address, this.size);
      this.mapped = false;
    }
    if (this.reserved) {
      hostSource(this.ownReservation).give(this.address);
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
   * and the hop to a driver thread costs more than the calls (it about
   * doubles a client's import + map + access). The daemon leaves it off.
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
    flags: 1 | 3,
  ) {
    this.peers = new PeerAccess(device, address, size, flags);
  }

  // Which peer devices the mapping is open to (native/peers.ts).
  private readonly peers: PeerAccess;

  /**
   * Reserves `size` bytes aligned to `granularity`, maps `handle` there and
   * sets access for `device`, the peers this process maps on too (usedPeers) and the host NUMA node, if named. The caller
   * keeps its handle reference: the mapping holds one of its own.
   * @throws the addon's error (CUDA_ERROR_*); nothing stays mapped or reserved
   */
  static async map(device: number, handle: bigint, size: bigint, granularity: bigint, access: DeviceAccess): Promise<DeviceMapping> {
    await join(device);
    const space = deviceSource(device);
    const address = space.take(size, granularity);
    let mapped = false;
    let mapping: DeviceMapping | undefined;
    try {
      await addon.cudaMap(address, size, 0n, handle, access.inline ?? false);
      mapped = true;
      const flags = access.readOnly ? 1 : 3;
      const peers = usedPeers(device);
      const descriptors: Array<{ type: number; id: number; flags: number }> = [{ type: CU_LOCATION.DEVICE, id: device, flags }];
      for (const peer of peers) descriptors.push({ type: CU_LOCATION.DEVICE, id: peer, flags });
      if (access.hostNuma !== undefined) descriptors.push({ type: CU_LOCATION.HOST_NUMA, id: access.hostNuma, flags });
      await addon.cudaSetAccess(address, size, descriptors, access.inline ?? false);
      mapping = new DeviceMapping(device, address, size, access.synchronizeUnmap ?? false, flags);
      await mapping.peers.register(peers);
      return mapping;
    } catch (error) {
      if (mapping !== undefined) await mapping.peers.close();
      // Nothing ran on the range yet: no synchronization needed.
      // The range goes back only once the unmap has completed: a failed unmap keeps it out of the arena.
      return rollBack(error, [
        async () => {
          if (mapped) await addon.cudaUnmap(device, address, size, false);
          space.give(address);
        },
      ]);
    }
  }

  /**
   * A descriptor of CUDA memory imported, mapped and opened in one driver
   * call on the calling thread (a client's own mapping, as `inline`): a range
   * of `size` bytes aligned to `granularity` from the arena, the import, map,
   * access and the release of the imported handle there, which the mapping
   * no longer needs. The caller keeps `fd`.
   * @throws the addon's error (CUDA_ERROR_*, naming the step); nothing stays imported, mapped or reserved
   */
  static async importDescriptor(device: number, fd: number, size: bigint, granularity: bigint, access: DeviceAccess): Promise<DeviceMapping> {
    await join(device);
    const space = deviceSource(device);
    const address = space.take(size, granularity);
    traceMark('mark:range taken');
    let releaseFailed: string | undefined;
    const peers = usedPeers(device);
    try {
      releaseFailed = await addon.cudaImportMap(fd, address, size, device, access.readOnly ? 1 : 3, access.hostNuma ?? -1, peers);
    } catch (error) {
      // The call undid its own steps: the range is free again. Unless even its unmap failed: the range stays
      // mapped, and is never handed out again (a later map there would fail, or meet this memory).
      if ((error as { stillMapped?: boolean }).stillMapped === true) {
        process.emitWarning(
          `vmmd: a failed import left ${size} bytes mapped at 0x${address.toString(16)} (${(error as { unmapError?: string }).unmapError}); that range is not used again`,
        );
      } else {
        space.give(address);
      }
      throw error;
    }
    // The mapping works; only the imported handle's reference is lost (as with separate calls, a warning, not a failure).
    if (releaseFailed !== undefined)
      process.emitWarning(
        `vmmd: releasing the imported handle of the mapping at 0x${address.toString(16)} failed (${releaseFailed}); the mapping works, the handle's reference lasts until this process ends`,
      );
    const mapping = new DeviceMapping(device, address, size, access.synchronizeUnmap ?? false, access.readOnly ? 1 : 3);
    try {
      await mapping.peers.register(peers);
      return mapping;
    } catch (error) {
      await mapping.unmap().catch(() => undefined);
      throw error;
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
   * Unmaps the memory (synchronizing the context first where the mapping's
   * unmaps do) but keeps the range reserved: what a sleeping mapping holds.
   * resume() maps memory there again.
   * @throws the addon's error
   */
  async suspend(): Promise<void> {
    if (!this.mapped) return;
    const settling = this.peers.close();
    if (settling !== undefined) await settling;
    try {
      await addon.cudaUnmap(this.device, this.address, this.size, this.synchronizeUnmap);
    } catch (error) {
      await this.peers.reopen();
      throw error;
    }
    this.mapped = false;
    this.peers.forget();
  }

  /**
   * Imports a descriptor of memory of the same size and maps it at the same
   * address, with the access of `access`, after suspend(). The caller keeps `fd`.
   * @throws the addon's error; the range stays reserved and unmapped
   */
  async resume(fd: number, access: DeviceAccess): Promise<void> {
    if (this.mapped || !this.reserved) throw new Error(`device mapping at 0x${this.address.toString(16)} is not suspended`);
    await join(this.device);
    const peers = usedPeers(this.device);
    this.peers.flags = access.readOnly ? 1 : 3;
    const releaseFailed = await addon.cudaImportMap(fd, this.address, this.size, this.device, this.peers.flags, access.hostNuma ?? -1, peers);
    this.mapped = true;
    try {
      await this.peers.register(peers);
    } catch (error) {
      // Asleep again, as the caller is told: a peer that joined meanwhile could not be given this memory.
      await this.suspend().catch(() => undefined);
      throw error;
    }
    if (releaseFailed !== undefined)
      process.emitWarning(`vmmd: releasing the imported handle of the mapping at 0x${this.address.toString(16)} failed (${releaseFailed})`);
  }

  /**
   * Unmaps (on a driver thread) and, once the unmap has completed, gives the
   * address range back to the arena: no later mapping gets the range while
   * the driver may still be unmapping it. After a failure the next call
   * resumes at the step that failed; once done, a call does nothing.
   * @param gather nobody waits: the unmap may wait a moment for others of this process (native/unmap-batch.ts)
   * @throws the addon's error
   */
  async unmap(gather = false): Promise<void> {
    if (this.mapped) {
      const settling = this.peers.close();
      if (settling !== undefined) await settling;
      try {
        // Nobody waits for it (a client's own mapping, synchronized first): gathered with its other unmaps into one driver job.
        if (gather && this.synchronizeUnmap) await unmapGathered(this.device, this.address, this.size);
        else await addon.cudaUnmap(this.device, this.address, this.size, this.synchronizeUnmap);
      } catch (error) {
        await this.peers.reopen();
        throw error;
      }
      this.mapped = false;
      this.peers.forget();
    }
    if (this.reserved) {
      deviceSource(this.device).give(this.address);
      this.reserved = false;
    }
  }
}
