/**
 * Closing a descriptor off the caller's path: after its turn, on a libuv
 * thread. The last close of a CUDA export descriptor frees the driver's export
 * object in the kernel, tens of microseconds, which neither a client's allocation nor the daemon's event loop should wait
 * for. The number stays taken until then, so nothing else can meet it; a
 * failure is reported to `failed` (a process warning by default). Resolves once
 * closed (or failed): callers that need the memory gone wait for it.
 */
import { close } from 'node:fs';

export function closeLater(
  fd: number,
  failed: (error: Error) => void = (error) => process.emitWarning(`vmmd: closing descriptor ${fd} failed: ${error.message}`),
): Promise<void> {
  return new Promise((resolve) =>
    setImmediate(() =>
      close(fd, (error) => {
        if (error) failed(error);
        resolve();
      }),
    ),
  );
}
