/**
 * Clients carry on across restarts of the daemon on the host backend, under
 * vmmd's keeper (test/reliability/resume-scenario.ts): 16 clients (12
 * TypeScript, 4 Python) and 8 open stores across a SIGKILL of the serving
 * daemon, a planned upgrade, and a take-over by a new daemon process. The
 * stores are 4 MiB each in npm test and 512 MiB each (4 GiB in all) with
 * VMMD_RELIABILITY=full (npm run reliability).
 */
import { MiB } from '../e2e/harness';
import { resumeScenario } from './resume-scenario';

const FULL = process.env.VMMD_RELIABILITY === 'full';
const STORE_BYTES = FULL ? 512n * MiB : 4n * MiB;

describe('clients carry on across restarts of the daemon (16 clients, 8 stores open)', () => {
  const timeout = FULL ? 900_000 : 150_000;
  it(
    'kill -9 of the serving daemon: every client resumes, owns what it owned, and sees no error',
    () => resumeScenario('host', 'kill', { storeBytes: STORE_BYTES }),
    timeout,
  );
  it(
    'a planned restart (SIGHUP to the keeper, an upgrade): no client sees an error',
    () => resumeScenario('host', 'upgrade', { storeBytes: STORE_BYTES }),
    timeout,
  );
  it(
    'a take-over by a second daemon process (vmmd --take-over, no keeper): no client sees an error',
    () => resumeScenario('host', 'take-over', { storeBytes: STORE_BYTES }),
    timeout,
  );
  // The cuda backend's allocation path on host: allocations made ahead, frees held back and a kept descriptor closed off
  // the event loop, while new memory gets the freed handle value (a memfd's number).
  it(
    'kill -9 with a stock of allocations made ahead: every client owns what it owned',
    () => resumeScenario('host', 'kill', { extraArgs: ['--stock', '2MiB:16,4MiB:4'] }),
    150_000,
  );
});
