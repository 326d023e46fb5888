/**
 * Restarts without loss on the host backend, under vmmd's keeper: the
 * serving daemon is killed (SIGKILL) and the keeper starts it again with
 * every parked descriptor; stores, their bytes, allocations, owners, share
 * keys and quota charges are what they were.
 */
import * as fs from 'node:fs';
import { eventually, MiB, Peer, sleep, TestDaemon } from '../e2e/harness';
import { observed } from './parked-objects';
import { killServing, restartScenario, servedAgain, servingPid, settledState } from './restart-scenario';

describe('the keeper', () => {
  let daemon: TestDaemon | undefined;
  const peers: Peer[] = [];
  afterEach(async () => {
    for (const peer of peers.splice(0)) await peer.kill();
    await daemon?.stop();
    daemon = undefined;
  });

  it('restarts a SIGKILLed daemon with every store, byte, allocation, owner, share key and quota charge as before', () => restartScenario('host'), 180_000);

  it("starts the serving daemon with Node's own options as the keeper was given them (a heap limit, a profiler)", async () => {
    daemon = await TestDaemon.start(['--keeper', 'on'], 'host', {}, { nodeArgs: ['--max-old-space-size=1234', '--stack-size=2000'] });
    const serving = await eventually(() => servingPid(daemon!.pid), 20_000, 'the serving daemon');
    const argv = fs.readFileSync(`/proc/${serving}/cmdline`, 'utf8').split('\0');
    expect(argv.slice(1, 3)).toEqual(['--max-old-space-size=1234', '--stack-size=2000']);
    // And after a restart.
    const { after } = await killServing(daemon);
    expect(fs.readFileSync(`/proc/${after}/cmdline`, 'utf8').split('\0').slice(1, 3)).toEqual(['--max-old-space-size=1234', '--stack-size=2000']);
  }, 120_000);

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
    const after = await eventually(
      async () => {
        const now = await observed(daemon!);
        return now.objects.some((o: any) => o.id === own.id) ? undefined : now;
      },
      20_000,
      'the grace to end',
    );
    expect(after.stores.map((s: any) => s.name)).toEqual(['kept']);
    // The reclaimed allocation is no longer charged; the store's memory is the daemon's, charged to its maker's uid and no session.
    expect(after.quotas.bySession).toEqual({});
    expect(Object.values(after.quotas.byUid)).toEqual([String(2n * MiB)]);
    expect(after.objects.find((o: any) => o.id === kept.id).owner).toBe('0');
    // And a restart after the reclaim brings back what is left, not what was reclaimed.
    await killServing(daemon);
    expect((await observed(daemon)).stores.map((s: any) => s.name)).toEqual(['kept']);
    expect((await observed(daemon)).objects.map((o: any) => o.id)).not.toContain(own.id);
  }, 180_000);

  it("a resumed session's objects, made before the restart and after, are reclaimed when its client closes", async () => {
    daemon = await TestDaemon.start(['--keeper', 'on', '--parked-grace-ms', '600000']);
    const client = await Peer.start(daemon.dir);
    peers.push(client);
    const before = await client.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    await killServing(daemon);
    // The client resumes its session by itself: its next call is served by the new daemon.
    const after = await client.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    expect((await observed(daemon)).objects.map((o: any) => o.id)).toEqual([before.id, after.id]);
    await client.stop();
    peers.splice(0);
    const left = await eventually(
      async () => {
        const { objects, quotas } = await observed(daemon!);
        return objects.length === 0 ? { objects, quotas } : undefined;
      },
      20_000,
      "the session's objects to be reclaimed",
    ).catch(async () => observed(daemon!));
    expect(left.objects).toEqual([]);
    expect(left.quotas.bySession).toEqual({});
  }, 180_000);

  it('restarts the daemon on SIGHUP to the keeper (a planned upgrade) with everything as before', async () => {
    daemon = await TestDaemon.start(['--keeper', 'on', '--parked-grace-ms', '600000']);
    const maker = await Peer.start(daemon.dir);
    peers.push(maker);
    const allocation = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    await maker.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: allocation.id, name: 'upgraded', handOver: true } });
    await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    const before = await observed(daemon);
    const old = servingPid(daemon.pid)!;
    process.kill(daemon.pid, 'SIGHUP');
    await servedAgain(daemon, old, 60_000);
    // The maker's session waits for it or is resumed by its client: the same either way (its end would reclaim).
    expect(await observed(daemon)).toEqual(before);
  }, 180_000);

  it('survives a crash in the middle of a planned restart: SIGKILL while the daemon drains after SIGHUP', async () => {
    daemon = await TestDaemon.start(['--keeper', 'on', '--parked-grace-ms', '600000', '--shutdown-grace-ms', '2000']);
    const maker = await Peer.start(daemon.dir);
    peers.push(maker);
    const allocation = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    await maker.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: allocation.id, name: 'mid-upgrade', handOver: true } });
    const before = await observed(daemon);
    const old = servingPid(daemon.pid)!;
    process.kill(daemon.pid, 'SIGHUP');
    await sleep(20);
    if (servingPid(daemon.pid) === old) process.kill(old, 'SIGKILL');
    await servedAgain(daemon, old, 60_000);
    expect(await observed(daemon)).toEqual(before);
  }, 180_000);

  it('survives a crash in the middle of store loads: each store is whole or absent, and a second crash changes nothing', async () => {
    daemon = await TestDaemon.start(['--keeper', 'on', '--parked-grace-ms', '600000']);
    const loader = await Peer.start(daemon.dir);
    peers.push(loader);
    // Loads race the kill: each is an allocation, a store of it and its bytes; some finish, some do not.
    const loads = Array.from({ length: 12 }, async (_, index) => {
      const allocation = await loader.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
      const store = await loader.do({
        op: 'call',
        api: 'stores',
        method: 'createStore',
        args: { allocationId: allocation.id, name: `load-${index}`, handOver: true },
      });
      await loader.do({ op: 'storeWrite', id: store.id, text: `load ${index}` });
      return index;
    });
    const settled = Promise.allSettled(loads);
    await sleep(150);
    await killServing(daemon);
    await settled;
    await loader.kill();
    peers.splice(0);
    const first = await settledState(daemon);
    // Every store listed is made of an allocation that exists: no half store.
    for (const store of first.stores) expect(first.objects.map((o: any) => o.id)).toContain(store.allocation);
    await killServing(daemon);
    expect(await observed(daemon)).toEqual(first);
  }, 180_000);
});
