/**
 * The hand-over of a running daemon to a new one (an upgrade where no
 * service manager holds the memory: `--park held`, `vmmd --take-over`). The
 * old daemon listens on `vmmd.handover.sock` in its socket directory (0600,
 * its uid's): a peer of the same uid or root asks to take over; the old one
 * stops accepting, finishes its calls in flight, parks its sessions, sends
 * every descriptor it holds and its journal by SCM_RIGHTS (at most 253 per
 * message), then "end"; the new one restores from them as from LISTEN_FDS,
 * binds the sockets, answers "done", and the old one exits.
 *
 * Failures: a new daemon that goes away before "done" (killed, or failed to
 * start) leaves the old one holding everything, unchanged: it serves again
 * from it (its sessions wait for their clients as after a restart), and the
 * next take-over gets it all; an old one that goes away
 * before "end" leaves the new one with nothing: it closes what it received
 * and refuses to start. A second take-over while one is under way is refused.
 */
import * as fs from 'node:fs';
import * as path from 'node:path';
import type { Logger } from 'pino';
import { SESSION_SOCKET_NAME } from '../../common/paths';
import { addon, isNativeError, Poller } from '../../native';

export const HAND_OVER_SOCKET_NAME = 'vmmd.handover.sock';

/** The kernel's limit on descriptors in one SCM_RIGHTS message (SCM_MAX_FD). */
const FDS_PER_MESSAGE = 253;
/** The longest hand-over message: 253 short names and their JSON, with room to spare. */
const MESSAGE_MAX_BYTES = 64 * 1024;
/** A full socket buffer is tried again after this long. */
const SEND_RETRY_MS = 1;

/** What the daemon being taken over does, in order: stop serving, show what it holds, finish once the successor serves. */
export interface HandOverSide {
  /** Why nothing can be handed over (no parked state held in this process); undefined: it can. */
  refusal(): string | undefined;
  /** Stops accepting, finishes calls in flight, parks the sessions and freezes the parked state. Called once; later take-overs find it done. */
  quiesce(): Promise<void>;
  /** The descriptors held and their names (the journal among them): sent as they are, the process keeps its copies. */
  held(): { fds: number[]; names: string[] };
  /** The successor serves: what is left goes, and the process exits. */
  handedOver(): void;
  /**
   * The successor went away after the quiesce: serve again with everything (absent: hold it for the next take-over).
   * Rejects when serving again failed: the side is quiesced again and holds everything for the next take-over.
   */
  resumeServing?(): Promise<void>;
}

type Message = { take?: { pid: number; version: string }; refused?: string; names?: string[]; end?: { descriptors: number; pid: number }; done?: boolean };

/** One hand-over connection: JSON messages with descriptors, read as they come. */
class Channel {
  private readonly poller: Poller;
  private readonly queue: Array<{ message: Message; fds: number[] } | null> = [];
  private waiter?: () => void;
  // The peer's end is closed (EOF), or this one is.
  private closed = false;
  private disposed = false;

  constructor(readonly fd: number) {
    this.poller = new addon.Poller(fd, () => this.drain());
    this.poller.start();
  }

  /** The next message; null once the peer has gone (EOF). @throws when none comes within `timeoutMs` */
  async next(timeoutMs: number, what: string): Promise<{ message: Message; fds: number[] } | null> {
    const deadline = Date.now() + timeoutMs;
    while (this.queue.length === 0) {
      if (this.closed) return null;
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`no ${what} within ${timeoutMs} ms`);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, left);
        this.waiter = () => {
          clearTimeout(timer);
          resolve();
        };
      });
    }
    return this.queue.shift()!;
  }

  /** Sends one message; a full buffer is waited out (the peer reads as it can). @throws the send's error (EPIPE: the peer went away) */
  async send(message: Message, fds: number[] = []): Promise<void> {
    const data = Buffer.from(JSON.stringify(message));
    for (;;) {
      try {
        addon.unixDgramSendFds(this.fd, data, fds);
        return;
      } catch (error) {
        if (!isNativeError(error, 'EAGAIN')) throw error;
        await new Promise((resolve) => setTimeout(resolve, SEND_RETRY_MS));
      }
    }
  }

  close(): void {
    if (this.disposed) return;
    this.disposed = true;
    this.poller.close();
    this.closed = true;
    try {
      addon.close(this.fd);
    } catch {
      // Closed already.
    }
    for (const entry of this.queue.splice(0)) for (const fd of entry?.fds ?? []) addon.close(fd);
    this.wake();
  }

  private drain(): void {
    for (;;) {
      let received;
      try {
        received = addon.unixDgramRecvFds(this.fd, MESSAGE_MAX_BYTES);
      } catch {
        received = { data: Buffer.alloc(0), fds: [], truncated: false };
      }
      if (received === null) break;
      if (received.data.length === 0 && received.fds.length === 0) {
        // EOF: the peer closed its end (or died).
        this.poller.stop();
        this.closed = true;
        break;
      }
      let message: Message;
      try {
        message = JSON.parse(received.data.toString('utf8')) as Message;
      } catch {
        message = {};
      }
      this.queue.push({ message, fds: received.fds });
    }
    this.wake();
  }

  private wake(): void {
    const waiter = this.waiter;
    this.waiter = undefined;
    waiter?.();
  }
}

/** The old daemon's end: accepts take-overs on the socket directory's hand-over socket. */
export class HandOverListener {
  private readonly poller: Poller;
  // Invariant: set while a take-over runs; others are refused meanwhile.
  private underWay?: number;
  private quiesced?: Promise<void>;
  private closed = false;

  private constructor(
    private readonly fd: number,
    private readonly path: string,
    private readonly side: HandOverSide,
    private readonly log: Logger,
    private readonly graceMs: number,
  ) {
    this.poller = new addon.Poller(fd, () => this.accept());
    this.poller.start();
    this.poller.unref();
  }

  /**
   * Listens on the hand-over socket of `dir` (mode 0600): replaces a stale file.
   * @param graceMs how long the successor waits for the stop (the calls in flight) before "end"
   */
  static listen(dir: string, side: HandOverSide, log: Logger, graceMs: number): HandOverListener {
    const socketPath = path.join(dir, HAND_OVER_SOCKET_NAME);
    fs.rmSync(socketPath, { force: true });
    const fd = addon.seqpacketListen(socketPath, 4);
    fs.chmodSync(socketPath, 0o600);
    return new HandOverListener(fd, socketPath, side, log, graceMs);
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.poller.close();
    addon.close(this.fd);
    fs.rmSync(this.path, { force: true });
  }

  /** After the quiesce, a hand-over that did not end in "done": serve again where the side can, else hold on. */
  private failed(): void {
    if (this.quiesced === undefined || this.side.resumeServing === undefined) return;
    this.quiesced = undefined;
    this.poller.unref();
    // Serving again failed: nothing serves, and what the process holds must outlive it until the next take-over.
    this.side.resumeServing().catch(() => this.poller.ref());
  }

  private accept(): void {
    for (;;) {
      let peer;
      try {
        peer = addon.seqpacketAccept(this.fd);
      } catch (error) {
        this.log.warn({ err: error }, 'cannot accept on the hand-over socket');
        return;
      }
      if (peer === null) return;
      void this.serve(peer);
    }
  }

  private async serve(peer: { fd: number; pid: number; uid: number }): Promise<void> {
    const channel = new Channel(peer.fd);
    const own = process.getuid!();
    // Judged at connect: the first peer allowed holds the hand-over from then on.
    let refusal: string | undefined;
    if (peer.uid !== own && peer.uid !== 0) refusal = `uid ${peer.uid} may not take over this daemon (uid ${own}): only its own uid or root may`;
    else if (this.underWay !== undefined) refusal = `a take-over by pid ${this.underWay} is under way`;
    else refusal = this.side.refusal();
    if (refusal === undefined) this.underWay = peer.pid;
    try {
      // The request is read before any answer: a socket closed with a message unread resets its peer's, refusal and all.
      const asked = await channel.next(this.graceMs, 'take-over request').catch(() => null);
      for (const fd of asked?.fds ?? []) addon.close(fd);
      if (asked === null) return;
      if (refusal === undefined && asked.message.take === undefined) refusal = 'the first message must ask to take over ({"take": …})';
      if (refusal !== undefined) {
        this.log.warn({ peerPid: peer.pid, peerUid: peer.uid }, `take-over refused: ${refusal}`);
        await channel.send({ refused: refusal }).catch(() => undefined);
        return;
      }
      this.log.info({ successor: asked.message.take }, 'handing over to a new daemon: no new sessions, finishing the calls in flight');
      this.quiesced ??= this.side.quiesce();
      await this.quiesced;
      // Nothing else keeps the process alive once it has stopped serving: what it holds must outlive a failed hand-over.
      this.poller.ref();
      const { fds, names } = this.side.held();
      for (let at = 0; at < fds.length; at += FDS_PER_MESSAGE) {
        await channel.send({ names: names.slice(at, at + FDS_PER_MESSAGE) }, fds.slice(at, at + FDS_PER_MESSAGE));
      }
      await channel.send({ end: { descriptors: fds.length, pid: process.pid } });
      const answer = await channel.next(this.graceMs + 60_000, '"done" from the new daemon').catch(() => null);
      if (answer?.message.done !== true) {
        this.log.error(
          { successor: peer.pid },
          this.side.resumeServing === undefined
            ? 'the new daemon went away before it served: this daemon serves no more but holds every descriptor and record as they were; start `vmmd --take-over` again to take them'
            : 'the new daemon went away before it served: serving again with every descriptor and record as they were',
        );
        this.failed();
        return;
      }
      this.log.info({ successor: peer.pid, descriptors: fds.length }, 'handed over; exiting');
      this.close();
      channel.close();
      this.side.handedOver();
    } catch (error) {
      this.log.error({ err: error, successor: peer.pid }, 'the hand-over failed: this daemon keeps what it holds');
      this.failed();
    } finally {
      if (this.underWay === peer.pid) this.underWay = undefined;
      channel.close();
    }
  }
}

/** What the new daemon took over: every descriptor by name, and the old daemon to tell once serving. */
export interface TakenOver {
  descriptors: Map<string, number[]>;
  from: number;
  /** Tells the old daemon this one serves, and waits for it to let go of the directory (it exits). */
  done(): Promise<void>;
  /** Gives up (this daemon cannot start): the old one keeps everything. */
  abandon(): void;
}

export class TakeOverError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'TakeOverError';
  }
}

/**
 * The new daemon's end: takes everything over from the daemon serving `dir`.
 * @param waitMs how long the old daemon may take to finish its calls and send
 * @throws TakeOverError: no daemon runs there, it refused, or it went away before it sent everything (nothing is kept then)
 */
export async function takeOver(dir: string, version: string, waitMs: number, log: Logger): Promise<TakenOver> {
  const socketPath = path.join(dir, HAND_OVER_SOCKET_NAME);
  let fd: number;
  try {
    fd = addon.seqpacketConnect(socketPath);
  } catch (error) {
    if (isNativeError(error, 'ENOENT') || isNativeError(error, 'ECONNREFUSED')) {
      if (answers(path.join(dir, SESSION_SOCKET_NAME))) {
        throw new TakeOverError(
          `the vmmd serving ${dir} takes no hand-over: it runs under systemd, whose file-descriptor store keeps its memory across \`systemctl restart vmmd\` (the upgrade there), or it is a version without --take-over`,
        );
      }
      throw new TakeOverError(
        `no vmmd is running on ${dir} (nothing answers on ${HAND_OVER_SOCKET_NAME}): there is nothing to take over; start vmmd without --take-over`,
      );
    }
    throw new TakeOverError(`cannot reach the running vmmd's hand-over socket ${socketPath}: ${(error as Error).message}`);
  }
  const from = addon.peerCredentials(fd).pid;
  const channel = new Channel(fd);
  const descriptors = new Map<string, number[]>();
  const closeReceived = () => {
    for (const list of descriptors.values()) for (const received of list) addon.close(received);
    descriptors.clear();
  };
  try {
    // A refusal comes as a message even where this send finds the socket closed.
    await channel.send({ take: { pid: process.pid, version } }).catch(() => undefined);
    let count = 0;
    for (;;) {
      const next = await channel.next(waitMs, `hand-over from the running vmmd (pid ${from})`);
      if (next === null) {
        throw new TakeOverError(
          `the running vmmd (pid ${from}) went away in the middle of the hand-over: nothing was taken over (${count} descriptors received and closed)`,
        );
      }
      const { message, fds } = next;
      if (message.refused !== undefined) throw new TakeOverError(`the running vmmd (pid ${from}) refused the take-over: ${message.refused}`);
      if (message.end !== undefined) {
        if (message.end.descriptors !== count) {
          throw new TakeOverError(`the running vmmd (pid ${from}) said it sent ${message.end.descriptors} descriptors; ${count} came: nothing was taken over`);
        }
        break;
      }
      const names = message.names ?? [];
      if (names.length !== fds.length) {
        for (const received of fds) addon.close(received);
        throw new TakeOverError(`a hand-over message named ${names.length} descriptors and carried ${fds.length}: nothing was taken over`);
      }
      names.forEach((name, index) => {
        const list = descriptors.get(name) ?? [];
        list.push(fds[index]);
        descriptors.set(name, list);
      });
      count += fds.length;
    }
    log.info({ from, descriptors: count }, 'took over every descriptor of the running vmmd');
  } catch (error) {
    closeReceived();
    channel.close();
    throw error instanceof TakeOverError ? error : new TakeOverError(`the take-over from pid ${from} failed: ${(error as Error).message}`);
  }
  return {
    descriptors,
    from,
    async done() {
      await channel.send({ done: true }).catch(() => undefined);
      // The old daemon closes its end as it exits: its hand-over socket is gone then.
      await channel.next(waitMs, 'the old daemon to exit').catch(() => null);
      channel.close();
    },
    abandon() {
      channel.close();
    },
  };
}

/** Whether a daemon answers on the session socket `socketPath`. */
function answers(socketPath: string): boolean {
  try {
    addon.close(addon.seqpacketConnect(socketPath));
    return true;
  } catch {
    return false;
  }
}
