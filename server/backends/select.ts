/**
 * Chooses the backend at start. `auto` takes cuda where the driver loads and
 * a device exists, host otherwise, and says why in one log line.
 */
import type { Logger } from 'pino';
import type { Backend } from './backend';
import { CudaBackend } from './cuda';
import { HostBackend } from './host';
import { StockedBackend, StockLevel } from './stock';

export class BackendUnavailableError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'BackendUnavailableError';
  }
}

export type BackendChoice = 'auto' | 'host' | 'cuda';

/** What choosing a backend needs of the daemon's configuration. */
export interface BackendSelection {
  backend: BackendChoice;
  hostCapacity: bigint;
  hostGranularity: bigint;
  /** Allocations created and exported ahead, per device ('auto': the backend's default). */
  stock: StockLevel[] | 'auto';
}

/** What --stock auto means: on cuda, a few of the sizes cold allocations ask for most (the client's 2 MiB granule and 32 MiB pool chunk); none on host, where creating is a memfd. */
export function defaultStock(backend: 'host' | 'cuda'): StockLevel[] {
  return backend === 'cuda'
    ? [
        { size: 2n << 20n, depth: 16 },
        { size: 32n << 20n, depth: 2 },
      ]
    : [];
}

/**
 * The backend, behind a stock of allocations created and exported ahead when
 * the configuration has one for it (server/backends/stock.ts); the stock is
 * full when this resolves. `wrap` adapts the chosen backend first (the
 * daemon measures its completions), so the stock's calls go through it too.
 * @throws BackendUnavailableError when cuda is asked for and cannot run
 */
export async function selectBackend(config: BackendSelection, log: Logger, wrap: (backend: Backend) => Backend = (backend) => backend): Promise<Backend> {
  const backend = wrap(await chooseBackend(config, log));
  const levels = config.stock === 'auto' ? defaultStock(backend.name) : config.stock;
  if (levels.length === 0) return backend;
  const stocked = new StockedBackend(backend, levels, log.child({ component: 'stock' }));
  await stocked.fill();
  log.info({ stock: stocked.stats().levels }, 'memory stocked: allocations created and exported ahead');
  return stocked;
}

async function chooseBackend(config: BackendSelection, log: Logger): Promise<Backend> {
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
