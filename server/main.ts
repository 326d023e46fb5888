/** `vmmd`: parses the command line, starts the daemon, stops it on SIGTERM or SIGINT or once a successor took it over. */
import * as os from 'node:os';
import pino from 'pino';
import { addon } from '../native';
import { ConfigError, parseCommandLine, USAGE } from './app/config';
import { Daemon, VERSION } from './app/daemon';
import { Notifier } from './app/notify';
import { socketDirFix } from './app/socket-dir';
import { runKeeper } from './lifecycle/keeper';

export async function main(argv: string[]): Promise<number> {
  let command;
  try {
    command = parseCommandLine(argv, process.env, addon.pageSize());
  } catch (error) {
    if (error instanceof ConfigError) {
      process.stderr.write(`vmmd: ${error.message}\nsee vmmd --help\n`);
      return 2;
    }
    throw error;
  }
  if (command.kind === 'help') {
    process.stdout.write(`${USAGE}\n`);
    return 0;
  }
  if (command.kind === 'version') {
    process.stdout.write(`vmmd ${VERSION}\n`);
    return 0;
  }
  const log = pino({ level: command.config.logLevel, base: { pid: process.pid } });
  if (command.config.keeper) return runKeeper(argv, __filename, log, { socketDir: command.config.socketDir, graceMs: command.config.shutdownGraceMs });
  if (process.env.npm_lifecycle_event !== undefined) endWithParent();
  // Handlers go in before the sockets exist: a SIGTERM that arrives while the
  // daemon starts stops it cleanly once it has started.
  let signalled: string | undefined;
  let onSignal: (signal: string) => void = (signal) => {
    signalled = signal;
  };
  process.once('SIGTERM', () => onSignal('SIGTERM'));
  process.once('SIGINT', () => onSignal('SIGINT'));
  const notifier = new Notifier(process.env, log);
  let daemon: Daemon;
  try {
    daemon = await Daemon.start(command.config, log);
  } catch (error) {
    // For a person at a terminal: one sentence and the fix on stderr; the stack only at debug.
    log.debug({ err: error }, 'vmmd cannot start');
    const fix = socketDirFix(error, command.config.socketDir, command.config.socketGroup);
    process.stderr.write(`vmmd cannot start: ${(error as Error).message}${fix === undefined ? '' : `\n${fix}`}\n`);
    return 1;
  }
  notifier.ready(`serving ${daemon.backend.name} memory on ${command.config.socketDir}`);
  return new Promise<number>((resolve) => {
    onSignal = (signal) => {
      log.info({ signal }, 'signal received');
      notifier.stopping();
      daemon.stop().then(
        () => {
          // pino writes synchronously to stdout: nothing is left unflushed here.
          log.flush();
          resolve(0);
        },
        (error) => {
          log.error({ err: error }, 'stopping failed');
          resolve(1);
        },
      );
    };
    if (signalled !== undefined) onSignal(signalled);
    // Taken over by a new daemon (`vmmd --take-over`): everything is its now.
    void daemon.handedOver.then(() => {
      log.flush();
      resolve(0);
    });
  });
}

/**
 * Started by npm (`npm start`, `npx vmmd`), the daemon runs under a shell that
 * npm started: npm passes its SIGTERM to that shell, which ends without passing
 * it on, and the daemon would serve on as an orphan holding its socket. So
 * there it asks the kernel for SIGTERM when its parent ends, and stops as
 * SIGTERM always stops it. Started any other way, its parent's end is none of
 * its business (a shell that started it in the background may well exit).
 */
function endWithParent(): void {
  addon.parentDeathSignal(os.constants.signals.SIGTERM);
}

if (require.main === module) {
  main(process.argv.slice(2)).then(
    (code) => process.exit(code),
    (error) => {
      process.stderr.write(`vmmd: ${(error as Error).stack ?? error}\n`);
      process.exit(1);
    },
  );
}
