/**
 * The stock that follows bursts and holds frees (server/backends/
 * stock.ts, stock-demand.ts, held-releases.ts), as a hostile client would
 * drive it: close() must wait for every free it let go (those started a
 * RELEASE_START_BATCH a turn included, and those that reach a closing stock)
 * before it closes the backend; held frees are started once each, never lost,
 * and bounded per device; what the demand remembers stays bounded whatever
 * sizes and devices are asked; plan() keeps every shelf within its floor,
 * BURST_MAX_DEPTH and the device's share. Fake timers, as the other stock tests.
 */
import pino from 'pino';
import {
  BURST_MAX_DEPTH,
  DEMAND_MAX_DEPTH,
  DEMAND_MAX_SHELVES,
  DEMAND_SHARE,
  DEMAND_WINDOW,
  RELEASE_HOLD_MAX,
  RELEASE_HOLD_MIN_BYTES,
  RELEASE_START_BATCH,
  StockedBackend,
} from '../../server/backends/stock';
import { HeldReleases } from '../../server/backends/held-releases';
import { Registry } from '../../server/registry';
import { StockDemand } from '../../server/backends/stock-demand';
import type { BackendHandle } from '../../server/backends/backend';
import { FakeBackend, GRANULARITY, MiB } from './fake-backend';

const DEVICE = { type: 'DEVICE' as const, id: 0 };
const quiet = pino({ level: 'silent' });
const SMALL = MiB / 16n;
const releases = (fake: FakeBackend) => fake.calls.filter((call) => call === 'release').length;
const turns = async (count = 3) => {
  for (let i = 0; i < count; i++) await new Promise((resolve) => setImmediate(resolve));
};

/** A fake that records how many allocations were still live when it was closed, and can hold releases at a gate. */
class Closing extends FakeBackend {
  closedWith = -1;
  closes = 0;
  readonly gates = new Map<number, Promise<void>>();
  override async release(handle: BackendHandle): Promise<void> {
    const gate = this.gates.get(Number(handle));
    if (gate !== undefined) await gate;
    return super.release(handle);
  }
  override close(): void {
    this.closes++;
    if (this.closedWith < 0) this.closedWith = this.memory.size;
  }
}

async function made(fake: FakeBackend, count: number, size = SMALL): Promise<BackendHandle[]> {
  const handles: BackendHandle[] = [];
  for (let i = 0; i < count; i++) handles.push(await fake.create(0, DEVICE, size));
  return handles;
}

describe('close() and the frees let go a batch a turn', () => {
  beforeEach(() => jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] }));
  afterEach(() => jest.useRealTimers());

  // FAILS on the current code: runAll(true) at close only sees this.held; the rest of an earlier batch waits in a
  // setImmediate chain, untracked, and starts (inner.release) after the inner backend was closed.
  it('close() closes the backend only after every release let go before it, those still waiting for their turn included', async () => {
    const fake = new Closing({ capacity: 256n * MiB });
    const stock = new StockedBackend(fake, [], quiet, () => undefined);
    const count = 3 * RELEASE_START_BATCH;
    const handles = await made(fake, count);
    const freed = handles.map((handle) => stock.release(handle, SMALL, false, 0));
    await turns();
    expect(stock.heldReleases).toBe(count);
    // A Release RPC waits for its free: RELEASE_START_BATCH start now, the rest at the next turns...
    void stock.settleReleases();
    expect(releases(fake)).toBe(RELEASE_START_BATCH);
    // ...and the daemon stops in this same turn.
    await stock.close();
    expect({ liveWhenClosed: fake.closedWith, releasedBeforeClose: count - fake.closedWith }).toEqual({ liveWhenClosed: 0, releasedBeforeClose: count });
    await Promise.all(freed);
  });

  // FAILS on the current code, for the same reason: the chain started by the RELEASE_HOLD_MAX bound.
  it('close() right after RELEASE_HOLD_MAX held frees were let go waits for all of them', async () => {
    const fake = new Closing({ capacity: 256n * MiB });
    const stock = new StockedBackend(fake, [], quiet, () => undefined);
    const handles = await made(fake, RELEASE_HOLD_MAX);
    const freed = handles.map((handle) => stock.release(handle, SMALL, false, 0));
    expect(stock.heldReleases).toBe(0);
    await stock.close();
    expect(fake.closedWith).toBe(0);
    await Promise.all(freed);
  });

  // FAILS on the current code: a release that reaches a closed stock goes to releaseNow() untracked (stock.ts:226),
  // so close() can close the backend while that free is still running on a driver thread.
  it('close() waits for a release that reaches the stock while it closes', async () => {
    const fake = new Closing({ capacity: 256n * MiB });
    const stock = new StockedBackend(fake, [], quiet, () => undefined);
    const [a, b] = await made(fake, 2);
    let openA!: () => void;
    let openB!: () => void;
    fake.gates.set(Number(a), new Promise((resolve) => (openA = resolve)));
    fake.gates.set(Number(b), new Promise((resolve) => (openB = resolve)));
    const freedA = stock.release(a, SMALL, false, 0);
    const closing = stock.close();
    await turns();
    // A session's teardown frees one more while the stock waits for the first.
    const freedB = stock.release(b, SMALL, false, 0);
    openA();
    await freedA;
    await turns(6);
    const closedBeforeB = fake.closedWith;
    openB();
    await freedB;
    await closing;
    expect(closedBeforeB).toBe(-1);
    expect(fake.closedWith).toBe(0);
  });

  // Passes: a second close() after the first adds no driver work (it closes the inner backend again, which the
  // backends tolerate today; see the report).
  it('close() twice leaves nothing live and rejects nothing', async () => {
    const fake = new Closing({ capacity: 256n * MiB });
    const stock = new StockedBackend(fake, [{ size: GRANULARITY, depth: 4 }], quiet, () => undefined);
    await stock.fill();
    const [handle] = await made(fake, 1);
    const freed = stock.release(handle, SMALL, false, 0);
    await Promise.all([stock.close(), stock.close()]);
    await freed;
    expect(fake.memory.size).toBe(0);
  });
});

describe('held frees: each started once, none lost, bounded per device', () => {
  beforeEach(() => jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] }));
  afterEach(() => jest.useRealTimers());

  // Passes: runAll() splices what it starts; a second runAll/hurry during an earlier chain starts only new ones.
  it('hurry() while an earlier batch is still being started starts every release exactly once', async () => {
    const started: number[] = [];
    const held = new HeldReleases(async (handle) => void started.push(Number(handle)));
    const first = Array.from({ length: 3 * RELEASE_START_BATCH }, (_, i) => held.hold(i, 1n, false, 0));
    held.runAll();
    const second = Array.from({ length: 2 * RELEASE_START_BATCH }, (_, i) => held.hold(1000 + i, 1n, false, 0));
    held.hurry();
    held.hurry();
    await Promise.all([...first, ...second]);
    await turns(8);
    expect(started.length).toBe(5 * RELEASE_START_BATCH);
    expect(new Set(started).size).toBe(started.length);
  });

  // Passes: the byte bound is per device (two devices each under it hold, together over it).
  it("holds each device's frees up to that device's bound, not the sum of all devices'", async () => {
    const started: number[] = [];
    const held = new HeldReleases(
      async (handle) => void started.push(Number(handle)),
      () => 0n,
    );
    const half = RELEASE_HOLD_MIN_BYTES / 2n;
    void held.hold(1, half, false, 0);
    void held.hold(2, half, false, 1);
    void held.hold(3, half, false, 0);
    void held.hold(4, half, false, 1);
    expect(started).toEqual([]);
    void held.hold(5, 1n, false, 0);
    expect(started.length).toBe(5);
  });

  // Passes: a failed start rejects its own promise only; the others of its batch still run.
  it('a release that fails rejects only its own promise', async () => {
    const held = new HeldReleases(async (handle) => {
      if (Number(handle) === 3) throw new Error('boom');
    });
    const all = Array.from({ length: 2 * RELEASE_START_BATCH }, (_, i) => held.hold(i, 1n, false, 0));
    held.runAll();
    const outcomes = await Promise.allSettled(all);
    expect(outcomes.filter((outcome) => outcome.status === 'rejected').length).toBe(1);
  });
});

describe('what the demand remembers and plans', () => {
  // Passes: forgotten with the window; bounded per device whatever sizes are asked.
  it('remembers at most DEMAND_WINDOW sizes per device, whatever sizes are asked, with no quiet moment ever', () => {
    const demand = new StockDemand();
    for (let i = 0; i < 20_000; i++) demand.note(i % 4, BigInt(i) * GRANULARITY + BigInt(i % 3));
    expect(demand.remembered).toBeLessThanOrEqual(4 * DEMAND_WINDOW);
    for (let i = 0; i < 20_000; i++) demand.note(0, GRANULARITY);
    demand.quiet();
    expect(demand.burstDepth(0, GRANULARITY)).toBe(BURST_MAX_DEPTH);
  });

  // Passes: checked over random demand, configured shelves and device sizes.
  it('plans every shelf within [floor, max(floor, BURST_MAX_DEPTH)], integral, the demand within total / DEMAND_SHARE, aligned', () => {
    let seed = 12345;
    const random = (n: number) => {
      seed = (seed * 1103515245 + 12345) % 2 ** 31;
      return seed % n;
    };
    for (let round = 0; round < 200; round++) {
      const demand = new StockDemand();
      const total = BigInt(1 + random(4096)) * MiB;
      const floors = Array.from({ length: random(3) }, () => ({ size: BigInt(1 + random(8)) * GRANULARITY, floor: 1 + random(600) }));
      const shelves = [...new Map(floors.map((shelf) => [shelf.size, shelf])).values()];
      for (let burst = 0; burst < 12; burst++) {
        for (let i = 0, n = random(200); i < n; i++) demand.note(0, BigInt(1 + random(10)) * (random(5) === 0 ? MiB : GRANULARITY));
        demand.quiet();
      }
      const depths = demand.plan(0, total, GRANULARITY, shelves);
      let extra = 0n;
      for (const [size, depth] of depths) {
        const floor = shelves.find((shelf) => shelf.size === size)?.floor ?? 0;
        expect(Number.isInteger(depth)).toBe(true);
        expect(depth).toBeGreaterThanOrEqual(Math.max(floor, 1));
        expect(depth).toBeLessThanOrEqual(Math.max(floor, BURST_MAX_DEPTH, DEMAND_MAX_DEPTH));
        if (floor === 0) expect(size % GRANULARITY).toBe(0n);
        extra += BigInt(depth - floor) * size;
      }
      for (const shelf of shelves) expect(depths.get(shelf.size)).toBeGreaterThanOrEqual(shelf.floor);
      expect([...depths.keys()].filter((size) => !shelves.some((shelf) => shelf.size === size)).length).toBeLessThanOrEqual(DEMAND_MAX_SHELVES);
      expect(extra).toBeLessThanOrEqual(total / DEMAND_SHARE);
    }
  });
});

describe('stocked memory yields to a Create', () => {
  beforeEach(() => jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] }));
  afterEach(() => jest.useRealTimers());

  // FAILS on the current code (older than this change, made worse by it: bursts deepen shelves up to total / 32 more):
  // a Create out of memory empties the device's shelves but still throws (stock.ts:202-206), and the registry retries
  // only while a free of its own is in flight, so the client is refused memory the stock held only for speed.
  it('a Create that fits once the stock gives its memory back succeeds', async () => {
    const fake = new FakeBackend({ capacity: 32n * MiB });
    const stock = new StockedBackend(fake, [{ size: GRANULARITY, depth: 8 }], quiet, () => undefined);
    await stock.fill();
    const registry = new Registry(stock);
    const args = { size: 4n * MiB, location: DEVICE, handleType: 'POSIX_FD' as const };
    for (let i = 0; i < 4; i++) await registry.create(7n, args);
    expect(fake.memoryInfo().freeBytes).toBe(0n);
    await expect(registry.create(7n, args)).resolves.toMatchObject({ size: 4n * MiB });
  });
});
