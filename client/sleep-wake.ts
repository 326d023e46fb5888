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
 */
import { status as Status } from '@grpc/grpc-js';
import { native } from '../native/client';
import { VmmdError } from './errors';
import type { ImportedMemory } from './local-memory';
import type { ClientSession } from './session';
import type { OpenedStore, StoresApi } from './stores';
import type { VirtualMemoryApi } from './vmm';

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
  /** Host memory of the daemon's holding its bytes while it sleeps (offload). */
  offloaded?: ImportedMemory;
}

/** Bytes of one piece of a copy between device and host memory: large enough for the copy engine's full speed. */
export const SLEEP_COPY_CHUNK_BYTES = 64 << 20;
/** Pieces in flight at once (each on a driver thread with its own stream): the copy of one overlaps the next's setup. */
export const SLEEP_COPIES_IN_FLIGHT = 4;
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

/** Runs `step` over [0, length) in pieces of `chunk` bytes, at most `inFlight` at once. */
async function inPieces(length: bigint, chunk: number, inFlight: number, step: (offset: bigint, bytes: number) => Promise<unknown>): Promise<void> {
  let next = 0n;
  const lane = async () => {
    while (next < length) {
      const offset = next;
      const bytes = Number(length - offset < BigInt(chunk) ? length - offset : BigInt(chunk));
      next += BigInt(bytes);
      await step(offset, bytes);
    }
  };
  const lanes = Array.from({ length: inFlight }, lane);
  const settled = await Promise.allSettled(lanes);
  const failed = settled.find((outcome) => outcome.status === 'rejected');
  if (failed !== undefined) throw (failed as PromiseRejectedResult).reason;
}

/** A host view of the memory's bytes [offset, +bytes): host memory mapped with CPU access has one. */
const hostBytes = (memory: ImportedMemory, offset: bigint, bytes: number) => Buffer.from(memory.buffer, Number(offset), bytes);

/** Copies `from`'s bytes into `host` (same size, with a CPU view): DMA pieces on cuda, one memcpy on the host backend. */
function copyOut(from: ImportedMemory, host: ImportedMemory): Promise<void> {
  return inPieces(from.size, SLEEP_COPY_CHUNK_BYTES, SLEEP_COPIES_IN_FLIGHT, (offset, bytes) => from.readInto(offset, hostBytes(host, offset, bytes)));
}

function copyIn(host: ImportedMemory, to: ImportedMemory): Promise<void> {
  return inPieces(to.size, SLEEP_COPY_CHUNK_BYTES, SLEEP_COPIES_IN_FLIGHT, (offset, bytes) => to.write(offset, hostBytes(host, offset, bytes)));
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
 */
export class TaggedMemory implements Sleeper {
  private readonly members: Member[] = [];
  private state: 'awake' | 'asleep' | 'busy' = 'awake';

  constructor(
    private readonly client: SleepClient,
    readonly tag: string,
  ) {}

  get asleep(): boolean {
    return this.state === 'asleep';
  }

  /** Memory this process mapped from an allocation of its session's (allocate, allocateAll, a pool's lease). */
  add(memory: ImportedMemory): void {
    this.checkAwake('add memory to');
    this.members.push({ memory });
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
    if (this.state !== 'awake') throw new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, `cannot ${what} tag "${this.tag}": it is ${this.state === 'busy' ? 'going to sleep or waking' : 'asleep'}`);
  }

  private async sleepNow(mode: SleepMode, deadlineMs: number): Promise<SleepReport> {
    // A kernel may still use the memory: the device finishes first (as cuMemFree does).
    if (this.client.backend === 'cuda') {
      for (const device of new Set(this.members.map((member) => member.memory.device))) await native.cudaSynchronize(device);
    }
    const copied = mode === 'offload' ? this.members.filter((member) => member.storeId === undefined) : [];
    let offloadedBytes = 0n;
    if (copied.length > 0) {
      const location = await hostMemoryNear(this.client, copied.map((member) => member.memory.device));
      const { memory: hosts } = await this.client.vmm.allocateAll({ sizes: copied.map((member) => member.memory.size), location, deadlineMs }, { hostAccess: true });
      try {
        await Promise.all(copied.map((member, index) => copyOut(member.memory, hosts[index])));
      } catch (error) {
        await discardAll(this.client, hosts);
        throw error;
      }
      copied.forEach((member, index) => (member.offloaded = hosts[index]));
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
      const hosts = this.members.flatMap((member) => (member.offloaded === undefined ? [] : [member.offloaded]));
      for (const member of this.members) member.offloaded = undefined;
      await discardAll(this.client, hosts);
      throw error;
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
        const entries = response.allocations.map((answer, index) => ({ member: members[index], allocationId: BigInt(answer.allocationId), fd: undefined as number | undefined }));
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
      await Promise.all(fresh.filter((member) => member.offloaded !== undefined).map((member) => copyIn(member.offloaded!, member.memory)));
    } catch (error) {
      for (const member of woken) await member.memory.suspend().catch(() => undefined);
      await this.undoWake(made);
      throw error;
    }
    const hosts = fresh.flatMap((member) => (member.offloaded === undefined ? [] : [member.offloaded]));
    const restoredBytes = hosts.reduce((sum, host) => sum + host.size, 0n);
    for (const member of fresh) member.offloaded = undefined;
    await discardAll(this.client, hosts);
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

/**
 * Sleepers by tag, for one client: what `sleep(tag)` and `wake(tag)` act on.
 * Invariant: each tag names the sleepers registered under it, in order.
 */
export class MemoryTags {
  private readonly tags = new Map<string, Sleeper[]>();

  constructor(private readonly client: SleepClient) {}

  /** The tag's group of mappings (made on first use). */
  group(tag: string): TaggedMemory {
    const sleepers = this.tags.get(tag) ?? [];
    let group = sleepers.find((sleeper): sleeper is TaggedMemory => sleeper instanceof TaggedMemory);
    if (group === undefined) {
      group = new TaggedMemory(this.client, tag);
      this.tags.set(tag, [...sleepers, group]);
    }
    return group;
  }

  /** Registers a sleeper (a memory manager's pool) under a tag. */
  register(tag: string, sleeper: Sleeper): void {
    this.tags.set(tag, [...(this.tags.get(tag) ?? []), sleeper]);
  }

  isAsleep(tag: string): boolean {
    const sleepers = this.tags.get(tag) ?? [];
    return sleepers.length > 0 && sleepers.every((sleeper) => sleeper.asleep);
  }

  /**
   * Puts every sleeper of the tag to sleep, in order.
   * @throws VmmdError NOT_FOUND NOT_VMMD_MEMORY (no such tag); a sleeper's refusal (those before it sleep)
   */
  async sleep(tag: string, options: SleepOptions = {}): Promise<SleepReport> {
    const total: SleepReport = { offloadedBytes: 0n, releasedBytes: 0n };
    for (const sleeper of this.sleepers(tag)) {
      if (sleeper.asleep) continue;
      const report = await sleeper.sleep(options);
      total.offloadedBytes += report.offloadedBytes;
      total.releasedBytes += report.releasedBytes;
    }
    return total;
  }

  /**
   * Wakes every sleeper of the tag, in order.
   * @throws VmmdError NOT_FOUND NOT_VMMD_MEMORY (no such tag); a sleeper's refusal (it and those after it stay asleep)
   */
  async wake(tag: string, options: WakeOptions = {}): Promise<WakeReport> {
    const total: WakeReport = { restoredBytes: 0n, waitedMs: 0 };
    for (const sleeper of this.sleepers(tag)) {
      if (!sleeper.asleep) continue;
      const report = await sleeper.wake(options);
      total.restoredBytes += report.restoredBytes;
      total.waitedMs = Math.max(total.waitedMs, report.waitedMs);
    }
    return total;
  }

  private sleepers(tag: string): Sleeper[] {
    const sleepers = this.tags.get(tag);
    if (sleepers === undefined) throw new VmmdError('NOT_VMMD_MEMORY', Status.NOT_FOUND, `no memory is tagged "${tag}" in this client`);
    return sleepers;
  }
}
