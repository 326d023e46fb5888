/**
 * The address-space arena's policy against a recorded address space: one
 * reservation serves many mappings, ranges are reused and coalesced, an empty
 * reservation is freed once idle, bad requests change nothing.
 */
import { AddressArena, AddressSpace } from '../../native/address-arena';

const MiB = 1024n * 1024n;
const GiB = 1024n * MiB;

/** An address space that hands out disjoint ranges and records every call. */
class RecordedSpace implements AddressSpace {
  readonly calls: string[] = [];
  readonly live = new Map<bigint, bigint>();
  refuseAbove: bigint | undefined;
  failFree = false;
  private next = 0x7f00_0000_0000n;

  reserve(size: bigint, alignment: bigint): bigint {
    this.calls.push(`reserve ${size / MiB} MiB`);
    if (this.refuseAbove !== undefined && size > this.refuseAbove) throw Object.assign(new Error(`mmap(${size}): Cannot allocate memory`), { code: 'ENOMEM' });
    const address = ((this.next + alignment - 1n) / alignment) * alignment;
    this.next = address + size + 64n * GiB;
    this.live.set(address, size);
    return address;
  }

  free(address: bigint, size: bigint): void {
    this.calls.push(`free ${size / MiB} MiB`);
    if (this.failFree) throw new Error(`munmap(${size}): Invalid argument`);
    expect(this.live.get(address)).toBe(size);
    this.live.delete(address);
  }
}

const options = { reservationBytes: 64n * MiB, alignment: 2n * MiB, idleMs: 0 };

describe('AddressArena', () => {
  it('carves adjacent ranges out of one reservation', () => {
    const space = new RecordedSpace();
    const arena = new AddressArena(space, options);
    const a = arena.take(2n * MiB, 2n * MiB);
    const b = arena.take(4n * MiB, 2n * MiB);
    const c = arena.take(2n * MiB, 2n * MiB);
    expect(b).toBe(a + 2n * MiB);
    expect(c).toBe(b + 4n * MiB);
    expect(space.calls).toEqual(['reserve 64 MiB']);
    expect(arena.stats()).toEqual({ reservations: 1, reservedBytes: 64n * MiB, takenBytes: 8n * MiB, freeRanges: 1 });
  });

  it('reuses a range given back, at the same address, with no new reservation', () => {
    const space = new RecordedSpace();
    const arena = new AddressArena(space, options);
    const a = arena.take(2n * MiB, 2n * MiB);
    arena.take(2n * MiB, 2n * MiB); // keeps the reservation in use
    arena.give(a);
    expect(arena.take(2n * MiB, 2n * MiB)).toBe(a);
    expect(space.calls).toEqual(['reserve 64 MiB']);
  });

  it('coalesces free neighbours: three ranges given back in any order make room for their sum', () => {
    const space = new RecordedSpace();
    const arena = new AddressArena(space, options);
    const [a, b, c] = [arena.take(2n * MiB, 2n * MiB), arena.take(2n * MiB, 2n * MiB), arena.take(2n * MiB, 2n * MiB)];
    const rest = arena.take(58n * MiB, 2n * MiB); // the reservation is now full
    expect(arena.stats().freeRanges).toBe(0);
    arena.give(a);
    arena.give(c);
    expect(arena.stats().freeRanges).toBe(2);
    arena.give(b);
    expect(arena.stats().freeRanges).toBe(1);
    expect(arena.take(6n * MiB, 2n * MiB)).toBe(a);
    expect(space.calls).toEqual(['reserve 64 MiB']);
    expect(rest).toBe(c + 2n * MiB);
  });

  it('aligns a range to a larger alignment and keeps the gap usable', () => {
    const space = new RecordedSpace();
    const arena = new AddressArena(space, options);
    const a = arena.take(2n * MiB, 2n * MiB);
    const big = arena.take(8n * MiB, 16n * MiB);
    expect(big % (16n * MiB)).toBe(0n);
    expect(big).toBeGreaterThan(a);
    // The gap between a and big is still free: a small range lands in it.
    const small = arena.take(2n * MiB, 2n * MiB);
    expect(small).toBe(a + 2n * MiB);
  });

  it('rounds a size up to its alignment, and gives back the rounded range', () => {
    const arena = new AddressArena(new RecordedSpace(), options);
    const a = arena.take(4096n, 2n * MiB);
    const b = arena.take(4096n, 2n * MiB);
    expect(b).toBe(a + 2n * MiB);
    expect(arena.stats().takenBytes).toBe(4n * MiB);
    arena.give(a);
    expect(arena.stats().takenBytes).toBe(2n * MiB);
  });

  it('gives a request larger than the reservation size a reservation of its own, rounded up', () => {
    const space = new RecordedSpace();
    const arena = new AddressArena(space, options);
    arena.take(2n * MiB, 2n * MiB);
    const large = arena.take(100n * MiB, 2n * MiB);
    expect(space.calls).toEqual(['reserve 64 MiB', 'reserve 128 MiB']);
    arena.give(large);
    expect(space.calls).toEqual(['reserve 64 MiB', 'reserve 128 MiB', 'free 128 MiB']);
  });

  it('opens a second reservation when the first is full, and frees each once it is empty', () => {
    const space = new RecordedSpace();
    const arena = new AddressArena(space, options);
    const first = arena.take(64n * MiB, 2n * MiB);
    const second = arena.take(2n * MiB, 2n * MiB);
    expect(space.calls).toEqual(['reserve 64 MiB', 'reserve 64 MiB']);
    arena.give(first);
    arena.give(second);
    expect(space.calls).toEqual(['reserve 64 MiB', 'reserve 64 MiB', 'free 64 MiB', 'free 64 MiB']);
    expect(space.live.size).toBe(0);
    expect(arena.stats().reservations).toBe(0);
  });

  it('reserves exactly the span where the address space refuses the arena size', () => {
    const space = new RecordedSpace();
    space.refuseAbove = 16n * MiB;
    const arena = new AddressArena(space, options);
    const a = arena.take(4n * MiB, 2n * MiB);
    expect(space.calls).toEqual(['reserve 64 MiB', 'reserve 4 MiB']);
    expect(arena.stats().reservedBytes).toBe(4n * MiB);
    arena.give(a);
    expect(space.live.size).toBe(0);
  });

  it("passes on the address space's own error when nothing can be reserved, and holds nothing", () => {
    const space = new RecordedSpace();
    space.refuseAbove = 1n * MiB;
    const arena = new AddressArena(space, options);
    expect(() => arena.take(4n * MiB, 2n * MiB)).toThrow('Cannot allocate memory');
    expect(arena.stats()).toEqual({ reservations: 0, reservedBytes: 0n, takenBytes: 0n, freeRanges: 0 });
  });

  it('refuses size 0 and an alignment that is not a power of two, reserving nothing', () => {
    const space = new RecordedSpace();
    const arena = new AddressArena(space, options);
    expect(() => arena.take(0n, 2n * MiB)).toThrow('size 0 must be positive');
    expect(() => arena.take(2n * MiB, 3n * MiB)).toThrow(`alignment ${3n * MiB} is not a power of two`);
    expect(() => arena.take(2n * MiB, 0n)).toThrow('alignment 0 is not a power of two');
    expect(space.calls).toEqual([]);
  });

  it('refuses a second give and an address it never handed out, changing nothing', () => {
    const space = new RecordedSpace();
    const arena = new AddressArena(space, options);
    const a = arena.take(2n * MiB, 2n * MiB);
    const b = arena.take(2n * MiB, 2n * MiB);
    arena.give(a);
    const before = arena.stats();
    expect(() => arena.give(a)).toThrow('given back twice');
    expect(() => arena.give(b + 4096n)).toThrow('is not a range of this arena');
    expect(arena.stats()).toEqual(before);
  });

  it('refuses bad options', () => {
    expect(() => new AddressArena(new RecordedSpace(), { ...options, alignment: 3n })).toThrow('alignment 3 is not a power of two');
    expect(() => new AddressArena(new RecordedSpace(), { ...options, reservationBytes: 3n * MiB })).toThrow('not a positive multiple of the alignment');
  });

  it('keeps a reservation whose free fails, usable, and warns', () => {
    const space = new RecordedSpace();
    const arena = new AddressArena(space, options);
    const warn = jest.spyOn(process, 'emitWarning').mockImplementation(() => undefined);
    try {
      const a = arena.take(2n * MiB, 2n * MiB);
      space.failFree = true;
      arena.give(a);
      expect(warn).toHaveBeenCalledWith(expect.stringContaining('freeing an address reservation of 67108864 bytes failed: munmap'));
      expect(arena.stats().reservations).toBe(1);
      expect(arena.take(2n * MiB, 2n * MiB)).toBe(a);
      space.failFree = false;
    } finally {
      warn.mockRestore();
    }
  });

  describe('with an idle delay', () => {
    beforeEach(() => jest.useFakeTimers());
    afterEach(() => jest.useRealTimers());

    it('frees an empty reservation only after it stayed unused for the delay', () => {
      const space = new RecordedSpace();
      const arena = new AddressArena(space, { ...options, idleMs: 1000 });
      const a = arena.take(2n * MiB, 2n * MiB);
      arena.give(a);
      jest.advanceTimersByTime(999);
      expect(space.calls).toEqual(['reserve 64 MiB']);
      jest.advanceTimersByTime(1);
      expect(space.calls).toEqual(['reserve 64 MiB', 'free 64 MiB']);
    });

    it('keeps a reservation that is used again before the delay, and trim() frees empty ones at once', () => {
      const space = new RecordedSpace();
      const arena = new AddressArena(space, { ...options, idleMs: 1000 });
      const a = arena.take(2n * MiB, 2n * MiB);
      arena.give(a);
      jest.advanceTimersByTime(500);
      const again = arena.take(2n * MiB, 2n * MiB);
      expect(again).toBe(a);
      jest.advanceTimersByTime(5000);
      expect(space.calls).toEqual(['reserve 64 MiB']);
      arena.give(again);
      expect(arena.trim()).toBe(1);
      expect(space.calls).toEqual(['reserve 64 MiB', 'free 64 MiB']);
      jest.advanceTimersByTime(5000);
      expect(space.calls).toEqual(['reserve 64 MiB', 'free 64 MiB']);
    });
  });
});
