/**
 * Two client processes share real memory through real descriptors, and the
 * daemon reclaims everything of a client killed with SIGKILL while the other
 * client's mapping stays intact. A contract for every backend: test/e2e runs
 * it on host, test/gpu on cuda.
 */
import { eventually, MiB, Peer, TestDaemon } from '../e2e/harness';

export function sharingContract(backend: 'host' | 'cuda'): void {
  const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];
  const SIZE = String(4n * MiB);

  let daemon: TestDaemon;
  const peers: Peer[] = [];

  beforeEach(async () => {
    daemon = await TestDaemon.start([], backend);
  });

  afterEach(async () => {
    for (const peer of peers.splice(0)) await peer.stop().catch(() => undefined);
    await daemon.stop();
  });

  async function peer(): Promise<Peer> {
    const started = await Peer.start(daemon.dir);
    peers.push(started);
    return started;
  }

  function objects(stats: Awaited<ReturnType<TestDaemon['stats']>>) {
    return {
      reservations: stats.reservations,
      allocations: stats.allocations,
      mappings: stats.mappings,
      reservedBytes: stats.reservedBytes,
      allocatedBytes: stats.allocatedBytes,
      importedBytes: stats.importedBytes,
      mappedBytes: stats.mappedBytes,
      pendingTransfers: stats.pendingTransfers,
    };
  }

  describe('sharing between processes', () => {
    it('A fills, B imports and sees it, B writes, A and the daemon see that; SIGKILL of A is reclaimed and B stays intact', async () => {
      const b = await peer();
      const baseline = objects(await daemon.stats());
      const baselineSessions = (await daemon.stats()).sessions;
      const baselineFds = daemon.openFds();

      // A: create, map in the daemon with access, map locally, fill a pattern.
      const a = await peer();
      const allocation = await a.do({ op: 'call', api: 'vmm', method: 'create', args: { size: SIZE } });
      const reservation = await a.do({ op: 'call', api: 'vmm', method: 'reserve', args: { size: SIZE } });
      await a.do({
        op: 'call',
        api: 'vmm',
        method: 'map',
        args: { address: reservation.address, size: SIZE, allocationId: allocation.id },
      });
      await a.do({ op: 'call', api: 'vmm', method: 'setAccess', args: { address: reservation.address, size: SIZE, descriptors: RW } });
      const mine = await a.do({ op: 'import', allocationId: allocation.id });
      const patternA = 'pattern written by A';
      await a.do({ op: 'fill', handle: mine.handle, offset: 1000, text: patternA });
      expect((await a.do({ op: 'read', address: String(BigInt(reservation.address) + 1000n), length: patternA.length })).text).toBe(patternA);

      // B: import A's allocation with the share key and read A's pattern.
      const { shareKey } = await a.do({ op: 'call', api: 'vmm', method: 'share', args: { allocationId: allocation.id } });
      const theirs = await b.do({ op: 'import', allocationId: allocation.id, shareKey });
      expect(theirs.address).not.toBe(reservation.address);
      expect((await b.do({ op: 'peek', handle: theirs.handle, offset: 1000, length: patternA.length })).text).toBe(patternA);

      // B writes its own pattern: A's local view and the daemon's Read see it.
      const patternB = 'B was here, at the far end';
      const farEnd = Number(4n * MiB) - patternB.length;
      await b.do({ op: 'fill', handle: theirs.handle, offset: farEnd, text: patternB });
      expect((await a.do({ op: 'peek', handle: mine.handle, offset: farEnd, length: patternB.length })).text).toBe(patternB);
      const address = String(BigInt(reservation.address) + BigInt(farEnd));
      expect((await a.do({ op: 'read', address, length: patternB.length })).text).toBe(patternB);

      // A holds more objects, then dies mid-life.
      await a.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
      await a.do({ op: 'call', api: 'vmm', method: 'reserve', args: { size: String(64n * MiB) } });
      const during = await daemon.stats();
      expect(BigInt(during.allocatedBytes)).toBe(6n * MiB);
      expect(during.sessions).toBe(baselineSessions + 1);
      await a.kill('SIGKILL');

      // The daemon reclaims all of A: objects, bytes and descriptors back to the baseline.
      await eventually(async () => ((await daemon.stats()).sessions === baselineSessions ? true : undefined), 10_000, 'A to be reclaimed');
      expect(objects(await daemon.stats())).toEqual(baseline);
      await eventually(() => (daemon.openFds() === baselineFds ? true : undefined), 10_000, `daemon fds back to ${baselineFds}`);

      // B's mapping outlives A and the daemon's reclaim, with both patterns intact.
      expect((await b.do({ op: 'peek', handle: theirs.handle, offset: 1000, length: patternA.length })).text).toBe(patternA);
      expect((await b.do({ op: 'peek', handle: theirs.handle, offset: farEnd, length: patternB.length })).text).toBe(patternB);
      await b.do({ op: 'fill', handle: theirs.handle, offset: 0, text: 'still writable' });
      expect((await b.do({ op: 'peek', handle: theirs.handle, offset: 0, length: 14 })).text).toBe('still writable');
    });

    it("refuses B another session's allocation without the share key, and with a wrong one", async () => {
      const a = await peer();
      const b = await peer();
      const allocation = await a.do({ op: 'call', api: 'vmm', method: 'create', args: { size: SIZE } });
      await expect(b.do({ op: 'import', allocationId: allocation.id })).rejects.toMatchObject({ code: 'NOT_OWNER', status: 7 });
      await a.do({ op: 'call', api: 'vmm', method: 'share', args: { allocationId: allocation.id } });
      await expect(b.do({ op: 'import', allocationId: allocation.id, shareKey: 'guess' })).rejects.toMatchObject({
        code: 'BAD_SHARE_KEY',
        status: 7,
      });
    });

    (backend === 'host' ? it : it.skip)('maps read-only when asked: reads work, a store through the view faults', async () => {
      const a = await peer();
      const allocation = await a.do({ op: 'call', api: 'vmm', method: 'create', args: { size: SIZE } });
      const local = await a.do({ op: 'import', allocationId: allocation.id });
      await a.do({ op: 'fill', handle: local.handle, offset: 0, text: 'abc' });
      await a.do({ op: 'unmapLocal', handle: local.handle });
      const again = await a.do({ op: 'import', allocationId: allocation.id, readOnly: true });
      expect((await a.do({ op: 'peek', handle: again.handle, offset: 0, length: 3 })).text).toBe('abc');
      await expect(a.do({ op: 'fill', handle: again.handle, offset: 0, text: 'x' })).rejects.toMatchObject({ code: 'READ_ONLY' });
      // The kernel enforces it too: a store straight through the read-only view faults the process.
      void a.do({ op: 'poke', handle: again.handle, offset: 0, text: 'x' }).catch(() => undefined);
      expect((await a.exited).signal).toBe('SIGSEGV');
    });
  });
}
