/** The stock of allocations created and exported ahead (server/backends/stock.ts), over the fake backend. */
import pino from 'pino';
import { parseStock } from '../../server/app/config';
import { REFILL_PARALLEL, StockedBackend } from '../../server/backends/stock';
import { Registry } from '../../server/registry';
import { FakeBackend, MiB } from './fake-backend';

const DEVICE = { type: 'DEVICE' as const, id: 0 };
const quiet = pino({ level: 'silent' });

function stocked(levels = [{ size: 2n * MiB, depth: 2 }], capacity = 64n * MiB, limit = 8) {
  const fake = new FakeBackend({ capacity });
  const closed: number[] = [];
  // The fake's descriptors are numbers: a dup is a new number, 5000 up.
  let next = 5000;
  const calls = { dup: () => next++, close: (fd: number) => void closed.push(fd) };
  const stock = new StockedBackend(fake, levels, quiet, (fd) => void closed.push(fd), { calls, limit });
  return { fake, stock, closed };
}

const settle = () => new Promise((resolve) => setTimeout(resolve, 20));

describe('a stock', () => {
  it('fills its shelves with created and exported allocations', async () => {
    const { fake, stock } = stocked([
      { size: 2n * MiB, depth: 3 },
      { size: 8n * MiB, depth: 1 },
    ]);
    await stock.fill();
    expect(stock.stats().levels).toEqual([
      { device: 0, size: String(2n * MiB), depth: 3, held: 3 },
      { device: 0, size: String(8n * MiB), depth: 1, held: 1 },
    ]);
    expect(fake.calls.filter((call) => call === 'create')).toHaveLength(4);
    expect(fake.calls.filter((call) => call === 'export')).toHaveLength(4);
  });

  it('skips sizes that are not a multiple of the granularity', () => {
    const { stock } = stocked([{ size: 3n * MiB, depth: 2 }]);
    expect(stock.stats().levels).toEqual([]);
  });

  it('hands out a stocked handle whose first export is the ready descriptor, then refills', async () => {
    const { fake, stock } = stocked();
    await stock.fill();
    fake.calls.length = 0;
    const handle = await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    expect(fake.calls).toEqual([]);
    expect(await stock.exportHandle(handle, 0)).toBe(1000 + Number(handle));
    expect(fake.calls).toEqual([]);
    // A second export is a dup of the descriptor kept from the first: no driver export either.
    expect(await stock.exportHandle(handle, 0)).toBe(5001);
    expect(fake.calls).toEqual([]);
    expect(stock.keptDescriptors).toBe(1);
    await settle();
    expect(stock.stats()).toMatchObject({ hits: 1, misses: 0, levels: [{ held: 2 }] });
  });

  it('creates on the spot when the shelf is empty, or for sizes, locations and handle types it does not stock', async () => {
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 1 }]);
    await stock.fill();
    await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    fake.calls.length = 0;
    await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    await stock.create(0, DEVICE, 4n * MiB, ['POSIX_FD']);
    await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD', 'FABRIC']);
    await stock.create(0, { type: 'HOST_NUMA', id: 0 }, 2n * MiB, ['POSIX_FD']);
    expect(fake.calls.filter((call) => call === 'create')).toHaveLength(4);
    expect(stock.stats().misses).toBe(1);
  });

  it("closes a handed-out handle's ready descriptor when it is released unexported", async () => {
    const { stock, closed } = stocked();
    await stock.fill();
    const handle = await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    await stock.release(handle, 2n * MiB, false, 0);
    expect(closed).toEqual([1000 + Number(handle)]);
  });

  it('closes the kept descriptor of a handed-out handle when it is released (after the backend freed it), keeps it when the free fails', async () => {
    const { fake, stock, closed } = stocked();
    await stock.fill();
    const handle = await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    await stock.exportHandle(handle, 0);
    // Kept: 5000, a dup of the ready descriptor the first export handed out.
    const failing = Object.assign(new Error('injected'), { code: 'CUDA_ERROR_UNKNOWN' });
    const release = fake.release.bind(fake);
    fake.release = async () => {
      throw failing;
    };
    await expect(stock.release(handle, 2n * MiB, false, 0)).rejects.toBe(failing);
    expect({ closed, kept: stock.keptDescriptors }).toEqual({ closed: [], kept: 1 });
    expect(await stock.exportHandle(handle, 0)).toBe(5001);
    fake.release = release;
    await stock.release(handle, 2n * MiB, false, 0);
    expect({ closed, kept: stock.keptDescriptors }).toEqual({ closed: [5000], kept: 0 });
    // Released: the next export of that handle value is the backend's own, not a dup of the old memory's.
    fake.calls.length = 0;
    await expect(stock.exportHandle(handle, 0)).rejects.toThrow();
    expect(fake.calls).toEqual(['export']);
  });

  it('keeps at most its bound of handed-out descriptors, least recently exported closed first', async () => {
    const { stock, closed } = stocked([{ size: 2n * MiB, depth: 4 }], 64n * MiB, 2);
    await stock.fill();
    const handles = [];
    for (let i = 0; i < 3; i++) handles.push(await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']));
    for (const handle of handles) await stock.exportHandle(handle, 0);
    // Kept 5000, 5001, 5002 for the three; the first went when the third came.
    expect({ kept: stock.keptDescriptors, closed }).toEqual({ kept: 2, closed: [5000] });
    stock.close();
  });

  it('stops refilling below its headroom, and gives the device its memory back for a Create that runs out, which then succeeds', async () => {
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 4 }], 12n * MiB);
    await stock.fill();
    // 12 MiB: after three, 6 MiB are free, less than four sizes (8 MiB): the refill stops.
    expect(stock.stats().levels[0].held).toBe(3);
    // Out of memory with 6 MiB stocked: the stock gives them back, and the Create is tried again once they are freed.
    await expect(stock.create(0, DEVICE, 12n * MiB, ['POSIX_FD'])).resolves.toBeDefined();
    expect(stock.stats().levels[0].held).toBe(0);
    expect(fake.memoryInfo().freeBytes).toBe(0n);
    // Nothing stocked to give back: refused.
    await expect(stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD'])).rejects.toThrow(/out of memory/);
    await settle();
  });

  it('gives everything back at close, and refills nothing after', async () => {
    const { fake, stock, closed } = stocked();
    await stock.fill();
    const handle = await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    stock.close();
    await settle();
    // The one still stocked, and the ready descriptor of the one handed out; the refill it asked for never ran.
    expect(closed).toHaveLength(2);
    expect(stock.stats().levels[0].held).toBe(0);
    await stock.release(handle, 2n * MiB, false, 0);
    expect(fake.memoryInfo().freeBytes).toBe(64n * MiB);
  });

  it('is invisible to the registry: stocked memory is no object, and Create and Export keep their rules', async () => {
    const { stock } = stocked();
    await stock.fill();
    const registry = new Registry(stock);
    expect(registry.stats().allocations).toBe(0);
    const record = await registry.create(5n, { size: 2n * MiB, location: DEVICE, handleType: 'POSIX_FD' });
    await expect(registry.exportHandle(6n, { allocationId: record.id, handleType: 'POSIX_FD', shareKey: '' })).rejects.toMatchObject({ code: 'NOT_OWNER' });
    const exported = await registry.exportHandle(5n, { allocationId: record.id, handleType: 'POSIX_FD', shareKey: '' });
    expect(exported.fd).toBe(1000 + Number(record.handle));
    await expect(registry.create(5n, { size: 3n * MiB, location: DEVICE, handleType: 'POSIX_FD' })).rejects.toThrow(/not a multiple/);
  });
});

describe('--stock', () => {
  it.each([
    ['auto', 'auto'],
    ['none', []],
    ['2MiB:4', [{ size: 2n * MiB, depth: 4 }]],
    [
      ' 2MiB:4, 32MiB:1 ',
      [
        { size: 2n * MiB, depth: 4 },
        { size: 32n * MiB, depth: 1 },
      ],
    ],
  ])('%s', (text, expected) => expect(parseStock('--stock', text)).toEqual(expected));

  it.each([
    ['2MiB', /"2MiB" is not SIZE:DEPTH/],
    ['2MiB:0', /"0" is not an integer from 1 to 64/],
    ['2MiB:65', /from 1 to 64/],
    ['0:2', /must be greater than 0/],
    ['2XB:1', /"2XB" is not a byte count/],
  ])('refuses %s', (text, message) => expect(() => parseStock('--stock', text)).toThrow(message));
});

describe('a refill', () => {
  it('creates REFILL_PARALLEL at once, and no more than the shelf lacks', async () => {
    class Concurrent extends FakeBackend {
      now = 0;
      most = 0;
      override async createExported(...args: Parameters<FakeBackend['createExported']>) {
        this.now++;
        this.most = Math.max(this.most, this.now);
        await new Promise((resolve) => setTimeout(resolve, 2));
        try {
          return await super.createExported(...args);
        } finally {
          this.now--;
        }
      }
    }
    const fake = new Concurrent({ capacity: 64n * MiB });
    const stock = new StockedBackend(fake, [{ size: 2n * MiB, depth: 5 }], quiet, () => undefined);
    await stock.fill();
    expect(fake.most).toBe(REFILL_PARALLEL);
    expect(stock.stats().levels[0].held).toBe(5);
    expect(fake.calls.filter((call) => call === 'create')).toHaveLength(5);
    stock.close();
  });
});
