/**
 * The allocation source the daemon composes, seen from inside the chain, on
 * the host backend with a stock: the registry tells the chain whether a
 * caller waits for a free (and the stock holds back only the frees nobody
 * waits for), someone waiting for every free in flight goes through the
 * chain (never around it to the backend), and a SYSMEM store's memfd is held
 * and charged through the same chain as an Import.
 */
import pino from 'pino';
import { HostBackend } from '../../server/backends/host';
import { StockedBackend } from '../../server/backends/stock';
import { composeSource, Registry } from '../../server/registry';
import { Quotas } from '../../server/registry/quotas';
import type { AllocationSource, HeldMemfd, SourcedAllocation } from '../../server/registry/source';
import { StoreRegistry } from '../../server/stores/stores';
import { addon } from '../../native';

const MiB = 1n << 20n;
const ARGS = { size: 2n * MiB, location: { type: 'DEVICE' as const, id: 0 }, handleType: 'POSIX_FD' as const };
const SESSION = 5n;
const UID = 1000;

/** An adaptor that records what reaches it and passes everything on. */
class Recorder implements AllocationSource {
  readonly calls: string[] = [];
  constructor(private readonly upstream: AllocationSource) {}
  create(...args: Parameters<AllocationSource['create']>) {
    this.calls.push('create');
    return this.upstream.create(...args);
  }
  adopt(...args: Parameters<AllocationSource['adopt']>) {
    this.calls.push('adopt');
    return this.upstream.adopt(...args);
  }
  restore(...args: Parameters<AllocationSource['restore']>) {
    this.calls.push('restore');
    return this.upstream.restore(...args);
  }
  async holdClientMemfd(owner: bigint, fd: number, size: bigint): Promise<HeldMemfd> {
    this.calls.push(`holdClientMemfd ${size}`);
    const held = await this.upstream.holdClientMemfd(owner, fd, size);
    return { identity: held.identity, release: () => (this.calls.push('dropClientMemfd'), held.release()) };
  }
  release(allocation: SourcedAllocation, awaited: boolean) {
    this.calls.push(`release ${awaited ? 'awaited' : 'answered'}`);
    return this.upstream.release(allocation, awaited);
  }
  settle() {
    this.calls.push('settle');
    return this.upstream.settle();
  }
}

describe('the allocation chain, composed outside the registry (host)', () => {
  let stock: StockedBackend;
  let recorder: Recorder | undefined;
  let quotas: Quotas;
  let registry: Registry;

  beforeEach(() => {
    stock = new StockedBackend(new HostBackend({ capacity: 64n * MiB, granularity: 2n * MiB }), [], pino({ level: 'silent' }));
    quotas = new Quotas({ perUid: 0n, perSession: 4n * MiB }, (session) => (session === SESSION ? UID : undefined));
    const composed = composeSource(stock, (upstream) =>
      quotas.around((recorder = new Recorder(upstream)), (handle, device) => stock.memoryIdentity(handle, device)),
    );
    registry = new Registry(stock, composed);
  });
  afterEach(async () => {
    await registry.settleFrees();
    await stock.close();
  });

  it('tells the chain whether the caller waits for the free: a Release RPC does, a session-socket release does not', async () => {
    const a = await registry.create(SESSION, ARGS);
    await registry.release(SESSION, a.id);
    const b = await registry.create(SESSION, ARGS);
    const { freeing } = await registry.releaseAnswering(SESSION, b.id);
    // Nobody waits: the stock holds it for a quiet moment.
    expect(stock.heldReleases).toBe(1);
    await registry.settleFrees();
    await freeing;
    expect(stock.heldReleases).toBe(0);
    expect(recorder!.calls).toEqual(['create', 'release awaited', 'create', 'release answered', 'settle']);
  });

  it('a create over the quota with the holder’s frees held back asks the chain to settle them, and goes on', async () => {
    const a = await registry.create(SESSION, ARGS);
    const b = await registry.create(SESSION, ARGS);
    await registry.releaseAnswering(SESSION, a.id);
    const c = await registry.create(SESSION, ARGS);
    expect(c).toMatchObject({ size: 2n * MiB });
    // The quota adaptor sits above the recorder: its wait reaches the stock through the chain.
    expect(recorder!.calls).toContain('settle');
    // Nothing left for the next test file of this worker.
    await registry.release(SESSION, b.id);
    await registry.release(SESSION, c.id);
  });

  it('holds and charges a SYSMEM store’s memfd through the chain, and drops both with the store', async () => {
    const stores = new StoreRegistry(registry);
    const memfd = addon.hostMemfdCreate('sysmem', 2n * MiB);
    const store = await stores.attach(SESSION, memfd, { target: 'SYSMEM', device: 0, size: 2n * MiB, readOnly: false, name: '', hasDeleter: false });
    expect(recorder!.calls).toEqual([`holdClientMemfd ${2n * MiB}`]);
    expect(quotas.usedByUid(UID)).toBe(2n * MiB);
    // Over the quota through the same adaptor as a create: 2 MiB attached + 4 MiB > 4 MiB.
    await expect(registry.create(SESSION, { ...ARGS, size: 4n * MiB })).rejects.toMatchObject({ code: 'QUOTA_EXCEEDED' });
    await stores.detach(SESSION, store);
    expect(recorder!.calls).toContain('dropClientMemfd');
    expect(quotas.usedByUid(UID)).toBe(0n);
  });
});
