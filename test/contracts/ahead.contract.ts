/**
 * Allocations ahead (client/emm/ahead.ts) against a real daemon
 * with a session quota: what the manager holds ahead is an ordinary
 * allocation of its session's, charged to it, taken by the next memalloc of
 * its size, given back when idle or asked to, never a cause of an
 * out-of-memory the caller would not have had. A contract for every backend
 * (test/e2e runs it on host, test/gpu on cuda).
 */
import { Config, connect, Context, DEFAULT_AHEAD, VmmdClient, VmmdError, VmmdMemoryManager } from '../../client';
import type { VmmdManagerContext } from '../../client';
import { call, eventually, MiB, stopWhenClean, TestDaemon } from '../e2e/harness';

/**
 * A manager of a session of its own whose every memalloc is an allocation of its own (nothing pooled, frees at
 * once); its client and itself join `clients` and `managers`, for the caller's teardown.
 */
export async function coldManager(
  socketDir: string,
  backend: 'host' | 'cuda',
  clients: VmmdClient[],
  managers: VmmdMemoryManager[],
  overrides: Partial<VmmdManagerContext> = {},
): Promise<{ mm: VmmdMemoryManager; client: VmmdClient }> {
  const client = await connect({ socketDir });
  clients.push(client);
  const mm = new VmmdMemoryManager({
    device: 0,
    backend,
    client,
    checks: true,
    pool: { chunkSize: 2n * MiB, largeThreshold: 0n },
    deferred: { count: 0, ratio: 1 },
    ...overrides,
  });
  managers.push(mm);
  await mm.initialize();
  return { mm, client };
}

export function aheadContract(backend: 'host' | 'cuda'): void {
  let daemon: TestDaemon;
  const clients: VmmdClient[] = [];
  const managers: VmmdMemoryManager[] = [];

  beforeAll(async () => {
    daemon = await TestDaemon.start(['--quota-per-session', '16MiB'], backend);
  });

  afterEach(async () => {
    for (const manager of managers.splice(0)) await manager.reset();
    for (const connected of clients.splice(0)) connected.close();
  });

  afterAll(async () => {
    await stopWhenClean(daemon, clients);
    expect(await daemon.stop()).toBe(0);
  });

  const manager = (overrides: Partial<VmmdManagerContext> = {}) => coldManager(daemon.dir, backend, clients, managers, overrides);

  /** The bytes the daemon charges `client`'s session (GetReport; the tests run as an admin). */
  async function charged(client: VmmdClient): Promise<bigint> {
    const report = JSON.parse((await call(daemon.raw.admin, 'GetReport', {})).json);
    return BigInt(report.quotas.bySession[client.session.id] ?? 0);
  }

  /** Waits until every allocation the manager asked for ahead has come (or was refused). */
  const settled = (mm: VmmdMemoryManager) => eventually(() => (mm.stats().ahead.arriving === 0 ? true : undefined), 20_000, 'the answers ahead');

  it('holds `depth` allocations ahead for a size asked for twice, charged to the session, and maps the oldest for the next memalloc of that size', async () => {
    const { mm, client } = await manager();
    const first = await mm.memalloc(2n * MiB);
    expect(mm.stats().ahead).toMatchObject({ allocations: 0, requested: 0 });
    const second = await mm.memalloc(2n * MiB);
    expect(mm.stats().ahead).toMatchObject({ allocations: 2, bytes: String(4n * MiB), requested: 2 });
    await settled(mm);
    expect(await charged(client)).toBe(8n * MiB);
    // Another size does not take them.
    const other = await mm.memalloc(4n * MiB);
    expect(mm.stats().ahead).toMatchObject({ taken: 0, allocations: 2 });
    const third = await mm.memalloc(2n * MiB);
    // One taken, and the next one asked for as it was.
    expect(mm.stats().ahead).toMatchObject({ taken: 1, requested: 3, allocations: 2 });
    for (const [i, pointer] of [first, second, third, other].entries()) await mm.write(pointer.pointer + pointer.size - 8n, Buffer.from(`piece ${i}!`));
    for (const [i, pointer] of [first, second, third, other].entries())
      expect((await mm.read(pointer.pointer + pointer.size - 8n, 8)).toString()).toBe(`piece ${i}!`);
    expect(new Set([first, second, third].map((pointer) => pointer.pointer)).size).toBe(3);
    await settled(mm);
    expect(await charged(client)).toBe(3n * 2n * MiB + 4n * MiB + 2n * 2n * MiB);
  });

  it('gives concurrent memallocs of one size each an allocation of its own', async () => {
    const { mm } = await manager();
    await (await mm.memalloc(2n * MiB)).free();
    await (await mm.memalloc(2n * MiB)).free();
    const pointers = await Promise.all([0, 1, 2, 3].map(() => mm.memalloc(2n * MiB)));
    expect(new Set(pointers.map((pointer) => pointer.pointer)).size).toBe(4);
    expect(mm.stats().ahead.taken).toBeGreaterThanOrEqual(1);
    for (const [i, pointer] of pointers.entries()) await mm.write(pointer.pointer, Buffer.from(`block ${i}`));
    for (const [i, pointer] of pointers.entries()) expect((await mm.read(pointer.pointer, 7)).toString()).toBe(`block ${i}`);
  });

  it('never costs the caller an out-of-memory: a memalloc that needs its room gets it, and one refused at the quota is silent', async () => {
    const { mm, client } = await manager();
    // (process.on('warning') sees nothing under jest: a spy does.)
    const warned = jest.spyOn(process, 'emitWarning');
    try {
      const held = [await mm.memalloc(4n * MiB), await mm.memalloc(4n * MiB)];
      await settled(mm);
      expect(await charged(client)).toBe(16n * MiB);
      // 8 MiB held and 8 MiB ahead: 8 more would pass the 16 MiB quota unless those ahead go back first.
      const big = await mm.memalloc(8n * MiB);
      expect(mm.stats().counters.outOfMemoryRetries).toBe(1);
      expect(mm.stats().ahead.allocations).toBe(0);
      expect(await charged(client)).toBe(16n * MiB);
      await big.free();
      await mm.flush();
      // Two 4 MiB held, two more asked for (the out-of-memory retry forgot the size): those the second asks for ahead pass the quota.
      held.push(await mm.memalloc(4n * MiB));
      await settled(mm);
      held.push(await mm.memalloc(4n * MiB));
      await settled(mm);
      expect(await charged(client)).toBe(16n * MiB);
      expect(mm.stats().ahead.refused).toBeGreaterThanOrEqual(1);
      const over = await mm.memalloc(4n * MiB).catch((error) => error);
      expect(over).toBeInstanceOf(VmmdError);
      expect(over.status).toBe(8); // RESOURCE_EXHAUSTED: the caller's own 16 MiB, nothing held ahead
      expect(await charged(client)).toBe(16n * MiB);
      expect(warned.mock.calls.map((args) => String(args[0]))).toEqual([]);
    } finally {
      warned.mockRestore();
    }
  });

  it('gives back what waits unused for idleMs, and everything on clearCaches(), also when its answer comes after', async () => {
    const { mm, client } = await manager({ ahead: { ...DEFAULT_AHEAD, idleMs: 50 } });
    const kept = [await mm.memalloc(2n * MiB), await mm.memalloc(2n * MiB)];
    await eventually(() => (mm.stats().ahead.expired === 2 ? true : undefined), 20_000, 'the allocations ahead to expire');
    expect(mm.stats().ahead.allocations).toBe(0);
    await eventually(async () => ((await charged(client)) === 4n * MiB ? true : undefined), 20_000, 'its release');
    // Asked for and dropped before the answer can have come.
    kept.push(await mm.memalloc(2n * MiB));
    expect(mm.stats().ahead.allocations).toBe(2);
    await mm.clearCaches();
    expect(mm.stats().ahead.allocations).toBe(0);
    // (cuda: the daemon's charge goes when its held free runs, soon after the release's answer.)
    await eventually(async () => ((await charged(client)) === 6n * MiB ? true : undefined), 20_000, 'the release of the one dropped');
    expect(kept).toHaveLength(3);
  });

  it('holds at most maxBytes (a larger size never), and nothing with maxBytes 0', async () => {
    const { mm } = await manager({ ahead: { ...DEFAULT_AHEAD, maxBytes: 4n * MiB } });
    for (let i = 0; i < 3; i++) await (await mm.memalloc(6n * MiB)).free();
    expect(mm.stats().ahead.requested).toBe(0);
    for (let i = 0; i < 3; i++) await (await mm.memalloc(4n * MiB)).free();
    for (let i = 0; i < 3; i++) await (await mm.memalloc(2n * MiB)).free();
    expect(mm.stats().ahead.allocations).toBe(1);
    expect(mm.stats().ahead.bytes).toBe(String(4n * MiB));
    const { mm: off } = await manager({ ahead: { ...DEFAULT_AHEAD, maxBytes: 0n } });
    for (let i = 0; i < 3; i++) await (await off.memalloc(2n * MiB)).free();
    expect(off.stats().ahead).toMatchObject({ requested: 0, allocations: 0 });
  });

  it('refuses bad settings as BAD_CONFIG naming the value, in the manager and in Config', async () => {
    const client = await connect({ socketDir: daemon.dir });
    clients.push(client);
    for (const [ahead, named] of [
      [{ maxBytes: -1n, idleMs: 10 }, /maxBytes -1 must be a bigint >= 0/],
      [{ maxBytes: 1n, idleMs: 0 }, /idleMs 0 must be an integer from 1 to/],
      [{ maxBytes: 1n, idleMs: 1.5 }, /idleMs 1.5 must be an integer/],
      [{ maxBytes: 1n, idleMs: 2 ** 31 }, /idleMs 2147483648 must be an integer from 1 to 2147483647/],
      [{ maxBytes: 5, idleMs: 10 }, /maxBytes 5 must be a bigint/],
      [{ maxBytes: 1n, idleMs: 10, depth: 0 }, /depth 0 must be an integer from 1 to 8/],
      [{ maxBytes: 1n, idleMs: 10, depth: 9 }, /depth 9 must be an integer from 1 to 8/],
      [{ maxBytes: 1n, idleMs: 10, depth: 1.5 }, /depth 1.5 must be an integer/],
    ] as const) {
      const made = (() => {
        try {
          return new VmmdMemoryManager({ device: 0, backend, client, ahead: ahead as never });
        } catch (error) {
          return error;
        }
      })();
      expect(made).toMatchObject({ code: 'BAD_CONFIG', status: 3 });
      expect((made as Error).message).toMatch(named);
      expect(() => new Config().setAhead(ahead as never)).toThrow(named);
    }
  });

  it('takes its settings from Config through a Context', async () => {
    const config = () =>
      new Config()
        .setSocketDir(daemon.dir)
        .setPool({ chunkSize: 2n * MiB, largeThreshold: 1n * MiB })
        .setDeferredFree({ count: 0 });
    for (const [made, requested] of [
      [config().setAhead({ maxBytes: 0n }), 0],
      [config().setAhead({ depth: 1 }), 2],
      [config(), 3],
    ] as const) {
      const context = await Context.create(made);
      try {
        for (let i = 0; i < 3; i++) await context.free(await context.memalloc(4n * MiB));
        expect((context.manager as VmmdMemoryManager).stats().ahead.requested).toBe(requested);
      } finally {
        await context.close();
      }
    }
  });
}
