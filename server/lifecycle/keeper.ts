/**
 * vmmd's keeper (`vmmd --keeper`): where no systemd runs the daemon (Docker,
 * Kubernetes, a shell), a small process of vmmd's own that answers systemd's
 * file-descriptor store protocol and nothing else. It holds every descriptor
 * the serving daemon parks (FDSTORE=1, FDNAME=, FDSTOREREMOVE=1 on its
 * NOTIFY_SOCKET), starts the daemon with the same settings, and when the
 * daemon exits for any reason starts it again with every descriptor handed
 * back as LISTEN_FDS / LISTEN_FDNAMES from fd 3 on, LISTEN_PID naming the
 * daemon, as systemd does. It never loads CUDA: a descriptor held by a
 * process that is not a CUDA process keeps a cuMemCreate allocation and its
 * bytes (docs/ARCHITECTURE.md). SIGHUP is a planned restart (an upgrade:
 * the daemon's files replaced on disk): the daemon stops as on SIGTERM,
 * finishing the calls in flight and leaving everything parked, and the keeper
 * starts it again from the files now there. A new daemon of another version
 * or path takes over from the keeper (`vmmd --take-over`, hand-over.ts): the
 * keeper stops its daemon, hands every descriptor over, and exits. SIGTERM or SIGINT stop the daemon
 * and then the keeper: its descriptors close, and the memory goes with them.
 */
import { ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type { Logger } from 'pino';
import { addon } from '../../native';
import { isValidFdName } from './fd-store';
import { HandOverListener, HandOverSide } from './hand-over';

/** The longest notification the keeper reads: systemd's own bound on a notify message. */
const NOTIFY_MAX_BYTES = 4096;
/** Wait before starting the daemon again; doubled while it keeps dying within RAPID_EXIT_MS, up to MAX_BACKOFF_MS. */
const FIRST_BACKOFF_MS = 20;
const MAX_BACKOFF_MS = 5_000;
const RAPID_EXIT_MS = 2_000;

/** The descriptors held, by name, in the order they came (the order LISTEN_FDS hands them back in). */
export class DescriptorStore {
  // Invariant: every descriptor held, under the name it was stored with; no entry holds an empty list.
  private readonly held = new Map<string, number[]>();

  /** Applies one notification; closes descriptors that came with anything but FDSTORE=1 (systemd does the same). */
  apply(text: string, fds: number[]): void {
    const fields = new Map<string, string>();
    for (const line of text.split('\n')) {
      const equals = line.indexOf('=');
      if (equals > 0) fields.set(line.slice(0, equals), line.slice(equals + 1));
    }
    const name = fields.get('FDNAME') ?? 'stored';
    if (fields.get('FDSTORE') === '1' && isValidFdName(name)) return this.put(name, fds);
    for (const fd of fds) addon.close(fd);
    if (fields.get('FDSTOREREMOVE') === '1' && fields.has('FDNAME')) this.drop(name);
  }

  /** Holds `fds` (now the store's) under `name`, after those it holds already. */
  put(name: string, fds: number[]): void {
    const list = this.held.get(name) ?? [];
    list.push(...fds);
    if (list.length > 0) this.held.set(name, list);
  }

  /** Closes and forgets every descriptor held under `name`. */
  drop(name: string): void {
    for (const fd of this.held.get(name) ?? []) addon.close(fd);
    this.held.delete(name);
  }

  /** The descriptors and their names, in LISTEN_FDS order. */
  listing(): { fds: number[]; names: string[] } {
    const fds: number[] = [];
    const names: string[] = [];
    for (const [name, list] of this.held) {
      for (const fd of list) {
        fds.push(fd);
        names.push(name);
      }
    }
    return { fds, names };
  }

  get size(): number {
    let total = 0;
    for (const list of this.held.values()) total += list.length;
    return total;
  }

  closeAll(): void {
    for (const list of this.held.values()) for (const fd of list) addon.close(fd);
    this.held.clear();
  }
}

/** The command line the daemon gets: the keeper's own, without --keeper. */
export function daemonArguments(argv: string[]): string[] {
  const out: string[] = [];
  for (let index = 0; index < argv.length; index++) {
    const arg = argv[index];
    if (arg === '--keeper' || arg.startsWith('--keeper=')) {
      // A separate value ("--keeper on") goes too.
      if (arg === '--keeper' && /^(on|off|true|false|yes|no|1|0)$/i.test(argv[index + 1] ?? '')) index++;
      continue;
    }
    out.push(arg);
  }
  return out;
}

/**
 * Runs the keeper until SIGTERM or SIGINT, or until a new daemon took
 * everything over (`vmmd --take-over` on the same socket directory: the
 * keeper stops its daemon, which parks everything, and hands the store over;
 * a successor that goes away before it serves gets the daemon started again
 * with everything). Resolves with the daemon's last exit status (0 after a
 * hand-over).
 * @param entry the daemon's main script (server/main.js)
 * @param handOver the socket directory the hand-over socket goes in, and how long a take-over's peer is waited for
 */
export async function runKeeper(argv: string[], entry: string, log: Logger, handOver?: { socketDir: string; graceMs: number }): Promise<number> {
  const limit = addon.descriptorLimit();
  if (limit.soft < limit.hard) addon.descriptorLimit(limit.hard);
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-keeper-'));
  fs.chmodSync(dir, 0o700);
  const socketPath = path.join(dir, 'notify');
  const socket = addon.unixDgramBind(socketPath);
  const store = new DescriptorStore();
  // Everything the daemon sent before it died is read before it starts again: a parked descriptor is never missed.
  const drain = () => {
    for (;;) {
      const message = addon.unixDgramRecvFds(socket, NOTIFY_MAX_BYTES);
      if (message === null) break;
      store.apply(message.data.toString('utf8'), message.fds);
    }
  };
  const poller = new addon.Poller(socket, drain);
  poller.start();
  poller.unref();

  let child: ChildProcess | undefined;
  let stopping = false;
  let backoff = FIRST_BACKOFF_MS;
  let lastCode = 0;
  const onSignal = (signal: NodeJS.Signals) => {
    log.info({ signal }, 'keeper: stopping the daemon');
    stopping = true;
    child?.kill(signal);
  };
  process.on('SIGTERM', onSignal);
  process.on('SIGINT', onSignal);
  process.on('SIGHUP', () => {
    if (handingOver !== undefined) return;
    log.info('keeper: restarting the daemon (SIGHUP)');
    child?.kill('SIGTERM');
  });

  // A take-over under way: the daemon's exit is the hand-over's, and what follows is the successor's answer.
  let handingOver: { outcome: Promise<'done' | 'failed'>; settle(outcome: 'done' | 'failed'): void } | undefined;
  let childExit: Promise<unknown> = Promise.resolve();
  const listener =
    handOver === undefined
      ? undefined
      : listenForTakeOver(handOver, log, {
          refusal: () => undefined,
          quiesce: async () => {
            let settle!: (outcome: 'done' | 'failed') => void;
            handingOver = { outcome: new Promise((resolve) => (settle = resolve)), settle: (outcome) => settle(outcome) };
            // The daemon stops as on SIGTERM under a store: calls finished, sessions parked, everything left here.
            child?.kill('SIGTERM');
            await childExit;
            drain();
          },
          held: () => store.listing(),
          handedOver: () => handingOver?.settle('done'),
          resumeServing: async () => handingOver?.settle('failed'),
        });

  const args = daemonArguments(argv);
  try {
    while (!stopping) {
      drain();
      const { fds, names } = store.listing();
      const env: NodeJS.ProcessEnv = { ...process.env, NOTIFY_SOCKET: socketPath, VMMD_KEEPER: 'off', VMMD_PARK: 'auto' };
      delete env.LISTEN_FDS;
      delete env.LISTEN_FDNAMES;
      delete env.LISTEN_PID;
      if (fds.length > 0) {
        env.LISTEN_FDS = String(fds.length);
        env.LISTEN_FDNAMES = names.join(':');
      }
      const startedAt = Date.now();
      // LISTEN_PID must name the daemon itself: a shell sets it to its own pid, then becomes the daemon. Node's own
      // options (a heap limit, --cpu-prof) are the daemon's as much as the keeper's.
      child = spawn('/bin/sh', ['-c', 'LISTEN_PID=$$ exec "$0" "$@"', process.execPath, ...process.execArgv, entry, ...args], {
        env,
        stdio: ['inherit', 'inherit', 'inherit', ...fds],
      });
      log.info({ pid: child.pid, descriptors: fds.length }, 'keeper: daemon started');
      const exit = new Promise<[number | null, NodeJS.Signals | null]>((resolve) => child!.once('exit', (c, s) => resolve([c, s])));
      childExit = exit;
      const [code, signal] = await exit;
      lastCode = code ?? 1;
      child = undefined;
      if (stopping) break;
      if (handingOver !== undefined) {
        const outcome = await handingOver.outcome;
        handingOver = undefined;
        if (outcome === 'done') {
          log.info({ descriptors: store.size }, 'keeper: a new daemon took everything over; exiting');
          lastCode = 0;
          break;
        }
        log.warn({ descriptors: store.size }, 'keeper: the new daemon went away before it served; starting the daemon again with everything parked');
        continue;
      }
      log.warn({ code, signal, descriptors: store.size }, 'keeper: the daemon ended; starting it again with everything parked');
      backoff = Date.now() - startedAt < RAPID_EXIT_MS ? Math.min(backoff * 2, MAX_BACKOFF_MS) : FIRST_BACKOFF_MS;
      await new Promise((resolve) => setTimeout(resolve, backoff));
    }
  } finally {
    listener?.close();
    poller.close();
    addon.close(socket);
    store.closeAll();
    fs.rmSync(dir, { recursive: true, force: true });
  }
  return lastCode;
}

/** The keeper's hand-over socket in the daemon's socket directory (made owner-only when the keeper comes first). */
function listenForTakeOver(handOver: { socketDir: string; graceMs: number }, log: Logger, side: HandOverSide): HandOverListener | undefined {
  try {
    fs.mkdirSync(handOver.socketDir, { recursive: true, mode: 0o700 });
    return HandOverListener.listen(handOver.socketDir, side, log, handOver.graceMs);
  } catch (error) {
    log.warn({ err: error, socketDir: handOver.socketDir }, 'keeper: no hand-over socket: a new daemon cannot take over from this one');
    return undefined;
  }
}
