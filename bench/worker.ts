/**
 * One client process of the concurrency benchmark (bench/sections/concurrency.ts):
 * connects, reports ready, and on "go" runs cold then pooled allocations for
 * the given time each, then sends its latencies back (pooled ones as a
 * uniform reservoir sample: a process makes millions).
 *   forked with: SOCKET_DIR PHASE_MS
 */
import { connect } from '../client';
import { manager } from './sections/allocations';

const MiB = 1n << 20n;
const RESERVOIR = 20_000;

export interface WorkerReport {
  cold: { count: number; samples: number[] };
  pooled: { count: number; samples: number[] };
}

async function main() {
  const [socketDir, phaseText] = process.argv.slice(2);
  const phaseMs = Number(phaseText);
  const client = await connect({ socketDir });
  const coldManager = await manager(client, true);
  const pooledManager = await manager(client, false);
  // Warm both paths before the clock starts.
  for (let i = 0; i < 5; i++) await (await coldManager.memalloc(2n * MiB)).free();
  for (let i = 0; i < 1000; i++) await (await pooledManager.memalloc(64n * 1024n)).free();
  process.send!({ ready: true });
  const phase = await new Promise<string>((resolve) => process.once('message', (message: { go: string }) => resolve(message.go)));
  const report: WorkerReport = { cold: { count: 0, samples: [] }, pooled: { count: 0, samples: [] } };
  if (phase === 'cold' || phase === 'both') {
    const end = performance.now() + phaseMs;
    while (performance.now() < end) {
      const start = performance.now();
      const pointer = await coldManager.memalloc(2n * MiB);
      report.cold.samples.push((performance.now() - start) * 1000);
      report.cold.count++;
      await pointer.free();
    }
  }
  if (phase === 'pooled' || phase === 'both') {
    const end = performance.now() + phaseMs;
    const samples = report.pooled.samples;
    while (performance.now() < end) {
      const start = performance.now();
      const pointer = await pooledManager.memalloc(64n * 1024n);
      await pointer.free();
      const elapsed = (performance.now() - start) * 1000;
      const seen = ++report.pooled.count;
      if (samples.length < RESERVOIR) samples.push(elapsed);
      else {
        const slot = Math.floor(Math.random() * seen);
        if (slot < RESERVOIR) samples[slot] = elapsed;
      }
    }
  }
  await coldManager.reset();
  await pooledManager.reset();
  client.close();
  // The parent disconnects once it has the report: exiting first could lose it.
  process.once('disconnect', () => process.exit(0));
  process.send!({ report });
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
