/**
 * Allocations ahead (client/emm/ahead.ts) at their edges (quotas, retries,
 * closing), each case run with allocations ahead off and on, so that what fails on
 * is the holder's doing (host backend).
 */
import { DEFAULT_AHEAD, VmmdClient, VmmdMemoryManager } from '../../client';
import type { VmmdManagerContext } from '../../client';
import { AllocationsAhead, Received } from '../../client/emm/ahead';
import { coldManager } from '../contracts/ahead.contract';
import { call, eventually, MiB, stopWhenClean, TestDaemon } from './harness';

function harness(args: string[]) {
  const state = { daemon: undefined as unknown as TestDaemon };
  const clients: VmmdClient[] = [];
  const managers: VmmdMemoryManager[] = [];
  beforeAll(async () => {
    state.daemon = await TestDaemon.start(args, 'host');
  });
  afterEach(async () => {
    for (const manager of managers.splice(0)) await manager.reset().catch(() => undefined);
    for (const connected of clients.splice(0)) connected.close();
  });
  afterAll(async () => {
    await stopWhenClean(state.daemon, clients);
    expect(await state.daemon.stop()).toBe(0);
  });
  const manager = (overrides: Partial<VmmdManagerContext> = {}) => coldManager(state.daemon.dir, 'host', clients, managers, overrides);
  const settled = (mm: VmmdMemoryManager) => eventually(() => (mm.stats().ahead.arriving === 0 ? true : undefined), 20_000, 'the answers ahead');
  async function charged(client: VmmdClient): Promise<bigint> {
    const report = JSON.parse((await call(state.daemon.raw.admin, 'GetReport', {})).json);
    return BigInt(report.quotas.bySession[client.session.id] ?? 0);
  }
  return { state, manager, settled, charged };
}

/** Two 4 MiB memallocs, freed: the manager then holds two 4 MiB allocations ahead (8 MiB charged), nothing else. */
async function warm(mm: VmmdMemoryManager, settled: (mm: VmmdMemoryManager) => Promise<unknown>): Promise<void> {
  for (let i = 0; i < 2; i++) await (await mm.memalloc(4n * MiB)).free();
  await mm.flush();
  await settled(mm);
}

const ON = { ...DEFAULT_AHEAD, idleMs: 20_000 };
const OFF = { ...DEFAULT_AHEAD, maxBytes: 0n };

describe('session quota 16 MiB', () => {
  const { manager, settled, charged } = harness(['--quota-per-session', '16MiB']);

  it('memhostalloc gives back what is held ahead and retries once, as memalloc does', async () => {
    for (const ahead of [OFF, ON]) {
      const { mm, client } = await manager({ ahead });
      await warm(mm, settled);
      expect(await charged(client)).toBe(ahead === ON ? 8n * MiB : 0n);
      // 12 MiB of a 16 MiB quota, nothing else in use by the caller: must succeed.
      const host = await mm.memhostalloc(12n * MiB).catch((error: Error) => error);
      expect({ ahead: ahead === ON, failed: host instanceof Error ? host.message : false }).toEqual({ ahead: ahead === ON, failed: false });
    }
  });

  it('nothing is asked for ahead while an out-of-memory retry runs (concurrent memallocs of another size)', async () => {
    for (const ahead of [OFF, ON]) {
      const { mm } = await manager({ ahead });
      await warm(mm, settled);
      // Forced interleaving: two concurrent memallocs of 2 MiB run while the 10 MiB memalloc awaits its
      // retry's settle() (right after its dropAll()).
      const holder = (mm as unknown as { leases: { ahead: AllocationsAhead<unknown> } }).leases.ahead;
      const dropAll = holder.dropAll.bind(holder);
      const others: Array<Promise<unknown>> = [];
      holder.dropAll = async () => {
        await dropAll();
        if (others.length === 0) {
          others.push(mm.memalloc(2n * MiB), mm.memalloc(2n * MiB));
          await Promise.all(others);
        }
      };
      // The caller's total: 10 + 2 + 2 = 14 MiB of 16.
      const big = await mm.memalloc(10n * MiB).catch((error: Error) => error);
      await Promise.all(others);
      expect({ ahead: ahead === ON, failed: big instanceof Error ? big.message : false }).toEqual({ ahead: ahead === ON, failed: false });
    }
  });
});

describe('uid quota 16 MiB (two processes of one user)', () => {
  const { manager, settled } = harness(['--quota-per-uid', '16MiB']);

  it('may refuse another session of the same uid while they are held: for at most idleMs (a documented limit)', async () => {
    const { mm: first } = await manager({ ahead: { ...DEFAULT_AHEAD, idleMs: 300 } });
    await warm(first, settled);
    const { mm: second } = await manager({ ahead: OFF });
    // The two callers' total: 12 MiB of 16, but 8 MiB are held ahead by the first.
    const refused = await second.memalloc(12n * MiB).catch((error: Error) => error);
    expect(refused).toMatchObject({ status: 8 });
    await eventually(() => (first.stats().ahead.expired === 2 ? true : undefined), 20_000, "the first session's allocations ahead to expire");
    const pointer = await eventually(async () => second.memalloc(12n * MiB).catch(() => undefined), 20_000, 'room for the second session');
    expect(pointer.size).toBe(12n * MiB);
  });
});

describe('AllocationsAhead state (fake daemon)', () => {
  function fake() {
    const pending: Array<{ resolve(received: Received): void; reject(error: Error): void }> = [];
    const givenBack: Received[] = [];
    const holder = new AllocationsAhead<number>(
      { maxBytes: 100n, idleMs: 10_000, depth: 1 },
      {
        allocate: () => new Promise<Received>((resolve, reject) => pending.push({ resolve, reject })),
        giveBack: (received) => givenBack.push(received),
      },
      (size, location) => `${location}:${size}`,
    );
    return { holder, pending, givenBack };
  }

  it('a refusal that arrives while dropAll() waits does not outlive it', async () => {
    const { holder, pending } = fake();
    holder.noteAllocated(1n, 0);
    holder.noteAllocated(1n, 0);
    expect(pending).toHaveLength(1);
    const dropped = holder.dropAll();
    pending[0].reject(new Error('QUOTA_EXCEEDED'));
    await dropped;
    // dropAll() is documented to end refusals: a size allocated twice again is held ahead again.
    holder.noteAllocated(1n, 0);
    holder.noteAllocated(1n, 0);
    expect(pending).toHaveLength(2);
  });
});

describe('session closed with allocations held ahead', () => {
  const { manager, settled } = harness([]);

  it('held when the client closes: their descriptors closed at expiry, no release sent, no warning', async () => {
    // process.on('warning') sees nothing under jest (its process object is not the one emitWarning emits on): spy instead.
    const spy = jest.spyOn(process, 'emitWarning');
    try {
      const fds = () => require('node:fs').readdirSync('/proc/self/fd').length;
      const before = fds();
      const { mm, client } = await manager({ ahead: { ...DEFAULT_AHEAD, idleMs: 300 } });
      await warm(mm, settled);
      expect(mm.stats().ahead.allocations).toBe(2);
      client.close();
      const afterClose = fds();
      await eventually(() => (mm.stats().ahead.expired === 2 ? true : undefined), 20_000, 'expiry');
      await new Promise((resolve) => setTimeout(resolve, 300));
      // Held until expiry: the two descriptors are still open after close (the client's gRPC channel may close a moment later).
      expect(afterClose).toBeGreaterThanOrEqual(before + 2);
      expect(fds()).toBe(before);
      // Nothing the caller asked for was released: no warning is due.
      expect(spy.mock.calls.map((args) => String(args[0]))).toEqual([]);
    } finally {
      spy.mockRestore();
    }
  });
});
