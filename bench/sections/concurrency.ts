/**
 * 7. Concurrency: 1, 4 and 16 client processes allocating at once, cold
 * (each memalloc a new allocation from the daemon) then pooled; aggregate
 * ops/s and p99, and the daemon's event-loop delay over each phase.
 */
import { ChildProcess, fork } from 'node:child_process';
import * as path from 'node:path';
import type { BenchDaemon } from '../lib/daemon';
import { percentile, Row, Section } from '../lib/stats';
import type { WorkerReport } from '../worker';

async function runPhase(daemon: BenchDaemon, workers: ChildProcess[], phase: 'cold' | 'pooled', phaseMs: number) {
  await daemon.client.admin.getStats({ resetEventLoopDelay: true });
  const reports = workers.map(
    (worker) =>
      new Promise<WorkerReport>((resolve, reject) => {
        worker.once('message', (message: { report: WorkerReport }) => resolve(message.report));
        worker.once('exit', (code) => reject(new Error(`a benchmark client exited with ${code}`)));
      }),
  );
  for (const worker of workers) worker.send({ go: phase });
  const results = await Promise.all(reports);
  const stats = await daemon.client.admin.getStats({ resetEventLoopDelay: true });
  return { results, stats };
}

export async function concurrency(daemon: BenchDaemon, counts: number[], phaseMs: number): Promise<Section> {
  const rows: Row[] = [];
  let worstDelay = 0;
  for (const count of counts) {
    for (const phase of ['cold', 'pooled'] as const) {
      const workers = Array.from({ length: count }, () =>
        fork(path.join(__dirname, '..', 'worker.js'), [daemon.dir, String(phaseMs)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] }),
      );
      await Promise.all(workers.map((worker) => new Promise((resolve, reject) => {
        worker.once('message', resolve);
        worker.once('exit', (code) => reject(new Error(`a benchmark client exited with ${code} before it was ready`)));
      })));
      const { results, stats } = await runPhase(daemon, workers, phase, phaseMs);
      await Promise.all(workers.map((worker) => (worker.exitCode !== null ? undefined : new Promise((resolve) => worker.once('exit', resolve)))));
      const samples = Float64Array.from(results.flatMap((report) => report[phase].samples)).sort();
      const operations = results.reduce((sum, report) => sum + report[phase].count, 0);
      const delayMax = Number(stats.eventLoopDelayMaxUs) / 1000;
      worstDelay = Math.max(worstDelay, delayMax);
      rows.push({
        clients: count,
        allocation: phase === 'cold' ? 'cold 2 MiB (daemon)' : 'pooled 64 KiB',
        ops_s: Math.round(operations / (phaseMs / 1000)),
        p50_us: +percentile(samples, 50).toFixed(1),
        p99_us: +percentile(samples, 99).toFixed(1),
        loop_delay_max_ms: +delayMax.toFixed(2),
        loop_delay_p99_ms: +(Number(stats.eventLoopDelayP99Us) / 1000).toFixed(2),
      });
    }
  }
  return {
    id: 'concurrency',
    title: `Concurrency: client processes allocating at once (${phaseMs / 1000} s a phase)`,
    rows,
    targets: [
      {
        target: `the daemon's event loop never stalls more than 5 ms with ${Math.max(...counts)} clients`,
        measured: `max ${worstDelay.toFixed(2)} ms`,
        limit: '5 ms',
        met: worstDelay <= 5,
      },
    ],
    notes: ['Event-loop delay: Node\'s monitorEventLoopDelay in the daemon (1 ms resolution), reset at the start of each phase.'],
  };
}
