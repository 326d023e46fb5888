/**
 * The per-uid budgets at their defaults (derived at start from this host's
 * vm.max_map_count and descriptor limit), against the attacks that took the
 * daemon's map entries, address space and descriptors: an attacker uid
 * (nobody) maps one allocation again and again, reserves terabytes, makes
 * stores and small allocations, each as fast as it can (128 calls in
 * flight), while a victim uid (root) reserves, maps, allocates, makes a
 * store and opens a new session. Each attack must end in BUDGET_EXCEEDED at
 * the budget, the victim served, the daemon up, and everything given back
 * when the attacker's session closes. Reports the daemon's RSS, descriptors
 * and map entries before, during and after. Larger with VMMD_RELIABILITY=full.
 * Peers of another uid need root.
 */
import * as fs from 'node:fs';
import { connect, VmmdClient } from '../../client';
import { eventually, freePort, MiB, Peer, scrapeMetrics, sleep, TestDaemon } from '../e2e/harness';
import { figure } from './figures';

const FULL = process.env.VMMD_RELIABILITY === 'full';
const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;
jest.setTimeout(FULL ? 900_000 : 180_000);

const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' as const }];

let daemon: TestDaemon | undefined;
let metricsPort = 0;
const clients: VmmdClient[] = [];
const peers: Peer[] = [];

afterEach(async () => {
  for (const client of clients.splice(0)) client.close();
  for (const peer of peers.splice(0)) await peer.kill();
  await daemon?.stop();
  daemon = undefined;
});

async function start(extra: string[] = []): Promise<{ victim: VmmdClient; attacker: Peer }> {
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
    ...extra,
  ]);
  const victim = await connect({ socketDir: daemon.dir });
  clients.push(victim);
  const attacker = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
  peers.push(attacker);
  return { victim, attacker };
}

const scrape = () => scrapeMetrics(metricsPort);

/** A budget's limit, as the daemon derived it. */
async function limit(budget: string): Promise<number> {
  const match = new RegExp(`^vmmd_budget_limit\\{budget="${budget}"\\} (\\S+)$`, 'm').exec(await scrape());
  return Number(match![1]);
}

/** The daemon process now: resident memory, descriptors, process map entries. */
function sample(): { rssMiB: number; descriptors: number; mapEntries: number } {
  const pid = daemon!.pid;
  const rssKiB = Number(/VmRSS:\s+(\d+)/.exec(fs.readFileSync(`/proc/${pid}/status`, 'utf8'))![1]);
  const mapEntries = fs.readFileSync(`/proc/${pid}/maps`, 'utf8').split('\n').filter(Boolean).length;
  return { rssMiB: Math.round(rssKiB / 1024), descriptors: daemon!.openFds(), mapEntries };
}

/** What the victim still does, timed: reserve, map, write, read, a store, a new session's allocation. */
async function victimServed(victim: VmmdClient, size = 2n * MiB): Promise<number> {
  const began = performance.now();
  const allocation = await victim.vmm.create({ size });
  const { address } = await victim.vmm.reserve({ size });
  await victim.vmm.map({ address, size, allocationId: allocation.id });
  await victim.vmm.setAccess({ address, size, descriptors: RW });
  await victim.vmm.write(address, Buffer.from('victim'));
  expect((await victim.vmm.read(address, 6)).toString()).toBe('victim');
  const store = await victim.stores.createStore({ allocationId: allocation.id });
  const second = await connect({ socketDir: daemon!.dir });
  const own = await second.vmm.create({ size });
  await second.vmm.release({ allocationId: own.id });
  second.close();
  await victim.stores.detach({ id: store.id });
  await victim.vmm.unmap({ address, size });
  await victim.vmm.freeAddress({ address, size });
  await victim.vmm.release({ allocationId: allocation.id });
  expect(daemon!.process.exitCode).toBeNull();
  return Math.round(performance.now() - began);
}

/** Runs the attack, checks it ended at the budget, the victim and the daemon; closes the attacker; reports. */
async function attack(
  name: string,
  victim: VmmdClient,
  attacker: Peer,
  budget: string,
  expected: number,
  run: () => Promise<{ done: number; refused: Record<string, number>; firstRefusal?: string }>,
  size?: bigint,
): Promise<void> {
  const before = sample();
  const began = performance.now();
  // The victim works in the middle of the flood, and again once the attacker holds its whole budget.
  const [result, victimDuringMs] = await Promise.all([run(), sleep(1_000).then(() => victimServed(victim, size))]);
  const seconds = (performance.now() - began) / 1000;
  const during = sample();
  expect(result.done).toBe(expected);
  expect(Object.keys(result.refused)).toEqual(['BUDGET_EXCEEDED']);
  expect(result.firstRefusal).toMatch(new RegExp(`^${budget}: uid ${NOBODY} holds`));
  const victimMs = await victimServed(victim, size);
  await attacker.stop();
  await eventually(
    async () => (/^vmmd_budget_used\{[^}]*uid="65534"\}/m.test(await scrape()) ? undefined : true),
    30_000,
    "the attacker's budgets to be given back",
  );
  const after = sample();
  figure(`budgets-${name}-host`, {
    budget,
    attempted: result.done + Object.values(result.refused).reduce((a, b) => a + b, 0),
    attackerGot: result.done,
    refused: result.refused.BUDGET_EXCEEDED,
    attackSeconds: Number(seconds.toFixed(1)),
    victimServed: true,
    victimDuringMs,
    victimAfterMs: victimMs,
    daemonUp: daemon!.process.exitCode === null,
    rssMiBBefore: before.rssMiB,
    rssMiBDuring: during.rssMiB,
    rssMiBAfter: after.rssMiB,
    descriptorsBefore: before.descriptors,
    descriptorsDuring: during.descriptors,
    descriptorsAfter: after.descriptors,
    mapEntriesBefore: before.mapEntries,
    mapEntriesDuring: during.mapEntries,
    mapEntriesAfter: after.mapEntries,
  });
}

const call = <T = any>(peer: Peer, api: string, method: string, args: object) => peer.do<T>({ op: 'call', api, method, args });

(isRoot ? describe : describe.skip)('per-uid budgets at their defaults, attacked (host, run as root)', () => {
  it('ends one allocation mapped again and again at the mappings budget, far from vm.max_map_count', async () => {
    const { victim, attacker } = await start();
    const size = 2n * MiB;
    const budget = await limit('mappings per uid');
    const tries = FULL ? 40_000 : budget + 500;
    const allocation = await call(attacker, 'vmm', 'create', { size: String(size) });
    const { address } = await call(attacker, 'vmm', 'reserve', { size: String(BigInt(tries) * size) });
    const args = Array.from({ length: tries }, (_, i) => ({
      address: String(BigInt(address) + BigInt(i) * size),
      size: String(size),
      allocationId: allocation.id,
    }));
    await attack('mappings', victim, attacker, 'mappings per uid', budget, () => attacker.do({ op: 'many', api: 'vmm', method: 'map', args, parallel: 128 }));
  });

  it('ends terabytes of reservations at the address space budget', async () => {
    const { victim, attacker } = await start();
    const TiB = 1n << 40n;
    const budget = await limit('address space per uid');
    const args = Array.from({ length: 128 }, () => ({ size: String(TiB) }));
    await attack('address-space', victim, attacker, 'address space per uid', Math.floor(budget / Number(TiB)), () =>
      attacker.do({ op: 'many', api: 'vmm', method: 'reserve', args, parallel: 16 }),
    );
  });

  it('ends a flood of stores with long names at the stores budget', async () => {
    const { victim, attacker } = await start();
    const budget = Math.min(await limit('stores per uid'), await limit('mappings per uid'));
    const allocation = await call(attacker, 'vmm', 'create', { size: String(2n * MiB) });
    const tries = FULL ? 17_472 : budget + 500;
    const args = Array.from({ length: tries }, (_, i) => ({ allocationId: allocation.id, name: `${'s'.repeat(247)}${String(i).padStart(8, '0')}` }));
    const name = budget === (await limit('stores per uid')) ? 'stores per uid' : 'mappings per uid';
    await attack('stores', victim, attacker, name, budget, () => attacker.do({ op: 'many', api: 'stores', method: 'createStore', args, parallel: 128 }));
  });

  it("ends 64 KiB allocations at the allocations budget, with the daemon's descriptors to spare", async () => {
    const { victim, attacker } = await start(['--host-granularity', '64KiB']);
    const size = 64n << 10n;
    const budget = await limit('allocations per uid');
    const tries = FULL ? 20_000 : budget + 500;
    const args = Array.from({ length: tries }, () => ({ size: String(size) }));
    await attack(
      'allocations',
      victim,
      attacker,
      'allocations per uid',
      budget,
      () => attacker.do({ op: 'many', api: 'vmm', method: 'create', args, parallel: 128 }),
      size,
    );
  });
});
