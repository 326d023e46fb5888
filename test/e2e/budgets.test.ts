/**
 * Per-uid budgets over the real sockets, on the host backend: an attacker uid
 * (nobody) takes one resource up to its budget and is refused past it with
 * RESOURCE_EXHAUSTED BUDGET_EXCEEDED, while a victim uid (root) keeps
 * reserving, mapping, allocating and making stores, and the daemon keeps
 * serving. What a budget counted is given back when the object is freed, and
 * all of it when the attacker's session closes (the metrics show each uid's
 * use). Small limits keep it fast; peers of another uid need root.
 */
import { connect, VmmdClient } from '../../client';
import { call as rawCall, eventually, freePort, MiB, Peer, scrapeMetrics, stopWhenClean, TestDaemon } from './harness';

const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;
const SIZE = 2n * MiB;
const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' as const }];

const LIMITS = { mappings: 6, reservations: 4, addressSpace: 24n * MiB, stores: 3, allocations: 4 };

let daemon: TestDaemon;
let metricsPort: number;
let victim: VmmdClient;
const clients: VmmdClient[] = [];
const peers: Peer[] = [];

const scrape = () => scrapeMetrics(metricsPort);

/** Each budget's use by a uid, from /metrics (a budget it holds nothing of is absent). */
async function usedBy(uid: number): Promise<Record<string, number>> {
  const used: Record<string, number> = {};
  for (const match of (await scrape()).matchAll(/^vmmd_budget_used\{budget="([^"]+)",uid="([^"]+)"\} (\S+)$/gm)) {
    if (match[2] === String(uid)) used[match[1]] = Number(match[3]);
  }
  return used;
}

/** What a victim of another uid still does, and the daemon with it. */
async function victimServed(): Promise<void> {
  const allocation = await victim.vmm.create({ size: SIZE });
  const { address } = await victim.vmm.reserve({ size: SIZE });
  await victim.vmm.map({ address, size: SIZE, allocationId: allocation.id });
  await victim.vmm.setAccess({ address, size: SIZE, descriptors: RW });
  await victim.vmm.write(address, Buffer.from('victim'));
  expect((await victim.vmm.read(address, 6)).toString()).toBe('victim');
  const store = await victim.stores.createStore({ allocationId: allocation.id });
  await victim.stores.detach({ id: store.id });
  await victim.vmm.unmap({ address, size: SIZE });
  await victim.vmm.freeAddress({ address, size: SIZE });
  await victim.vmm.release({ allocationId: allocation.id });
  expect(daemon.process.exitCode).toBeNull();
}

const refusal = (budget: string, used: number | bigint, limit: number | bigint, unit = '') => ({
  status: 8, // RESOURCE_EXHAUSTED
  code: 'BUDGET_EXCEEDED',
  message: expect.stringContaining(`${budget}: uid ${NOBODY} holds ${used}${unit} of at most ${limit}${unit}`),
});

async function attacker(): Promise<Peer> {
  const peer = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
  peers.push(peer);
  return peer;
}

const call = <T = any>(peer: Peer, api: string, method: string, args: object) => peer.do<T>({ op: 'call', api, method, args });

/** The attacker's session closes: everything it held is reclaimed, and with it every budget's use. */
async function closedToZero(peer: Peer): Promise<void> {
  await peer.stop();
  await eventually(async () => (Object.keys(await usedBy(NOBODY)).length === 0 ? true : undefined), 10_000, "the attacker's budgets to be given back");
}

(isRoot ? describe : describe.skip)('per-uid budgets (host, run as root)', () => {
  beforeAll(async () => {
    metricsPort = await freePort();
    daemon = await TestDaemon.start([
      '--socket-group',
      String(NOBODY),
      '--allow-gids',
      String(NOBODY),
      '--allow-uids',
      '0',
      '--metrics-port',
      String(metricsPort),
      '--max-mappings-per-uid',
      String(LIMITS.mappings),
      '--max-reservations-per-uid',
      String(LIMITS.reservations),
      '--max-address-space-per-uid',
      String(LIMITS.addressSpace),
      '--max-stores-per-uid',
      String(LIMITS.stores),
      '--max-allocations-per-uid',
      String(LIMITS.allocations),
    ]);
    victim = await connect({ socketDir: daemon.dir });
    clients.push(victim);
  });

  // A test that failed half-way leaves no attacker behind to keep the next one (or jest) waiting.
  afterEach(async () => {
    for (const peer of peers.splice(0)) await peer.kill();
  });

  afterAll(async () => {
    await stopWhenClean(daemon, clients);
  });

  it('refuses daemon mappings past the budget, gives one back on unmap, all on close; the victim maps on', async () => {
    const peer = await attacker();
    const allocation = await call(peer, 'vmm', 'create', { size: String(SIZE) });
    const span = BigInt(LIMITS.mappings + 2) * SIZE;
    const { address } = await call(peer, 'vmm', 'reserve', { size: String(span) });
    const at = (i: number) => String(BigInt(address) + BigInt(i) * SIZE);
    for (let i = 0; i < LIMITS.mappings; i++) await call(peer, 'vmm', 'map', { address: at(i), size: String(SIZE), allocationId: allocation.id });
    await expect(call(peer, 'vmm', 'map', { address: at(LIMITS.mappings), size: String(SIZE), allocationId: allocation.id })).rejects.toMatchObject(
      refusal('mappings per uid', LIMITS.mappings, LIMITS.mappings),
    );
    expect(await usedBy(NOBODY)).toMatchObject({ 'mappings per uid': LIMITS.mappings });
    // An admin's report shows it too.
    const report = JSON.parse((await rawCall(daemon.raw.admin, 'GetReport', {})).json);
    expect(report.budgets['mappings per uid']).toEqual({ limit: LIMITS.mappings, used: { [NOBODY]: LIMITS.mappings } });
    await victimServed();
    await call(peer, 'vmm', 'unmap', { address: at(0), size: String(SIZE) });
    await call(peer, 'vmm', 'map', { address: at(LIMITS.mappings), size: String(SIZE), allocationId: allocation.id });
    await closedToZero(peer);
  });

  it('refuses reservations past the budget, gives one back on free, all on close; the victim reserves on', async () => {
    const peer = await attacker();
    const addresses: string[] = [];
    for (let i = 0; i < LIMITS.reservations; i++) addresses.push((await call(peer, 'vmm', 'reserve', { size: String(SIZE) })).address);
    await expect(call(peer, 'vmm', 'reserve', { size: String(SIZE) })).rejects.toMatchObject(
      refusal('reservations per uid', LIMITS.reservations, LIMITS.reservations),
    );
    await victimServed();
    await call(peer, 'vmm', 'freeAddress', { address: addresses[0], size: String(SIZE) });
    await call(peer, 'vmm', 'reserve', { size: String(SIZE) });
    await closedToZero(peer);
  });

  it('refuses address space past the budget, in bytes; the victim reserves on', async () => {
    const peer = await attacker();
    const half = LIMITS.addressSpace / 2n;
    const first = await call(peer, 'vmm', 'reserve', { size: String(half) });
    await call(peer, 'vmm', 'reserve', { size: String(half) });
    await expect(call(peer, 'vmm', 'reserve', { size: String(SIZE) })).rejects.toMatchObject(
      refusal('address space per uid', LIMITS.addressSpace, LIMITS.addressSpace, ' bytes'),
    );
    expect(await usedBy(NOBODY)).toMatchObject({ 'address space per uid': Number(LIMITS.addressSpace), 'reservations per uid': 2 });
    await victimServed();
    await call(peer, 'vmm', 'freeAddress', { address: first.address, size: String(half) });
    await call(peer, 'vmm', 'reserve', { size: String(SIZE) });
    await closedToZero(peer);
  });

  it('refuses stores past the budget, gives one back when a store is freed, all on close; the victim makes stores on', async () => {
    const peer = await attacker();
    const allocation = await call(peer, 'vmm', 'create', { size: String(SIZE) });
    const stores: Array<{ id: string }> = [];
    for (let i = 0; i < LIMITS.stores; i++) stores.push(await call(peer, 'stores', 'createStore', { allocationId: allocation.id, name: `attacker-${i}` }));
    await expect(call(peer, 'stores', 'createStore', { allocationId: allocation.id, name: 'one-too-many' })).rejects.toMatchObject(
      refusal('stores per uid', LIMITS.stores, LIMITS.stores),
    );
    // Each store is one daemon mapping of its maker's uid too, and the address space the daemon maps it in.
    expect(await usedBy(NOBODY)).toMatchObject({
      'stores per uid': LIMITS.stores,
      'mappings per uid': LIMITS.stores,
      'address space per uid': LIMITS.stores * Number(SIZE),
    });
    await victimServed();
    await call(peer, 'stores', 'detach', { id: stores[0].id });
    await eventually(async () => ((await usedBy(NOBODY))['stores per uid'] === LIMITS.stores - 1 ? true : undefined));
    await call(peer, 'stores', 'createStore', { allocationId: allocation.id, name: 'after-detach' });
    await closedToZero(peer);
  });

  it('refuses allocations past the budget, gives one back on release, all on close; the victim allocates on', async () => {
    const peer = await attacker();
    const allocations: Array<{ id: string }> = [];
    for (let i = 0; i < LIMITS.allocations; i++) allocations.push(await call(peer, 'vmm', 'create', { size: String(SIZE) }));
    await expect(call(peer, 'vmm', 'create', { size: String(SIZE) })).rejects.toMatchObject(
      refusal('allocations per uid', LIMITS.allocations, LIMITS.allocations),
    );
    await victimServed();
    await call(peer, 'vmm', 'release', { allocationId: allocations[0].id });
    await call(peer, 'vmm', 'create', { size: String(SIZE) });
    await closedToZero(peer);
  });

  it('shows each budget and its limit in the metrics', async () => {
    const text = await scrape();
    expect(text).toMatch(/^# TYPE vmmd_budget_used gauge$/m);
    expect(text).toMatch(/^vmmd_budget_limit\{budget="mappings per uid"\} 6$/m);
    expect(text).toMatch(/^vmmd_budget_limit\{budget="address space per uid"\} 25165824$/m);
    expect(text).toMatch(/^vmmd_budget_limit\{budget="allocations per uid"\} 4$/m);
  });
});
