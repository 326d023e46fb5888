/**
 * Load on the host backend (test/reliability/load-scenario.ts): 32 clients for
 * 60 s with VMMD_RELIABILITY=full (npm run reliability), 8 for 10 s in CI.
 */
import { loadScenario } from './load-scenario';

const FULL = process.env.VMMD_RELIABILITY === 'full';
const CLIENTS = FULL ? 32 : 8;
const SECONDS = FULL ? 60 : 10;

it(
  `serves ${CLIENTS} clients of mixed load for ${SECONDS} s with no unexpected error, exact accounting and bounded memory`,
  () => loadScenario('host', CLIENTS, SECONDS),
  300_000,
);
