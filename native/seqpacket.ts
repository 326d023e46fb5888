/**
 * SOCK_SEQPACKET connections over the addon, driven by the event loop: each
 * message arrives whole, with at most one descriptor. Used by both sides of
 * the session socket; the protocol on top lives in native/protocol.ts.
 */
import { EventEmitter } from 'node:events';
import { addon, Credentials, Poller } from './index';

/** The largest message either side reads; longer ones arrive truncated. */
export const MAX_MESSAGE_BYTES = 4096;

const UV_DISCONNECT = 4;

export interface SeqpacketMessage {
  data: Buffer;
  /** The descriptor that came with the message, now owned by the listener, or -1. */
  fd: number;
  /** The message was longer than MAX_MESSAGE_BYTES and was cut. */
  truncated: boolean;
  /** Descriptors beyond the first, already closed. */
  extraFds: number;
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

  constructor(fd: number, readonly peer?: Credentials) {
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

  private onReadable(status: number, events: number): void {
    if (this.closed) return;
    if (status < 0) {
      this.closeReason = `poll failed with status ${status}`;
      this.close();
      return;
    }
    // Drain every waiting message: the poller is level-triggered, but reading
    // all of them here saves a trip through the loop for each.
    for (;;) {
      let received;
      try {
        received = addon.seqpacketRecv(this.fd, MAX_MESSAGE_BYTES);
      } catch (error) {
        this.closeReason = (error as Error).message;
        this.close();
        return;
      }
      if (received === null) break;
      if (received.eof) {
        this.close();
        return;
      }
      const message: SeqpacketMessage = {
        data: received.data,
        fd: received.fd,
        truncated: received.truncated,
        extraFds: received.extraFds,
      };
      if (this.listenerCount('message') === 0) {
        if (message.fd >= 0) addon.close(message.fd);
      } else {
        this.emit('message', message);
      }
      if (this.closed) return;
    }
    if (events & UV_DISCONNECT) this.close();
  }
}

/** A listening SEQPACKET socket. Emits 'connection' (SeqpacketConnection). */
export class SeqpacketListener extends EventEmitter {
  private fd: number;
  private readonly poller: Poller;

  constructor(readonly path: string, backlog = 128) {
    super();
    this.fd = addon.seqpacketListen(path, backlog);
    this.poller = new addon.Poller(this.fd, () => this.onAcceptable());
    this.poller.start();
  }

  close(): void {
    if (this.fd < 0) return;
    this.poller.close();
    addon.close(this.fd);
    this.fd = -1;
  }

  private onAcceptable(): void {
    for (;;) {
      if (this.fd < 0) return;
      let accepted;
      try {
        accepted = addon.seqpacketAccept(this.fd);
      } catch (error) {
        // EMFILE and friends: the connection waits in the backlog; say so once per burst.
        this.emit('error', error);
        return;
      }
      if (accepted === null) return;
      const { fd, pid, uid, gid } = accepted;
      this.emit('connection', new SeqpacketConnection(fd, { pid, uid, gid }));
    }
  }
}
