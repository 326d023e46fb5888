/**
 * One new worker of the new-worker benchmark (bench/sections/new-worker.ts).
 * Untimed, before it says it is ready: the client library loaded and, on
 * cuda, this process's CUDA context made (the driver loaded, each device's
 * primary context retained). On "go" it connects and opens the store (the
 * descriptor imported, mapped and opened: ready to read), times each, and
 * sends the times back.
 *   forked with: SOCKET_DIR STORE_NAME BACKEND
 */
import { connect } from '../client';
import { native } from '../native/client';

export interface NewWorkerReport {
  connectMs: number;
  openMs: number;
  totalMs: number;
  /** Bytes the open mapped here. */
  mappedBytes: string;
}

async function main(): Promise<void> {
  const [socketDir, storeName, backend] = process.argv.slice(2);
  if (backend === 'cuda') {
    const loaded = native.cudaLoad();
    if (!loaded.loaded) throw new Error(`new worker: no CUDA: ${loaded.reason}`);
  }
  process.send!({ ready: true });
  await new Promise((resolve) => process.once('message', resolve));
  const start = performance.now();
  const client = await connect({ socketDir });
  const connected = performance.now();
  const opened = await client.stores.open(storeName);
  const done = performance.now();
  const report: NewWorkerReport = {
    connectMs: connected - start,
    openMs: done - connected,
    totalMs: done - start,
    mappedBytes: String(opened.memory.size),
  };
  process.send!({ report }, () => {
    // The session's end drops the open (as a worker that exits does).
    client.close();
    process.disconnect();
  });
}

main().catch((error: Error) => {
  process.stderr.write(`new worker failed: ${error.stack}\n`);
  process.exit(1);
});
