/**
 * The stock holds back the frees nobody waits for (a session socket's
 * release, answered before its free) and runs them together: when the
 * daemon is quiet, with a refill burst, once RELEASE_BATCH are held, or at
 * close(). Whoever waits for a free hurries them: the Release RPC, a
 * reclaim, a create out of memory or over a quota. Fake timers: no test
 * here depends on the machine's speed.
 */
import pino from 'pino';
import { Quotas } from '../../server/registry/quotas';
import { Registry } from '../../server/registry';
import {
  DEMAND_SHARE,
  QUIET_MS,
  RELEASE_HOLD_MAX,
  RELEASE_HOLD_MIN_BYTES,
  RELEASE_START_BATCH,
  StockedBackend,
  MAX_REFILL_DELAY_MS,
} from '../../server/backends/stock';
import type { BackendHandle } from '../../server/backends/backend';
import { FakeBackend, MiB } from './fake-backend';

const DEVICE = { type: 'DEVICE' as const, id: 0 };
const SESSION = 7n;
const quiet = pino({ level: 'silent' });
const releases = (fake: FakeBackend) => fake.calls.filter((call) => call === 'release').length;
const turns = async (count = 3) => {
  for (let i = 0; i < count; i++) await new Promise((resolve) => setImmediate(resolve));
};

function stocked(levels = [{ size: 2n * MiB, depth: 4 }], capacity = 256n * MiB) {
  const fake = new FakeBackend({ capacity });
  const stock = new StockedBackend(fake, levels, quiet, () => undefined);
  return { fake, stock };
}

/** `count` allocations of `size` made by the backend under the stock (the stock's demand does not see them). */
async function made(fake: FakeBackend, count: number, size = 4n * MiB): Promise<BackendHandle[]> {
  const handles: BackendHandle[] = [];
  for (let i = 0; i < count; i++) handles.push(await fake.create(0, DEVICE, size));
  return handles;
}

describe('frees the stock holds back', () => {
  beforeEach(() => jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] }));
  afterEach(() => jest.useRealTimers());

  it('runs a release once the daemon is quiet, and resolves it then', async () => {
    const { fake, stock } = stocked([]);
    const [handle] = await made(fake, 1);
    let freed = false;
    void stock.release(handle, 4n * MiB, false, 0).then(() => (freed = true));
    await turns();
    expect(releases(fake)).toBe(0);
    expect(stock.heldReleases).toBe(1);
    expect(fake.memoryInfo().freeBytes).toBe(252n * MiB);
    await jest.advanceTimersByTimeAsync(QUIET_MS);
    expect(releases(fake)).toBe(1);
    expect(freed).toBe(true);
    expect(fake.memoryInfo().freeBytes).toBe(256n * MiB);
  });

  it('holds them while creates keep coming, but not past MAX_REFILL_DELAY_MS', async () => {
    // A deep shelf: the takes below never bring it down to a quarter (which would start a burst).
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 160 }], 512n * MiB);
    await stock.fill();
    const [handle] = await made(fake, 1);
    void stock.release(handle, 4n * MiB, false, 0);
    // A stocked create every 0.9 QUIET_MS: never quiet.
    let elapsed = 0;
    while (releases(fake) === 0 && elapsed <= 2 * MAX_REFILL_DELAY_MS) {
      await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
      await jest.advanceTimersByTimeAsync(QUIET_MS * 0.9);
      elapsed += QUIET_MS * 0.9;
    }
    expect(releases(fake)).toBeGreaterThan(0);
    expect(elapsed).toBeGreaterThanOrEqual(MAX_REFILL_DELAY_MS - QUIET_MS);
    expect(elapsed).toBeLessThanOrEqual(MAX_REFILL_DELAY_MS + QUIET_MS);
  });

  it('runs them all once RELEASE_HOLD_MAX are held', async () => {
    // 64 KiB each: 16 MiB in all, under the bytes bound of 1 GiB (32 MiB).
    const size = MiB / 16n;
    const { fake, stock } = stocked([], 1024n * MiB);
    const handles = await made(fake, RELEASE_HOLD_MAX, size);
    for (const handle of handles.slice(0, -1)) void stock.release(handle, size, false, 0);
    await turns();
    expect(releases(fake)).toBe(0);
    void stock.release(handles[handles.length - 1], size, false, 0);
    // RELEASE_START_BATCH start in that turn, as many more at each turn after: none waits for another to end.
    expect({ started: releases(fake), held: stock.heldReleases }).toEqual({ started: RELEASE_START_BATCH, held: 0 });
    await turns(1);
    expect(releases(fake)).toBe(2 * RELEASE_START_BATCH);
    await turns(RELEASE_HOLD_MAX / RELEASE_START_BATCH);
    expect(releases(fake)).toBe(RELEASE_HOLD_MAX);
  });

  it("runs them all once a device's held bytes pass its total / DEMAND_SHARE (at least RELEASE_HOLD_MIN_BYTES)", async () => {
    // 4 GiB: at most 128 MiB held. Two 48 MiB frees are 96 MiB: held; the third passes the bound.
    const capacity = 4096n * MiB;
    expect(capacity / DEMAND_SHARE).toBe(128n * MiB);
    expect(RELEASE_HOLD_MIN_BYTES).toBeLessThan(128n * MiB);
    const { fake, stock } = stocked([], capacity);
    const handles = await made(fake, 3, 48n * MiB);
    for (const handle of handles.slice(0, 2)) void stock.release(handle, 48n * MiB, false, 0);
    await turns();
    expect(releases(fake)).toBe(0);
    void stock.release(handles[2], 48n * MiB, false, 0);
    await turns(6);
    expect(releases(fake)).toBe(3);
  });

  it('runs them before the refill of a shelf run low, in one burst: frees first, then creates', async () => {
    const { fake, stock } = stocked([{ size: 2n * MiB, depth: 4 }]);
    await stock.fill();
    const [handle] = await made(fake, 1);
    void stock.release(handle, 4n * MiB, false, 0);
    fake.calls.length = 0;
    for (let i = 0; i < 3; i++) await stock.create(0, DEVICE, 2n * MiB, ['POSIX_FD']);
    await turns(6);
    expect(fake.calls.filter((call) => call === 'release' || call === 'create')).toEqual(['release', 'create', 'create', 'create']);
  });

  it('starts them when someone waits for the frees in flight, with a release that reaches the stock later in the same turn', async () => {
    const { fake, stock } = stocked([]);
    const [a, b] = await made(fake, 2);
    const first = stock.release(a, 4n * MiB, false, 0);
    void stock.settleReleases();
    // On its way through the registry's adaptors: it arrives after settleReleases(), in the same turn.
    const second = Promise.resolve().then(() => stock.release(b, 4n * MiB, false, 0));
    await first;
    await second;
    expect(releases(fake)).toBe(2);
  });

  it('rejects a held release that fails, and the memory stays', async () => {
    const { fake, stock } = stocked([]);
    const [handle] = await made(fake, 1);
    const failing = stock.release(Number(handle) + 1000, 4n * MiB, false, 0);
    void stock.settleReleases();
    await expect(failing).rejects.toMatchObject({ code: 'EBADF' });
    expect(fake.memoryInfo().freeBytes).toBe(252n * MiB);
  });

  it('close() resolves once every release it started (held, the shelves emptied) has run, and closes the backend after them', async () => {
    // The daemon exits once close() resolves: a driver call still running then meets the driver's teardown.
    class Gated extends FakeBackend {
      gate: Promise<void> = Promise.resolve();
      closedWith = -1;
      override async release(handle: BackendHandle): Promise<void> {
        await this.gate;
        return super.release(handle);
      }
      override close(): void {
        this.closedWith = this.memory.size;
      }
    }
    const fake = new Gated({ capacity: 256n * MiB });
    const stock = new StockedBackend(fake, [{ size: 2n * MiB, depth: 4 }], quiet, () => undefined);
    await stock.fill();
    const handles = await made(fake, 5);
    for (const handle of handles) void stock.release(handle, 4n * MiB, false, 0);
    let open!: () => void;
    fake.gate = new Promise((resolve) => (open = resolve));
    let closed = false;
    const closing = Promise.resolve(stock.close()).then(() => (closed = true));
    await turns(6);
    expect({ closed, backendClosed: fake.closedWith }).toEqual({ closed: false, backendClosed: -1 });
    open();
    await closing;
    // Nothing left: the five released, the four stocked given back, and only then the backend closed.
    expect({ live: fake.memory.size, backendClosed: fake.closedWith }).toEqual({ live: 0, backendClosed: 0 });
  });

  it('runs them at close()', async () => {
    const { fake, stock } = stocked([]);
    const [handle] = await made(fake, 1);
    const released = stock.release(handle, 4n * MiB, false, 0);
    stock.close();
    await released;
    expect(fake.memoryInfo().freeBytes).toBe(256n * MiB);
  });
});

describe('whoever waits for a free hurries the held ones (no timer advances in these)', () => {
  beforeEach(() => jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] }));
  afterEach(() => jest.useRealTimers());
  const ARGS = { size: 4n * MiB, location: DEVICE, handleType: 'POSIX_FD' as const };

  it('the Release RPC (release resolves after the free) and a reclaim', async () => {
    const { fake, stock } = stocked([]);
    const registry = new Registry(stock);
    const a = await registry.create(SESSION, ARGS);
    await expect(registry.release(SESSION, a.id)).resolves.toMatchObject({ freed: true });
    expect(releases(fake)).toBe(1);
    const b = await registry.create(SESSION, ARGS);
    await registry.reclaim(SESSION);
    expect(fake.memoryInfo().freeBytes).toBe(256n * MiB);
    expect(b.freed).toBe(true);
  });

  it('a create out of device memory right after a session-socket release', async () => {
    const { stock } = stocked([], 8n * MiB);
    const registry = new Registry(stock);
    const a = await registry.create(SESSION, ARGS);
    await registry.create(SESSION, ARGS);
    await registry.releaseAnswering(SESSION, a.id);
    await expect(registry.create(SESSION, ARGS)).resolves.toMatchObject({ size: 4n * MiB });
  });

  it('a create over the session quota right after a session-socket release', async () => {
    const { stock } = stocked([], 64n * MiB);
    const quotas = new Quotas({ perUid: 0n, perSession: 8n * MiB }, () => 1000);
    const registry = new Registry(stock, (upstream) => quotas.around(upstream, (handle, device) => stock.memoryIdentity(handle, device)));
    const a = await registry.create(SESSION, ARGS);
    await registry.create(SESSION, ARGS);
    await registry.releaseAnswering(SESSION, a.id);
    await expect(registry.create(SESSION, ARGS)).resolves.toMatchObject({ size: 4n * MiB });
  });
});
