/**
 * Closing a descriptor off the caller's path: after its turn, on a libuv
 * thread. The last close of a CUDA export descriptor frees the driver's export
 * object in the kernel, 25-45 us on an H100 host (bench/results/cold-probe),
 * which neither a client's allocation nor the daemon's event loop should wait
 * for. The number stays taken until then, so nothing else can meet it; a
 * failure is reported to `failed` (a process warning by default).
 */
import { close } from 'node:fs';

export function closeLater(fd: number, failed: (error: Error) => void = (error) => process.emitWarning(`vmmd: closing descriptor ${fd} failed: ${error.message}`)): void {
  setImmediate(() =>
    close(fd, (error) => {
      if (error) failed(error);
    }),
  );
}
