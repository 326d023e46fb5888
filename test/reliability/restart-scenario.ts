/**
 * A daemon SIGKILLed under vmmd's keeper (test/reliability/restart.test.ts on
 * the host backend, test/gpu/park-cuda.test.ts on cuda), and the waits for
 * the keeper's next daemon to serve: after the restart, the objects of
 * test/reliability/parked-objects.ts (stores, checksums, allocations,
 * owners, quota charges, the share key) are what they were, and no id is
 * given twice.
 */
import * as fs from 'node:fs';
import { call, eventually, MiB, Peer, TestDaemon } from '../e2e/harness';
import { checksums, expectIntact, observed, populate, STORE_NAMES } from './parked-objects';

/** The serving daemon under a keeper: the keeper's only child. */
export function servingPid(keeper: number): number | undefined {
  const children = fs.readFileSync(`/proc/${keeper}/task/${keeper}/children`, 'utf8').trim();
  return children === '' ? undefined : Number(children.split(' ')[0]);
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
    const made = await populate(daemon, peers);
    const sums = await checksums(daemon.dir);
    const before = await observed(daemon);
    expect(before.stores.map((store: any) => store.name)).toEqual(STORE_NAMES);
    expect(before.objects.map((o: any) => o.id)).not.toContain(made.gone.id);
    // The session's allocation is its own; the one let go of is the daemon's. Both are charged to the uid (five
    // stores of 2 MiB and the 4 MiB), the session only with what it holds.
    expect(before.objects.find((o: any) => o.id === made.own.id).owner).not.toBe('0');
    expect(before.objects.find((o: any) => o.id === made.letGo).owner).toBe('0');
    expect(Object.keys(before.quotas.byUid)).toHaveLength(1);
    expect(Object.values(before.quotas.byUid)).toEqual([String(14n * MiB)]);
    expect(Object.values(before.quotas.bySession)).toEqual([String(12n * MiB)]);

    await killServing(daemon);
    // The maker's session waits for it (the grace) and its client resumes it: its objects are its own either way.
    await expectIntact(daemon, before, sums, made);
  } finally {
    for (const peer of peers) await peer.kill().catch(() => undefined);
    await daemon.stop();
  }
}
