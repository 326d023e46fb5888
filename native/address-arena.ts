/**
 * An address-space arena: large ranges of this process's address space
 * reserved once (cuMemAddressReserve, or mmap PROT_NONE on the host) and
 * carved into the ranges that mappings need, so that a mapping costs no
 * reservation of its own. Policy only: the reserve and free calls come from
 * native/mapping.ts, which is the one place that maps into these ranges.
 */

/** `size` rounded up to a multiple of `granularity`: the one rounding rule of local mappings (native/mapping.ts re-exports it). */
export function roundUp(size: bigint, granularity: bigint): bigint {
  return ((size + granularity - 1n) / granularity) * granularity;
}

/** The calls that reserve and free address space of one kind (host or cuda). */
export interface AddressSpace {
  /** Reserves `size` bytes aligned to `alignment`; throws when the address space cannot be had. */
  reserve(size: bigint, alignment: bigint): bigint;
  /** Frees a whole range that reserve() returned. */
  free(address: bigint, size: bigint): void;
}

export interface ArenaOptions {
  /** Bytes reserved at a time; a larger request gets a reservation of its own, rounded up to this. */
  reservationBytes: bigint;
  /** Alignment of every reservation (a power of two). */
  alignment: bigint;
  /** How long an empty reservation stays before it is freed (0: at once). */
  idleMs: number;
}

/** What the arena holds, for tests and metrics. */
export interface ArenaStats {
  reservations: number;
  reservedBytes: bigint;
  takenBytes: bigint;
  /** Free ranges across all reservations, after coalescing. */
  freeRanges: number;
}

interface Range {
  start: bigint;
  end: bigint;
}

/** One reservation and the ranges of it that are free. */
class Reservation {
  // Invariant: `free` is sorted by start, its ranges lie inside [base, base + size), never touch or overlap.
  readonly free: Range[];
  taken = 0n;
  idleTimer: NodeJS.Timeout | undefined;

  constructor(
    readonly base: bigint,
    readonly size: bigint,
  ) {
    this.free = [{ start: base, end: base + size }];
  }

  get end(): bigint {
    return this.base + this.size;
  }

  contains(address: bigint, size: bigint): boolean {
    return address >= this.base && address + size <= this.end;
  }

  /** The lowest address of a free range that fits `size` at `alignment`, taken; undefined when none fits. */
  take(size: bigint, alignment: bigint): bigint | undefined {
    for (let i = 0; i < this.free.length; i++) {
      const range = this.free[i];
      const start = roundUp(range.start, alignment);
      if (start + size > range.end) continue;
      const pieces: Range[] = [];
      if (start > range.start) pieces.push({ start: range.start, end: start });
      if (start + size < range.end) pieces.push({ start: start + size, end: range.end });
      this.free.splice(i, 1, ...pieces);
      this.taken += size;
      return start;
    }
    return undefined;
  }

  /** Puts [address, address + size) back, merged with the free ranges it touches. */
  give(address: bigint, size: bigint): void {
    const end = address + size;
    let i = 0;
    while (i < this.free.length && this.free[i].start < address) i++;
    const before = this.free[i - 1];
    const after = this.free[i];
    if ((before !== undefined && before.end > address) || (after !== undefined && after.start < end)) {
      throw new Error(`address arena: [0x${address.toString(16)}, 0x${end.toString(16)}) overlaps a free range`);
    }
    const merged: Range = { start: address, end };
    let from = i;
    let count = 0;
    if (before !== undefined && before.end === address) {
      merged.start = before.start;
      from = i - 1;
      count++;
    }
    if (after !== undefined && after.start === end) {
      merged.end = after.end;
      count++;
    }
    this.free.splice(from, count, merged);
    this.taken -= size;
  }

  get empty(): boolean {
    return this.taken === 0n;
  }
}

/**
 * Ranges of address space handed to mappings. A range comes back (give) only
 * once its mapping is gone: the caller gives it after the unmap completed,
 * so a range is never handed out while the driver may still be unmapping it.
 * An empty reservation is freed once it stayed empty for `idleMs`.
 */
export class AddressArena {
  // Invariant: every taken range is in `taken` (address → rounded size) and lies inside one reservation, outside its free ranges.
  private readonly reservations: Reservation[] = [];
  private readonly taken = new Map<bigint, { size: bigint; reservation: Reservation }>();

  constructor(
    private readonly space: AddressSpace,
    private readonly options: ArenaOptions,
  ) {
    if (options.alignment <= 0n || (options.alignment & (options.alignment - 1n)) !== 0n) {
      throw new RangeError(`address arena: alignment ${options.alignment} is not a power of two`);
    }
    if (options.reservationBytes <= 0n || options.reservationBytes % options.alignment !== 0n) {
      throw new RangeError(`address arena: reservation size ${options.reservationBytes} is not a positive multiple of the alignment ${options.alignment}`);
    }
  }

  /**
   * A range of at least `size` bytes (rounded up to `alignment`) aligned to
   * `alignment`, from a reservation that has room, else from a new one.
   * @throws RangeError for a size of 0 or an alignment that is not a power of two; the address space's own error when nothing can be reserved
   */
  take(size: bigint, alignment: bigint): bigint {
    if (size <= 0n) throw new RangeError(`address arena: size ${size} must be positive`);
    if (alignment <= 0n || (alignment & (alignment - 1n)) !== 0n) throw new RangeError(`address arena: alignment ${alignment} is not a power of two`);
    const span = roundUp(size, alignment);
    for (const reservation of this.reservations) {
      const address = reservation.take(span, alignment);
      if (address !== undefined) return this.record(address, span, reservation);
    }
    const reservation = this.reserve(span, alignment);
    return this.record(reservation.take(span, alignment)!, span, reservation);
  }

  /**
   * Gives back a range take() returned, once nothing is mapped in it any more.
   * @throws Error when `address` is not a range this arena handed out (a second give)
   */
  give(address: bigint): void {
    const entry = this.taken.get(address);
    if (entry === undefined) throw new Error(`address arena: 0x${address.toString(16)} is not a range of this arena (given back twice?)`);
    this.taken.delete(address);
    const { size, reservation } = entry;
    reservation.give(address, size);
    if (reservation.empty) this.scheduleRelease(reservation);
  }

  /** Frees every empty reservation now; returns how many were freed. */
  trim(): number {
    let freed = 0;
    for (const reservation of [...this.reservations]) {
      if (reservation.empty && this.release(reservation)) freed++;
    }
    return freed;
  }

  stats(): ArenaStats {
    let reservedBytes = 0n;
    let takenBytes = 0n;
    let freeRanges = 0;
    for (const reservation of this.reservations) {
      reservedBytes += reservation.size;
      takenBytes += reservation.taken;
      freeRanges += reservation.free.length;
    }
    return { reservations: this.reservations.length, reservedBytes, takenBytes, freeRanges };
  }

  private record(address: bigint, size: bigint, reservation: Reservation): bigint {
    if (reservation.idleTimer !== undefined) {
      clearTimeout(reservation.idleTimer);
      reservation.idleTimer = undefined;
    }
    this.taken.set(address, { size, reservation });
    return address;
  }

  /**
   * A new reservation holding `span` at `alignment`: the arena's size (or
   * more, for a large request); where the address space refuses that much
   * (a low RLIMIT_AS, a small VA space), exactly the span.
   */
  private reserve(span: bigint, alignment: bigint): Reservation {
    const align = alignment > this.options.alignment ? alignment : this.options.alignment;
    const size = roundUp(span, this.options.reservationBytes);
    let base: bigint;
    let reserved = size;
    try {
      base = this.space.reserve(size, align);
    } catch (error) {
      if (size === span) throw error;
      base = this.space.reserve(span, align);
      reserved = span;
    }
    const reservation = new Reservation(base, reserved);
    this.reservations.push(reservation);
    return reservation;
  }

  private scheduleRelease(reservation: Reservation): void {
    if (this.options.idleMs <= 0) {
      this.release(reservation);
      return;
    }
    if (reservation.idleTimer !== undefined) clearTimeout(reservation.idleTimer);
    reservation.idleTimer = setTimeout(() => {
      reservation.idleTimer = undefined;
      if (reservation.empty) this.release(reservation);
    }, this.options.idleMs);
    // An idle reservation never keeps the process alive.
    reservation.idleTimer.unref();
  }

  /** Frees an empty reservation; a failed free keeps it (it stays usable) and says false. */
  private release(reservation: Reservation): boolean {
    if (reservation.idleTimer !== undefined) clearTimeout(reservation.idleTimer);
    reservation.idleTimer = undefined;
    try {
      this.space.free(reservation.base, reservation.size);
    } catch (error) {
      process.emitWarning(`vmmd: freeing an address reservation of ${reservation.size} bytes failed: ${(error as Error).message}`);
      return false;
    }
    this.reservations.splice(this.reservations.indexOf(reservation), 1);
    return true;
  }
}
