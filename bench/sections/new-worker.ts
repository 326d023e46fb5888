/**
 * A new worker ready to read a store: processes that have loaded
 * the client library and made their CUDA context, released at once, each
 * timing connect() and the open of the store (Open on the session socket,
 * the descriptor imported, mapped and opened here). 8 at once, and one alone
 * for reference, several rounds. Target: connect + open p50 ≤ 15 ms with 8
 * processes at once, for a 4 GiB store on a GPU host.
 */
import { ChildProcess, fork } from 'node:child_process';
import * as path from 'node:path';
import type { NewWorkerReport } from '../new-worker-child';
import type { BenchDaemon } from '../lib/daemon';
import { Row, Section, summarize, Target } from '../lib/stats';
import { sizeName } from './allocations';

const TARGET_MS = 15;

/** Starts `count` workers, waits until each is ready, lets them all go at once and collects their reports. */
async function round(daemon: BenchDaemon, storeName: string, backend: string, count: number): Promise<NewWorkerReport[]> {
  const workers: ChildProcess[] = Array.from({ length: count }, () =>
    fork(path.join(__dirname, '..', 'new-worker-child.js'), [daemon.dir, storeName, backend], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] }),
  );
  const exited = workers.map((worker) => new Promise<number | null>((resolve) => worker.once('exit', resolve)));
  const message = <T>(worker: ChildProcess, what: string) =>
    new Promise<T>((resolve, reject) => {
      worker.once('message', (value: T) => resolve(value));
      worker.once('exit', (code) => reject(new Error(`a new worker exited with ${code} before it ${what}`)));
    });
  await Promise.all(workers.map((worker) => message(worker, 'was ready')));
  const reports = workers.map((worker) => message<{ report: NewWorkerReport }>(worker, 'reported'));
  for (const worker of workers) worker.send({ go: true });
  const results = (await Promise.all(reports)).map(({ report }) => report);
  await Promise.all(exited);
  return results;
}

export async function newWorker(daemon: BenchDaemon, backend: string, storeBytes: bigint, rounds: number, workers = 8): Promise<Section> {
  const client = daemon.client;
  const storeName = `bench-new-worker-${process.pid}`;
  const allocation = await client.vmm.create({ size: storeBytes });
  await client.stores.createStore({ allocationId: allocation.id, name: storeName, size: String(storeBytes) });
  // The store holds the memory now.
  await client.vmm.release({ allocationId: allocation.id });
  const together: NewWorkerReport[] = [];
  const alone: NewWorkerReport[] = [];
  try {
    for (let i = 0; i < rounds; i++) {
      alone.push(...(await round(daemon, storeName, backend, 1)));
      together.push(...(await round(daemon, storeName, backend, workers)));
    }
  } finally {
    await client.stores.detach(storeName).catch(() => undefined);
  }
  const us = (reports: NewWorkerReport[], key: 'connectMs' | 'openMs' | 'totalMs') => reports.map((report) => report[key] * 1000);
  const rows: Row[] = [];
  for (const [label, reports] of [
    [`${workers} at once`, together],
    ['alone', alone],
  ] as const) {
    for (const [step, key] of [
      ['connect()', 'connectMs'],
      ['open (socket Open, import, map, access)', 'openMs'],
      ['connect + open', 'totalMs'],
    ] as const) {
      const summary = summarize(us(reports, key));
      rows.push({
        workers: label,
        step,
        store: sizeName(storeBytes),
        n: summary.n,
        p50_ms: +(summary.p50_us / 1000).toFixed(2),
        p99_ms: +(summary.p99_us / 1000).toFixed(2),
        max_ms: +(Math.max(...us(reports, key)) / 1000).toFixed(2),
      });
    }
  }
  const p50 = summarize(us(together, 'totalMs')).p50_us / 1000;
  const targets: Target[] = [
    {
      target: `new worker ready to read a ${sizeName(storeBytes)} store (connect + open${backend === 'cuda' ? ', CUDA context made before' : ''}), ${workers} processes at once, p50 ≤ ${TARGET_MS} ms`,
      measured: `${p50.toFixed(2)} ms`,
      limit: `${TARGET_MS} ms`,
      met: p50 <= TARGET_MS,
    },
  ];
  const mapped = new Set(together.map((report) => report.mappedBytes));
  return {
    id: 'new-worker',
    title: `A new worker ready to read a ${sizeName(storeBytes)} store: connect() + open, ${workers} processes at once`,
    rows,
    targets,
    notes: [
      `Each worker process loaded the client library${backend === 'cuda' ? ' and made its CUDA context (the driver loaded, the primary contexts retained)' : ''} before the clock started; ${rounds} rounds of ${workers} released at once, and of one alone.`,
      `connect(): the session socket and its hello (which names the backend); the gRPC channel is not made (no call needs it). open: Open on the session socket (the descriptor attached), then import, map and set access of the whole store in one driver call. Mapped per worker: ${[...mapped].join(', ')} bytes.`,
    ],
  };
}
