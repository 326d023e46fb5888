/**
 * The registry: every reservation, allocation and mapping the daemon holds,
 * who owns it, and the rules of the CUDA VMM API, composed of parts with one
 * job each (allocations, address space, I/O, reclaim and inspection) over an
 * allocation source with its adaptors. Each request is validated before the
 * backend sees it, because the driver's answer to misuse can be undefined
 * behaviour; a refused request throws RpcError and changes nothing. The
 * allocation source comes composed (server/app/daemon.ts): the registry
 * draws from it and reads its statistics, and builds no policy of its own.
 */
import type { AccessGrant, Backend, DeviceInfo, ImportSource, MemLocation } from '../backends/backend';
import { AllocationStatistics } from './statistics';
import { AddressSpace } from './address-space';
import { Allocations } from './allocations';
import { DeviceTable } from './devices';
import { ByteIo } from './io';
import { Inspection, RegistrySnapshot, RegistryStats } from './reclaim';
import { AllocationRecord, CreateArgs, Exported, ExportArgs, IdSequence, MapArgs, Ownership, ReserveArgs } from './records';
import { AllocationSource, BackendSource, HeldMemfd, RestoredMemory } from './source';
import { AllocationBudget } from './allocation-budget';
import type { UidBudgets } from './uid-budgets';
import { AllocateAllArgs, FreedSignal, Referee } from './referee';

export { DAEMON_OWNER, IO_CHUNK_BYTES, MAX_RESERVATION_BYTES } from './records';
export type { AllocationRecord, CreateArgs, Exported, MapArgs, MappingRecord, ReleaseResult, ReservationRecord, ReserveArgs } from './records';
export type { RegistrySnapshot, RegistryStats } from './reclaim';
export type { AllocateAllArgs, AllocatedAll, RefereeStats } from './referee';
export type { AllocationSource, HeldMemfd, RestoredMemory } from './source';
export type { AllocationObserver } from './records';

/** An allocation parked by an earlier daemon process, as the registry takes it back. */
export interface RestoredAllocation {
  id: bigint;
  owner: bigint;
  location: MemLocation;
  /** Handle references by holder (sessions); stores' holders come back with their stores. */
  references: Map<bigint, number>;
  shareKey?: string;
  /** The session request that made it. */
  request?: string;
  memory: RestoredMemory;
}

/** The allocation source the registry draws from, composed by the daemon, and the statistics adaptor in it that inspection reads. */
export interface ComposedSource {
  readonly source: AllocationSource;
  readonly statistics: AllocationStatistics;
}

/**
 * The chain the daemon composes, for a registry made in one step (tests,
 * tools): statistics over the backend, `adapt`'s adaptors (quotas) above
 * them, and the per-uid allocation count on top when `budgets` are given.
 */
export function composeSource(
  backend: Backend,
  adapt: (upstream: AllocationSource) => AllocationSource = (upstream) => upstream,
  budgets?: UidBudgets,
): ComposedSource {
  const statistics = new AllocationStatistics(new BackendSource(backend));
  const adapted = adapt(statistics);
  return { source: budgets === undefined ? adapted : new AllocationBudget(budgets, adapted), statistics };
}

export class Registry {
  readonly deviceTable: DeviceTable;
  readonly allocations: Allocations;
  readonly space: AddressSpace;
  readonly io: ByteIo;
  readonly inspection: Inspection;
  readonly statistics: AllocationStatistics;
  /** Serves AllocateAll: all-or-none requests, one at a time per device, waiting for memory to be freed. */
  readonly referee: Referee;
  /** Ids of reservations, allocations and stores' holders. */
  readonly ids = new IdSequence();
  private readonly source: FreedSignal;

  /**
   * @param source the allocation source, composed (the daemon's); or the adaptors to compose over the
   *   backend's statistics (composeSource: quotas; the allocation count per uid on top where `budgets` are given)
   * @param actsForDaemon which callers besides the daemon may act on daemon-owned objects (default: every one)
   * @param budgets count reservations and mappings per uid; none: not counted
   */
  constructor(
    readonly backend: Backend,
    source: ComposedSource | ((upstream: AllocationSource) => AllocationSource) = (upstream) => upstream,
    actsForDaemon?: (caller: bigint) => boolean,
    readonly budgets?: UidBudgets,
  ) {
    const ids = this.ids;
    const ownership = new Ownership(actsForDaemon);
    const composed = typeof source === 'function' ? composeSource(backend, source, budgets) : source;
    this.deviceTable = new DeviceTable(backend);
    this.statistics = composed.statistics;
    this.source = new FreedSignal(composed.source);
    this.allocations = new Allocations(backend, this.source, this.deviceTable, ids, ownership);
    this.referee = new Referee(backend, this.allocations, this.deviceTable, this.source, budgets);
    this.space = new AddressSpace(backend, this.allocations, this.deviceTable, ids, ownership, budgets);
    this.io = new ByteIo(backend, this.space);
    this.inspection = new Inspection(this.space, this.allocations, this.statistics);
  }

  /**
   * Takes back an allocation an earlier daemon process parked: its memory
   * through the source's adaptors (counted and charged as before), under its
   * own id, owner, references and share key. Ids given out before are never
   * given again (advance `ids` past them).
   * @throws the backend's BAD_DESCRIPTOR (nothing is recorded)
   */
  async restoreAllocation(parked: RestoredAllocation): Promise<AllocationRecord> {
    const restored = await this.source.restore(parked.memory);
    const record: AllocationRecord = {
      id: parked.id,
      owner: parked.owner,
      device: restored.device,
      location: parked.location,
      size: restored.size,
      handle: restored.handle,
      handleTypes: ['POSIX_FD'],
      imported: parked.memory.imported,
      granularity: this.backend.granularity(parked.location).minimum,
      references: parked.references,
      backendRetains: 0,
      mappingCount: 0,
      busy: 0,
      shareKey: parked.shareKey,
      ...(parked.request === undefined ? {} : { request: parked.request }),
      freed: false,
    };
    this.allocations.insert(record);
    return record;
  }

  get devices(): readonly DeviceInfo[] {
    return this.deviceTable.list;
  }

  /** @throws OUT_OF_RANGE UNKNOWN_DEVICE */
  deviceByUuid(uuid: string, field = 'device_uuid'): number {
    return this.deviceTable.byUuid(uuid, field);
  }

  /** The granularity of memory at a location. @throws OUT_OF_RANGE UNKNOWN_DEVICE */
  granularity(location: MemLocation): { minimum: bigint; recommended: bigint } {
    this.deviceTable.deviceOf(location);
    return this.backend.granularity(location);
  }

  // The operations, by the part that owns them (their rules and @throws are there).
  reserve = (caller: bigint, args: ReserveArgs) => this.space.reserve(caller, args);
  freeAddress = (caller: bigint, address: bigint, size: bigint) => this.space.freeAddress(caller, address, size);
  map = (caller: bigint, args: MapArgs) => this.space.map(caller, args);
  unmap = (caller: bigint, address: bigint, size: bigint) => this.space.unmap(caller, address, size);
  setAccess = (caller: bigint, address: bigint, size: bigint, grants: AccessGrant[]) => this.space.setAccess(caller, address, size, grants);
  getAccess = (caller: bigint, address: bigint, location: MemLocation) => this.space.getAccess(caller, address, location);
  retainHandle = (caller: bigint, address: bigint) => this.space.retainHandle(caller, address);

  create = (caller: bigint, args: CreateArgs) => this.allocations.create(caller, args);
  importHandle = (caller: bigint, source: ImportSource, size: bigint) => this.allocations.importHandle(caller, source, size);
  /**
   * A client's memfd (admitted by the caller) the daemon maps for the caller's SYSMEM store, held through the
   * allocation source like an import (the backend's capacity, the caller's quotas) until the hold is released.
   * @throws RESOURCE_EXHAUSTED OUT_OF_MEMORY, QUOTA_EXCEEDED
   */
  holdClientMemfd = (caller: bigint, fd: number, size: bigint): Promise<HeldMemfd> => this.source.holdClientMemfd(caller, fd, size);
  release = (caller: bigint, allocationId: bigint) => this.allocations.release(caller, allocationId);
  releaseAnswering = (caller: bigint, allocationId: bigint) => this.allocations.releaseAnswering(caller, allocationId);
  retryFree = (allocationId: bigint) => this.allocations.retryFree(allocationId);
  /** Resolves once every free in flight has settled (the daemon's shutdown waits for them before closing the backend). */
  settleFrees = () => this.allocations.settleFrees();
  allocation = (allocationId: bigint) => this.allocations.get(allocationId);
  inspectAllocation = (caller: bigint, allocationId: bigint) => this.allocations.inspect(caller, allocationId);
  createExported = (caller: bigint, args: CreateArgs, onRollbackFailure: (error: unknown) => void) =>
    this.allocations.createExported(caller, args, onRollbackFailure);
  allocateAll = (caller: bigint, args: AllocateAllArgs) => this.referee.allocateAll(caller, args);
  /** Gives back what an AllocateAll answered when the answer cannot be delivered: descriptors closed, memory released. */
  undoAllocateAll = (caller: bigint, made: Exported[]) => this.referee.undo(caller, made);
  holdAllocation = (caller: bigint, allocationId: bigint, holder: bigint, forDaemon = false) => this.allocations.hold(caller, allocationId, holder, forDaemon);
  dropHolder = (holder: bigint, allocationId: bigint) => this.allocations.dropHolder(holder, allocationId);
  referenceCount = (allocation: Parameters<Allocations['referenceCount']>[0]) => this.allocations.referenceCount(allocation);
  sealReadOnly = (allocation: Parameters<Allocations['sealReadOnly']>[0], store: bigint) => this.allocations.sealReadOnly(allocation, store);
  share = (caller: bigint, allocationId: bigint) => this.allocations.share(caller, allocationId);
  exportHandle = (caller: bigint, args: ExportArgs) => this.allocations.exportHandle(caller, args);

  checkIo = (caller: bigint, address: bigint, length: bigint, write: boolean) => this.io.check(caller, address, length, write);
  read = (caller: bigint, address: bigint, length: bigint) => this.io.read(caller, address, length);
  readInto = (caller: bigint, address: bigint, into: Buffer) => this.io.readInto(caller, address, into);
  write = (caller: bigint, address: bigint, data: Buffer) => this.io.write(caller, address, data);

  reclaim = (owner: bigint) => this.inspection.reclaim(owner);
  stats = (): RegistryStats => this.inspection.stats();
  snapshot = (): RegistrySnapshot => this.inspection.snapshot();
  /** Bytes of live allocations the daemon created on a device. */
  allocatedBytes = (device: number) => this.statistics.createdBytes(device);
}
