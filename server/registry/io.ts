/**
 * Byte I/O through the daemon (Read, Write, staged copies, stores): checks
 * that the daemon may read or write a range, splits it into runs of one
 * device each, and copies each run through its device in the reservation's
 * queue.
 */
import { Access, ACCESS_READ, ACCESS_READWRITE, Backend } from '../backends/backend';
import { failedPrecondition, invalidArgument } from '../errors';
import { AddressSpace, locationKey } from './address-space';
import { IO_CHUNK_BYTES, range, readOnlyMemory, ReservationRecord } from './records';

interface Segment {
  address: bigint;
  length: bigint;
  device: number;
}

export class ByteIo {
  constructor(
    private readonly backend: Backend,
    private readonly space: AddressSpace,
  ) {}

  /**
   * Checks that the daemon may read (or write) all of [address, address + length)
   * through mappings with access for their own device.
   * @throws INVALID_ARGUMENT ZERO_SIZE; NOT_FOUND NOT_MAPPED; OUT_OF_RANGE BEYOND_RESERVATION;
   *   FAILED_PRECONDITION NOT_FULLY_MAPPED, NO_ACCESS, READ_ONLY_MEMORY; PERMISSION_DENIED NOT_OWNER
   */
  check(caller: bigint, address: bigint, length: bigint, write: boolean): ReservationRecord {
    if (length === 0n) throw invalidArgument('ZERO_SIZE', `${write ? 'write' : 'read'} length must be greater than 0`);
    const reservation = this.space.reservationContaining(caller, address, 'NOT_MAPPED');
    this.segments(reservation, address, length, write);
    return reservation;
  }

  /** Reads a range checked with check(), a chunk at a time, each in the reservation's queue. */
  async *read(caller: bigint, address: bigint, length: bigint): AsyncGenerator<{ offset: bigint; data: Buffer }> {
    const reservation = this.check(caller, address, length, false);
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
    await this.copySegments(this.check(caller, address, BigInt(into.length), false), address, into, false);
  }

  /** Writes bytes to a range the daemon may write, in the reservation's queue. */
  async write(caller: bigint, address: bigint, data: Buffer): Promise<void> {
    await this.copySegments(this.check(caller, address, BigInt(data.length), true), address, data, true);
  }

  /**
   * In the reservation's queue: checks [address, +bytes) again, then copies
   * each device's segment of it between the mapped memory and `bytes`
   * (out of the memory, or into it with `write`), through that device.
   */
  private copySegments(reservation: ReservationRecord, address: bigint, bytes: Buffer, write: boolean): Promise<void> {
    return reservation.queue.run(async () => {
      const segments = this.segments(reservation, address, BigInt(bytes.length), write);
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

  /** Checks access to [address, address + length) and splits it into runs of one device each. */
  private segments(reservation: ReservationRecord, address: bigint, length: bigint, write: boolean): Segment[] {
    this.space.checkLive(reservation, address, 'NOT_MAPPED');
    const needed: Access = write ? ACCESS_READWRITE : ACCESS_READ;
    const end = address + length;
    const segments: Segment[] = [];
    for (const mapping of this.space.mappingsCovering(reservation, address, length)) {
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
