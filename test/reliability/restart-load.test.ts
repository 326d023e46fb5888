/**
 * A restart while 16 clients allocate, on the host backend under vmmd's
 * keeper: the serving daemon is SIGKILLed in the middle; every allocation a
 * client was answered for is still there afterwards, its own (one owner per
 * client, none shared), and the daemon holds no allocation nobody was told
 * of beyond the calls the restart cut off.
 */
import { call, eventually, MiB, Peer, sleep, TestDaemon } from '../e2e/harness';
import { killServing } from './restart-scenario';

const CLIENTS = 16;
/** Allocations a client makes before the restart at most, and after it: 16 × (12 + 3) × 2 MiB stays well inside the 1 GiB capacity. */
const BEFORE = 12;
const AFTER = 3;

it('keeps every answered allocation of 16 clients allocating through a SIGKILL of the daemon, each its own', async () => {
  const daemon = await TestDaemon.start(['--keeper', 'on', '--parked-grace-ms', '600000', '--host-capacity', '1GiB']);
  const peers: Peer[] = [];
  try {
    for (let index = 0; index < CLIENTS; index++) peers.push(await Peer.start(daemon.dir));
    let stop = false;
    const answered: string[][] = peers.map(() => []);
    const refused: string[] = [];
    // Each client allocates up to its limit, then waits for a higher one: the clients cannot fill the capacity
    // between the restart and the moment the test counts what each had.
    const limits = peers.map(() => BEFORE);
    const loops = peers.map(async (peer, index) => {
      while (!stop) {
        if (answered[index].length >= limits[index]) {
          await sleep(10);
          continue;
        }
        try {
          answered[index].push((await peer.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } })).id);
        } catch (error) {
          refused.push(String((error as { code?: unknown }).code));
          await sleep(20);
        }
      }
    });
    await eventually(() => (answered.every((ids) => ids.length >= 2) ? true : undefined), 60_000, 'every client to allocate');
    await killServing(daemon);
    // The clients carry on: each is answered again after the restart.
    const atRestart = answered.map((ids) => ids.length);
    atRestart.forEach((count, index) => (limits[index] = count + AFTER));
    await eventually(
      () => (answered.every((ids, index) => ids.length === limits[index]) ? true : undefined),
      120_000,
      `every client to allocate again (refused: ${refused.join(',')})`,
    );
    stop = true;
    await Promise.all(loops);
    const objects: Array<{ id: string; ownerSession: string }> = (await call(daemon.raw.admin, 'ListObjects', {})).objects.filter(
      (o: any) => o.kind === 'allocation',
    );
    const ownerOf = new Map(objects.map((o) => [o.id, o.ownerSession]));
    const owners = new Set<string>();
    for (const ids of answered) {
      expect(ids.length).toBeGreaterThan(0);
      const mine = new Set(ids.map((id) => ownerOf.get(id)));
      // Every answered allocation exists, and all of one client's have one owner: its session, before and after.
      expect(mine.has(undefined)).toBe(false);
      expect(mine.size).toBe(1);
      owners.add([...mine][0]!);
    }
    expect(owners.size).toBe(CLIENTS);
    // Nothing half-made: beyond the answered ones, at most one per call the restart cut off.
    const total = answered.reduce((sum, ids) => sum + ids.length, 0);
    expect(objects.length).toBeGreaterThanOrEqual(total);
    expect(objects.length - total).toBeLessThanOrEqual(refused.length);
  } finally {
    for (const peer of peers) await peer.kill().catch(() => undefined);
    await daemon.stop();
  }
}, 300_000);
