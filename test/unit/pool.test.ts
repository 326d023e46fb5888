import { Chunk, Pool, sizeClass } from '../../client/emm/pool';

describe('size classes', () => {
  it.each([
    [1n, 256n],
    [256n, 256n],
    [257n, 512n],
    [600n, 768n],
    [1000n, 1024n],
    [1025n, 1280n],
    [5000n, 5120n],
    [(1n << 20n) + 1n, (1n << 20n) + (1n << 18n)],
  ])('%s bytes → %s', (size, expected) => expect(sizeClass(size)).toBe(expected));

  it('rounds by at most a quarter above 1 KiB, and to multiples of 256', () => {
    for (let size = 1025n; size < 1n << 22n; size = (size * 9n) / 7n) {
      const rounded = sizeClass(size);
      expect(rounded % 256n).toBe(0n);
      expect(rounded >= size && rounded * 4n <= size * 5n + 4n * 256n).toBe(true);
    }
  });
});

describe('a chunk', () => {
  it('takes first fit and coalesces frees with both neighbours', () => {
    const chunk = new Chunk('lease', 0x1000_0000n, 4096n);
    const a = chunk.take(1024n)!;
    const b = chunk.take(1024n)!;
    const c = chunk.take(1024n)!;
    expect([a, b, c]).toEqual([0n, 1024n, 2048n]);
    chunk.give(a, 1024n);
    chunk.give(c, 1024n);
    expect(chunk.free).toEqual([
      { offset: 0n, size: 1024n },
      { offset: 2048n, size: 2048n },
    ]);
    chunk.give(b, 1024n);
    expect(chunk.free).toEqual([{ offset: 0n, size: 4096n }]);
    expect(chunk.empty).toBe(true);
    chunk.check();
  });

  it('refuses a block freed twice', () => {
    const chunk = new Chunk('lease', 0n, 4096n);
    const a = chunk.take(512n)!;
    chunk.give(a, 512n);
    expect(() => chunk.give(a, 512n)).toThrow(/freed twice/);
  });

  it('keeps its invariant through a random workload', () => {
    const chunk = new Chunk('lease', 0n, 1n << 20n);
    const live: Array<[bigint, bigint]> = [];
    let seed = 7;
    const random = () => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
    for (let step = 0; step < 5000; step++) {
      if (live.length > 0 && random() < 0.45) {
        const [offset, size] = live.splice(Math.floor(random() * live.length), 1)[0];
        chunk.give(offset, size);
      } else {
        const size = sizeClass(BigInt(1 + Math.floor(random() * 20000)));
        const offset = chunk.take(size);
        if (offset !== undefined) live.push([offset, size]);
      }
      if (step % 97 === 0) chunk.check();
    }
    for (const [offset, size] of live) chunk.give(offset, size);
    expect(chunk.free).toEqual([{ offset: 0n, size: 1n << 20n }]);
  });
});

describe('a pool', () => {
  it('finds the chunk of a pointer and reports occupancy', () => {
    const pool = new Pool<string>();
    pool.add(new Chunk('b', 0x2000_0000n, 1n << 21n));
    pool.add(new Chunk('a', 0x1000_0000n, 1n << 21n));
    expect(pool.chunks.map((chunk) => chunk.lease)).toEqual(['a', 'b']);
    const block = pool.take(1000n)!;
    expect(block).toMatchObject({ size: 1024n, offset: 0n });
    expect(block.chunk.lease).toBe('a');
    expect(pool.chunkAt(0x2000_0000n + 5n)?.lease).toBe('b');
    expect(pool.chunkAt(0x3000_0000n)).toBeUndefined();
    expect(pool.occupancy()).toEqual({ chunks: 2, bytes: 1n << 22n, used: 1024n, blocks: 1 });
    pool.give(block);
    expect(pool.occupancy().used).toBe(0n);
  });
});
