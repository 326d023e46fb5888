/** Daemon crash on the host backend (test/reliability/daemon-crash-scenario.ts). */
import { daemonCrashScenario } from './daemon-crash-scenario';

it(
  'keeps every client memory intact through a daemon crash, reports the loss, and reconnects to a restarted daemon',
  () => daemonCrashScenario('host'),
  120_000,
);
