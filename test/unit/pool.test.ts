import { Chunk, Pool, sizeClass, sizeClassBytes } from '../../client/emm/pool';

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

  it('are the same computed in numbers (the hot path) and in bigints, for every size up to 64 KiB and powers of two around larger ones', () => {
    const sizes: number[] = [];
    for (let size = 1; size <= 65536; size++) sizes.push(size);
    for (let power = 2 ** 16; power <= 2 ** 40; power *= 2) sizes.push(power - 1, power, power + 1);
    for (const size of sizes) {
      let expected = 256n;
      if (BigInt(size) > 256n) {
        let p = 256n;
        while (p * 2n < BigInt(size)) p *= 2n;
        const step = p / 4n < 256n ? 256n : p / 4n;
        expected = ((BigInt(size) + step - 1n) / step) * step;
      }
      if (BigInt(sizeClassBytes(size)) !== expected) throw new Error(`size ${size}: ${sizeClassBytes(size)} != ${expected}`);
    }
  });

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
    const a = chunk.take(1024)!;
    const b = chunk.take(1024)!;
    const c = chunk.take(1024)!;
    expect([a, b, c]).toEqual([0, 1024, 2048]);
    chunk.give(a, 1024);
    chunk.give(c, 1024);
    expect(chunk.free).toEqual([
      { offset: 0, size: 1024 },
      { offset: 2048, size: 2048 },
    ]);
    chunk.give(b, 1024);
    expect(chunk.free).toEqual([{ offset: 0, size: 4096 }]);
    expect(chunk.empty).toBe(true);
    chunk.check();
  });

  it('refuses a block freed twice', () => {
    const chunk = new Chunk('lease', 0n, 4096n);
    const a = chunk.take(512)!;
    chunk.give(a, 512);
    expect(() => chunk.give(a, 512)).toThrow(/freed twice/);
  });

  it('keeps its invariant through a random workload', () => {
    const chunk = new Chunk('lease', 0n, 1n << 20n);
    const live: Array<[number, number]> = [];
    let seed = 7;
    const random = () => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
    for (let step = 0; step < 5000; step++) {
      if (live.length > 0 && random() < 0.45) {
        const [offset, size] = live.splice(Math.floor(random() * live.length), 1)[0];
        chunk.give(offset, size);
      } else {
        const size = sizeClassBytes(1 + Math.floor(random() * 20000));
        const offset = chunk.take(size);
        if (offset !== undefined) live.push([offset, size]);
      }
      if (step % 97 === 0) chunk.check();
    }
    for (const [offset, size] of live) chunk.give(offset, size);
    expect(chunk.free).toEqual([{ offset: 0, size: 1 << 20 }]);
  });
});

describe('a pool', () => {
  it('finds the chunk of a pointer and reports occupancy', () => {
    const pool = new Pool<string>();
    pool.add(new Chunk('b', 0x2000_0000n, 1n << 21n));
    pool.add(new Chunk('a', 0x1000_0000n, 1n << 21n));
    expect(pool.chunks.map((chunk) => chunk.lease)).toEqual(['a', 'b']);
    const block = pool.take(1000)!;
    expect(block).toMatchObject({ size: 1024, offset: 0 });
    expect(block.chunk.lease).toBe('a');
    expect(pool.chunkAt(0x2000_0000n + 5n)?.lease).toBe('b');
    expect(pool.chunkAt(0x3000_0000n)).toBeUndefined();
    expect(pool.occupancy()).toEqual({ chunks: 2, bytes: 1n << 22n, used: 1024n, blocks: 1 });
    pool.give(block);
    expect(pool.occupancy().used).toBe(0n);
  });
});
