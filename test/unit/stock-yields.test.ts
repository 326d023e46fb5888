/**
 * What the stock holds for speed (server/backends/stock.ts: allocations made
 * ahead, frees held back) yields to every request that needs memory, not to
 * Create alone: an Import or a client's memfd held for a store that runs
 * out of memory gets what the stock gives back, then is tried once more.
 */
import pino from 'pino';
import { ImportedHandle, ImportSource } from '../../server/backends/backend';
import { StockedBackend } from '../../server/backends/stock';
import { FakeBackend, GRANULARITY, MiB } from './fake-backend';

const DEVICE = { type: 'DEVICE' as const, id: 0 };
const quiet = pino({ level: 'silent' });

/** The fake, with a capacity that imports and held client memfds count against too (as the host backend's does). */
class CountingFake extends FakeBackend {
  readonly imports: number[] = [];
  readonly closed: number[] = [];
  private held = 0n;

  private room(size: bigint): void {
    const { freeBytes } = this.memoryInfo();
    if (size + this.held > freeBytes) throw Object.assign(new Error(`out of memory: ${size} bytes, ${freeBytes - this.held} free`), { code: 'OUT_OF_MEMORY' });
  }

  override async importHandle(source: ImportSource, size: bigint): Promise<ImportedHandle> {
    const fd = (source as { fd: number }).fd;
    this.imports.push(fd);
    try {
      this.room(size);
    } catch (error) {
      // The backend takes the descriptor over: closed on failure too.
      this.closed.push(fd);
      throw error;
    }
    this.held += size;
    return { handle: fd, size, device: 0, location: DEVICE };
  }

  override async holdClientMemfd(fd: number, size: bigint): Promise<string> {
    this.room(size);
    this.held += size;
    return `fake-memfd:${fd}`;
  }
}

function stocked(depth: number) {
  const fake = new CountingFake({ capacity: 64n * MiB });
  let next = 5000;
  const closed: number[] = [];
  const dups: number[] = [];
  const calls = { dup: () => (dups.push(next), next++), close: (fd: number) => void closed.push(fd) };
  const stock = new StockedBackend(fake, [{ size: GRANULARITY, depth }], quiet, (fd) => void closed.push(fd), { calls });
  // Every copy of a descriptor the stock made is closed, or was taken over by the backend.
  const noCopyLeft = () => dups.every((fd) => closed.includes(fd) || fake.imports.includes(fd));
  return { fake, stock, closed, noCopyLeft };
}

describe('the stock yields memory', () => {
  it('to an Import that runs out of it: the stock is given back and the import tried once more', async () => {
    const { fake, stock, closed } = stocked(8);
    await stock.fill();
    const imported = await stock.importHandle({ fd: 42 }, 56n * MiB);
    expect(imported.size).toBe(56n * MiB);
    expect(stock.stats().levels[0].held).toBe(0);
    // The first try's descriptor went with its failure; the second try had a copy of its own (the stock's dup).
    expect(fake.imports).toEqual([42, 5000]);
    expect(fake.closed).toEqual([42]);
    expect(closed).not.toContain(5000);
    await stock.close();
  });

  it('to an Import while a free is held back', async () => {
    const { stock } = stocked(1);
    await stock.fill();
    const handle = await stock.create(0, DEVICE, 56n * MiB, ['POSIX_FD']);
    // Held back until the daemon is quiet; the import that needs its memory does not wait for that.
    const released = stock.release(handle, 56n * MiB, false, 0);
    expect(stock.heldReleases).toBe(1);
    expect((await stock.importHandle({ fd: 43 }, 56n * MiB)).size).toBe(56n * MiB);
    await released;
    await stock.close();
  });

  it("to a client's memfd held for a store", async () => {
    const { stock } = stocked(8);
    await stock.fill();
    expect(await stock.holdClientMemfd(44, 56n * MiB)).toBe('fake-memfd:44');
    await stock.close();
  });

  it('and refuses what does not fit even then, closing its copy of the descriptor', async () => {
    const { stock, noCopyLeft } = stocked(8);
    await stock.fill();
    await expect(stock.importHandle({ fd: 45 }, 80n * MiB)).rejects.toMatchObject({ code: 'OUT_OF_MEMORY' });
    expect(noCopyLeft()).toBe(true);
    await stock.close();
  });

  it('an Import that fits takes nothing from the stock', async () => {
    const { stock, noCopyLeft } = stocked(8);
    await stock.fill();
    expect((await stock.importHandle({ fd: 46 }, 4n * MiB)).size).toBe(4n * MiB);
    expect(stock.stats().levels[0].held).toBe(8);
    expect(noCopyLeft()).toBe(true);
    await stock.close();
  });
});
