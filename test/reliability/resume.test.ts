/**
 * Clients carry on across restarts of the daemon on the host backend, under
 * vmmd's keeper (test/reliability/resume-scenario.ts): 16 clients (12
 * TypeScript, 4 Python) and 8 open stores across a SIGKILL of the serving
 * daemon and a planned upgrade. The stores are 4 MiB each in npm test and
 * 512 MiB each (4 GiB in all) with VMMD_RELIABILITY=full (npm run reliability).
 */
import { MiB } from '../e2e/harness';
import { resumeScenario } from './resume-scenario';

const FULL = process.env.VMMD_RELIABILITY === 'full';
const STORE_BYTES = FULL ? 512n * MiB : 4n * MiB;

describe('clients carry on across restarts of the daemon (16 clients, 8 stores open)', () => {
  it('kill -9 of the serving daemon: every client resumes, owns what it owned, and sees no error', () => resumeScenario('host', 'kill', STORE_BYTES), FULL ? 900_000 : 150_000);
  it('a planned restart (SIGHUP to the keeper, an upgrade): no client sees an error', () => resumeScenario('host', 'upgrade', STORE_BYTES), FULL ? 900_000 : 150_000);
});
