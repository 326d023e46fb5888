/**
 * The objects every restart and take-over scenario must bring through, made
 * and checked in one place (test/reliability/restart-scenario.ts,
 * take-over-scenario.ts and the tests on them): stores with bytes, handed to
 * the daemon (three their maker keeps its allocation of, one whose maker let
 * go of it: the daemon's then, charged to the maker's uid alone, and one
 * read-only), a session's allocation shared with a key and written through
 * another client's mapping, and one released (gone for good, its id never
 * given again).
 */
import { call, MiB, Peer, TestDaemon } from '../e2e/harness';

/** The stores populate() makes, in order. */
export const STORE_NAMES = ['model-0', 'model-1', 'model-2', 'model-3', 'frozen'];

/** What must survive: stores (names, sizes, flags, owners), allocations (ids, owners, sizes), quota charges. */
export async function observed(daemon: TestDaemon) {
  const stores = (await call(daemon.raw.stores, 'List', {})).stores
    .map((s: any) => ({ id: s.id, name: s.name, size: s.size, readOnly: s.readOnly, owner: s.ownerSession, allocation: s.allocationId, state: s.state }))
    .sort((a: any, b: any) => Number(a.id) - Number(b.id));
  const objects = (await call(daemon.raw.admin, 'ListObjects', {})).objects
    .filter((o: any) => o.kind === 'allocation')
    .map((o: any) => ({ id: o.id, owner: o.ownerSession, size: o.size }))
    .sort((a: any, b: any) => Number(a.id) - Number(b.id));
  const report = JSON.parse((await call(daemon.raw.admin, 'GetReport', {})).json);
  return { stores, objects, quotas: report.quotas };
}

/** Makes the objects on `daemon` through a client (the maker) that stays connected; the clients started go to `peers`. */
export async function populate(daemon: TestDaemon, peers: Peer[]) {
  const maker = await Peer.start(daemon.dir);
  peers.push(maker);
  const create = async (size: bigint) => maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(size) } });
  const texts = ['weights of model a', 'weights of model b', 'tokenizer c', 'weights of model d'];
  let letGo = '';
  for (const [index, text] of texts.entries()) {
    const allocation = await create(2n * MiB);
    const store = await maker.do({
      op: 'call',
      api: 'stores',
      method: 'createStore',
      args: { allocationId: allocation.id, name: `model-${index}`, handOver: true },
    });
    await maker.do({ op: 'storeWrite', id: store.id, text });
    if (index === texts.length - 1) {
      await maker.do({ op: 'call', api: 'vmm', method: 'release', args: { allocationId: allocation.id } });
      letGo = allocation.id;
    }
  }
  const frozen = await create(2n * MiB);
  await maker.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: frozen.id, name: 'frozen', readOnly: true, handOver: true } });
  const own = await create(4n * MiB);
  const { shareKey } = await maker.do({ op: 'call', api: 'vmm', method: 'share', args: { allocationId: own.id } });
  const writer = await Peer.start(daemon.dir);
  const mapped = await writer.do({ op: 'import', allocationId: own.id, shareKey });
  await writer.do({ op: 'fill', handle: mapped.handle, offset: 4096, text: 'bytes of the session' });
  await writer.stop();
  const gone = await create(2n * MiB);
  await maker.do({ op: 'call', api: 'vmm', method: 'release', args: { allocationId: gone.id } });
  return { maker, own, shareKey, letGo, gone };
}

/** The stores' checksums, through a fresh client. */
export async function checksums(dir: string): Promise<Record<string, string>> {
  const checker = await Peer.start(dir);
  try {
    const sums: Record<string, string> = {};
    for (const name of STORE_NAMES) {
      const opened = await checker.do({ op: 'storeOpen', name });
      sums[name] = (await checker.do({ op: 'storeChecksum', handle: opened.handle })).sha256;
      await checker.do({ op: 'storeClose', handle: opened.handle });
    }
    return sums;
  } finally {
    await checker.stop();
  }
}

/**
 * Everything is as before on `daemon`: stores, bytes, allocations, owners, quota charges, the share key's bytes,
 * the read-only store's refusal; the maker's client resumed its session by itself and makes more, with ids
 * never given before.
 */
export async function expectIntact(
  daemon: TestDaemon,
  before: Awaited<ReturnType<typeof observed>>,
  sums: Record<string, string>,
  made: Awaited<ReturnType<typeof populate>>,
) {
  expect(await observed(daemon)).toEqual(before);
  expect(await checksums(daemon.dir)).toEqual(sums);
  const reader = await Peer.start(daemon.dir);
  try {
    const reopened = await reader.do({ op: 'import', allocationId: made.own.id, shareKey: made.shareKey });
    expect((await reader.do({ op: 'peek', handle: reopened.handle, offset: 4096, length: 20 })).text).toBe('bytes of the session');
    await expect(reader.do({ op: 'storeOpen', name: 'frozen', writable: true })).rejects.toMatchObject({ code: 'STORE_READ_ONLY' });
  } finally {
    await reader.stop();
  }
  const fresh = await made.maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
  expect(BigInt(fresh.id)).toBeGreaterThan(BigInt(made.gone.id));
  await made.maker.do({ op: 'call', api: 'vmm', method: 'release', args: { allocationId: fresh.id } });
}
