/**
 * The client-side pool: chunks leased from the daemon, carved into blocks.
 * Requests round up to a size class (multiples of 256 bytes, then steps of a
 * quarter of the power of two below them, so at most 25% is lost to
 * rounding); a block comes from the first chunk with a free run long enough;
 * freed blocks coalesce with free neighbours at once. Pure data: leasing and
 * releasing chunks is the manager's.
 */

/** Numba's allocations are 256-byte aligned; so are all of the pool's. */
const ALIGNMENT = 256;

export interface PoolSettings {
  /** Bytes of each chunk leased from the daemon (rounded up to the granularity). */
  chunkSize: bigint;
  /** Requests above this get an allocation of their own instead of pool space. */
  largeThreshold: bigint;
}

export const DEFAULT_POOL: PoolSettings = { chunkSize: 32n << 20n, largeThreshold: 16n << 20n };

/**
 * The size class of a request in bytes, as a number: the pool's hot path
 * stays in doubles (exact below 2^53; chunks are far smaller) and allocates
 * nothing.
 */
export function sizeClassBytes(size: number): number {
  if (size <= ALIGNMENT) return ALIGNMENT;
  // The largest power of two below `size` (clz32 while it fits in 32 bits).
  const power = size <= 2 ** 31 ? 1 << (31 - Math.clz32(size - 1)) : 2 ** Math.floor(Math.log2(size - 1));
  const step = Math.max(ALIGNMENT, power / 4);
  return Math.ceil(size / step) * step;
}

/** The size class of a request: what the pool really hands out for it. */
export function sizeClass(size: bigint): bigint {
  return BigInt(sizeClassBytes(Number(size)));
}

interface FreeRun {
  offset: number;
  size: number;
}

export class Chunk<T> {
  // Invariant: sorted by offset, inside [0, size), never overlapping nor touching
  // (touching runs are merged).
  readonly free: FreeRun[];
  used = 0;
  blocks = 0;
  /** The chunk's bytes as a number (offsets and sizes inside it are numbers). */
  readonly length: number;

  constructor(
    /** What the chunk lives in (the manager's lease). */
    readonly lease: T,
    readonly base: bigint,
    readonly size: bigint,
  ) {
    this.length = Number(size);
    this.free = [{ offset: 0, size: this.length }];
  }

  /** Takes `size` bytes from the first free run that holds them; undefined when none does. */
  take(size: number): number | undefined {
    const free = this.free;
    for (let index = 0; index < free.length; index++) {
      const run = free[index];
      if (run.size < size) continue;
      const offset = run.offset;
      if (run.size === size) free.splice(index, 1);
      else {
        run.offset += size;
        run.size -= size;
      }
      this.used += size;
      this.blocks++;
      return offset;
    }
    return undefined;
  }

  /** Gives [offset, +size) back, merged with free neighbours. */
  give(offset: number, size: number): void {
    const free = this.free;
    let low = 0;
    let high = free.length;
    while (low < high) {
      const middle = (low + high) >>> 1;
      if (free[middle].offset < offset) low = middle + 1;
      else high = middle;
    }
    const before = free[low - 1];
    const after = free[low];
    if ((before && before.offset + before.size > offset) || (after && offset + size > after.offset)) {
      throw new Error(`pool: [${offset}, +${size}) overlaps free space: freed twice?`);
    }
    const joinsBefore = before !== undefined && before.offset + before.size === offset;
    const joinsAfter = after !== undefined && offset + size === after.offset;
    if (joinsBefore && joinsAfter) {
      before.size += size + after.size;
      free.splice(low, 1);
    } else if (joinsBefore) {
      before.size += size;
    } else if (joinsAfter) {
      after.offset = offset;
      after.size += size;
    } else {
      free.splice(low, 0, { offset, size });
    }
    this.used -= size;
    this.blocks--;
  }

  get empty(): boolean {
    return this.blocks === 0;
  }

  /** Checks the invariant (debugging mode): free runs sorted, apart, and adding up with `used`. */
  check(): void {
    let total = 0;
    for (let index = 0; index < this.free.length; index++) {
      const run = this.free[index];
      const next = this.free[index + 1];
      if (run.size <= 0 || run.offset < 0 || run.offset + run.size > this.length) throw new Error('pool: a free run is out of its chunk');
      if (next && run.offset + run.size >= next.offset) throw new Error('pool: free runs overlap or touch');
      total += run.size;
    }
    if (total + this.used !== this.length) throw new Error(`pool: free ${total} + used ${this.used} is not the chunk's ${this.length}`);
  }
}

export interface PoolBlock<T> {
  chunk: Chunk<T>;
  offset: number;
  size: number;
}

export class Pool<T> {
  // Invariant: sorted by base address, never overlapping.
  readonly chunks: Chunk<T>[] = [];

  /** A block of `size`'s class from the chunks held, or undefined when none has room. */
  take(size: number): PoolBlock<T> | undefined {
    return this.takeClass(sizeClassBytes(size));
  }

  /** take() for a size already rounded to its class. */
  takeClass(rounded: number): PoolBlock<T> | undefined {
    const chunks = this.chunks;
    for (let index = 0; index < chunks.length; index++) {
      const offset = chunks[index].take(rounded);
      if (offset !== undefined) return { chunk: chunks[index], offset, size: rounded };
    }
    return undefined;
  }

  give(block: PoolBlock<T>): void {
    block.chunk.give(block.offset, block.size);
  }

  add(chunk: Chunk<T>): void {
    let index = 0;
    while (index < this.chunks.length && this.chunks[index].base < chunk.base) index++;
    this.chunks.splice(index, 0, chunk);
  }

  remove(chunk: Chunk<T>): void {
    const index = this.chunks.indexOf(chunk);
    if (index >= 0) this.chunks.splice(index, 1);
  }

  /** The chunk holding a pointer, if any. */
  chunkAt(pointer: bigint): Chunk<T> | undefined {
    let low = 0;
    let high = this.chunks.length;
    while (low < high) {
      const middle = (low + high) >>> 1;
      if (this.chunks[middle].base <= pointer) low = middle + 1;
      else high = middle;
    }
    const chunk = this.chunks[low - 1];
    return chunk !== undefined && pointer < chunk.base + chunk.size ? chunk : undefined;
  }

  occupancy(): { chunks: number; bytes: bigint; used: bigint; blocks: number } {
    let bytes = 0n;
    let used = 0;
    let blocks = 0;
    for (const chunk of this.chunks) {
      bytes += chunk.size;
      used += chunk.used;
      blocks += chunk.blocks;
    }
    return { chunks: this.chunks.length, bytes, used: BigInt(used), blocks };
  }
}
