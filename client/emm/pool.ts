/**
 * The client-side pool: chunks leased from the daemon, carved into blocks.
 * Requests round up to a size class (multiples of 256 bytes, then steps of a
 * quarter of the power of two below them, so at most 25% is lost to
 * rounding); a block comes from the first chunk with a free run long enough;
 * freed blocks coalesce with free neighbours at once. Pure data: leasing and
 * releasing chunks is the manager's.
 */

/** Numba's allocations are 256-byte aligned; so are all of the pool's. */
export const POOL_ALIGNMENT = 256n;

export interface PoolSettings {
  /** Bytes of each chunk leased from the daemon (rounded up to the granularity). */
  chunkSize: bigint;
  /** Requests above this get an allocation of their own instead of pool space. */
  largeThreshold: bigint;
}

export const DEFAULT_POOL: PoolSettings = { chunkSize: 32n << 20n, largeThreshold: 16n << 20n };

/** The size class of a request: what the pool really hands out for it. */
export function sizeClass(size: bigint): bigint {
  if (size <= POOL_ALIGNMENT) return POOL_ALIGNMENT;
  let power = POOL_ALIGNMENT;
  while (power * 2n < size) power *= 2n;
  let step = power / 4n;
  if (step < POOL_ALIGNMENT) step = POOL_ALIGNMENT;
  return ((size + step - 1n) / step) * step;
}

interface FreeRun {
  offset: bigint;
  size: bigint;
}

export class Chunk<T> {
  // Invariant: sorted by offset, inside [0, size), never overlapping nor touching
  // (touching runs are merged).
  readonly free: FreeRun[];
  used = 0n;
  blocks = 0;

  constructor(
    /** What the chunk lives in (the manager's lease). */
    readonly lease: T,
    readonly base: bigint,
    readonly size: bigint,
  ) {
    this.free = [{ offset: 0n, size }];
  }

  /** Takes `size` bytes from the first free run that holds them; undefined when none does. */
  take(size: bigint): bigint | undefined {
    for (let index = 0; index < this.free.length; index++) {
      const run = this.free[index];
      if (run.size < size) continue;
      const offset = run.offset;
      if (run.size === size) this.free.splice(index, 1);
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
  give(offset: bigint, size: bigint): void {
    let low = 0;
    let high = this.free.length;
    while (low < high) {
      const middle = (low + high) >>> 1;
      if (this.free[middle].offset < offset) low = middle + 1;
      else high = middle;
    }
    const before = this.free[low - 1];
    const after = this.free[low];
    if ((before && before.offset + before.size > offset) || (after && offset + size > after.offset)) {
      throw new Error(`pool: [${offset}, +${size}) overlaps free space: freed twice?`);
    }
    const joinsBefore = before !== undefined && before.offset + before.size === offset;
    const joinsAfter = after !== undefined && offset + size === after.offset;
    if (joinsBefore && joinsAfter) {
      before.size += size + after.size;
      this.free.splice(low, 1);
    } else if (joinsBefore) {
      before.size += size;
    } else if (joinsAfter) {
      after.offset = offset;
      after.size += size;
    } else {
      this.free.splice(low, 0, { offset, size });
    }
    this.used -= size;
    this.blocks--;
  }

  get empty(): boolean {
    return this.blocks === 0;
  }

  /** Checks the invariant (debugging mode): free runs sorted, apart, and adding up with `used`. */
  check(): void {
    let total = 0n;
    for (let index = 0; index < this.free.length; index++) {
      const run = this.free[index];
      const next = this.free[index + 1];
      if (run.size <= 0n || run.offset < 0n || run.offset + run.size > this.size) throw new Error('pool: a free run is out of its chunk');
      if (next && run.offset + run.size >= next.offset) throw new Error('pool: free runs overlap or touch');
      total += run.size;
    }
    if (total + this.used !== this.size) throw new Error(`pool: free ${total} + used ${this.used} is not the chunk's ${this.size}`);
  }
}

export interface PoolBlock<T> {
  chunk: Chunk<T>;
  offset: bigint;
  size: bigint;
}

export class Pool<T> {
  // Invariant: sorted by base address, never overlapping.
  readonly chunks: Chunk<T>[] = [];

  /** A block of a size class from the chunks held, or undefined when none has room. */
  take(size: bigint): PoolBlock<T> | undefined {
    const rounded = sizeClass(size);
    for (const chunk of this.chunks) {
      const offset = chunk.take(rounded);
      if (offset !== undefined) return { chunk, offset, size: rounded };
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
    let used = 0n;
    let blocks = 0;
    for (const chunk of this.chunks) {
      bytes += chunk.size;
      used += chunk.used;
      blocks += chunk.blocks;
    }
    return { chunks: this.chunks.length, bytes, used, blocks };
  }
}
