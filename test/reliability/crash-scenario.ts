/**
 * The client-crash scenario, on either backend: clients killed with SIGKILL
 * at random points (mid-RPC, mid-transfer, holding imported and mapped
 * memory, with stores and unclaimed exports). After each batch the daemon's
 * objects, bytes and descriptors return to the baseline, and a witness client
 * that lives through it all keeps its memory intact and its session working.
 * Used by test/reliability/crashes.test.ts (host) and test/gpu/crashes-cuda.test.ts.
 */
import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import * as path from 'node:path';
import { connect } from '../../client';
import { eventually, MiB, packageRoot, TestDaemon } from '../e2e/harness';
import { figure } from './figures';

const CHURN = path.join(packageRoot(), 'dist', 'test', 'reliability', 'fixtures', 'churn.js');
const AT_ONCE = 4;

function objectsOf(stats: Awaited<ReturnType<TestDaemon['stats']>>) {
  const { sessions, reservations, allocations, mappings, reservedBytes, allocatedBytes, importedBytes, mappedBytes, pendingTransfers } = stats;
  return { sessions, reservations, allocations, mappings, reservedBytes, allocatedBytes, importedBytes, mappedBytes, pendingTransfers };
}

/** The daemon's live objects: allocations, reservations and mappings. */
function liveObjects(stats: Awaited<ReturnType<TestDaemon['stats']>>): number {
  return Number(stats.allocations) + Number(stats.reservations) + Number(stats.mappings);
}

/**
 * A churning client, killed after `lifeMs` and, with `holdingMoreThan`, not
 * before the daemon holds more live objects than that (a slow machine must not
 * kill every client before it holds anything); resolves once it is dead, with
 * the daemon's live objects just before.
 */
async function churnAndKill(daemon: TestDaemon, seed: number, lifeMs: number, holdingMoreThan?: number): Promise<number> {
  const dir = daemon.dir;
  const child = spawn(process.execPath, [CHURN, String(seed)], { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, VMMD_SOCKET_DIR: dir } });
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  await new Promise<void>((resolve, reject) => {
    child.stdout!.once('data', () => resolve());
    child.once('exit', (code) => reject(new Error(`a churning client exited with ${code} before it was ready`)));
  });
  await new Promise((resolve) => setTimeout(resolve, lifeMs));
  const live =
    holdingMoreThan === undefined
      ? liveObjects(await daemon.stats())
      : await eventually(
          async () => {
            const now = liveObjects(await daemon.stats());
            return now > holdingMoreThan ? now : undefined;
          },
          20_000,
          `the daemon to hold more than ${holdingMoreThan} live objects while clients churn`,
        );
  child.kill('SIGKILL');
  await exited;
  return live;
}

export async function crashScenario(backend: 'host' | 'cuda', CLIENTS: number): Promise<void> {
  const daemon = await TestDaemon.start(['--quota-per-session', '64MiB'], backend);
  const witness = await connect({ socketDir: daemon.dir });
  try {
    // The witness: memory it imported, filled, and checks after every batch.
    const memory = await witness.vmm.allocate({ size: 4n * MiB });
    const bytes = Buffer.alloc(Number(memory.size));
    for (let i = 0; i < bytes.length; i++) bytes[i] = (i * 131) & 0xff;
    await memory.write(0, bytes);
    // Read back through this process's own mapping (device memory on cuda): the daemon is not asked.
    const checksum = async () =>
      createHash('sha256')
        .update(await memory.read(0, memory.size))
        .digest('hex');
    const expected = await checksum();
    // A stock (cuda's default) refills after each take: the baseline is a full stock.
    const stockFull = async () => {
      const report = (await witness.admin.getReport()) as { stock: { levels: Array<{ depth: number; held: number }> } | null };
      return report.stock === null || report.stock.levels.every((level) => level.held === level.depth) ? true : undefined;
    };
    await eventually(stockFull, 20_000, 'the stock to be full');
    // The stock holds one exported descriptor per allocation on its shelves, and its
    // shelves follow what clients ask: descriptors are compared net of them.
    const stockHeld = async () => {
      const report = (await witness.admin.getReport()) as { stock: { levels: Array<{ held: number }> } | null };
      return (report.stock?.levels ?? []).reduce((sum, level) => sum + level.held, 0);
    };
    const ownFds = async () => daemon.openFds() - (await stockHeld());
    const baseline = objectsOf(await daemon.stats());
    const baselineFds = await ownFds();
    const reclaimMs: number[] = [];
    let seed = 1;
    let witnessFailures = 0;
    let heldAtKill = 0;
    // The clients did hold things when they died (the test is not vacuous): the first of each batch is
    // killed no sooner than the daemon holds a few objects more than the witness's.
    const holding = Number(baseline.allocations) + 4;
    for (let done = 0; done < CLIENTS; done += AT_ONCE) {
      const batch = Array.from({ length: Math.min(AT_ONCE, CLIENTS - done) }, (_, index) =>
        churnAndKill(daemon, seed++, 20 + ((seed * 7919) % 400), index === 0 ? holding : undefined),
      );
      const held = await Promise.all(batch);
      heldAtKill = Math.max(heldAtKill, ...held);
      const killed = Date.now();
      await eventually(
        async () =>
          JSON.stringify(objectsOf(await daemon.stats())) === JSON.stringify(baseline) && (await stockFull()) && (await ownFds()) === baselineFds
            ? true
            : undefined,
        20_000,
        `objects and descriptors back to the baseline after client ${done + batch.length}`,
      );
      reclaimMs.push(Date.now() - killed);
      if ((await checksum()) !== expected) witnessFailures++;
      await witness.devices.getGranularity();
    }
    expect(witnessFailures).toBe(0);
    expect(heldAtKill).toBeGreaterThan(holding);
    expect(objectsOf(await daemon.stats())).toEqual(baseline);
    expect(await ownFds()).toBe(baselineFds);
    reclaimMs.sort((a, b) => a - b);
    figure(`client crashes (${backend})`, {
      clients_killed: CLIENTS,
      killed_at: '20–420 ms after connecting, 4 at a time, mid-whatever',
      live_objects_when_killed_max: heldAtKill,
      leaked_objects: 0,
      leaked_descriptors: 0,
      witness_checksum_failures: witnessFailures,
      reclaim_ms_p50: reclaimMs[Math.floor(reclaimMs.length / 2)],
      reclaim_ms_max: reclaimMs[reclaimMs.length - 1],
    });
    await memory.close();
  } finally {
    witness.close();
    expect(await daemon.stop()).toBe(0);
  }
}
