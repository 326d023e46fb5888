/**
 * Chooses the backend at start. `auto` takes cuda where the driver loads and
 * a device exists, host otherwise, and says why in one log line.
 */
import type { Logger } from 'pino';
import type { DaemonConfig } from '../config';
import type { Backend } from './backend';
import { CudaBackend } from './cuda';
import { HostBackend } from './host';

export class BackendUnavailableError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'BackendUnavailableError';
  }
}

/** @throws BackendUnavailableError when cuda is asked for and cannot run */
export async function selectBackend(config: DaemonConfig, log: Logger): Promise<Backend> {
  const host = () => new HostBackend({ capacity: config.hostCapacity, granularity: config.hostGranularity });
  switch (config.backend) {
    case 'host':
      return host();
    case 'cuda':
      try {
        return await CudaBackend.open(log);
      } catch (error) {
        throw new BackendUnavailableError(`--backend cuda: ${(error as Error).message}`);
      }
    case 'auto':
      try {
        return await CudaBackend.open(log);
      } catch (error) {
        log.info({ reason: (error as Error).message }, 'using the host backend: the cuda backend cannot run here');
        return host();
      }
  }
}
