/**
 * 6. Scale: create, map, unmap and release latency with 100, 10,000 and
 * 100,000 live objects in the daemon. The live objects are reservations and
 * allocations of one granule (allocations capped at a quarter of the device's
 * memory, so that a GPU does not run out), made by a second session.
 */
import * as fs from 'node:fs';
import type { VmmdClient } from '../../client';
import type { Stats__Output } from '../../generated/vmmd/v1/Stats';
import type { BenchDaemon } from '../lib/daemon';
import { ratio, Row, Section, summarize } from '../lib/stats';

const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' as const }];

const liveObjects = (stats: Stats__Output) => Number(stats.reservations) + Number(stats.allocations) + Number(stats.mappings);

/** This process's soft limit on open files (the daemon it started inherits it). */
function openFileLimit(): number {
  try {
    const line = fs
      .readFileSync('/proc/self/limits', 'utf8')
      .split('\n')
      .find((text) => text.startsWith('Max open files'));
    const soft = Number(line?.split(/\s{2,}/)[1]);
    return Number.isFinite(soft) ? soft : 1024;
  } catch {
    return 1024;
  }
}

/** Runs `count` calls of `body`, `width` at a time. */
async function concurrently(count: number, width: number, body: (index: number) => Promise<unknown>): Promise<void> {
  let next = 0;
  await Promise.all(
    Array.from({ length: Math.min(width, count) }, async () => {
      while (next < count) await body(next++);
    }),
  );
}

export async function scale(daemon: BenchDaemon, levels: number[], iterations: number): Promise<Section> {
  const client = daemon.client;
  const filler: VmmdClient = await daemon.connect();
  const granule = BigInt((await client.devices.getGranularity()).minimum);
  const info = await client.devices.getMemoryInfo();
  // A quarter of device memory at most; on the host backend each allocation is a descriptor, so also half the fd limit.
  let allocationCap = Number(BigInt(info.totalBytes) / 4n / granule);
  if (client.backend === 'host') allocationCap = Math.min(allocationCap, Math.floor(openFileLimit() / 2));
  const standing = await client.vmm.reserve({ size: granule });
  let live = { reservations: 0, allocations: 0 };
  const rows: Row[] = [];
  const results: Array<{ objects: number; p50: number }> = [];
  try {
    for (const level of levels) {
      const others = liveObjects(await client.admin.getStats()) - live.reservations - live.allocations;
      const wanted = Math.max(0, level - others);
      const targetAllocations = Math.min(Math.floor(wanted / 2), allocationCap);
      const allocations = Math.max(0, targetAllocations - live.allocations);
      const reservations = Math.max(0, wanted - targetAllocations - live.reservations);
      const started = performance.now();
      await concurrently(allocations, 64, () => filler.vmm.create({ size: granule }));
      await concurrently(reservations, 64, () => filler.vmm.reserve({ size: granule }));
      live = { reservations: live.reservations + reservations, allocations: live.allocations + allocations };
      const fillSeconds = (performance.now() - started) / 1000;
      const objects = liveObjects(await client.admin.getStats());
      const times = { create: [] as number[], map: [] as number[], setAccess: [] as number[], unmap: [] as number[], release: [] as number[] };
      const at = () => performance.now() * 1000;
      for (let i = 0; i < iterations + 20; i++) {
        const t0 = at();
        const allocation = await client.vmm.create({ size: granule });
        const t1 = at();
        await client.vmm.map({ address: standing.address, size: granule, allocationId: allocation.id });
        const t2 = at();
        await client.vmm.setAccess({ address: standing.address, size: granule, descriptors: RW });
        const t3 = at();
        await client.vmm.unmap({ address: standing.address, size: granule });
        const t4 = at();
        await client.vmm.release({ allocationId: allocation.id });
        const t5 = at();
        if (i < 20) continue; // warm-up
        times.create.push(t1 - t0);
        times.map.push(t2 - t1);
        times.setAccess.push(t3 - t2);
        times.unmap.push(t4 - t3);
        times.release.push(t5 - t4);
      }
      const all = Object.values(times).reduce((sum, list) => sum.map((value, index) => value + list[index]));
      const cycle = summarize(all);
      results.push({ objects, p50: cycle.p50_us });
      rows.push({
        live_objects: objects,
        fill_s: +fillSeconds.toFixed(1),
        create_p50_us: summarize(times.create).p50_us,
        map_p50_us: summarize(times.map).p50_us,
        set_access_p50_us: summarize(times.setAccess).p50_us,
        unmap_p50_us: summarize(times.unmap).p50_us,
        release_p50_us: summarize(times.release).p50_us,
        cycle_p50_us: cycle.p50_us,
        cycle_p99_us: cycle.p99_us,
        daemon_rss_MiB: Math.round(Number((await client.admin.getStats()).rssBytes) / 2 ** 20),
      });
    }
  } finally {
    await client.vmm.freeAddress({ address: standing.address, size: granule }).catch(() => undefined);
    filler.close();
    // The daemon reclaims the filler's objects; later sections start from a quiet daemon.
    const deadline = Date.now() + 120_000;
    while (liveObjects(await client.admin.getStats()) > 10 && Date.now() < deadline) await new Promise((resolve) => setTimeout(resolve, 200));
  }
  const first = results[0];
  const last = results[results.length - 1];
  return {
    id: 'scale',
    title: 'Scale: create / map / set access / unmap / release with many live objects',
    rows,
    targets: [
      {
        target: `cycle p50 at ${last.objects} live objects within 20% of that at ${first.objects}`,
        measured: `${last.p50} µs vs ${first.p50} µs (×${ratio(last.p50, first.p50)})`,
        limit: '×1.2',
        met: last.p50 <= first.p50 * 1.2,
      },
    ],
    notes: [
      'Live objects: reservations and unmapped allocations of one granule, owned by another session (allocations at most a quarter of device memory; on the host backend at most half the open-file limit, each being a memfd).',
      'On the host backend reservations are mmaps, so vm.max_map_count (65530 by default) bounds the live objects; the top level there is 60% of it.',
    ],
  };
}
