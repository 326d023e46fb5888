/**
 * The address space: reservations, the mappings inside them and their
 * access. Every change of a reservation runs in its serial queue, so the
 * checks and the backend call that follows them see the same state.
 */
import { Access, ACCESS_READWRITE, AccessGrant, Backend, describeLocation, MemLocation } from '../backends/backend';
import { type CodeWithStatus, failedPrecondition, invalidArgument, notFound, outOfRange } from '../errors';
import { SerialQueue } from '../serial-queue';
import type { Allocations } from './allocations';
import type { DeviceTable } from './devices';
import type { UidBudgets } from './uid-budgets';
import {
  AllocationRecord,
  checkAligned,
  DAEMON_OWNER,
  hex,
  IdSequence,
  indexAfter,
  isPowerOfTwo,
  MapArgs,
  MappingRecord,
  Ownership,
  MAX_RESERVATION_BYTES,
  range,
  readOnlyMemory,
  ReservationRecord,
  ReserveArgs,
} from './records';

export const locationKey = (location: MemLocation) => describeLocation(location);

export class AddressSpace {
  // Invariant: every live reservation, sorted by address, never overlapping.
  private readonly byAddress: ReservationRecord[] = [];

  constructor(
    private readonly backend: Backend,
    private readonly allocations: Allocations,
    private readonly devices: DeviceTable,
    private readonly ids: IdSequence,
    private readonly ownership: Ownership = new Ownership(),
    private readonly budgets?: UidBudgets,
  ) {}

  /** Every live reservation, sorted by address. */
  all(): readonly ReservationRecord[] {
    return this.byAddress;
  }

  /**
   * Reserves address space for the caller, counted against its uid's
   * reservations and address space until it is freed.
   * @throws INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED, BAD_ALIGNMENT; OUT_OF_RANGE RESERVATION_TOO_LARGE;
   *   RESOURCE_EXHAUSTED BUDGET_EXCEEDED; the backend's ENOMEM
   */
  reserve(caller: bigint, args: ReserveArgs): ReservationRecord {
    const granularity = this.devices.reservationGranularity;
    if (args.size === 0n) throw invalidArgument('ZERO_SIZE', 'reservation size must be greater than 0');
    checkAligned('reservation size', args.size, granularity);
    if (args.size > MAX_RESERVATION_BYTES) {
      throw outOfRange('RESERVATION_TOO_LARGE', `reservation size ${args.size} exceeds the largest reservation, ${MAX_RESERVATION_BYTES} bytes`);
    }
    if (args.alignment !== 0n && !isPowerOfTwo(args.alignment)) {
      throw invalidArgument('BAD_ALIGNMENT', `alignment ${args.alignment} is not a power of two`);
    }
    if (args.alignment > MAX_RESERVATION_BYTES) {
      throw outOfRange('ALIGNMENT_TOO_LARGE', `alignment ${args.alignment} exceeds ${MAX_RESERVATION_BYTES}`);
    }
    if (args.address !== 0n) checkAligned('address hint', args.address, granularity);
    const alignment = args.alignment > granularity ? args.alignment : granularity;
    const charge = this.budgets?.take(caller, { reservations: 1, addressSpace: Number(args.size) });
    let address: bigint;
    try {
      address = this.backend.reserve(args.size, alignment, args.address);
    } catch (error) {
      charge?.give();
      throw error;
    }
    const record: ReservationRecord = {
      id: this.ids.take(),
      owner: caller,
      address,
      size: args.size,
      alignment,
      mappings: [],
      queue: new SerialQueue(),
      charge,
      freed: false,
    };
    this.byAddress.splice(indexAfter(this.byAddress, address), 0, record);
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
    this.ownership.check(caller, reservation.owner, `reservation ${reservation.id}`);
    await reservation.queue.run(() => {
      if (reservation.freed) throw notFound('NOT_RESERVED', `no reservation starts at ${hex(address)}`);
      if (size !== reservation.size) {
        throw invalidArgument(
          'PARTIAL_FREE',
          `free address must name the whole reservation ${range(reservation.address, reservation.size)} (size ${reservation.size}), not size ${size}`,
        );
      }
      if (reservation.mappings.length > 0) {
        throw failedPrecondition('RESERVATION_MAPPED', `reservation ${reservation.id} still has ${reservation.mappings.length} mapping(s); unmap them first`);
      }
      this.backend.freeAddress(reservation.address, reservation.size);
      this.drop(reservation);
    });
  }

  /**
   * Maps an allocation into an unmapped part of a reservation, with no
   * access yet; counted against the caller's uid's mappings until unmapped.
   * @throws NOT_FOUND NOT_RESERVED, UNKNOWN_ALLOCATION; INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED, NONZERO_OFFSET;
   *   OUT_OF_RANGE BEYOND_ALLOCATION, BEYOND_RESERVATION; FAILED_PRECONDITION ALREADY_MAPPED, ALREADY_RELEASED;
   *   PERMISSION_DENIED NOT_OWNER; RESOURCE_EXHAUSTED BUDGET_EXCEEDED; the backend's ENOMEM
   */
  async map(caller: bigint, args: MapArgs): Promise<MappingRecord> {
    if (args.size === 0n) throw invalidArgument('ZERO_SIZE', 'mapping size must be greater than 0');
    if (args.offset !== 0n) {
      throw invalidArgument('NONZERO_OFFSET', `offset ${args.offset} must be 0: the driver maps allocations from their start`);
    }
    const reservation = this.reservationContaining(caller, args.address);
    return reservation.queue.run(async () => {
      this.checkLive(reservation, args.address);
      const allocation = this.allocations.live(args.allocationId);
      this.allocations.checkMayUse(caller, allocation);
      checkAligned('mapping address', args.address, allocation.granularity);
      checkAligned('mapping size', args.size, allocation.granularity);
      if (args.offset + args.size > allocation.size) {
        throw outOfRange('BEYOND_ALLOCATION', `offset ${args.offset} + size ${args.size} exceeds allocation ${allocation.id} of ${allocation.size} bytes`);
      }
      if (args.address + args.size > reservation.address + reservation.size) {
        throw outOfRange(
          'BEYOND_RESERVATION',
          `${range(args.address, args.size)} runs past the end of reservation ${reservation.id} ${range(reservation.address, reservation.size)}`,
        );
      }
      const index = indexAfter(reservation.mappings, args.address);
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
      // The checks above and the record below bracket the driver call: the queue lets nothing else in between.
      const charge = this.budgets?.take(caller, { mappings: 1 });
      try {
        await this.backend.map(args.address, args.size, allocation.handle, args.offset);
      } catch (error) {
        charge?.give();
        throw error;
      }
      const mapping: MappingRecord = { address: args.address, size: args.size, allocation, access: new Map(), charge, unmapping: false };
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
   *   OUT_OF_RANGE UNKNOWN_DEVICE; NOT_FOUND NOT_MAPPED; FAILED_PRECONDITION NOT_FULLY_MAPPED,
   *   PEER_ACCESS_UNSUPPORTED, READ_ONLY_MEMORY; PERMISSION_DENIED NOT_OWNER
   */
  async setAccess(caller: bigint, address: bigint, size: bigint, grants: AccessGrant[]): Promise<void> {
    if (grants.length === 0) throw invalidArgument('NO_DESCRIPTORS', 'set access needs at least one access descriptor');
    const seen = new Set<string>();
    for (const grant of grants) {
      this.devices.deviceOf(grant.location);
      const key = locationKey(grant.location);
      if (seen.has(key)) throw invalidArgument('DUPLICATE_LOCATION', `location ${key} appears twice in the descriptors`);
      seen.add(key);
    }
    if (size === 0n) throw invalidArgument('ZERO_SIZE', 'access range size must be greater than 0');
    checkAligned('access address', address, this.devices.reservationGranularity);
    checkAligned('access size', size, this.devices.reservationGranularity);
    const reservation = this.reservationContaining(caller, address, 'NOT_MAPPED');
    await reservation.queue.run(async () => {
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
      await this.backend.setAccess(address, size, grants);
      for (const mapping of mappings) {
        for (const grant of grants) {
          if (grant.access === 0) mapping.access.delete(locationKey(grant.location));
          else mapping.access.set(locationKey(grant.location), grant.access);
        }
      }
    });
  }

  /**
   * The access a location has to the mapping at an address, in a reservation
   * the caller may act on (a call without a session, an operator's, may look at any).
   * @throws NOT_FOUND NOT_MAPPED; OUT_OF_RANGE UNKNOWN_DEVICE; PERMISSION_DENIED NOT_OWNER
   */
  getAccess(caller: bigint, address: bigint, location: MemLocation): Access {
    this.devices.deviceOf(location);
    const reservation = this.reservationAt(address);
    if (reservation === undefined) throw notFound('NOT_MAPPED', `nothing is mapped at ${hex(address)}`);
    if (caller !== DAEMON_OWNER) this.ownership.check(caller, reservation.owner, `reservation ${reservation.id}`);
    const mapping = this.mappingContaining(reservation, address);
    return mapping.access.get(locationKey(location)) ?? 0;
  }

  /**
   * A new handle reference, held by the caller, to the allocation mapped at an address.
   * @throws NOT_FOUND NOT_MAPPED; PERMISSION_DENIED NOT_OWNER
   */
  retainHandle(caller: bigint, address: bigint): Promise<AllocationRecord> {
    const reservation = this.reservationContaining(caller, address, 'NOT_MAPPED');
    const mapping = this.mappingContaining(reservation, address);
    return this.allocations.retainAt(caller, mapping.allocation, address);
  }

  /** Unmaps every mapping of a reservation and frees it (a session's reclaim), in its queue. */
  reclaim(reservation: ReservationRecord): Promise<void> {
    return reservation.queue.run(async () => {
      if (reservation.freed) return;
      while (reservation.mappings.length > 0) {
        await this.unmapInQueue(reservation, reservation.mappings[reservation.mappings.length - 1]);
      }
      this.backend.freeAddress(reservation.address, reservation.size);
      this.drop(reservation);
    });
  }

  /**
   * The reservation holding `address`, which the caller may act on.
   * @throws NOT_FOUND `code`; PERMISSION_DENIED NOT_OWNER
   */
  reservationContaining(caller: bigint, address: bigint, code: CodeWithStatus<'NOT_FOUND'> = 'NOT_RESERVED'): ReservationRecord {
    const reservation = this.reservationAt(address);
    if (reservation === undefined) throw notFound(code, `${hex(address)} is not inside any reservation`);
    this.ownership.check(caller, reservation.owner, `reservation ${reservation.id}`);
    return reservation;
  }

  /** @throws NOT_FOUND `code` when the reservation was freed meanwhile */
  checkLive(reservation: ReservationRecord, address: bigint, code: CodeWithStatus<'NOT_FOUND'> = 'NOT_RESERVED'): void {
    if (reservation.freed) throw notFound(code, `${hex(address)} is not inside any reservation`);
  }

  /**
   * The mappings that cover [address, address + size) with no gap, in order;
   * the first and last may stick out of the range.
   * @throws OUT_OF_RANGE BEYOND_RESERVATION; FAILED_PRECONDITION NOT_FULLY_MAPPED
   */
  mappingsCovering(reservation: ReservationRecord, address: bigint, size: bigint): MappingRecord[] {
    const end = address + size;
    if (end > reservation.address + reservation.size) {
      throw outOfRange('BEYOND_RESERVATION', `${range(address, size)} runs past the end of reservation ${reservation.id}`);
    }
    const mappings = reservation.mappings;
    // Start at the last mapping that begins at or before `address`, if it reaches it.
    let index = Math.max(0, indexAfter(mappings, address) - 1);
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

  private async unmapInQueue(reservation: ReservationRecord, mapping: MappingRecord): Promise<boolean> {
    mapping.unmapping = true;
    try {
      await this.backend.unmap(mapping.address, mapping.size, mapping.allocation.device);
    } catch (error) {
      mapping.unmapping = false;
      throw error;
    }
    reservation.mappings.splice(reservation.mappings.indexOf(mapping), 1);
    mapping.charge?.give();
    mapping.allocation.mappingCount--;
    return this.allocations.freeIfUnused(mapping.allocation);
  }

  private drop(reservation: ReservationRecord): void {
    reservation.freed = true;
    reservation.charge?.give();
    const index = indexAfter(this.byAddress, reservation.address) - 1;
    if (this.byAddress[index] !== reservation) throw new Error(`registry: reservation ${reservation.id} is not in the address index`);
    this.byAddress.splice(index, 1);
  }

  private reservationAt(address: bigint): ReservationRecord | undefined {
    const candidate = this.byAddress[indexAfter(this.byAddress, address) - 1];
    if (candidate === undefined || address >= candidate.address + candidate.size) return undefined;
    return candidate;
  }

  private mappingContaining(reservation: ReservationRecord, address: bigint): MappingRecord {
    const mapping = reservation.mappings[indexAfter(reservation.mappings, address) - 1];
    if (mapping === undefined || address >= mapping.address + mapping.size || mapping.unmapping) {
      throw notFound('NOT_MAPPED', `nothing is mapped at ${hex(address)}`);
    }
    return mapping;
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
}
