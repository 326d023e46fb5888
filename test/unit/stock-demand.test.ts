/**
 * The stock following what clients ask for, refilled when the daemon is
 * quiet: sizes asked often get shelves of their own, deeper the
 * more they are asked, within a share of the device; sizes no longer asked
 * give their memory back; refills wait while requests keep coming, but not
 * forever. Fake timers: nothing here depends on the machine's speed.
 */
import pino from 'pino';
import {
  BURST_HEADROOM,
  BURST_IDLE_MS,
  BURST_MAX_DEPTH,
  BURST_MEMORY,
  DEMAND_MAX_DEPTH,
  DEMAND_MAX_SHELVES,
  DEMAND_MIN_COUNT,
  DEMAND_WINDOW,
  MAX_REFILL_DELAY_MS,
  QUIET_MS,
  StockedBackend,
  StockLevel,
} from '../../server/backends/stock';
import { StockDemand } from '../../server/backends/stock-demand';
import { FakeBackend, MiB } from './fake-backend';

const DEVICE = { type: 'DEVICE' as const, id: 0 };
const quiet = pino({ level: 'silent' });

function stocked(levels: StockLevel[] = [], capacity = 1024n * MiB) {
  const fake = new FakeBackend({ capacity });
  const stock = new StockedBackend(fake, levels, quiet, () => undefined);
  return { fake, stock };
}

const creates = (fake: FakeBackend) => fake.calls.filter((call) => call === 'create').length;
/**
 * Asks for `count` allocations of `size`, each released at once (as a client that allocates and frees would,
 * on the session socket: nobody waits for the free, which the stock holds back until it is quiet).
 */
async function ask(stock: StockedBackend, size: bigint, count: number, spacingMs = 0): Promise<void> {
  for (let i = 0; i < count; i++) {
    const handle = await stock.create(0, DEVICE, size, ['POSIX_FD']);
    void stock.release(handle, size, false, 0);
    if (spacingMs > 0) await jest.advanceTimersByTimeAsync(spacingMs);
  }
}
const demandLevels = (stock: StockedBackend) => stock.stats().levels.filter((level) => level.demand);
/**
 * Waits for `condition` without advancing the (fake) clock: the event loop turns until it holds, so a test
 * says what it waits for rather than how many turns the stock takes to get there. Fails after `maxTurns`.
 */
async function until(condition: () => boolean, maxTurns = 1000): Promise<void> {
  for (let turn = 0; turn < maxTurns; turn++) {
    if (condition()) return;
    await new Promise((resolve) => setImmediate(resolve));
  }
  throw new Error(`condition not met after ${maxTurns} event-loop turns: ${condition.toString()}`);
}

describe('a stock that follows demand and refills when quiet', () => {
  beforeEach(() => jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] }));
  afterEach(() => jest.useRealTimers());

  it('gives a size asked often a shelf of its own at once, filled without waiting for quiet; the next ask is a hit', async () => {
    const { fake, stock } = stocked();
    await ask(stock, 6n * MiB, DEMAND_MIN_COUNT - 1);
    await jest.advanceTimersByTimeAsync(10 * QUIET_MS);
    expect(demandLevels(stock)).toEqual([]);
    const before = creates(fake);
    // The ask that makes the size steady demand: its shelf exists on the spot and fills without a quiet moment,
    // while requests keep coming (no timer advances: never quiet).
    await ask(stock, 6n * MiB, 1);
    expect(demandLevels(stock)).toEqual([{ device: 0, size: String(6n * MiB), depth: 1, held: 0, demand: true }]);
    await until(() => demandLevels(stock)[0]?.held === 1);
    expect(demandLevels(stock)).toEqual([{ device: 0, size: String(6n * MiB), depth: 1, held: 1, demand: true }]);
    expect(creates(fake)).toBe(before + 2);
    await stock.create(0, DEVICE, 6n * MiB, ['POSIX_FD']);
    expect(stock.stats()).toMatchObject({ hits: 1 });
  });

  it('deepens a shelf the more its size is asked, up to DEMAND_MAX_DEPTH', async () => {
    const { stock } = stocked();
    // One at a time, quiet after each (bursts of one deepen nothing: how often counts here).
    await ask(stock, 2n * MiB, DEMAND_MIN_COUNT * 2, 2 * QUIET_MS);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    expect(demandLevels(stock)).toMatchObject([{ size: String(2n * MiB), depth: 2, held: 2 }]);
    await ask(stock, 2n * MiB, DEMAND_MIN_COUNT * 10, 2 * QUIET_MS);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    expect(demandLevels(stock)).toMatchObject([{ size: String(2n * MiB), depth: DEMAND_MAX_DEPTH, held: DEMAND_MAX_DEPTH }]);
  });

  it('waits for quiet while requests keep coming, but refills at the latest MAX_REFILL_DELAY_MS after a take', async () => {
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 8 }]);
    await stock.fill();
    const start = creates(fake);
    // Three takes leave five: half the depth or more, so the refill waits for quiet. Each comes before QUIET_MS.
    const spacing = QUIET_MS * 0.6;
    for (let i = 0; i < 3; i++) {
      await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
      await jest.advanceTimersByTimeAsync(spacing);
    }
    expect(creates(fake)).toBe(start);
    expect(stock.stats().levels[0].held).toBe(5);
    await jest.advanceTimersByTimeAsync(2 * QUIET_MS);
    expect(stock.stats().levels[0].held).toBe(8);
    // Requests of another size every 0.6 QUIET_MS: never quiet; the refill of one take runs at the latest delay.
    await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    const asked = creates(fake);
    await ask(stock, 4n * MiB, Math.floor(MAX_REFILL_DELAY_MS / spacing) - 2, spacing);
    expect(stock.stats().levels[0].held).toBe(7);
    const onTheSpot = creates(fake) - asked;
    await jest.advanceTimersByTimeAsync(4 * spacing);
    expect(stock.stats().levels[0].held).toBe(8);
    expect(creates(fake) - asked).toBeGreaterThan(onTheSpot);
  });

  it('refills a shelf left with a quarter of its depth or less at once, to full, quiet or not', async () => {
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 4 }]);
    await stock.fill();
    const start = creates(fake);
    const turns = async () => {
      await new Promise((resolve) => setImmediate(resolve));
      await new Promise((resolve) => setImmediate(resolve));
    };
    for (let i = 0; i < 2; i++) await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    // Two left, more than a quarter of four: the refill waits for quiet.
    await turns();
    expect(creates(fake)).toBe(start);
    await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    // One left: a quarter. No timer needed, and the burst fills the shelf.
    for (let i = 0; i < 5 && stock.stats().levels[0].held < 4; i++) await turns();
    expect(stock.stats().levels[0].held).toBe(4);
    expect(creates(fake)).toBe(start + 3);
  });

  it('keeps the shelves the demand added within the device total / 32', async () => {
    // 1 GiB: 32 MiB for demand shelves. 24 MiB fits once, 40 MiB not at all.
    const { stock } = stocked([], 1024n * MiB);
    await ask(stock, 40n * MiB, DEMAND_MIN_COUNT * 4);
    await ask(stock, 24n * MiB, DEMAND_MIN_COUNT * 3);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    expect(demandLevels(stock)).toEqual([{ device: 0, size: String(24n * MiB), depth: 1, held: 1, demand: true }]);
  });

  it('adds at most DEMAND_MAX_SHELVES shelves, for the most asked sizes, and never for a configured or unaligned one', async () => {
    // 8 GiB: a demand budget of 256 MiB, room for all four.
    const { stock } = stocked([{ size: 2n * MiB, depth: 1 }], 8192n * MiB);
    await stock.fill();
    const sizes = [4n, 6n, 8n, 10n, 12n, 14n].map((n) => n * MiB);
    // One at a time, quiet after each: how often counts here, not how many at once.
    for (const [index, size] of sizes.entries()) await ask(stock, size, DEMAND_MIN_COUNT + index, 2 * QUIET_MS);
    await ask(stock, 2n * MiB, DEMAND_MIN_COUNT * 2, 2 * QUIET_MS);
    await ask(stock, 3n * MiB, DEMAND_MIN_COUNT * 2, 2 * QUIET_MS); // not a multiple of the fake's 2 MiB granularity
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    // The most asked sizes, whichever order their shelves were made in.
    expect(
      demandLevels(stock)
        .map((level) => Number(BigInt(level.size) / MiB))
        .sort((x, y) => y - x),
    ).toEqual([14, 12, 10, 8].slice(0, DEMAND_MAX_SHELVES));
    // The configured shelf: bursts of one ask deepen nothing.
    expect(stock.stats().levels.filter((level) => !level.demand)).toEqual([{ device: 0, size: String(2n * MiB), depth: 1, held: 1 }]);
  });

  it('gives back a shelf and its memory once its size is no longer asked', async () => {
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 1 }], 256n * MiB);
    await stock.fill();
    await ask(stock, 6n * MiB, DEMAND_MIN_COUNT);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    expect(demandLevels(stock)).toMatchObject([{ size: String(6n * MiB), held: 1 }]);
    // A window of other requests: 6 MiB falls out of it.
    await ask(stock, 2n * MiB, DEMAND_WINDOW);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    expect(demandLevels(stock)).toEqual([]);
    // The stock holds only the configured shelf now: the 6 MiB went back.
    const held = stock.stats().levels.reduce((sum, level) => sum + BigInt(level.size) * BigInt(level.held), 0n);
    expect(fake.memoryInfo().freeBytes).toBe(256n * MiB - held);
  });

  it('refills nothing after close()', async () => {
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 2 }]);
    await stock.fill();
    await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    stock.close();
    const before = creates(fake);
    await jest.advanceTimersByTimeAsync(10 * MAX_REFILL_DELAY_MS);
    expect(creates(fake)).toBe(before);
  });
});

describe('a size that becomes steady demand on a request', () => {
  beforeEach(() => jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] }));
  afterEach(() => jest.useRealTimers());

  it('gets a shelf of its own there, and no other shelf changes until the quiet moment', async () => {
    const { fake, stock } = stocked([], 8192n * MiB);
    // 4 MiB asked twice the minimum, one at a time: a shelf two deep.
    await ask(stock, 4n * MiB, DEMAND_MIN_COUNT * 2, 2 * QUIET_MS);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    expect(demandLevels(stock)).toMatchObject([{ size: String(4n * MiB), depth: 2, held: 2 }]);
    // Enough other sizes (each asked less than the minimum) to push most 4 MiB asks out of the window.
    for (let i = 0; i < DEMAND_WINDOW - DEMAND_MIN_COUNT; i++) {
      const size = BigInt(10 + 2 * (i % 20)) * MiB;
      await stock.create(0, DEVICE, size, ['POSIX_FD']).then(
        (handle) => void stock.release(handle, size, false, 0),
        () => undefined,
      );
      void stock.settleReleases();
      if (demandLevels(stock).length > 1) break;
    }
    const discards = fake.calls.filter((call) => call === 'release').length;
    // 6 MiB becomes steady demand now, with no quiet moment: its shelf comes; the 4 MiB shelf stays as it was.
    for (let i = 0; i < DEMAND_MIN_COUNT; i++) await stock.create(0, DEVICE, 6n * MiB, ['POSIX_FD']);
    const levels = demandLevels(stock);
    expect(levels.find((level) => level.size === String(6n * MiB))).toMatchObject({ depth: 1 });
    expect(levels.find((level) => level.size === String(4n * MiB))).toMatchObject({ depth: 2, held: 2 });
    expect(fake.calls.filter((call) => call === 'release').length).toBe(discards);
    // The quiet moment fits the shelves to the demand: 4 MiB, now rarely asked, gives its memory back.
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    expect(demandLevels(stock).find((level) => level.size === String(4n * MiB))).toBeUndefined();
  });
});

describe('a stock as deep as the bursts it serves', () => {
  beforeEach(() => jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] }));
  afterEach(() => jest.useRealTimers());
  const releases = (fake: FakeBackend) => fake.calls.filter((call) => call === 'release').length;
  const level = (stock: StockedBackend, size: bigint) => stock.stats().levels.find((candidate) => candidate.size === String(size));

  it('deepens a configured shelf to its bursts: a second burst like the first meets no create and no free until it ends', async () => {
    // 4 GiB: 128 MiB for what the demand adds, room for 64 more 2 MiB.
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 4 }], 4096n * MiB);
    await stock.fill();
    // A burst of 20 (the shelf of 4 refills as it goes: it runs low), then quiet.
    await ask(stock, 2n * MiB, 20);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    const deep = Math.ceil(20 * BURST_HEADROOM);
    await until(() => level(stock, 2n * MiB)?.held === deep);
    expect(level(stock, 2n * MiB)).toEqual({ device: 0, size: String(2n * MiB), depth: deep, held: deep });
    // The same burst again, with no quiet moment in it: all hits, and the daemon's driver work waits.
    const before = { creates: creates(fake), releases: releases(fake), hits: stock.stats().hits };
    await ask(stock, 2n * MiB, 20);
    for (let i = 0; i < 10; i++) await new Promise((resolve) => setImmediate(resolve));
    expect({ creates: creates(fake), releases: releases(fake), hits: stock.stats().hits }).toEqual({ ...before, hits: before.hits + 20 });
    // Then quiet: the frees and the refill run.
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    await until(() => level(stock, 2n * MiB)?.held === deep && releases(fake) === before.releases + 20);
    expect(creates(fake)).toBe(before.creates + 20);
  });

  it('forgets a burst after BURST_MEMORY smaller ones and gives its memory back, never below the configured depth', async () => {
    const capacity = 4096n * MiB;
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 4 }], capacity);
    await stock.fill();
    await ask(stock, 2n * MiB, 20);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    await until(() => level(stock, 2n * MiB)?.held === Math.ceil(20 * BURST_HEADROOM));
    for (let i = 0; i < BURST_MEMORY; i++) {
      await ask(stock, 2n * MiB, 1);
      await jest.advanceTimersByTimeAsync(QUIET_MS);
    }
    await until(() => level(stock, 2n * MiB)?.held === 4);
    expect(level(stock, 2n * MiB)).toEqual({ device: 0, size: String(2n * MiB), depth: 4, held: 4 });
    await until(() => fake.memoryInfo().freeBytes === capacity - 4n * 2n * MiB);
  });

  it('gives back what bursts added once the device has been idle for BURST_IDLE_MS', async () => {
    const capacity = 4096n * MiB;
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 4 }], capacity);
    await stock.fill();
    await ask(stock, 2n * MiB, 20);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    await until(() => level(stock, 2n * MiB)?.held === 30);
    // Nothing asked since: the deepened shelf stays until the idle bound, then goes back to its configured depth.
    await jest.advanceTimersByTimeAsync(BURST_IDLE_MS - 10 * QUIET_MS);
    expect(level(stock, 2n * MiB)).toMatchObject({ depth: 30 });
    await jest.advanceTimersByTimeAsync(20 * QUIET_MS);
    await until(() => level(stock, 2n * MiB)?.held === 4);
    expect(level(stock, 2n * MiB)).toEqual({ device: 0, size: String(2n * MiB), depth: 4, held: 4 });
    await until(() => fake.memoryInfo().freeBytes === capacity - 4n * 2n * MiB);
    // The next burst teaches it again.
    await ask(stock, 2n * MiB, 20);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    await until(() => level(stock, 2n * MiB)?.held === 30);
  });

  it('keeps what bursts add within the device total / 32', async () => {
    // 1 GiB: 32 MiB beyond the configured depth of 4 (16 more 2 MiB), however large the burst.
    const { stock } = stocked([{ size: 2n * MiB, depth: 4 }], 1024n * MiB);
    await stock.fill();
    await ask(stock, 2n * MiB, 60);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    await until(() => level(stock, 2n * MiB)?.held === 20);
    expect(level(stock, 2n * MiB)).toMatchObject({ depth: 20, held: 20 });
  });

  it('gives a size that comes in bursts a shelf of its own as deep as them', async () => {
    const { stock } = stocked([], 4096n * MiB);
    await ask(stock, 6n * MiB, 10);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    await until(() => level(stock, 6n * MiB)?.held === 15);
    expect(level(stock, 6n * MiB)).toEqual({ device: 0, size: String(6n * MiB), depth: 15, held: 15, demand: true });
  });
});

describe('the demand the stock follows (StockDemand)', () => {
  it('asks for BURST_HEADROOM times the largest of the last BURST_MEMORY bursts, at most BURST_MAX_DEPTH', () => {
    const demand = new StockDemand();
    const burst = (count: number) => {
      for (let i = 0; i < count; i++) demand.note(0, 2n * MiB);
      demand.quiet();
    };
    expect(demand.burstDepth(0, 2n * MiB)).toBe(0);
    burst(10);
    burst(5);
    expect(demand.burstDepth(0, 2n * MiB)).toBe(Math.ceil(10 * BURST_HEADROOM));
    for (let i = 0; i < BURST_MEMORY - 1; i++) burst(5);
    expect(demand.burstDepth(0, 2n * MiB)).toBe(Math.ceil(5 * BURST_HEADROOM));
    // Quiet moments with no request of the size are no bursts of it.
    demand.quiet();
    expect(demand.burstDepth(0, 2n * MiB)).toBe(Math.ceil(5 * BURST_HEADROOM));
    // Bursts smaller than DEMAND_MIN_COUNT ask for nothing.
    for (let i = 0; i < BURST_MEMORY; i++) burst(DEMAND_MIN_COUNT - 1);
    expect(demand.burstDepth(0, 2n * MiB)).toBe(0);
    burst(100_000);
    expect(demand.burstDepth(0, 2n * MiB)).toBe(BURST_MAX_DEPTH);
    expect(demand.burstDepth(1, 2n * MiB)).toBe(0);
  });

  it('forgets the bursts of a size once it leaves the window: a stream of new sizes keeps what is remembered bounded', () => {
    const demand = new StockDemand();
    for (let i = 0; i < 20; i++) demand.note(0, 2n * MiB);
    demand.quiet();
    expect(demand.burstDepth(0, 2n * MiB)).toBe(30);
    // A client asking a new size every time, with no quiet moment: each falls out of the window in turn.
    for (let i = 1; i <= 100_000; i++) demand.note(0, BigInt(i) * 4n * MiB);
    expect(demand.burstDepth(0, 2n * MiB)).toBe(0);
    expect(demand.remembered).toBeLessThanOrEqual(DEMAND_WINDOW);
  });

  it('plans configured shelves at least at their depth, and none of the demand below DEMAND_MIN_COUNT asks', () => {
    const demand = new StockDemand();
    for (let i = 0; i < DEMAND_MIN_COUNT - 1; i++) demand.note(0, 4n * MiB);
    demand.quiet();
    const plan = demand.plan(0, 1024n * MiB, 2n * MiB, [{ size: 2n * MiB, floor: 3 }]);
    expect([...plan]).toEqual([[2n * MiB, 3]]);
  });
});
