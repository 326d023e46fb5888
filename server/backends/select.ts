/**
 * Chooses the backend at start. `auto` takes cuda where the driver loads and
 * a device exists, host otherwise, and says why in one log line.
 */
import type { Logger } from 'pino';
import type { DaemonConfig } from '../config';
import type { Backend } from './backend';
import { HostBackend } from './host';

export class BackendUnavailableError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'BackendUnavailableError';
  }
}

/** Why the cuda backend cannot run here, or undefined when it can. */
function cudaUnavailableReason(): string {
  // The cuda backend (dlopen of libcuda.so.1) is not part of this build yet.
  return 'this build of vmmd has no cuda backend yet';
}

/** @throws BackendUnavailableError when cuda is asked for and cannot run */
export function selectBackend(config: DaemonConfig, log: Logger): Backend {
  const host = () => new HostBackend({ capacity: config.hostCapacity, granularity: config.hostGranularity });
  switch (config.backend) {
    case 'host':
      return host();
    case 'cuda':
      throw new BackendUnavailableError(`--backend cuda: ${cudaUnavailableReason()}; use --backend host (or auto)`);
    case 'auto':
      log.info({ reason: cudaUnavailableReason() }, 'using the host backend: no usable CUDA driver');
      return host();
  }
}
