/**
 * Clients carry on across restarts of the daemon on the cuda backend
 * (test/reliability/resume-scenario.ts): 16 clients (12 TypeScript, 4 Python)
 * holding device memory and 8 open stores, across a SIGKILL of the serving
 * daemon under the keeper, a planned upgrade, and a take-over by a new daemon.
 */
import { resumeScenario } from '../reliability/resume-scenario';
import { describeGpu } from './gpu';

describeGpu('clients across restarts on the cuda backend', () => {
  it('kill -9 of the serving daemon: every client resumes, owns what it owned, and sees no error', () => resumeScenario('cuda', 'kill'), 180_000);
  it('a planned restart (SIGHUP to the keeper): no client sees an error', () => resumeScenario('cuda', 'upgrade'), 180_000);
  it('a take-over by a second daemon process (vmmd --take-over, no keeper): no client sees an error', () => resumeScenario('cuda', 'take-over'), 180_000);
});
