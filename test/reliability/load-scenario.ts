/**
 * Load: many client processes doing mixed operations at once (allocate,
 * create/map/access/staged and streamed read-write/unmap/free, import, stores).
 * No unexpected error, exact accounting at the end (objects, bytes and
 * descriptors back to the baseline), and the daemon's memory growth bounded.
 * 32 clients for 60 s with VMMD_RELIABILITY=full (npm run reliability), 8 for 10 s in CI.
 */
import * as path from 'node:path';
import { eventually, packageRoot, TestDaemon } from '../e2e/harness';
import { figure } from './figures';
import { runReportingClient } from './report-client';

const LOAD = path.join(packageRoot(), 'dist', 'test', 'reliability', 'fixtures', 'load.js');
/** The daemon may grow this much over the run (caches warming, V8's heap settling); a leak per operation would pass it. */
const GROWTH_LIMIT_MIB = 96;

/**
 * The daemon's V8 old space is capped for the run (--max-old-space-size, 64 MiB; VMMD_LOAD_HEAP_MIB
 * changes it, 0 lifts it). Uncapped, V8 lets garbage pile up under 1,000 operations a second
 * (the daemon's RSS climbed by about a hundred MiB in a minute, mostly heap, then fell when
 * collected); capped, garbage cannot pass for growth, a JavaScript leak past the cap
 * kills the daemon (its exit code is checked), and the RSS bound watches native memory.
 */
const HEAP_LIMIT_MIB = Number(process.env.VMMD_LOAD_HEAP_MIB ?? 64);

function heapLimit(): NodeJS.ProcessEnv {
  if (HEAP_LIMIT_MIB <= 0) return {};
  return { NODE_OPTIONS: `${process.env.NODE_OPTIONS ?? ''} --max-old-space-size=${HEAP_LIMIT_MIB}`.trim() };
}

/** The scenario, on either backend (test/gpu/load-cuda.test.ts runs it on cuda). */
export async function loadScenario(backend: 'host' | 'cuda', CLIENTS: number, SECONDS: number, daemonArgs: string[] = []): Promise<void> {
  const daemon = await TestDaemon.start(daemonArgs, backend, heapLimit());
  let failed = false;
  try {
    const baseline = await daemon.stats();
    const baselineFds = daemon.openFds();
    // The daemon's RSS every 5 s while the clients run: a leak climbs with the operations, warming up flattens.
    const rssSeries: number[] = [];
    const sampler = setInterval(() => {
      daemon.stats().then(
        (stats) => rssSeries.push(Math.round(Number(stats.rssBytes) / 2 ** 20)),
        () => undefined,
      );
    }, 5_000);
    const reports = await Promise.all(
      Array.from({ length: CLIENTS }, (_, index) =>
        runReportingClient<{ ops: number; errors: Record<string, number>; first?: { op: number; kind: number; message: string } }>(
          LOAD,
          [String(index + 1), String(SECONDS * 1000)],
          daemon.dir,
        ),
      ),
    );
    clearInterval(sampler);
    const atEnd = await daemon.stats();
    await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 20_000, 'the sessions to close');
    const after = await daemon.stats();
    const errors: Record<string, number> = {};
    for (const report of reports) for (const [code, count] of Object.entries(report.errors)) errors[code] = (errors[code] ?? 0) + count;
    const firsts = reports.map((report, index) => ({ client: index + 1, ...report.first })).filter((entry) => entry.message !== undefined);
    expect({ errors, firsts }).toEqual({ errors: {}, firsts: [] });
    for (const key of ['reservations', 'allocations', 'mappings', 'reservedBytes', 'allocatedBytes', 'mappedBytes', 'pendingTransfers'] as const) {
      expect(after[key]).toEqual(baseline[key]);
    }
    await eventually(() => (daemon.openFds() === baselineFds ? true : undefined), 10_000, `daemon fds back to ${baselineFds}`);
    const growthMiB = (Number(atEnd.rssBytes) - Number(baseline.rssBytes)) / 2 ** 20;
    const ops = reports.reduce((sum, report) => sum + report.ops, 0);
    figure(`load (${backend}${daemonArgs.length > 0 ? ` ${daemonArgs.join(' ')}` : ''})`, {
      backend,
      clients: CLIENTS,
      seconds: SECONDS,
      operations: ops,
      operations_per_second: Math.round(ops / SECONDS),
      unexpected_errors: Object.values(errors).reduce((sum, count) => sum + count, 0),
      objects_left: 0,
      descriptors_left: 0,
      daemon_rss_MiB_before: Math.round(Number(baseline.rssBytes) / 2 ** 20),
      daemon_rss_MiB_at_end: Math.round(Number(atEnd.rssBytes) / 2 ** 20),
      daemon_heap_MiB_at_end: Math.round(Number(atEnd.heapUsedBytes) / 2 ** 20),
      daemon_rss_MiB_every_5_s: rssSeries.join(' '),
      daemon_old_space_cap_MiB: HEAP_LIMIT_MIB,
    });
    if (growthMiB >= GROWTH_LIMIT_MIB) {
      throw new Error(
        `the daemon's RSS grew ${growthMiB.toFixed(0)} MiB (limit ${GROWTH_LIMIT_MIB}) over ${ops} operations; every 5 s: ${rssSeries.join(', ')} MiB`,
      );
    }
  } catch (error) {
    failed = true;
    // The daemon's last words with the first failure (a stop that fails next would hide it).
    const code = await daemon.stop();
    const words = `daemon exit ${code}; its last log lines:\n${daemon.logs.slice(-30).join('\n')}`;
    throw Object.assign(error as Error, { message: `${(error as Error).message}\n\n${words}`, stack: `${(error as Error).stack}\n\n${words}` });
  } finally {
    if (!failed) {
      const code = await daemon.stop();
      if (code !== 0) throw new Error(`the daemon exited ${code}; its last log lines:\n${daemon.logs.slice(-30).join('\n')}`);
    }
  }
}
