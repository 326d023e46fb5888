/**
 * SOCK_SEQPACKET connections over the addon, driven by the event loop: each
 * message arrives whole, with at most one descriptor. Used by both sides of
 * the session socket; the protocol on top lives in native/protocol.ts.
 */
import { EventEmitter } from 'node:events';
import * as fs from 'node:fs';
import { addon, Credentials, Poller } from './index';

/** The largest message either side reads; longer ones arrive truncated. */
export const MAX_MESSAGE_BYTES = 4096;
/**
 * The most messages one readable callback reads: the poller is level-triggered,
 * so the rest come at the loop's next turn, after the other sockets and timers
 * had theirs (a client with a socket-full of pipelined requests held the
 * daemon's loop ~6 ms, all of it one turn). The daemon's session sockets are
 * read by its own scheduler instead (scheduleReads: turns shared per uid).
 */
export const MAX_MESSAGES_PER_READ = 32;

const UV_DISCONNECT = 4;

export interface SeqpacketMessage {
  data: Buffer;
  /** The descriptor that came with the message, now owned by the listener, or -1. */
  fd: number;
  /** The message was longer than MAX_MESSAGE_BYTES and was cut. */
  truncated: boolean;
  /** Descriptors beyond the first, already closed. */
  extraFds: number;
  /**
   * The kernel dropped descriptors that came with the message: the process
   * had no free descriptor for them (EMFILE), or more came than fit.
   */
  descriptorsDropped: boolean;
}

/**
 * One connected SEQPACKET socket. Emits 'message' (SeqpacketMessage) and
 * 'close' once. A listener of 'message' owns the message's descriptor: it must
 * close it or keep it.
 */
export class SeqpacketConnection extends EventEmitter {
  private fd: number;
  private readonly poller: Poller;
  private closed = false;

  constructor(
    fd: number,
    readonly peer?: Credentials,
  ) {
    super();
    this.fd = fd;
    this.poller = new addon.Poller(fd, (status, events) => this.onReadable(status, events));
    this.poller.start();
  }

  /** Opens a connection to a listening session socket. */
  static connect(path: string): SeqpacketConnection {
    return new SeqpacketConnection(addon.seqpacketConnect(path));
  }

  /** Why the connection closed itself (a failed receive), if it did; undefined for EOF or close(). */
  closeReason?: string;

  get isClosed(): boolean {
    return this.closed;
  }

  /** Keeps the process alive while the connection is open (the default). */
  ref(): void {
    if (!this.closed) this.poller.ref();
  }

  /** Lets the process exit while the connection is open. */
  unref(): void {
    if (!this.closed) this.poller.unref();
  }

  /**
   * Sends one message, with a descriptor when fd >= 0 (the kernel duplicates
   * it; the caller still owns its own). Returns false when the peer's buffer
   * is full.
   * @throws NativeError with code EPIPE, ECONNRESET or ETOOMANYREFS
   */
  send(data: Buffer, fd = -1): boolean {
    if (this.closed) {
      const error = new Error('send on a closed session socket') as Error & { code: string };
      error.code = 'EPIPE';
      throw error;
    }
    return addon.seqpacketSend(this.fd, data, fd);
  }

  /** Closes the socket; emits 'close' once. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.poller.close();
    addon.close(this.fd);
    this.fd = -1;
    this.emit('close');
  }

  /**
   * Hands the socket's reading to `scheduler`: from now on, a readable socket
   * calls `ready(this)` once until readMessages() drains it, and only
   * readMessages() reads it (the session transport shares its turns over
   * uids, not sockets). The poller stays on meanwhile: stopping and starting
   * it costs epoll_ctl calls per message, and a socket read in the same loop
   * iteration's turn is not reported again.
   */
  scheduleReads(ready: (connection: SeqpacketConnection) => void): void {
    this.ready = ready;
  }

  /**
   * Reads and emits at most `max` waiting messages. 'more': messages may be
   * left (no new ready() comes for them: call again); 'drained': none waits and the
   * poller watches again; 'closed': the connection is closed.
   */
  readMessages(max: number): 'more' | 'drained' | 'closed' {
    // Closed while it waited for its turn (by the daemon, or a failed send).
    if (this.closed) return 'closed';
    const outcome = this.readSome(max, this.events);
    if (outcome !== 'more') this.waitingTurn = false;
    return this.closed ? 'closed' : outcome;
  }

  /**
   * Bytes sent on this socket that the peer has not read yet (SIOCOUTQ); 0
   * once it has read everything, descriptors included. 0 on a closed socket.
   */
  unsentBytes(): number {
    return this.closed ? 0 : addon.socketUnsentBytes(this.fd);
  }

  private ready?: (connection: SeqpacketConnection) => void;
  // Given to ready() and not drained since: its readable callbacks until then are not passed on again.
  private waitingTurn = false;
  // The poll events of the last readable callback: a hang-up read by readMessages.
  private events = 0;

  private onReadable(status: number, events: number): void {
    if (this.closed) return;
    if (status < 0) {
      // An error on the socket (the peer reset it): what it sent before is still queued and is read first,
      // and the connection ends as failed, not as a peer that hung up in good order.
      this.closeReason = `poll failed with status ${status}`;
      this.readSome(MAX_MESSAGES_PER_READ, UV_DISCONNECT);
      if (!this.closed) this.close();
      return;
    }
    if (this.ready !== undefined) {
      this.events = events;
      if (!this.waitingTurn) {
        this.waitingTurn = true;
        this.ready(this);
      }
      return;
    }
    // Several waiting messages in one callback (a trip through the loop for each costs more),
    // but at most MAX_MESSAGES_PER_READ: the poller calls again for the rest.
    this.readSome(MAX_MESSAGES_PER_READ, events);
  }

  private readSome(max: number, events: number): 'more' | 'drained' | 'closed' {
    for (let read = 0; read < max; read++) {
      let received;
      try {
        received = addon.seqpacketRecv(this.fd, MAX_MESSAGE_BYTES);
      } catch (error) {
        this.closeReason = (error as Error).message;
        this.close();
        return 'closed';
      }
      if (received === null) {
        // Drained: a peer that hung up is gone once all it sent was read.
        if (events & UV_DISCONNECT) this.close();
        return this.closed ? 'closed' : 'drained';
      }
      if (received.eof) {
        this.close();
        return 'closed';
      }
      const message: SeqpacketMessage = {
        data: received.data,
        fd: received.fd,
        truncated: received.truncated,
        extraFds: received.extraFds,
        descriptorsDropped: received.controlTruncated,
      };
      if (this.listenerCount('message') === 0) {
        if (message.fd >= 0) addon.close(message.fd);
      } else {
        this.emit('message', message);
      }
      if (this.closed) return 'closed';
    }
    return 'more';
  }
}

/** The messages a connection has sent so far, read and dropped (at most MAX_MESSAGES_PER_READ; never throws). */
function drain(fd: number): void {
  for (let read = 0; read < MAX_MESSAGES_PER_READ; read++) {
    let received;
    try {
      received = addon.seqpacketRecv(fd, MAX_MESSAGE_BYTES);
    } catch {
      return;
    }
    if (received === null || received.eof) return;
    if (received.fd >= 0) addon.close(received.fd);
  }
}

/** How long accepting pauses after the process ran out of descriptors, at first and at most. */
const ACCEPT_BACKOFF_MS = { first: 50, max: 1_000 };

/**
 * A listening SEQPACKET socket. Emits 'connection' (SeqpacketConnection),
 * 'refused' (the peer's credentials) for a connection turned away while the
 * process is out of descriptors, 'error' for a failed accept, and 'recovered'
 * (how many accepts failed) once accepting works again.
 */
export class SeqpacketListener extends EventEmitter {
  private fd: number;
  private readonly poller: Poller;
  // A descriptor kept in reserve: closed to accept (and turn away) one connection when the process is out of them.
  private spare = -1;
  private backoffMs = 0;
  private retry?: NodeJS.Timeout;
  private failures = 0;

  /**
   * @param refusal what a connection turned away for lack of descriptors is sent before it is closed
   */
  constructor(
    readonly path: string,
    backlog = 128,
    private readonly refusal?: Buffer,
  ) {
    super();
    this.fd = addon.seqpacketListen(path, backlog);
    this.spare = this.openSpare();
    this.poller = new addon.Poller(this.fd, () => this.onAcceptable());
    this.poller.start();
  }

  close(): void {
    if (this.fd < 0) return;
    clearTimeout(this.retry);
    this.poller.close();
    addon.close(this.fd);
    this.fd = -1;
    if (this.spare >= 0) addon.close(this.spare);
    this.spare = -1;
  }

  private openSpare(): number {
    try {
      // Not addon.dup: that is a fault-injection point, whose counts belong to requests.
      return fs.openSync('/dev/null', 'r');
    } catch {
      return -1;
    }
  }

  private onAcceptable(): void {
    for (;;) {
      if (this.fd < 0) return;
      let accepted;
      try {
        accepted = addon.seqpacketAccept(this.fd);
      } catch (error) {
        const code = (error as { code?: string }).code;
        if (code === 'EMFILE' || code === 'ENFILE') {
          // NOTE: accept4 takes the new descriptor before it looks at the backlog, so EMFILE
          // comes whether or not a connection waits (reading it as "one
          // waits" would loop here for good, the event loop never turned again, and sessions whose
          // peers hung up were never reclaimed). The spare tells the two apart.
          const outcome = this.turnAway();
          if (outcome === 'none waiting') return; // the level-triggered poller calls again when one arrives
          this.failures++;
          this.emit('error', error);
          if (outcome === 'turned away') continue;
        } else {
          this.failures++;
          this.emit('error', error);
        }
        // Out of descriptors with no spare (or another failure): the connection waits in the
        // backlog; stop polling for a while instead of spinning on a level-triggered poller.
        this.backOff();
        return;
      }
      if (accepted === null) return;
      if (this.failures > 0) {
        this.emit('recovered', this.failures);
        this.failures = 0;
      }
      this.backoffMs = 0;
      if (this.spare < 0) this.spare = this.openSpare();
      const { fd, pid, uid, gid } = accepted;
      this.emit('connection', new SeqpacketConnection(fd, { pid, uid, gid }));
    }
  }

  /**
   * Frees the spare descriptor to accept one waiting connection, tells it why,
   * closes it, and takes the spare again. 'none waiting' when the backlog was
   * empty; 'failed' when there was no spare or it could not be taken again.
   */
  private turnAway(): 'turned away' | 'none waiting' | 'failed' {
    if (this.spare < 0) return 'failed';
    addon.close(this.spare);
    this.spare = -1;
    let accepted;
    try {
      accepted = addon.seqpacketAccept(this.fd);
    } catch {
      accepted = undefined;
    }
    if (accepted !== null && accepted !== undefined) {
      // What the client sent first (its hello) is read before the refusal goes: a socket closed with a message
      // unread resets its peer, and a client that takes the reset for the end never reads the refusal.
      drain(accepted.fd);
      try {
        if (this.refusal !== undefined) addon.seqpacketSend(accepted.fd, this.refusal, -1);
      } catch {
        // it left already
      }
      addon.close(accepted.fd);
      this.emit('refused', { pid: accepted.pid, uid: accepted.uid, gid: accepted.gid });
    }
    this.spare = this.openSpare();
    if (accepted === undefined || this.spare < 0) return 'failed';
    return accepted === null ? 'none waiting' : 'turned away';
  }

  private backOff(): void {
    this.backoffMs = this.backoffMs === 0 ? ACCEPT_BACKOFF_MS.first : Math.min(this.backoffMs * 2, ACCEPT_BACKOFF_MS.max);
    this.poller.stop();
    this.retry = setTimeout(() => {
      if (this.fd < 0) return;
      if (this.spare < 0) this.spare = this.openSpare();
      this.poller.start();
    }, this.backoffMs);
    this.retry.unref();
  }
}
