/**
 * Quotas by physical memory as a property: random
 * sequences of Create, Export, Import, Attach (SYSMEM), Release, Share (and
 * the other session's Export with the key), Map, Unmap, Detach and session
 * ends, by sessions of two uids, on the real host backend (memfds, in this
 * process) with the registry, the quota adaptor and the stores as the daemon
 * composes them. After every step, computed from what is alive (each live
 * allocation's and store's memfd, by its file, as this test reads it):
 * - the physical bytes each session and each uid keeps alive never exceed its quota,
 *   and the quotas charge exactly that;
 * - GetMemoryInfo's free bytes are the capacity less the distinct memory alive;
 * and once everything is released, all is back at the start.
 * ≥ 10,000 steps with VMMD_RELIABILITY=full (npm run reliability); fewer in npm test.
 */
import * as fc from 'fast-check';
import { addon } from '../../native';
import { HostBackend } from '../../server/backends/host';
import { memfdIdentity } from '../../server/backends/client-memfd';
import { RpcError } from '../../server/errors';
import { Quotas } from '../../server/registry/quotas';
import { Registry } from '../../server/registry';
import { StoreRecord, StoreRegistry } from '../../server/stores/stores';
import { figure } from './figures';

const MiB = 1n << 20n;
const GRANULARITY = 2n * MiB;
// Below the two uids' quotas together: the capacity binds too.
const CAPACITY = 24n * MiB;
const PER_SESSION = 12n * MiB;
const PER_UID = 20n * MiB;
const FULL = process.env.VMMD_RELIABILITY === 'full';
const RUNS = FULL ? 100 : 12;
const STEPS = FULL ? 160 : 60;
/** Sessions 1 and 2 are uid 1000's, 3 and 4 uid 1001's. */
const UID_OF = new Map<bigint, number>([
  [1n, 1000],
  [2n, 1000],
  [3n, 1001],
  [4n, 1001],
]);
/** Memfd sizes a client offers: small, the quota's edges, past the capacity, and a 32 TiB sparse one. */
const CLIENT_SIZES = [2n * MiB, 4n * MiB, 8n * MiB, PER_SESSION, PER_UID + GRANULARITY, CAPACITY + GRANULARITY, 32n << 40n];

type Step =
  | { op: 'create'; session: number; units: number }
  | { op: 'export'; session: number; pick: number }
  | { op: 'share'; session: number; other: number; pick: number }
  | { op: 'memfd'; size: number }
  | { op: 'import'; session: number; pick: number }
  | { op: 'attach'; session: number; pick: number }
  | { op: 'release'; session: number; pick: number }
  | { op: 'map'; session: number; pick: number }
  | { op: 'unmap'; pick: number }
  | { op: 'detach'; session: number; pick: number }
  | { op: 'closeFd'; pick: number }
  | { op: 'end'; session: number };

const session = fc.integer({ min: 1, max: 4 });
const pick = fc.nat(1000);
const step: fc.Arbitrary<Step> = fc.oneof(
  fc.record({ op: fc.constant('create' as const), session, units: fc.integer({ min: 1, max: 7 }) }),
  fc.record({ op: fc.constant('export' as const), session, pick }),
  fc.record({ op: fc.constant('share' as const), session, other: session, pick }),
  fc.record({ op: fc.constant('memfd' as const), size: fc.nat(CLIENT_SIZES.length - 1) }),
  fc.record({ op: fc.constant('import' as const), session, pick }),
  fc.record({ op: fc.constant('import' as const), session, pick }),
  fc.record({ op: fc.constant('attach' as const), session, pick }),
  fc.record({ op: fc.constant('release' as const), session, pick }),
  fc.record({ op: fc.constant('release' as const), session, pick }),
  fc.record({ op: fc.constant('map' as const), session, pick }),
  fc.record({ op: fc.constant('unmap' as const), pick }),
  fc.record({ op: fc.constant('detach' as const), session, pick }),
  fc.record({ op: fc.constant('closeFd' as const), pick }),
  fc.record({ op: fc.constant('end' as const), session }),
);

const of = <T>(items: T[], index: number): T | undefined => (items.length === 0 ? undefined : items[index % items.length]);
const identityOf = (fd: number) => memfdIdentity(addon.hostFdInfo(fd));

/** A world: the daemon's parts over a fresh host backend, and what the test's clients hold. */
class World {
  readonly backend = new HostBackend({ capacity: CAPACITY, granularity: GRANULARITY });
  readonly quotas = new Quotas({ perSession: PER_SESSION, perUid: PER_UID }, (id) => UID_OF.get(id));
  readonly registry = new Registry(this.backend, (upstream) => this.quotas.around(upstream, (handle) => this.backend.memoryIdentity(handle)));
  readonly stores = new StoreRegistry(this.registry);
  /** Which session made or imported each allocation (the one it is charged to), while it lives. */
  readonly holderOf = new Map<bigint, bigint>();
  /** Each SYSMEM store's memfd (its identity and size) and the session that attached it. */
  readonly attached = new Map<bigint, { identity: string; size: bigint; session: bigint }>();
  /** Descriptors the clients hold (exports, their own memfds). */
  readonly clientFds: number[] = [];
  readonly mappings: Array<{ session: bigint; address: bigint; size: bigint }> = [];
  readonly ended = new Set<bigint>();
  steps = 0;
  peakAlive = 0n;
  refusals: Record<string, number> = {};

  liveAllocations() {
    return [...this.registry.allocations.all()].filter((allocation) => !allocation.freed);
  }

  liveStores(): StoreRecord[] {
    return this.stores.list();
  }

  async run(step: Step): Promise<void> {
    this.steps++;
    try {
      await this.apply(step);
    } catch (error) {
      // Refusals are the daemon's answer to a bad or over-quota request; anything else is a bug.
      const code = error instanceof RpcError ? error.code : (error as { code?: unknown }).code;
      if (!(error instanceof RpcError) && code !== 'OUT_OF_MEMORY') throw error;
      this.refusals[String(code)] = (this.refusals[String(code)] ?? 0) + 1;
    }
  }

  private async apply(step: Step): Promise<void> {
    const caller = 'session' in step ? BigInt(step.session) : 0n;
    if (caller !== 0n && this.ended.has(caller)) return;
    const all = this.liveAllocations().filter((allocation) => this.holderOf.has(allocation.id));
    // Mostly the caller's own (else most steps are NOT_OWNER refusals); another's when it has none.
    const own = all.filter((allocation) => allocation.owner === caller || allocation.references.has(caller));
    const allocations = own.length > 0 ? own : all;
    switch (step.op) {
      case 'create': {
        const record = await this.registry.create(caller, {
          size: BigInt(step.units) * GRANULARITY,
          location: { type: 'DEVICE', id: 0 },
          handleType: 'POSIX_FD',
        });
        this.holderOf.set(record.id, caller);
        return;
      }
      case 'export': {
        const target = of(allocations, step.pick);
        if (target === undefined) return;
        const exported = await this.registry.exportHandle(caller, { allocationId: target.id, handleType: 'POSIX_FD', shareKey: '' });
        this.clientFds.push(exported.fd!);
        return;
      }
      case 'share': {
        const target = of(allocations, step.pick);
        if (target === undefined || this.ended.has(BigInt(step.other))) return;
        const key = this.registry.share(caller, target.id);
        const exported = await this.registry.exportHandle(BigInt(step.other), { allocationId: target.id, handleType: 'POSIX_FD', shareKey: key });
        this.clientFds.push(exported.fd!);
        return;
      }
      case 'memfd':
        this.clientFds.push(addon.hostMemfdCreate('client', CLIENT_SIZES[step.size]));
        return;
      case 'import': {
        const fd = of(this.clientFds, step.pick);
        if (fd === undefined) return;
        const record = await this.registry.importHandle(caller, { fd: addon.dup(fd) }, 0n);
        this.holderOf.set(record.id, caller);
        return;
      }
      case 'attach': {
        const fd = of(this.clientFds, step.pick);
        if (fd === undefined) return;
        const info = addon.hostFdInfo(fd);
        const store = await this.stores.attach(caller, addon.dup(fd), {
          target: 'SYSMEM',
          device: 0,
          size: GRANULARITY,
          readOnly: false,
          name: '',
          hasDeleter: false,
        });
        this.attached.set(store.id, { identity: memfdIdentity(info), size: info.size, session: caller });
        return;
      }
      case 'release': {
        const target = of(allocations, step.pick);
        if (target === undefined) return;
        await this.registry.release(caller, target.id);
        return;
      }
      case 'map': {
        const target = of(allocations, step.pick);
        if (target === undefined) return;
        const reservation = await this.registry.reserve(caller, { size: target.size, alignment: 0n, address: 0n });
        try {
          await this.registry.map(caller, { address: reservation.address, size: target.size, offset: 0n, allocationId: target.id });
        } catch (error) {
          await this.registry.freeAddress(caller, reservation.address, target.size);
          throw error;
        }
        this.mappings.push({ session: caller, address: reservation.address, size: target.size });
        return;
      }
      case 'unmap': {
        const mapping = of(this.mappings, step.pick);
        if (mapping === undefined) return;
        this.mappings.splice(this.mappings.indexOf(mapping), 1);
        await this.registry.unmap(mapping.session, mapping.address, mapping.size);
        await this.registry.freeAddress(mapping.session, mapping.address, mapping.size);
        return;
      }
      case 'detach': {
        const store = of(
          this.liveStores().filter((candidate) => candidate.state === 'LIVE'),
          step.pick,
        );
        if (store === undefined) return;
        await this.stores.detach(caller, store);
        return;
      }
      case 'closeFd': {
        const fd = of(this.clientFds, step.pick);
        if (fd === undefined) return;
        this.clientFds.splice(this.clientFds.indexOf(fd), 1);
        addon.close(fd);
        return;
      }
      case 'end':
        await this.endSession(caller);
        return;
    }
  }

  async endSession(id: bigint): Promise<void> {
    if (this.ended.has(id)) return;
    this.ended.add(id);
    for (const mapping of this.mappings.filter((candidate) => candidate.session === id)) this.mappings.splice(this.mappings.indexOf(mapping), 1);
    await this.stores.reclaim(id);
    await this.registry.reclaim(id);
  }

  /** The invariants, from what is alive now. */
  check(): void {
    // Distinct memory each session and uid keeps alive: its live allocations' memfds and its SYSMEM stores'.
    const bySession = new Map<bigint, Map<string, bigint>>();
    const byUid = new Map<number, Map<string, bigint>>();
    const alive = new Map<string, bigint>();
    const keep = (holder: bigint, identity: string, size: bigint) => {
      alive.set(identity, size);
      if (holder === 0n) return;
      if (!bySession.has(holder)) bySession.set(holder, new Map());
      bySession.get(holder)!.set(identity, size);
      const uid = UID_OF.get(holder)!;
      if (!byUid.has(uid)) byUid.set(uid, new Map());
      byUid.get(uid)!.set(identity, size);
    };
    for (const allocation of this.liveAllocations()) {
      keep(this.holderOf.get(allocation.id) ?? 0n, identityOf(Number(allocation.handle)), allocation.size);
    }
    const live = new Set(this.liveStores().map((store) => store.id));
    for (const [id, memfd] of this.attached) {
      if (live.has(id)) keep(memfd.session, memfd.identity, memfd.size);
      else this.attached.delete(id);
    }
    const sum = (memory: Map<string, bigint>) => [...memory.values()].reduce((total, size) => total + size, 0n);
    const expectedSessions: Record<string, string> = {};
    for (const [id, memory] of bySession) {
      expect(sum(memory)).toBeLessThanOrEqual(PER_SESSION);
      expectedSessions[String(id)] = String(sum(memory));
    }
    const expectedUids: Record<string, string> = {};
    for (const [uid, memory] of byUid) {
      expect(sum(memory)).toBeLessThanOrEqual(PER_UID);
      expectedUids[String(uid)] = String(sum(memory));
    }
    expect(this.quotas.used()).toEqual({ bySession: expectedSessions, byUid: expectedUids });
    if (sum(alive) > this.peakAlive) this.peakAlive = sum(alive);
    expect(sum(alive)).toBeLessThanOrEqual(CAPACITY);
    expect(this.backend.memoryInfo().freeBytes).toBe(CAPACITY - sum(alive));
  }

  /** Everything released: sessions end, clients close their descriptors. */
  async drain(): Promise<void> {
    for (const id of UID_OF.keys()) await this.endSession(id);
    for (const fd of this.clientFds.splice(0)) addon.close(fd);
  }
}

describe('quotas by physical memory, as a property (host backend)', () => {
  it('keeps every session and uid within its quota, free = capacity − alive, and all back at the start after release', async () => {
    let steps = 0;
    let peakAlive = 0n;
    const refusals: Record<string, number> = {};
    await fc.assert(
      fc.asyncProperty(fc.array(step, { minLength: STEPS / 2, maxLength: STEPS }), async (sequence) => {
        const world = new World();
        const fdsBefore = require('node:fs').readdirSync('/proc/self/fd').length;
        try {
          for (const next of sequence) {
            await world.run(next);
            world.check();
          }
        } finally {
          await world.drain();
        }
        steps += world.steps;
        if (world.peakAlive > peakAlive) peakAlive = world.peakAlive;
        for (const [code, count] of Object.entries(world.refusals)) refusals[code] = (refusals[code] ?? 0) + count;
        expect(world.liveAllocations()).toHaveLength(0);
        expect(world.liveStores()).toHaveLength(0);
        expect(world.quotas.used()).toEqual({ bySession: {}, byUid: {} });
        expect(world.backend.memoryInfo().freeBytes).toBe(CAPACITY);
        expect(require('node:fs').readdirSync('/proc/self/fd').length).toBe(fdsBefore);
      }),
      { numRuns: RUNS },
    );
    if (FULL) expect(steps).toBeGreaterThanOrEqual(10_000);
    figure('quotas-property-host', {
      runs: RUNS,
      steps,
      peakAliveMiB: Number(peakAlive / MiB),
      capacityMiB: Number(CAPACITY / MiB),
      ...Object.fromEntries(Object.entries(refusals).map(([code, count]) => [`refused${code}`, count])),
      violations: 0,
    });
  }, 600_000);
});

describe('host capacity by physical memory, without quotas', () => {
  it('counts imports and SYSMEM attachments by their size, once per memfd, and refuses past the capacity', async () => {
    const backend = new HostBackend({ capacity: CAPACITY, granularity: GRANULARITY });
    const quotas = new Quotas({ perSession: 0n, perUid: 0n }, (id) => UID_OF.get(id));
    const registry = new Registry(backend, (upstream) => quotas.around(upstream, (handle) => backend.memoryIdentity(handle)));
    const stores = new StoreRegistry(registry);
    const sparse = addon.hostMemfdCreate('sparse', 32n << 40n);
    const half = addon.hostMemfdCreate('half', CAPACITY / 2n);
    try {
      for (const attempt of [
        () => registry.importHandle(1n, { fd: addon.dup(sparse) }, 0n),
        () => stores.attach(1n, addon.dup(sparse), { target: 'SYSMEM', device: 0, size: GRANULARITY, readOnly: false, name: '', hasDeleter: false }),
      ]) {
        await expect(attempt()).rejects.toMatchObject({
          code: 'OUT_OF_MEMORY',
          message: expect.stringContaining(`${32n << 40n} bytes, 0 of ${CAPACITY} bytes in use (host capacity)`),
        });
      }
      const imported = await registry.importHandle(1n, { fd: addon.dup(half) }, 0n);
      const again = await registry.importHandle(2n, { fd: addon.dup(half) }, 0n);
      const store = await stores.attach(3n, addon.dup(half), { target: 'SYSMEM', device: 0, size: GRANULARITY, readOnly: false, name: '', hasDeleter: false });
      expect(backend.memoryInfo().freeBytes).toBe(CAPACITY / 2n);
      // A Create of more than is left is refused: the imports count.
      await expect(
        (async () => registry.create(1n, { size: CAPACITY / 2n + GRANULARITY, location: { type: 'DEVICE', id: 0 }, handleType: 'POSIX_FD' }))(),
      ).rejects.toThrow(/host capacity/);
      await registry.release(1n, imported.id);
      await registry.release(2n, again.id);
      expect(backend.memoryInfo().freeBytes).toBe(CAPACITY / 2n);
      await stores.detach(3n, store);
      expect(backend.memoryInfo().freeBytes).toBe(CAPACITY);
    } finally {
      addon.close(sparse);
      addon.close(half);
    }
  });
});
