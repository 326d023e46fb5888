/**
 * Sleep and wake of memory mapped into this process, by tag: a sleeping
 * pool gives its physical memory back to the daemon and keeps every address
 * range reserved, so that pointers into it stay valid across the sleep.
 * Sleep waits for the device, copies what must be kept into host memory of
 * the daemon's (`offload`; charged to this session) or not (`discard`),
 * unmaps and releases. Wake asks the daemon for all of the memory as one
 * AllocateAll (the referee between processes on the device: served in turn,
 * waiting for a sleep elsewhere to free it), maps each allocation at its old
 * address, and copies the offloaded bytes back. A read-only store's mapping
 * is unmapped and mapped again: nothing is copied, the store stays with the
 * daemon. A wake that fails leaves everything asleep as it was.
 *
 * With `prepareOffload`, the host memory for each member's copy is made
 * ahead, in the background, as soon as the member joins, and kept while the
 * memory is awake (charged to the session as host memory): a sleep then costs
 * the copy only, the first one included, instead of the daemon making (and
 * the driver pinning) the host memory first. Copies go by address
 * (client/offload-copy.ts), so a member of any size sleeps.
 */
import { status as Status } from '@grpc/grpc-js';
import { native } from '../native/client';
import { VmmdError } from './errors';
import type { ImportedMemory } from './local-memory';
import type { ClientSession } from './session';
import type { OpenedStore, StoresApi } from './stores';
import type { VirtualMemoryApi } from './vmm';
import { copyBetween } from './offload-copy';

export { SLEEP_COPIES_IN_FLIGHT, SLEEP_COPY_CHUNK_BYTES } from './offload-copy';

/** What sleep and wake use of a client (client/connection.ts's VmmdClient). */
export interface SleepClient {
  readonly backend: string;
  readonly vmm: VirtualMemoryApi;
  readonly session: ClientSession;
  readonly stores: StoresApi;
  /** ListDevices (connection.ts's DevicesApi): which host memory is nearest a device. */
  readonly devices: { listDevices(): Promise<{ devices: Array<{ index: number; hostNumaId: number }> }> };
}

/** offload: the contents are copied to host memory and back; discard: the memory comes back with contents not promised. */
export type SleepMode = 'offload' | 'discard';

export interface SleepOptions {
  /** Default offload. */
  mode?: SleepMode;
  /** How long the offload's host memory may be waited for (AllocateAll's deadline), ms; default 10 s. */
  deadlineMs?: number;
}

/** How a group of mappings offloads (TaggedMemory's options). */
export interface TagOptions {
  /**
   * Make each member's host copy ahead, in the background, and keep it while awake (host memory equal to the
   * members' bytes, charged to the session): every offload sleep, the first included, then costs the copy only.
   */
  prepareOffload?: boolean;
}

/** What a group holds for its offload while awake (prepareOffload). */
export interface PreparedOffload {
  /** Bytes of host memory made ahead and held for the next offload. */
  preparedBytes: bigint;
  /** Members whose host memory is being made now. */
  pending: number;
  /** Why the last preparation failed (the next sleep makes that member's copy itself), if it did. */
  lastError?: Error;
}

export interface WakeOptions {
  /** How long the memory may be waited for (a sleep elsewhere freeing it), ms; default 30 s. */
  deadlineMs?: number;
}

/** What can sleep and wake: a group of mappings (TaggedMemory), a memory manager's pool. */
export interface Sleeper {
  readonly asleep: boolean;
  /** @throws VmmdError FAILED_PRECONDITION ASLEEP (asleep already); the offload's refusals (nothing changed then) */
  sleep(options?: SleepOptions): Promise<SleepReport>;
  /** @throws VmmdError FAILED_PRECONDITION ASLEEP (awake already); RESOURCE_EXHAUSTED OUT_OF_MEMORY (still asleep, intact) */
  wake(options?: WakeOptions): Promise<WakeReport>;
}

export interface SleepReport {
  /** Bytes copied to host memory. */
  offloadedBytes: bigint;
  /** Bytes given back to the daemon (device memory released; store mappings not counted). */
  releasedBytes: bigint;
}

export interface WakeReport {
  /** Bytes copied back from host memory. */
  restoredBytes: bigint;
  /** How long the daemon's referee made the wake wait for its memory, ms. */
  waitedMs: number;
}

/** One mapping that sleeps: its memory, whether it maps a store, and where its bytes sleep. */
interface Member {
  readonly memory: ImportedMemory;
  /** The store it maps (read-only): mapped again on wake, nothing copied. */
  readonly storeId?: bigint;
  /** Host memory of the daemon's holding its bytes while it sleeps (offload); awake, the copy made ahead (prepareOffload). */
  offloaded?: ImportedMemory;
  /** The making of `offloaded` ahead, while it runs. */
  preparing?: Promise<void>;
}

const DEFAULT_SLEEP_DEADLINE_MS = 10_000;
const DEFAULT_WAKE_DEADLINE_MS = 30_000;

/**
 * Where offloaded bytes go: the host memory nearest the device (on a host of two sockets the far one
 * halves the copy's bandwidth); node 0 where the daemon does not know it, or the memory spans devices.
 */
async function hostMemoryNear(client: SleepClient, devices: number[]): Promise<{ type: 'LOCATION_TYPE_HOST_NUMA'; id: number }> {
  const known = new Set(devices);
  if (client.backend !== 'cuda' || known.size !== 1) return { type: 'LOCATION_TYPE_HOST_NUMA', id: 0 };
  const device = (await client.devices.listDevices()).devices.find((info) => info.index === devices[0]);
  return { type: 'LOCATION_TYPE_HOST_NUMA', id: device !== undefined && device.hostNumaId >= 0 ? device.hostNumaId : 0 };
}

/** Copies each member's bytes to or from its host memory, device by device, by address; resolves once all have landed. */
async function copyMembers(client: SleepClient, members: Member[], direction: 'out' | 'in'): Promise<void> {
  for (const device of new Set(members.map((member) => member.memory.device))) {
    const pairs = members
      .filter((member) => member.memory.device === device)
      .map((member) => {
        const [memory, host] = [member.memory.address, member.offloaded!.address];
        return direction === 'out'
          ? { target: host, source: memory, length: member.memory.size }
          : { target: memory, source: host, length: member.memory.size };
      });
    await copyBetween(client.backend === 'cuda' ? device : undefined, pairs);
  }
}

/** Closes mappings and releases their allocations, failures ignored (the session reclaims what is left). */
async function discardAll(client: SleepClient, memory: ImportedMemory[]): Promise<void> {
  await Promise.all(
    memory.map(async (mapped) => {
      await mapped.close().catch(() => undefined);
      await client.vmm.release({ allocationId: mapped.allocationId }).catch(() => undefined);
    }),
  );
}

/**
 * Mappings that sleep and wake together.
 * Invariant: every member is awake while `asleep` is false; while it is true every member is suspended (its range
 * kept, nothing mapped), its allocation released unless it maps a store, and `offloaded` holds its bytes if it was offloaded.
 * Awake, `offloaded` is host memory made ahead (prepareOffload) or absent; every one is an allocation of this session's.
 */
export class TaggedMemory implements Sleeper {
  private readonly members: Member[] = [];
  private state: 'awake' | 'asleep' | 'busy' = 'awake';
  private prepareOffload: boolean;
  private lastPrepareError: Error | undefined;

  constructor(
    private readonly client: SleepClient,
    readonly tag: string,
    options: TagOptions = {},
  ) {
    this.prepareOffload = options.prepareOffload ?? false;
  }

  get asleep(): boolean {
    return this.state === 'asleep';
  }

  /** What the group holds ahead for its next offload (prepareOffload). */
  get prepared(): PreparedOffload {
    const ready = this.state === 'asleep' ? [] : this.members.filter((member) => member.offloaded !== undefined);
    return {
      preparedBytes: ready.reduce((sum, member) => sum + member.offloaded!.size, 0n),
      pending: this.members.filter((member) => member.preparing !== undefined).length,
      ...(this.lastPrepareError === undefined ? {} : { lastError: this.lastPrepareError }),
    };
  }

  /**
   * Turns on making the host copies ahead (TagOptions.prepareOffload): from now on for every member
   * without one, in the background. Turning it off drops what is held ahead (awake only).
   * @throws VmmdError FAILED_PRECONDITION ASLEEP while a sleep or wake runs
   */
  async setPrepareOffload(on: boolean): Promise<void> {
    if (this.state === 'busy') this.checkAwake('change the offload preparation of');
    this.prepareOffload = on;
    if (on) {
      if (this.state === 'awake') for (const member of this.members) this.prepare(member);
      return;
    }
    await this.settlePreparation();
    if (this.state !== 'awake') return;
    const held = this.members.flatMap((member) => (member.offloaded === undefined ? [] : [member.offloaded]));
    for (const member of this.members) member.offloaded = undefined;
    await discardAll(this.client, held);
  }

  /** Memory this process mapped from an allocation of its session's (allocate, allocateAll, a pool's lease). */
  add(memory: ImportedMemory): void {
    this.checkAwake('add memory to');
    const member: Member = { memory };
    this.members.push(member);
    this.prepare(member);
  }

  /**
   * Starts making a member's host copy ahead, unless it has one, is being made one, maps a store, or
   * preparation is off. A failure is kept in `prepared.lastError`: the next sleep makes the copy itself.
   */
  private prepare(member: Member): void {
    if (!this.prepareOffload || member.storeId !== undefined || member.offloaded !== undefined || member.preparing !== undefined) return;
    const run = async () => {
      try {
        const location = await hostMemoryNear(this.client, [member.memory.device]);
        // A plain allocation, never queued: it must not wait behind a wake that waits for memory.
        const host = await this.client.vmm.allocate({ size: member.memory.size, location }, { hostAccess: true });
        // Host backend: the memfd's pages are made on first touch; touched now, the sleep's copy takes no fault
        // (on cuda the driver made and pinned them with the allocation).
        if (this.client.backend !== 'cuda') await native.hostPopulate(host.address, host.size).catch(() => undefined);
        // Forgotten meanwhile, or preparation turned off: the copy is nobody's.
        if (!this.members.includes(member) || !this.prepareOffload || member.offloaded !== undefined) await discardAll(this.client, [host]);
        else member.offloaded = host;
      } catch (error) {
        this.lastPrepareError = error as Error;
      } finally {
        member.preparing = undefined;
      }
    };
    member.preparing = run();
  }

  /** Waits until no member's host copy is being made. */
  private async settlePreparation(): Promise<void> {
    for (;;) {
      const running = this.members.flatMap((member) => (member.preparing === undefined ? [] : [member.preparing]));
      if (running.length === 0) return;
      await Promise.all(running);
    }
  }

  /** A store's mapping: on sleep unmapped, on wake mapped again from the store (nothing copied). */
  addStore(opened: OpenedStore): void {
    this.checkAwake('add a store to');
    this.members.push({ memory: opened.memory, storeId: BigInt(opened.store.id) });
  }

  /**
   * Forgets memory its owner frees: awake, it is the owner's to release;
   * asleep, its allocation is released already and its offloaded bytes go now.
   * @returns whether the memory was asleep (nothing left to release)
   * @throws VmmdError FAILED_PRECONDITION ASLEEP while a sleep or wake runs
   */
  async forget(memory: ImportedMemory): Promise<boolean> {
    if (this.state === 'busy') this.checkAwake('remove memory from');
    const index = this.members.findIndex((member) => member.memory === memory);
    if (index < 0) return false;
    const [member] = this.members.splice(index, 1);
    // A copy still being made is dropped when it arrives (the member is gone); wait for it to go.
    if (member.preparing !== undefined) await member.preparing;
    if (member.offloaded !== undefined) await discardAll(this.client, [member.offloaded]);
    member.offloaded = undefined;
    return this.state === 'asleep';
  }

  /**
   * Puts the memory to sleep: waits for the device, offloads (or not),
   * unmaps keeping every address, releases the allocations.
   * @throws VmmdError FAILED_PRECONDITION ASLEEP; the offload's AllocateAll refusals (OUT_OF_MEMORY…): awake and unchanged then
   */
  async sleep(options: SleepOptions = {}): Promise<SleepReport> {
    this.checkAwake('put to sleep');
    const mode = options.mode ?? 'offload';
    this.state = 'busy';
    try {
      const report = await this.sleepNow(mode, options.deadlineMs ?? DEFAULT_SLEEP_DEADLINE_MS);
      this.state = 'asleep';
      return report;
    } catch (error) {
      this.state = 'awake';
      throw error;
    }
  }

  /**
   * Wakes the memory at the same addresses: all of it from the daemon as one
   * request (waiting up to `deadlineMs` for it), offloaded bytes copied back.
   * @throws VmmdError FAILED_PRECONDITION ASLEEP (awake); RESOURCE_EXHAUSTED OUT_OF_MEMORY and any other failure:
   *   still asleep, every address and offloaded byte kept
   */
  async wake(options: WakeOptions = {}): Promise<WakeReport> {
    if (this.state !== 'asleep') throw new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, `tag "${this.tag}" is not asleep (${this.state})`);
    this.state = 'busy';
    try {
      const report = await this.wakeNow(options.deadlineMs ?? DEFAULT_WAKE_DEADLINE_MS);
      this.state = 'awake';
      return report;
    } catch (error) {
      this.state = 'asleep';
      throw error;
    }
  }

  private checkAwake(what: string): void {
    if (this.state !== 'awake')
      throw new VmmdError(
        'ASLEEP',
        Status.FAILED_PRECONDITION,
        `cannot ${what} tag "${this.tag}": it is ${this.state === 'busy' ? 'going to sleep or waking' : 'asleep'}`,
      );
  }

  private async sleepNow(mode: SleepMode, deadlineMs: number): Promise<SleepReport> {
    // A kernel may still use the memory: the device finishes first (as cuMemFree does).
    if (this.client.backend === 'cuda') {
      for (const device of new Set(this.members.map((member) => member.memory.device))) await native.cudaSynchronize(device);
    }
    // Copies made ahead are used, never raced: a preparation still running is waited for.
    await this.settlePreparation();
    const copied = mode === 'offload' ? this.members.filter((member) => member.storeId === undefined) : [];
    const made: ImportedMemory[] = [];
    let offloadedBytes = 0n;
    if (copied.length > 0) {
      const missing = copied.filter((member) => member.offloaded === undefined || member.offloaded.size < member.memory.size);
      if (missing.length > 0) {
        const location = await hostMemoryNear(
          this.client,
          missing.map((member) => member.memory.device),
        );
        const { memory: hosts } = await this.client.vmm.allocateAll(
          { sizes: missing.map((member) => member.memory.size), location, deadlineMs },
          { hostAccess: true },
        );
        made.push(...hosts);
      }
      // Members as they were before this sleep: a failure puts them back (copies made ahead kept, new ones dropped).
      const before = copied.map((member) => member.offloaded);
      const stale = missing.flatMap((member) => (member.offloaded === undefined ? [] : [member.offloaded]));
      missing.forEach((member, index) => (member.offloaded = made[index]));
      try {
        await copyMembers(this.client, copied, 'out');
      } catch (error) {
        copied.forEach((member, index) => (member.offloaded = before[index]));
        await discardAll(this.client, made);
        throw error;
      }
      // Copies made ahead that a grown member outgrew.
      await discardAll(this.client, stale);
      offloadedBytes = copied.reduce((sum, member) => sum + member.memory.size, 0n);
    }
    const suspended: Member[] = [];
    try {
      for (const member of this.members) {
        await member.memory.suspend();
        suspended.push(member);
      }
    } catch (error) {
      // Mapped again from the allocations, still held: the memory is awake as it was.
      for (const member of suspended) await this.remap(member, member.memory.allocationId).catch(() => undefined);
      // The copies made for this sleep go; those made ahead stay for the next one.
      for (const member of this.members) if (member.offloaded !== undefined && made.includes(member.offloaded)) member.offloaded = undefined;
      await discardAll(this.client, made);
      throw error;
    }
    if (mode === 'discard') {
      // Nothing is kept while asleep: host memory made ahead goes too (made again after wake).
      const held = this.members.flatMap((member) => (member.offloaded === undefined ? [] : [member.offloaded]));
      for (const member of this.members) member.offloaded = undefined;
      await discardAll(this.client, held);
    }
    let releasedBytes = 0n;
    for (const member of this.members) {
      if (member.storeId !== undefined) continue;
      await this.client.vmm.release({ allocationId: member.memory.allocationId });
      releasedBytes += member.memory.size;
    }
    return { offloadedBytes, releasedBytes };
  }

  /** Maps an allocation of this session's (by export) or a store (by open) at a suspended member's address. */
  private async remap(member: Member, allocationId: bigint): Promise<void> {
    if (member.storeId === undefined) {
      const { fd } = await this.client.session.export(allocationId);
      await member.memory.resume(allocationId, fd);
      return;
    }
    const { message, fd } = await this.client.session.open({ id: String(member.storeId), name: '' }, false);
    try {
      await member.memory.resume(BigInt(message.store!.allocationId), fd);
    } finally {
      // The mapping's own open was kept while it slept: this one goes again.
      await this.client.stores.close(member.storeId);
    }
  }

  private async wakeNow(deadlineMs: number): Promise<WakeReport> {
    const fresh = this.members.filter((member) => member.storeId === undefined);
    const made: Array<{ member: Member; allocationId: bigint; fd?: number }> = [];
    let waitedMs = 0;
    // One request per device: all of a device's memory or none of it.
    for (const device of new Set(fresh.map((member) => member.memory.device))) {
      const members = fresh.filter((member) => member.memory.device === device);
      const location = { type: 'LOCATION_TYPE_DEVICE' as const, id: device };
      try {
        const response = await this.client.vmm.allocateAllRaw({ sizes: members.map((member) => member.memory.size), location, deadlineMs });
        waitedMs = Math.max(waitedMs, response.waitedMs);
        const entries = response.allocations.map((answer, index) => ({
          member: members[index],
          allocationId: BigInt(answer.allocationId),
          fd: undefined as number | undefined,
        }));
        made.push(...entries);
        for (const [index, answer] of response.allocations.entries()) entries[index].fd = await this.client.session.takeTransfer(answer.transferId);
      } catch (error) {
        await this.undoWake(made);
        throw error;
      }
    }
    const woken: Member[] = [];
    try {
      for (const entry of made) {
        const fd = entry.fd!;
        entry.fd = undefined;
        await entry.member.memory.resume(entry.allocationId, fd);
        woken.push(entry.member);
      }
      for (const member of this.members) {
        if (member.storeId === undefined) continue;
        await this.remap(member, 0n);
        woken.push(member);
      }
      await copyMembers(
        this.client,
        fresh.filter((member) => member.offloaded !== undefined),
        'in',
      );
    } catch (error) {
      for (const member of woken) await member.memory.suspend().catch(() => undefined);
      await this.undoWake(made);
      throw error;
    }
    const restored = fresh.filter((member) => member.offloaded !== undefined);
    const restoredBytes = restored.reduce((sum, member) => sum + member.memory.size, 0n);
    if (this.prepareOffload) {
      // The copies stay for the next sleep; members that slept without one get theirs made again.
      for (const member of fresh) this.prepare(member);
    } else {
      const hosts = restored.map((member) => member.offloaded!);
      for (const member of fresh) member.offloaded = undefined;
      await discardAll(this.client, hosts);
    }
    return { restoredBytes, waitedMs };
  }

  /** Gives back what a failed wake got: descriptors not yet mapped closed, every new allocation released. */
  private async undoWake(made: Array<{ allocationId: bigint; fd?: number }>): Promise<void> {
    for (const entry of made) {
      if (entry.fd !== undefined) native.close(entry.fd);
      entry.fd = undefined;
      await this.client.vmm.release({ allocationId: entry.allocationId }).catch(() => undefined);
    }
  }
}
