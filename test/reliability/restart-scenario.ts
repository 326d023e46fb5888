/**
 * A daemon SIGKILLed under vmmd's keeper (test/reliability/restart.test.ts on
 * the host backend, test/gpu/park-cuda.test.ts on cuda): stores with bytes
 * (one read-only), a session's allocation shared with a key and written, one
 * released, a store whose maker let go of its allocation (the daemon's then,
 * charged to the maker's uid alone); after the restart, stores, checksums,
 * allocations, owners, quota charges and the share key are what they were,
 * and no id is given twice.
 */
import * as fs from 'node:fs';
import { call, eventually, MiB, Peer, TestDaemon } from '../e2e/harness';

/** The serving daemon under a keeper: the keeper's only child. */
export function servingPid(keeper: number): number | undefined {
  const children = fs.readFileSync(`/proc/${keeper}/task/${keeper}/children`, 'utf8').trim();
  return children === '' ? undefined : Number(children.split(' ')[0]);
}

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

/** What `observed` says once it stays the same for half a second (a session's end, a reclaim, have settled). */
export async function settledState(daemon: TestDaemon) {
  let last = JSON.stringify(await observed(daemon));
  for (;;) {
    await new Promise((resolve) => setTimeout(resolve, 500));
    const now = await observed(daemon);
    if (JSON.stringify(now) === last) return now;
    last = JSON.stringify(now);
  }
}

/** Waits until the keeper's serving daemon is another than `before` and answers (within `serveWithinMs`); its pid. */
export async function servedAgain(daemon: TestDaemon, before: number, serveWithinMs = 120_000): Promise<number> {
  const after = await eventually(
    () => {
      const pid = servingPid(daemon.pid);
      return pid !== undefined && pid !== before ? pid : undefined;
    },
    30_000,
    'the keeper to start the daemon again',
  );
  await eventually(
    async () =>
      await call(daemon.raw.devices, 'ListDevices', {}).then(
        () => true,
        () => undefined,
      ),
    serveWithinMs,
    'the daemon to serve again',
  );
  return after;
}

/** Kills the serving daemon and waits until the keeper's next one serves. */
export async function killServing(daemon: TestDaemon): Promise<{ before: number; after: number }> {
  const before = servingPid(daemon.pid)!;
  process.kill(before, 'SIGKILL');
  return { before, after: await servedAgain(daemon, before) };
}

export async function restartScenario(backend: 'host' | 'cuda'): Promise<void> {
  const daemon = await TestDaemon.start(['--keeper', 'on', '--quota-per-uid', '64MiB', '--parked-grace-ms', '600000'], backend);
  const peers: Peer[] = [];
  try {
    const maker = await Peer.start(daemon.dir);
    peers.push(maker);
    // Stores with bytes: handed to the daemon (they outlive their maker), one read-only.
    const texts = ['weights of model a', 'weights of model b', 'tokenizer c'];
    for (const [index, text] of texts.entries()) {
      const allocation = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
      const store = await maker.do({
        op: 'call',
        api: 'stores',
        method: 'createStore',
        args: { allocationId: allocation.id, name: `model-${index}`, handOver: true },
      });
      await maker.do({ op: 'storeWrite', id: store.id, text });
    }
    // A store whose maker lets go of its allocation: the daemon's from then on, charged to the maker's uid and no session.
    const letGo = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    const kept = await maker.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: letGo.id, name: 'model-3', handOver: true } });
    await maker.do({ op: 'storeWrite', id: kept.id, text: 'weights of model d' });
    await maker.do({ op: 'call', api: 'vmm', method: 'release', args: { allocationId: letGo.id } });
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
        for (const name of ['model-0', 'model-1', 'model-2', 'model-3', 'frozen']) {
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
    expect(before.stores).toHaveLength(5);
    expect(before.objects.map((o: any) => o.id)).not.toContain(gone.id);
    // The session's allocation is its own, and charged to its uid.
    expect(before.objects.find((o: any) => o.id === own.id).owner).not.toBe('0');
    expect(Object.keys(before.quotas.byUid)).toHaveLength(1);
    // The one let go of is the daemon's: charged to the uid (five stores of 2 MiB and the 4 MiB), not to the session.
    expect(before.objects.find((o: any) => o.id === letGo.id).owner).toBe('0');
    expect(Object.values(before.quotas.byUid)).toEqual([String(14n * MiB)]);
    expect(Object.values(before.quotas.bySession)).toEqual([String(12n * MiB)]);

    await killServing(daemon);
    // The maker's session waits for it (the grace) and its client resumes it: its objects are its own either way.
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
  } finally {
    for (const peer of peers) await peer.kill().catch(() => undefined);
    await daemon.stop();
  }
}
