/**
 * Restarts without loss on the host backend, under vmmd's keeper: the
 * serving daemon is killed (SIGKILL) and the keeper starts it again with
 * every parked descriptor; stores, their bytes, allocations, owners, share
 * keys and quota charges are what they were.
 */
import * as fs from 'node:fs';
import { call, eventually, MiB, Peer, sleep, TestDaemon } from '../e2e/harness';

/** The serving daemon under a keeper: the keeper's only child. */
function servingPid(keeper: number): number | undefined {
  const children = fs.readFileSync(`/proc/${keeper}/task/${keeper}/children`, 'utf8').trim();
  return children === '' ? undefined : Number(children.split(' ')[0]);
}

/** What must survive: stores (names, sizes, flags, owners), allocations (ids, owners, sizes), quota charges. */
async function observed(daemon: TestDaemon) {
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

/** Kills the serving daemon and waits until the keeper's next one serves. */
async function killServing(daemon: TestDaemon): Promise<{ before: number; after: number }> {
  const before = servingPid(daemon.pid)!;
  process.kill(before, 'SIGKILL');
  const after = await eventually(() => {
    const pid = servingPid(daemon.pid);
    return pid !== undefined && pid !== before ? pid : undefined;
  }, 30_000, 'the keeper to start the daemon again');
  await eventually(async () => (await call(daemon.raw.devices, 'ListDevices', {}).then(() => true, () => undefined)), 60_000, 'the daemon to serve again');
  return { before, after };
}

describe('the keeper', () => {
  let daemon: TestDaemon | undefined;
  const peers: Peer[] = [];
  afterEach(async () => {
    for (const peer of peers.splice(0)) await peer.kill();
    await daemon?.stop();
    daemon = undefined;
  });

  it('restarts a SIGKILLed daemon with every store, byte, allocation, owner, share key and quota charge as before', async () => {
    daemon = await TestDaemon.start(['--keeper', 'on', '--quota-per-uid', '64MiB', '--parked-grace-ms', '600000']);
    const maker = await Peer.start(daemon.dir);
    peers.push(maker);
    // Stores with bytes: handed to the daemon (they outlive their maker), one read-only.
    const texts = ['weights of model a', 'weights of model b', 'tokenizer c'];
    for (const [index, text] of texts.entries()) {
      const allocation = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
      const store = await maker.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: allocation.id, name: `model-${index}`, handOver: true } });
      await maker.do({ op: 'storeWrite', id: store.id, text });
    }
    const readOnly = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    await maker.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: readOnly.id, name: 'frozen', readOnly: true, handOver: true } });
    // An allocation of the session's, shared with a key, with bytes in it; and one released (gone for good).
    const own = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(4n * MiB) } });
    const { shareKey } = await maker.do({ op: 'call', api: 'vmm', method: 'share', args: { allocationId: own.id } });
    const reader = await Peer.start(daemon.dir);
    peers.push(reader);
    const mapped = await reader.do({ op: 'import', allocationId: own.id, shareKey });
    await reader.do({ op: 'fill', handle: mapped.handle, offset: 4096, text: 'bytes of the session' });
    const gone = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    await maker.do({ op: 'call', api: 'vmm', method: 'release', args: { allocationId: gone.id } });

    const checksums = async () => {
      const checker = await Peer.start(daemon!.dir);
      try {
        const sums: Record<string, string> = {};
        for (const name of ['model-0', 'model-1', 'model-2', 'frozen']) {
          const opened = await checker.do({ op: 'storeOpen', name });
          sums[name] = (await checker.do({ op: 'storeChecksum', handle: opened.handle })).sha256;
          await checker.do({ op: 'storeClose', handle: opened.handle });
        }
        return sums;
      } finally {
        await checker.stop();
      }
    };
    const sumsBefore = await checksums();
    await reader.kill();
    peers.splice(peers.indexOf(reader), 1);
    const before = await observed(daemon);
    expect(before.stores).toHaveLength(4);
    expect(before.objects.map((o: any) => o.id)).not.toContain(gone.id);
    // The session's allocation is its own, and charged to its uid.
    expect(before.objects.find((o: any) => o.id === own.id).owner).not.toBe('0');
    expect(Object.keys(before.quotas.byUid)).toHaveLength(1);

    await killServing(daemon);
    // The maker's session waits for it (the grace), or is resumed by its client: its objects are its own either way.
    const after = await observed(daemon);
    expect(after).toEqual(before);
    expect(await checksums()).toEqual(sumsBefore);
    // The share key opens the same memory, with its bytes.
    const again = await Peer.start(daemon.dir);
    peers.push(again);
    const reopened = await again.do({ op: 'import', allocationId: own.id, shareKey });
    expect((await again.do({ op: 'peek', handle: reopened.handle, offset: 4096, length: 20 })).text).toBe('bytes of the session');
    // The read-only store stays read-only.
    await expect(again.do({ op: 'storeOpen', name: 'frozen', writable: true })).rejects.toMatchObject({ code: 'STORE_READ_ONLY' });
    // New objects get new ids: none given before is given again.
    const fresh = await again.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    expect(BigInt(fresh.id)).toBeGreaterThan(BigInt(gone.id));
  }, 180_000);

  it("reclaims a parked session's objects once its grace ends, as if it had closed; the daemon's stay", async () => {
    daemon = await TestDaemon.start(['--keeper', 'on', '--quota-per-uid', '64MiB', '--parked-grace-ms', '1500']);
    const maker = await Peer.start(daemon.dir);
    peers.push(maker);
    const own = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    const kept = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    await maker.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: kept.id, name: 'kept', handOver: true } });
    await killServing(daemon);
    await maker.kill();
    peers.splice(0);
    const after = await eventually(async () => {
      const now = await observed(daemon!);
      return now.objects.some((o: any) => o.id === own.id) ? undefined : now;
    }, 20_000, 'the grace to end');
    expect(after.stores.map((s: any) => s.name)).toEqual(['kept']);
    // The reclaimed allocation is no longer charged; the store's memory stays charged to whoever made it, as after any close.
    expect(Object.values(after.quotas.bySession)).toEqual([String(2n * MiB)]);
    // And a restart after the reclaim brings back what is left, not what was reclaimed.
    await killServing(daemon);
    expect((await observed(daemon)).stores.map((s: any) => s.name)).toEqual(['kept']);
    expect((await observed(daemon)).objects.map((o: any) => o.id)).not.toContain(own.id);
  }, 180_000);

  it('survives a crash in the middle of store loads: each store is whole or absent, and a second crash changes nothing', async () => {
    daemon = await TestDaemon.start(['--keeper', 'on', '--parked-grace-ms', '600000']);
    const loader = await Peer.start(daemon.dir);
    peers.push(loader);
    // Loads race the kill: each is an allocation, a store of it and its bytes; some finish, some do not.
    const loads = Array.from({ length: 12 }, async (_, index) => {
      const allocation = await loader.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
      const store = await loader.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: allocation.id, name: `load-${index}`, handOver: true } });
      await loader.do({ op: 'storeWrite', id: store.id, text: `load ${index}` });
      return index;
    });
    const settled = Promise.allSettled(loads);
    await sleep(150);
    await killServing(daemon);
    await settled;
    await loader.kill();
    peers.splice(0);
    const first = await observed(daemon);
    // Every store listed is made of an allocation that exists: no half store.
    for (const store of first.stores) expect(first.objects.map((o: any) => o.id)).toContain(store.allocation);
    await killServing(daemon);
    expect(await observed(daemon)).toEqual(first);
  }, 180_000);
});
