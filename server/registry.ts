/**
 * The registry: every reservation, allocation and mapping the daemon holds,
 * who owns it, and the rules of the CUDA VMM API. Each request is validated
 * here before the backend sees it, because the driver's answer to misuse can
 * be undefined behaviour; a refused request throws RpcError and changes
 * nothing.
 */
import { randomBytes, timingSafeEqual } from 'node:crypto';
import {
  Access,
  ACCESS_READ,
  ACCESS_READWRITE,
  AccessGrant,
  Backend,
  BackendHandle,
  DeviceInfo,
  describeLocation,
  HandleKind,
  MemLocation,
} from './backends/backend';
import {
  failedPrecondition,
  invalidArgument,
  notFound,
  outOfRange,
  permissionDenied,
} from './errors';
import { SerialQueue } from './serial-queue';

/** The owner id of objects that belong to the daemon rather than a session. */
export const DAEMON_OWNER = 0n;

/** Largest reservation: 2^46 bytes (64 TiB), well inside a 47-bit user address space. */
export const MAX_RESERVATION_BYTES = 1n << 46n;

/** Largest Read or Write chunk the registry hands the backend at once. */
export const IO_CHUNK_BYTES = 1 << 20;

export interface ReservationRecord {
  readonly id: bigint;
  readonly owner: bigint;
  readonly address: bigint;
  readonly size: bigint;
  readonly alignment: bigint;
  // Invariant: sorted by address; every mapping lies inside the reservation and no two overlap.
  readonly mappings: MappingRecord[];
  readonly queue: SerialQueue;
  freed: boolean;
}

export interface AllocationRecord {
  readonly id: bigint;
  owner: bigint;
  readonly device: number;
  readonly location: MemLocation;
  readonly size: bigint;
  readonly handle: BackendHandle;
  readonly handleTypes: HandleKind[];
  readonly imported: boolean;
  /** Minimum granularity of the allocation's location: its mappings align to it. */
  readonly granularity: bigint;
  // Invariant: handle references by holder (owner id); no entry holds 0.
  readonly references: Map<bigint, number>;
  // Invariant: the backend holds 1 + backendRetains references to `handle` while
  // any registry reference is left; releases drop a retained one first.
  backendRetains: number;
  mappingCount: number;
  // Operations in flight that use the handle (export); freeing waits for them.
  busy: number;
  shareKey?: string;
  /** The read-only store made of it, if any: from then on nothing writes it through the daemon (for good, as the host's seal). */
  readOnlyStore?: bigint;
  freed: boolean;
  /** Gives back the quota this allocation was charged (when freed). */
  refund?: () => void;
}

export interface MappingRecord {
  readonly address: bigint;
  readonly size: bigint;
  readonly allocation: AllocationRecord;
  // Invariant: holds only READ or READWRITE; a location absent has no access.
  readonly access: Map<string, Access>;
  unmapping: boolean;
}

export interface ReserveArgs {
  size: bigint;
  alignment: bigint;
  address: bigint;
}

export interface CreateArgs {
  size: bigint;
  location: MemLocation;
  handleType: HandleKind;
}

export interface MapArgs {
  address: bigint;
  size: bigint;
  offset: bigint;
  allocationId: bigint;
}

export interface ExportArgs {
  allocationId: bigint;
  handleType: HandleKind;
  shareKey: string;
}

export interface ReleaseResult {
  freed: boolean;
  handleReferences: number;
  mappingCount: number;
}

export interface RegistryStats {
  reservations: number;
  allocations: number;
  mappings: number;
  reservedBytes: bigint;
  allocatedBytes: bigint;
  importedBytes: bigint;
  mappedBytes: bigint;
}

/** A plain, comparable picture of the registry, for tests and reports. */
export interface RegistrySnapshot {
  reservations: Array<{
    id: string;
    owner: string;
    address: string;
    size: string;
    mappings: Array<{ address: string; size: string; allocation: string; access: Record<string, number> }>;
  }>;
  allocations: Array<{
    id: string;
    owner: string;
    size: string;
    references: Record<string, number>;
    mappingCount: number;
    imported: boolean;
    shared: boolean;
  }>;
}

const hex = (value: bigint) => `0x${value.toString(16)}`;
const range = (address: bigint, size: bigint) => `[${hex(address)}, ${hex(address + size)})`;
const ownerName = (owner: bigint) => (owner === DAEMON_OWNER ? 'the daemon' : `session ${owner}`);
const isPowerOfTwo = (value: bigint) => value > 0n && (value & (value - 1n)) === 0n;
const locationKey = (location: MemLocation) => describeLocation(location);

/** Binary search in a list sorted by address: the index of the first entry starting after `address`. */
function indexAfter(list: ReadonlyArray<{ address: bigint }>, address: bigint): number {
  let low = 0;
  let high = list.length;
  while (low < high) {
    const middle = (low + high) >>> 1;
    if (list[middle].address <= address) low = middle + 1;
    else high = middle;
  }
  return low;
}

/** Objects a long loop (a session's reclaim) handles before it lets the event loop serve others. */
const YIELD_EVERY = 64;

/** Every YIELD_EVERY-th call waits one turn of the event loop: awaits that resolve at once never yield. */
function breathe(count: number): Promise<void> | undefined {
  return count % YIELD_EVERY === 0 ? new Promise((resolve) => setImmediate(resolve)) : undefined;
}

export class Registry {
  private nextId = 1n;
  private readonly reservations = new Map<bigint, ReservationRecord>();
  // Invariant: the same records as `reservations`, sorted by address, never overlapping.
  private readonly reservationsByAddress: ReservationRecord[] = [];
  private readonly allocations = new Map<bigint, AllocationRecord>();
  private readonly deviceList: DeviceInfo[];
  private readonly reservationGranularity: bigint;

  /**
   * @param charge takes quota for a new allocation (throwing when there is none) and returns its refund
   */
  constructor(
    readonly backend: Backend,
    private readonly charge: (owner: bigint, bytes: bigint) => () => void = () => () => undefined,
  ) {
    this.deviceList = backend.devices();
    // A reservation may hold memory of any device, so it follows the coarsest one.
    this.reservationGranularity = this.deviceList.reduce(
      (coarsest, device) => (device.granularityMinimum > coarsest ? device.granularityMinimum : coarsest),
      1n,
    );
  }

  get devices(): readonly DeviceInfo[] {
    return this.deviceList;
  }

  /**
   * The index of the device with this UUID.
   * @throws OUT_OF_RANGE UNKNOWN_DEVICE
   */
  deviceByUuid(uuid: string, field = 'device_uuid'): number {
    const device = this.deviceList.find((candidate) => candidate.uuid !== '' && candidate.uuid === uuid);
    if (device === undefined) {
      throw outOfRange('UNKNOWN_DEVICE', `${field} ${JSON.stringify(uuid.slice(0, 64))} names no device of this daemon`);
    }
    return device.index;
  }

  /** The granularity of memory at a location. @throws OUT_OF_RANGE UNKNOWN_DEVICE */
  granularity(location: MemLocation): { minimum: bigint; recommended: bigint } {
    this.deviceOf(location);
    return this.backend.granularity(location);
  }

  // ---- reservations -------------------------------------------------------

  /**
   * Reserves address space for the caller.
   * @throws INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED, BAD_ALIGNMENT; OUT_OF_RANGE RESERVATION_TOO_LARGE
   */
  reserve(caller: bigint, args: ReserveArgs): ReservationRecord {
    const granularity = this.reservationGranularity;
    if (args.size === 0n) throw invalidArgument('ZERO_SIZE', 'reservation size must be greater than 0');
    this.checkAligned('reservation size', args.size, granularity);
    if (args.size > MAX_RESERVATION_BYTES) {
      throw outOfRange(
        'RESERVATION_TOO_LARGE',
        `reservation size ${args.size} exceeds the largest reservation, ${MAX_RESERVATION_BYTES} bytes`,
      );
    }
    if (args.alignment !== 0n && !isPowerOfTwo(args.alignment)) {
      throw invalidArgument('BAD_ALIGNMENT', `alignment ${args.alignment} is not a power of two`);
    }
    if (args.alignment > MAX_RESERVATION_BYTES) {
      throw outOfRange('BAD_ALIGNMENT', `alignment ${args.alignment} exceeds ${MAX_RESERVATION_BYTES}`);
    }
    if (args.address !== 0n) this.checkAligned('address hint', args.address, granularity);
    const alignment = args.alignment > granularity ? args.alignment : granularity;
    const address = this.backend.reserve(args.size, alignment, args.address);
    const record: ReservationRecord = {
      id: this.newId(),
      owner: caller,
      address,
      size: args.size,
      alignment,
      mappings: [],
      queue: new SerialQueue(),
      freed: false,
    };
    this.reservations.set(record.id, record);
    this.reservationsByAddress.splice(this.reservationIndexAfter(address), 0, record);
    return record;
  }

  /**
   * Frees a whole reservation without mappings.
   * @throws NOT_FOUND NOT_RESERVED; INVALID_ARGUMENT PARTIAL_FREE; FAILED_PRECONDITION RESERVATION_MAPPED;
   *   PERMISSION_DENIED NOT_OWNER
   */
  async freeAddress(caller: bigint, address: bigint, size: bigint): Promise<void> {
    const reservation = this.reservationAt(address);
    if (reservation === undefined || reservation.address !== address) {
      throw notFound('NOT_RESERVED', `no reservation starts at ${hex(address)}`);
    }
    this.checkCanAct(caller, reservation.owner, `reservation ${reservation.id}`);
    await reservation.queue.run(() => {
      if (reservation.freed) throw notFound('NOT_RESERVED', `no reservation starts at ${hex(address)}`);
      if (size !== reservation.size) {
        throw invalidArgument(
          'PARTIAL_FREE',
          `free address must name the whole reservation ${range(reservation.address, reservation.size)} (size ${reservation.size}), not size ${size}`,
        );
      }
      if (reservation.mappings.length > 0) {
        throw failedPrecondition(
          'RESERVATION_MAPPED',
          `reservation ${reservation.id} still has ${reservation.mappings.length} mapping(s); unmap them first`,
        );
      }
      this.backend.freeAddress(reservation.address, reservation.size);
      this.dropReservation(reservation);
    });
  }

  // ---- allocations --------------------------------------------------------

  /**
   * Creates physical memory owned by the caller, with one handle reference.
   * @throws INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED; OUT_OF_RANGE UNKNOWN_DEVICE;
   *   FAILED_PRECONDITION UNSUPPORTED_HANDLE_TYPE; RESOURCE_EXHAUSTED OUT_OF_MEMORY (from the backend)
   */
  create(caller: bigint, args: CreateArgs): AllocationRecord {
    const device = this.deviceOf(args.location);
    const info = this.deviceList[device];
    if (args.size === 0n) throw invalidArgument('ZERO_SIZE', 'allocation size must be greater than 0');
    if (!info.handleTypes.includes(args.handleType)) {
      throw failedPrecondition(
        'UNSUPPORTED_HANDLE_TYPE',
        `device ${device} cannot export ${args.handleType} handles (supported: ${info.handleTypes.join(', ')})`,
      );
    }
    const granularity = this.backend.granularity(args.location).minimum;
    this.checkAligned('allocation size', args.size, granularity);
    // Descriptors always work; fabric comes on top where asked for.
    const handleTypes: HandleKind[] = args.handleType === 'FABRIC' ? ['POSIX_FD', 'FABRIC'] : ['POSIX_FD'];
    // Charged and checked in one synchronous step with the creation: concurrent requests cannot overshoot.
    const refund = this.charge(caller, args.size);
    let handle: BackendHandle;
    try {
      handle = this.backend.create(device, args.location, args.size, handleTypes);
    } catch (error) {
      refund();
      throw error;
    }
    const record = this.addAllocation(caller, handle, args.size, device, args.location, handleTypes, false, granularity);
    record.refund = refund;
    return record;
  }

  /** Records imported memory; the caller holds its one handle reference. */
  addImported(caller: bigint, handle: BackendHandle, size: bigint, device: number, location: MemLocation): AllocationRecord {
    const granularity = this.backend.granularity(location).minimum;
    return this.addAllocation(caller, handle, size, device, location, ['POSIX_FD'], true, granularity);
  }

  /**
   * Drops one handle reference: the caller's own, else (when the caller may act
   * for the owner) the owner's. Memory is freed once no reference and no mapping is left.
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; FAILED_PRECONDITION ALREADY_RELEASED, NO_REFERENCE;
   *   PERMISSION_DENIED NOT_OWNER
   */
  async release(caller: bigint, allocationId: bigint): Promise<ReleaseResult> {
    const allocation = this.allocation(allocationId);
    const total = this.referenceCount(allocation);
    if (total === 0 && allocation.mappingCount === 0 && allocation.busy === 0) {
      // Every reference was dropped but freeing failed (a driver error): this Release tries again.
      this.checkCanAct(caller, allocation.owner, `allocation ${allocationId}`);
      const freed = await this.freeIfUnused(allocation);
      return { freed, handleReferences: 0, mappingCount: 0 };
    }
    if (total === 0) {
      throw failedPrecondition(
        'ALREADY_RELEASED',
        `allocation ${allocationId} was already released; its memory lives until its ${allocation.mappingCount} mapping(s) are unmapped`,
      );
    }
    let holder: bigint;
    if (allocation.references.has(caller)) {
      holder = caller;
    } else {
      this.checkCanAct(caller, allocation.owner, `allocation ${allocationId}`);
      if (!allocation.references.has(allocation.owner)) {
        throw failedPrecondition(
          'NO_REFERENCE',
          `${ownerName(caller)} holds no handle reference to allocation ${allocationId}`,
        );
      }
      holder = allocation.owner;
    }
    await this.dropReferences(allocation, holder, 1);
    const freed = await this.freeIfUnused(allocation);
    return { freed, handleReferences: this.referenceCount(allocation), mappingCount: allocation.mappingCount };
  }

  /**
   * The allocation with this id, for inspection.
   * @throws NOT_FOUND UNKNOWN_ALLOCATION
   */
  allocation(allocationId: bigint): AllocationRecord {
    const allocation = this.allocations.get(allocationId);
    // (One being freed is already gone for callers.)
    if (allocation === undefined || allocation.freed) {
      throw notFound('UNKNOWN_ALLOCATION', `allocation ${allocationId} does not exist (never created, or freed)`);
    }
    return allocation;
  }

  /**
   * A handle reference held by `holder` (a store) on an allocation the caller may touch.
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; FAILED_PRECONDITION ALREADY_RELEASED; PERMISSION_DENIED NOT_OWNER
   */
  holdAllocation(caller: bigint, allocationId: bigint, holder: bigint): AllocationRecord {
    const allocation = this.liveAllocation(allocationId);
    if (!this.mayAct(caller, allocation.owner) && !allocation.references.has(caller)) {
      throw permissionDenied('NOT_OWNER', `allocation ${allocationId} belongs to ${ownerName(allocation.owner)}`);
    }
    allocation.references.set(holder, (allocation.references.get(holder) ?? 0) + 1);
    return allocation;
  }

  /**
   * Drops every reference `holder` (a store) has on an allocation, and frees it
   * if nobody else references or maps it. Safe to repeat after a failure: a
   * repeat drops what is left and tries the free again.
   */
  async dropHolder(holder: bigint, allocationId: bigint): Promise<void> {
    const allocation = this.allocations.get(allocationId);
    if (allocation === undefined || allocation.freed) return;
    const held = allocation.references.get(holder);
    if (held !== undefined) await this.dropReferences(allocation, holder, held);
    await this.freeIfUnused(allocation);
  }

  /**
   * Makes an allocation read-only for good, for the read-only store `store`:
   * the backend seals it where it can (host memfds), and the registry refuses
   * write access and writes to it from then on, to every caller.
   */
  sealReadOnly(allocation: AllocationRecord, store: bigint): void {
    this.backend.sealReadOnly(allocation.handle);
    allocation.readOnlyStore ??= store;
  }

  referenceCount(allocation: AllocationRecord): number {
    let total = 0;
    for (const count of allocation.references.values()) total += count;
    return total;
  }

  /**
   * A key that lets any session export the allocation (Share).
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; PERMISSION_DENIED NOT_OWNER; FAILED_PRECONDITION ALREADY_RELEASED
   */
  share(caller: bigint, allocationId: bigint): string {
    const allocation = this.liveAllocation(allocationId);
    this.checkCanAct(caller, allocation.owner, `allocation ${allocationId}`);
    allocation.shareKey ??= randomBytes(24).toString('base64url');
    return allocation.shareKey;
  }

  /**
   * Checks that the caller may export the allocation and pins it while the
   * backend makes the descriptor; `done` must be called once exported.
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; FAILED_PRECONDITION ALREADY_RELEASED, UNSUPPORTED_HANDLE_TYPE;
   *   PERMISSION_DENIED NOT_OWNER, BAD_SHARE_KEY
   */
  async exportHandle(
    caller: bigint,
    args: ExportArgs,
  ): Promise<{ allocation: AllocationRecord; fd?: number; fabric?: Buffer }> {
    const allocation = this.liveAllocation(args.allocationId);
    if (!this.mayAct(caller, allocation.owner) && !allocation.references.has(caller)) {
      if (args.shareKey === '') {
        throw permissionDenied(
          'NOT_OWNER',
          `allocation ${allocation.id} belongs to ${ownerName(allocation.owner)}; its owner can Share it and hand you the key`,
        );
      }
      if (!this.shareKeyMatches(allocation, args.shareKey)) {
        throw permissionDenied('BAD_SHARE_KEY', `the share key does not open allocation ${allocation.id}`);
      }
    }
    if (!allocation.handleTypes.includes(args.handleType)) {
      throw failedPrecondition(
        'UNSUPPORTED_HANDLE_TYPE',
        `allocation ${allocation.id} was created for ${allocation.handleTypes.join(', ')} handles, not ${args.handleType}`,
      );
    }
    allocation.busy++;
    try {
      if (args.handleType === 'FABRIC') return { allocation, fabric: await this.backend.exportFabric(allocation.handle) };
      return { allocation, fd: await this.backend.exportHandle(allocation.handle) };
    } finally {
      allocation.busy--;
      await this.freeIfUnused(allocation);
    }
  }

  // ---- mappings -----------------------------------------------------------

  /**
   * Maps an allocation into an unmapped part of a reservation, with no access yet.
   * @throws NOT_FOUND NOT_RESERVED, UNKNOWN_ALLOCATION; INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED, NONZERO_OFFSET;
   *   OUT_OF_RANGE BEYOND_ALLOCATION, BEYOND_RESERVATION; FAILED_PRECONDITION ALREADY_MAPPED, ALREADY_RELEASED;
   *   PERMISSION_DENIED NOT_OWNER
   */
  async map(caller: bigint, args: MapArgs): Promise<MappingRecord> {
    if (args.size === 0n) throw invalidArgument('ZERO_SIZE', 'mapping size must be greater than 0');
    if (args.offset !== 0n) {
      throw invalidArgument('NONZERO_OFFSET', `offset ${args.offset} must be 0: the driver maps allocations from their start`);
    }
    const reservation = this.reservationContaining(caller, args.address);
    return reservation.queue.run(() => {
      this.checkLive(reservation, args.address);
      const allocation = this.liveAllocation(args.allocationId);
      if (!this.mayAct(caller, allocation.owner) && !allocation.references.has(caller)) {
        throw permissionDenied('NOT_OWNER', `allocation ${allocation.id} belongs to ${ownerName(allocation.owner)}`);
      }
      this.checkAligned('mapping address', args.address, allocation.granularity);
      this.checkAligned('mapping size', args.size, allocation.granularity);
      if (args.offset + args.size > allocation.size) {
        throw outOfRange(
          'BEYOND_ALLOCATION',
          `offset ${args.offset} + size ${args.size} exceeds allocation ${allocation.id} of ${allocation.size} bytes`,
        );
      }
      if (args.address + args.size > reservation.address + reservation.size) {
        throw outOfRange(
          'BEYOND_RESERVATION',
          `${range(args.address, args.size)} runs past the end of reservation ${reservation.id} ${range(reservation.address, reservation.size)}`,
        );
      }
      const index = this.mappingIndexAfter(reservation, args.address);
      const before = reservation.mappings[index - 1];
      const after = reservation.mappings[index];
      const overlap =
        before !== undefined && before.address + before.size > args.address
          ? before
          : after !== undefined && after.address < args.address + args.size
            ? after
            : undefined;
      if (overlap !== undefined) {
        throw failedPrecondition(
          'ALREADY_MAPPED',
          `${range(args.address, args.size)} overlaps the mapping ${range(overlap.address, overlap.size)}; map only into unmapped parts of a reservation`,
        );
      }
      this.backend.map(args.address, args.size, allocation.handle, args.offset);
      const mapping: MappingRecord = {
        address: args.address,
        size: args.size,
        allocation,
        access: new Map(),
        unmapping: false,
      };
      reservation.mappings.splice(index, 0, mapping);
      allocation.mappingCount++;
      return mapping;
    });
  }

  /**
   * Unmaps exactly one whole mapping; frees its allocation if it was released and this was its last mapping.
   * @throws NOT_FOUND NOT_MAPPED; INVALID_ARGUMENT PARTIAL_UNMAP; PERMISSION_DENIED NOT_OWNER
   */
  async unmap(caller: bigint, address: bigint, size: bigint): Promise<{ freed: boolean }> {
    const reservation = this.reservationContaining(caller, address, 'NOT_MAPPED');
    return reservation.queue.run(async () => {
      this.checkLive(reservation, address, 'NOT_MAPPED');
      const mapping = this.mappingContaining(reservation, address);
      if (mapping.address !== address || mapping.size !== size) {
        throw invalidArgument(
          'PARTIAL_UNMAP',
          `unmap must name exactly one whole mapping: ${range(address, size)} is not the mapping ${range(mapping.address, mapping.size)}`,
        );
      }
      return { freed: await this.unmapInQueue(reservation, mapping) };
    });
  }

  /**
   * Sets access of locations to whole mappings covering [address, address + size) with no gap.
   * @throws INVALID_ARGUMENT NO_DESCRIPTORS, DUPLICATE_LOCATION, ZERO_SIZE, NOT_ALIGNED, PARTIAL_MAPPING;
   *   OUT_OF_RANGE UNKNOWN_DEVICE; NOT_FOUND NOT_MAPPED; FAILED_PRECONDITION NOT_FULLY_MAPPED; PERMISSION_DENIED NOT_OWNER
   */
  async setAccess(caller: bigint, address: bigint, size: bigint, grants: AccessGrant[]): Promise<void> {
    if (grants.length === 0) throw invalidArgument('NO_DESCRIPTORS', 'set access needs at least one access descriptor');
    const seen = new Set<string>();
    for (const grant of grants) {
      this.deviceOf(grant.location);
      const key = locationKey(grant.location);
      if (seen.has(key)) throw invalidArgument('DUPLICATE_LOCATION', `location ${key} appears twice in the descriptors`);
      seen.add(key);
    }
    if (size === 0n) throw invalidArgument('ZERO_SIZE', 'access range size must be greater than 0');
    this.checkAligned('access address', address, this.reservationGranularity);
    this.checkAligned('access size', size, this.reservationGranularity);
    const reservation = this.reservationContaining(caller, address, 'NOT_MAPPED');
    await reservation.queue.run(() => {
      this.checkLive(reservation, address, 'NOT_MAPPED');
      const mappings = this.wholeMappingsCovering(reservation, address, size);
      for (const mapping of mappings) {
        if (mapping.allocation.readOnlyStore !== undefined && grants.some((grant) => grant.access === ACCESS_READWRITE)) {
          throw readOnlyMemory(mapping.allocation, `grant READWRITE access to ${range(mapping.address, mapping.size)}`);
        }
        for (const grant of grants) {
          if (grant.location.type !== 'DEVICE' || grant.access === 0) continue;
          if (!this.backend.canAccessPeer(grant.location.id, mapping.allocation.device)) {
            throw failedPrecondition(
              'PEER_ACCESS_UNSUPPORTED',
              `device ${grant.location.id} cannot access memory of device ${mapping.allocation.device} (no peer access between them)`,
            );
          }
        }
      }
      this.backend.setAccess(address, size, grants);
      for (const mapping of mappings) {
        for (const grant of grants) {
          if (grant.access === 0) mapping.access.delete(locationKey(grant.location));
          else mapping.access.set(locationKey(grant.location), grant.access);
        }
      }
    });
  }

  /**
   * The access a location has to the mapping at an address.
   * @throws NOT_FOUND NOT_MAPPED; OUT_OF_RANGE UNKNOWN_DEVICE
   */
  getAccess(address: bigint, location: MemLocation): Access {
    this.deviceOf(location);
    const reservation = this.reservationAt(address);
    if (reservation === undefined) throw notFound('NOT_MAPPED', `nothing is mapped at ${hex(address)}`);
    const mapping = this.mappingContaining(reservation, address);
    return mapping.access.get(locationKey(location)) ?? 0;
  }

  /**
   * A new handle reference, held by the caller, to the allocation mapped at an address.
   * @throws NOT_FOUND NOT_MAPPED; PERMISSION_DENIED NOT_OWNER
   */
  retainHandle(caller: bigint, address: bigint): AllocationRecord {
    const reservation = this.reservationContaining(caller, address, 'NOT_MAPPED');
    const mapping = this.mappingContaining(reservation, address);
    const allocation = mapping.allocation;
    const handle = this.backend.retainHandle(address, allocation.handle);
    if (handle !== allocation.handle) {
      // The driver and the registry disagree about what is mapped here: refuse rather than guess.
      void this.backend.releaseReference(handle);
      throw new Error(`the backend maps handle ${handle} at ${hex(address)}, the registry ${allocation.handle}`);
    }
    allocation.backendRetains++;
    allocation.references.set(caller, (allocation.references.get(caller) ?? 0) + 1);
    return allocation;
  }

  // ---- data ---------------------------------------------------------------

  /**
   * Checks that the daemon may read (or write) all of [address, address + length)
   * through mappings with access for their own device.
   * @throws INVALID_ARGUMENT ZERO_SIZE; NOT_FOUND NOT_MAPPED; OUT_OF_RANGE BEYOND_RESERVATION;
   *   FAILED_PRECONDITION NOT_FULLY_MAPPED, NO_ACCESS; PERMISSION_DENIED NOT_OWNER
   */
  checkIo(caller: bigint, address: bigint, length: bigint, write: boolean): ReservationRecord {
    if (length === 0n) throw invalidArgument('ZERO_SIZE', `${write ? 'write' : 'read'} length must be greater than 0`);
    const reservation = this.reservationContaining(caller, address, 'NOT_MAPPED');
    this.checkIoInQueue(reservation, address, length, write);
    return reservation;
  }

  /** Reads a range checked with checkIo, a chunk at a time, each in the reservation's queue. */
  async *read(caller: bigint, address: bigint, length: bigint): AsyncGenerator<{ offset: bigint; data: Buffer }> {
    const reservation = this.checkIo(caller, address, length, false);
    for (let offset = 0n; offset < length; offset += BigInt(IO_CHUNK_BYTES)) {
      const chunk = length - offset < BigInt(IO_CHUNK_BYTES) ? length - offset : BigInt(IO_CHUNK_BYTES);
      const data = Buffer.allocUnsafe(Number(chunk));
      await this.copySegments(reservation, address + offset, data, false);
      yield { offset, data };
    }
  }

  /**
   * Reads a range the daemon may read straight into `into` (a staging buffer's
   * bytes), in the reservation's queue: the bulk path, with no Buffer in between.
   */
  async readInto(caller: bigint, address: bigint, into: Buffer): Promise<void> {
    await this.copySegments(this.checkIo(caller, address, BigInt(into.length), false), address, into, false);
  }

  /** Writes bytes to a range the daemon may write, in the reservation's queue. */
  async write(caller: bigint, address: bigint, data: Buffer): Promise<void> {
    await this.copySegments(this.checkIo(caller, address, BigInt(data.length), true), address, data, true);
  }

  /**
   * In the reservation's queue: checks [address, +bytes) again, then copies
   * each device's segment of it between the mapped memory and `bytes`
   * (out of the memory, or into it with `write`), through that device.
   */
  private copySegments(reservation: ReservationRecord, address: bigint, bytes: Buffer, write: boolean): Promise<void> {
    return reservation.queue.run(async () => {
      const segments = this.checkIoInQueue(reservation, address, BigInt(bytes.length), write);
      await Promise.all(
        segments.map((segment) => {
          const start = Number(segment.address - address);
          const part = bytes.subarray(start, start + Number(segment.length));
          return write
            ? this.backend.writeBytes(segment.address, part, segment.device)
            : this.backend.readBytes(segment.address, part.length, segment.device, part);
        }),
      );
    });
  }

  // ---- sessions -----------------------------------------------------------

  /**
   * Reclaims everything an owner holds: its mappings and reservations, its
   * handle references. Its allocations still mapped elsewhere or referenced by
   * others pass to the daemon.
   */
  async reclaim(owner: bigint): Promise<void> {
    // Every object is tried: one that fails (ENOMEM from munmap at vm.max_map_count, a driver error)
    // must not leave the others behind. The failures are reported together at the end.
    const failures: unknown[] = [];
    const attempt = async (body: () => Promise<void>) => {
      try {
        await body();
      } catch (error) {
        failures.push(error);
      }
    };
    const reservations = this.reservationsByAddress.filter((reservation) => reservation.owner === owner);
    let done = 0;
    for (const reservation of reservations) {
      await breathe(++done);
      await attempt(() =>
        reservation.queue.run(async () => {
          if (reservation.freed) return;
          while (reservation.mappings.length > 0) {
            await this.unmapInQueue(reservation, reservation.mappings[reservation.mappings.length - 1]);
          }
          this.backend.freeAddress(reservation.address, reservation.size);
          this.dropReservation(reservation);
        }),
      );
    }
    for (const allocation of [...this.allocations.values()]) {
      await breathe(++done);
      await attempt(async () => {
        const held = allocation.references.get(owner);
        if (held !== undefined) await this.dropReferences(allocation, owner, held);
        if (allocation.owner === owner) allocation.owner = DAEMON_OWNER;
        await this.freeIfUnused(allocation);
      });
    }
    if (failures.length > 0) {
      throw new AggregateError(failures, `reclaiming owner ${owner}: ${failures.length} object(s) could not be freed (first: ${(failures[0] as Error)?.message})`);
    }
  }

  // ---- inspection ---------------------------------------------------------

  stats(): RegistryStats {
    const stats: RegistryStats = {
      reservations: this.reservations.size,
      allocations: this.allocations.size,
      mappings: 0,
      reservedBytes: 0n,
      allocatedBytes: 0n,
      importedBytes: 0n,
      mappedBytes: 0n,
    };
    for (const reservation of this.reservations.values()) {
      stats.reservedBytes += reservation.size;
      stats.mappings += reservation.mappings.length;
      for (const mapping of reservation.mappings) stats.mappedBytes += mapping.size;
    }
    for (const allocation of this.allocations.values()) {
      if (allocation.imported) stats.importedBytes += allocation.size;
      else stats.allocatedBytes += allocation.size;
    }
    return stats;
  }

  /** Bytes of live allocations the daemon created on a device. */
  allocatedBytes(device: number): bigint {
    let total = 0n;
    for (const allocation of this.allocations.values()) {
      if (!allocation.imported && allocation.device === device) total += allocation.size;
    }
    return total;
  }

  snapshot(): RegistrySnapshot {
    return {
      reservations: [...this.reservations.values()].map((reservation) => ({
        id: String(reservation.id),
        owner: String(reservation.owner),
        address: hex(reservation.address),
        size: String(reservation.size),
        mappings: reservation.mappings.map((mapping) => ({
          address: hex(mapping.address),
          size: String(mapping.size),
          allocation: String(mapping.allocation.id),
          access: Object.fromEntries(mapping.access),
        })),
      })),
      allocations: [...this.allocations.values()].map((allocation) => ({
        id: String(allocation.id),
        owner: String(allocation.owner),
        size: String(allocation.size),
        references: Object.fromEntries([...allocation.references].map(([holder, count]) => [String(holder), count])),
        mappingCount: allocation.mappingCount,
        imported: allocation.imported,
        shared: allocation.shareKey !== undefined,
      })),
    };
  }

  // ---- helpers ------------------------------------------------------------

  private newId(): bigint {
    return this.nextId++;
  }

  private addAllocation(
    owner: bigint,
    handle: BackendHandle,
    size: bigint,
    device: number,
    location: MemLocation,
    handleTypes: HandleKind[],
    imported: boolean,
    granularity: bigint,
  ): AllocationRecord {
    const record: AllocationRecord = {
      id: this.newId(),
      owner,
      device,
      location,
      size,
      handle,
      handleTypes,
      imported,
      granularity,
      references: new Map([[owner, 1]]),
      backendRetains: 0,
      mappingCount: 0,
      busy: 0,
      freed: false,
    };
    this.allocations.set(record.id, record);
    return record;
  }

  private liveAllocation(allocationId: bigint): AllocationRecord {
    const allocation = this.allocation(allocationId);
    if (this.referenceCount(allocation) === 0) {
      throw failedPrecondition(
        'ALREADY_RELEASED',
        `allocation ${allocationId} was released; it can no longer be mapped or exported`,
      );
    }
    return allocation;
  }

  /** Drops `count` of the holder's references, and as many retained backend references as there are. */
  /**
   * Drops a holder's references. The driver's references go first: when one
   * fails, the holder keeps its references and a retry drops the rest (the
   * driver references already dropped are not dropped twice).
   */
  private async dropReferences(allocation: AllocationRecord, holder: bigint, count: number): Promise<void> {
    const retained = Math.min(count, allocation.backendRetains);
    for (let i = 0; i < retained; i++) {
      await this.backend.releaseReference(allocation.handle);
      allocation.backendRetains--;
    }
    const left = (allocation.references.get(holder) ?? 0) - count;
    if (left <= 0) allocation.references.delete(holder);
    else allocation.references.set(holder, left);
  }

  /**
   * Frees an allocation nobody references or maps. Recorded as freed only once
   * the backend has freed it: when that fails the allocation stays, accounted
   * and charged, and the next Release or reclaim tries again.
   */
  private async freeIfUnused(allocation: AllocationRecord): Promise<boolean> {
    if (allocation.freed || allocation.busy > 0 || allocation.mappingCount > 0) return false;
    if (this.referenceCount(allocation) > 0) return false;
    allocation.freed = true;
    try {
      await this.backend.release(allocation.handle, allocation.size, allocation.imported);
    } catch (error) {
      allocation.freed = false;
      throw error;
    }
    this.allocations.delete(allocation.id);
    allocation.refund?.();
    return true;
  }

  private async unmapInQueue(reservation: ReservationRecord, mapping: MappingRecord): Promise<boolean> {
    mapping.unmapping = true;
    try {
      await this.backend.unmap(mapping.address, mapping.size);
    } catch (error) {
      mapping.unmapping = false;
      throw error;
    }
    reservation.mappings.splice(reservation.mappings.indexOf(mapping), 1);
    mapping.allocation.mappingCount--;
    return this.freeIfUnused(mapping.allocation);
  }

  private dropReservation(reservation: ReservationRecord): void {
    reservation.freed = true;
    this.reservations.delete(reservation.id);
    const index = this.reservationIndexAfter(reservation.address) - 1;
    if (this.reservationsByAddress[index] !== reservation) throw new Error(`registry: reservation ${reservation.id} is not in the address index`);
    this.reservationsByAddress.splice(index, 1);
  }

  private mayAct(caller: bigint, owner: bigint): boolean {
    return owner === caller || owner === DAEMON_OWNER;
  }

  private checkCanAct(caller: bigint, owner: bigint, what: string): void {
    if (!this.mayAct(caller, owner)) {
      throw permissionDenied(
        'NOT_OWNER',
        `${what} belongs to ${ownerName(owner)}; ${ownerName(caller)} may touch only its own and daemon-owned objects`,
      );
    }
  }

  private shareKeyMatches(allocation: AllocationRecord, key: string): boolean {
    if (allocation.shareKey === undefined) return false;
    const expected = Buffer.from(allocation.shareKey);
    const given = Buffer.from(key);
    return expected.length === given.length && timingSafeEqual(expected, given);
  }

  private checkAligned(what: string, value: bigint, granularity: bigint): void {
    if (value % granularity !== 0n) {
      throw invalidArgument(
        'NOT_ALIGNED',
        `${what} ${value >= 1n << 20n ? hex(value) : value} is not a multiple of the granularity ${granularity}`,
      );
    }
  }

  private deviceOf(location: MemLocation): number {
    if (location.type === 'DEVICE') {
      if (!Number.isInteger(location.id) || location.id < 0 || location.id >= this.deviceList.length) {
        throw outOfRange(
          'UNKNOWN_DEVICE',
          `device ${location.id} does not exist (the daemon has ${this.deviceList.length} device(s))`,
        );
      }
      return location.id;
    }
    // Host memory (HOST, HOST_NUMA) is carved with device 0's rules.
    if (location.id !== 0 && this.backend.name === 'host') {
      throw outOfRange('UNKNOWN_DEVICE', `${describeLocation(location)} does not exist on the host backend (only id 0)`);
    }
    return 0;
  }

  /** Index of the first reservation starting after `address`. */
  private reservationIndexAfter(address: bigint): number {
    return indexAfter(this.reservationsByAddress, address);
  }

  private reservationAt(address: bigint): ReservationRecord | undefined {
    const candidate = this.reservationsByAddress[this.reservationIndexAfter(address) - 1];
    if (candidate === undefined || address >= candidate.address + candidate.size) return undefined;
    return candidate;
  }

  private reservationContaining(caller: bigint, address: bigint, code = 'NOT_RESERVED'): ReservationRecord {
    const reservation = this.reservationAt(address);
    if (reservation === undefined) {
      throw notFound(code, `${hex(address)} is not inside any reservation`);
    }
    this.checkCanAct(caller, reservation.owner, `reservation ${reservation.id}`);
    return reservation;
  }

  private checkLive(reservation: ReservationRecord, address: bigint, code = 'NOT_RESERVED'): void {
    if (reservation.freed) throw notFound(code, `${hex(address)} is not inside any reservation`);
  }

  /** Index of the first mapping of the reservation starting after `address`. */
  private mappingIndexAfter(reservation: ReservationRecord, address: bigint): number {
    return indexAfter(reservation.mappings, address);
  }

  private mappingContaining(reservation: ReservationRecord, address: bigint): MappingRecord {
    const mapping = reservation.mappings[this.mappingIndexAfter(reservation, address) - 1];
    if (mapping === undefined || address >= mapping.address + mapping.size || mapping.unmapping) {
      throw notFound('NOT_MAPPED', `nothing is mapped at ${hex(address)}`);
    }
    return mapping;
  }

  /**
   * The mappings that cover [address, address + size) with no gap, in order;
   * the first and last may stick out of the range.
   */
  private mappingsCovering(reservation: ReservationRecord, address: bigint, size: bigint): MappingRecord[] {
    const end = address + size;
    if (end > reservation.address + reservation.size) {
      throw outOfRange('BEYOND_RESERVATION', `${range(address, size)} runs past the end of reservation ${reservation.id}`);
    }
    const mappings = reservation.mappings;
    // Start at the last mapping that begins at or before `address`, if it reaches it.
    let index = Math.max(0, this.mappingIndexAfter(reservation, address) - 1);
    if (mappings[index] !== undefined && mappings[index].address + mappings[index].size <= address) index++;
    const result: MappingRecord[] = [];
    for (let cursor = address; cursor < end; index++) {
      const mapping = mappings[index];
      if (mapping === undefined || mapping.address > cursor || mapping.unmapping) {
        throw failedPrecondition('NOT_FULLY_MAPPED', `${range(address, size)} is not fully mapped: nothing is mapped at ${hex(cursor)}`);
      }
      result.push(mapping);
      cursor = mapping.address + mapping.size;
    }
    return result;
  }

  /** The mappings that tile [address, address + size) exactly. */
  private wholeMappingsCovering(reservation: ReservationRecord, address: bigint, size: bigint): MappingRecord[] {
    const mappings = this.mappingsCovering(reservation, address, size);
    for (const mapping of [mappings[0], mappings[mappings.length - 1]]) {
      if (mapping.address < address || mapping.address + mapping.size > address + size) {
        throw invalidArgument(
          'PARTIAL_MAPPING',
          `${range(address, size)} cuts the mapping ${range(mapping.address, mapping.size)}; access is set on whole mappings`,
        );
      }
    }
    return mappings;
  }

  /**
   * Checks access to [address, address + length) and splits it into runs of
   * one device each: a copy goes through the device that owns the memory.
   */
  private checkIoInQueue(
    reservation: ReservationRecord,
    address: bigint,
    length: bigint,
    write: boolean,
  ): Array<{ address: bigint; length: bigint; device: number }> {
    this.checkLive(reservation, address, 'NOT_MAPPED');
    const needed: Access = write ? ACCESS_READWRITE : ACCESS_READ;
    const end = address + length;
    const segments: Array<{ address: bigint; length: bigint; device: number }> = [];
    for (const mapping of this.mappingsCovering(reservation, address, length)) {
      if (write && mapping.allocation.readOnlyStore !== undefined) throw readOnlyMemory(mapping.allocation, `write ${range(mapping.address, mapping.size)}`);
      const key = locationKey({ type: 'DEVICE', id: mapping.allocation.device });
      const access = mapping.access.get(key) ?? 0;
      if ((access & needed) !== needed) {
        throw failedPrecondition(
          'NO_ACCESS',
          `the daemon may not ${write ? 'write' : 'read'} the mapping ${range(mapping.address, mapping.size)}: set ${write ? 'READWRITE' : 'READ'} access for ${key} first`,
        );
      }
      const start = mapping.address > address ? mapping.address : address;
      const stop = mapping.address + mapping.size < end ? mapping.address + mapping.size : end;
      const last = segments[segments.length - 1];
      if (last !== undefined && last.device === mapping.allocation.device) last.length += stop - start;
      else segments.push({ address: start, length: stop - start, device: mapping.allocation.device });
    }
    return segments;
  }
}

const readOnlyMemory = (allocation: AllocationRecord, what: string) =>
  failedPrecondition(
    'READ_ONLY_MEMORY',
    `cannot ${what}: allocation ${allocation.id} backs read-only store ${allocation.readOnlyStore}, and nothing writes it through the daemon`,
  );
