/**
 * Load on the cuda backend (test/reliability/load-scenario.ts): 32 client
 * processes for 60 s of mixed operations on device memory, with the default
 * stock and with none; no unexpected error, exact accounting, daemon memory
 * growth bounded.
 */
import { loadScenario } from '../reliability/load-scenario';
import { describeGpu } from './gpu';

describeGpu('load on the cuda backend', () => {
  it('serves 32 clients of mixed load for 60 s (default stock)', () => loadScenario('cuda', 32, 60), 300_000);
  it('serves 32 clients of mixed load for 30 s (no stock)', () => loadScenario('cuda', 32, 30, ['--stock', 'none']), 300_000);
});
