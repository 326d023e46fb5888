/**
 * Daemon crash on the cuda backend (test/reliability/daemon-crash-scenario.ts):
 * SIGKILL the daemon while 4 clients hold device memory they imported; each
 * client's memory keeps its checksum, the loss is reported, reconnect() works.
 */
import { daemonCrashScenario } from '../reliability/daemon-crash-scenario';
import { describeGpu } from './gpu';

describeGpu('daemon crash on the cuda backend', () => {
  it('keeps every client device memory intact through a daemon crash, and reconnects', () => daemonCrashScenario('cuda'), 120_000);
});
