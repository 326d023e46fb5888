/**
 * Chooses the backend at start. `auto` takes cuda where the driver loads and
 * a device exists, host otherwise, and says why in one log line.
 */
import type { Logger } from 'pino';
import { DaemonConfig, defaultStock } from '../app/config';
import type { Backend } from './backend';
import { CudaBackend } from './cuda';
import { HostBackend } from './host';
import { StockedBackend } from './stock';

export class BackendUnavailableError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'BackendUnavailableError';
  }
}

/**
 * The backend, behind a stock of allocations created and exported ahead when
 * the configuration has one for it (server/backends/stock.ts); the stock is
 * full when this resolves. `wrap` adapts the chosen backend first (the
 * daemon measures its completions), so the stock's calls go through it too.
 * @throws BackendUnavailableError when cuda is asked for and cannot run
 */
export async function selectBackend(config: DaemonConfig, log: Logger, wrap: (backend: Backend) => Backend = (backend) => backend): Promise<Backend> {
  const backend = wrap(await chooseBackend(config, log));
  const levels = config.stock === 'auto' ? defaultStock(backend.name) : config.stock;
  if (levels.length === 0) return backend;
  const stocked = new StockedBackend(backend, levels, log.child({ component: 'stock' }));
  await stocked.fill();
  log.info({ stock: stocked.stats().levels }, 'memory stocked: allocations created and exported ahead');
  return stocked;
}

async function chooseBackend(config: DaemonConfig, log: Logger): Promise<Backend> {
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
