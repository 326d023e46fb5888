/**
 * Client crashes on the host backend (test/reliability/crash-scenario.ts):
 * 100 clients with VMMD_RELIABILITY=full (npm run reliability), 24 in CI.
 */
import { crashScenario } from './crash-scenario';

const CLIENTS = process.env.VMMD_RELIABILITY === 'full' ? 100 : 24;

it(`reclaims everything of ${CLIENTS} clients killed at random points, and a witness keeps its memory`, () => crashScenario('host', CLIENTS), 600_000);
