/**
 * Write-then-close on either backend: PROCESSES clients at once,
 * each allocating, writing 4 KiB and closing with no read in between, over and
 * over. A write resolves only when its bytes are in the memory and close()
 * waits for copies in flight, so no client may see an error and every byte
 * read back through a second mapping must be what was written.
 */
import * as path from 'node:path';
import { eventually, packageRoot, TestDaemon } from '../e2e/harness';
import { figure } from './figures';
import { runReportingClient } from './report-client';

const FIXTURE = path.join(packageRoot(), 'dist', 'test', 'reliability', 'fixtures', 'write-close.js');

interface Report {
  iterations: number;
  errors: Record<string, number>;
  first?: { iteration: number; message: string };
  mismatches: number;
}

export async function writeCloseScenario(
  backend: 'host' | 'cuda',
  processes: number,
  iterations: number,
  mode: 'awaited' | 'unawaited' | 'verified',
): Promise<void> {
  const daemon = await TestDaemon.start([], backend);
  try {
    const baseline = await daemon.stats();
    const reports = await Promise.all(Array.from({ length: processes }, () => runReportingClient<Report>(FIXTURE, [String(iterations), mode], daemon.dir)));
    const failed = reports.map((report, index) => ({ client: index + 1, ...report })).filter((r) => Object.keys(r.errors).length > 0 || r.mismatches > 0);
    figure(`write then close (${backend}, ${mode})`, {
      backend,
      processes,
      iterations_each: iterations,
      clients_with_errors: failed.length,
      errors: reports.reduce((sum, r) => sum + Object.values(r.errors).reduce((a, b) => a + b, 0), 0),
      mismatches: reports.reduce((sum, r) => sum + r.mismatches, 0),
    });
    expect(failed).toEqual([]);
    await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 20_000, 'the sessions to close');
    const after = await daemon.stats();
    for (const key of ['reservations', 'allocations', 'mappings', 'allocatedBytes', 'mappedBytes', 'pendingTransfers'] as const) {
      expect(after[key]).toEqual(baseline[key]);
    }
  } finally {
    expect(await daemon.stop()).toBe(0);
  }
}
