/**
 * Sessions: one per connection to the session socket. The connection is the
 * lease: when it closes, the session's in-flight calls drain and the registry
 * reclaims everything it owns. Descriptors travel on it in both directions,
 * each named by a transfer id (docs/PROTOCOL.md).
 */
import { randomBytes } from 'node:crypto';
import { EventEmitter } from 'node:events';
import type { Logger } from 'pino';
import {
  AllocatedMessage,
  AllocateMessage,
  decodeMessage,
  encodeMessage,
  PROTOCOL_VERSION,
  SessionMessage,
} from '../common/protocol';
import { addon, Credentials } from '../native';
import { SeqpacketConnection, SeqpacketListener, SeqpacketMessage } from '../native/seqpacket';
import { status as Status } from '@grpc/grpc-js';
import { deadlineExceeded, ERROR_CODE_KEY, failedPrecondition, toServiceError, unauthenticated, unavailable } from './errors';
import type { Registry } from './registry';

export interface SessionOptions {
  /** Why a peer may not open a session, or undefined when it may. */
  authorize?: (peer: Credentials) => string | undefined;
  /** How long Import waits for a descriptor the client has not sent yet. */
  transferWaitMs: number;
  /** How long a received, unclaimed descriptor is kept before it is closed. */
  transferKeepMs: number;
  /** Unclaimed descriptors a session may hold at once; more are closed and refused. */
  maxPendingTransfers: number;
}

export const DEFAULT_SESSION_OPTIONS: SessionOptions = {
  transferWaitMs: 5_000,
  transferKeepMs: 30_000,
  maxPendingTransfers: 64,
};

interface PendingTransfer {
  fd: number;
  timer: NodeJS.Timeout;
}

interface TransferWaiter {
  resolve(fd: number): void;
  reject(error: Error): void;
  timer: NodeJS.Timeout;
}

export class Session {
  readonly token = randomBytes(32).toString('hex');
  readonly log: Logger;
  closing = false;
  // Invariant: inFlight counts calls of this session that started and have not settled.
  private inFlight = 0;
  private drainWaiters: Array<() => void> = [];
  // Invariant: a transfer id is in at most one of received and waiters; every id
  // in received is at most highestReceived; ids the client sends must increase,
  // so an id at or below highestReceived that is not in received was used.
  readonly received = new Map<string, PendingTransfer>();
  readonly waiters = new Map<string, TransferWaiter>();
  highestReceived = 0n;
  private nextOutgoing = 1n;

  constructor(
    readonly id: bigint,
    readonly peer: Credentials,
    readonly connection: SeqpacketConnection,
    log: Logger,
  ) {
    this.log = log.child({ session: String(id), peerPid: peer.pid, peerUid: peer.uid });
  }

  get inFlightCalls(): number {
    return this.inFlight;
  }

  /** Runs a call as part of this session; the session's reclaim waits for it. */
  async track<T>(call: () => Promise<T>): Promise<T> {
    this.inFlight++;
    try {
      return await call();
    } finally {
      this.inFlight--;
      if (this.inFlight === 0) for (const wake of this.drainWaiters.splice(0)) wake();
    }
  }

  drained(): Promise<void> {
    if (this.inFlight === 0) return Promise.resolve();
    return new Promise((resolve) => this.drainWaiters.push(resolve));
  }

  send(message: SessionMessage, fd = -1): void {
    if (!this.connection.send(encodeMessage(message), fd)) {
      throw unavailable('SESSION_SOCKET_FULL', `session ${this.id}'s socket is full; the client is not reading it`);
    }
  }

  newOutgoingTransferId(): string {
    return String(this.nextOutgoing++);
  }
}

/**
 * Accepts session connections and owns every live session. Emits 'opened'
 * (Session) and 'reclaimed' (Session) once its objects are gone.
 */
export class SessionManager extends EventEmitter {
  private listener?: SeqpacketListener;
  private nextId = 1n;
  private readonly byToken = new Map<string, Session>();
  private readonly sessions = new Map<bigint, Session>();
  private readonly reclaims = new Set<Promise<void>>();

  // Answers requests that arrive on session sockets (allocate): set by the service that owns the rule.
  private allocateHandler?: (session: Session, message: AllocateMessage) => Promise<{ reply: AllocatedMessage; fd: number }>;

  /** Who answers `allocate` messages (the VirtualMemory service, with Allocate's rules). */
  answerAllocate(handler: (session: Session, message: AllocateMessage) => Promise<{ reply: AllocatedMessage; fd: number }>): void {
    this.allocateHandler = handler;
  }

  /** Runs before the registry reclaims a session's objects (stores drop its opens first). */
  private readonly reclaimers: Array<(session: bigint) => Promise<void>> = [];

  constructor(
    private readonly registry: Registry,
    private readonly log: Logger,
    private readonly options: SessionOptions = DEFAULT_SESSION_OPTIONS,
  ) {
    super();
  }

  onReclaim(reclaimer: (session: bigint) => Promise<void>): void {
    this.reclaimers.push(reclaimer);
  }

  listen(path: string): void {
    this.listener = new SeqpacketListener(path);
    this.listener.on('connection', (connection: SeqpacketConnection) => this.open(connection));
    this.listener.on('error', (error: Error) => this.log.warn({ err: error }, 'cannot accept a session connection'));
  }

  /** Open sessions (closing ones included until reclaimed). */
  get count(): number {
    return this.sessions.size;
  }

  list(): Session[] {
    return [...this.sessions.values()];
  }

  /** Closes every received descriptor nobody claimed; returns how many. */
  closePendingTransfers(): number {
    let closed = 0;
    for (const session of this.sessions.values()) {
      for (const pending of session.received.values()) {
        clearTimeout(pending.timer);
        addon.close(pending.fd);
        closed++;
      }
      session.received.clear();
    }
    return closed;
  }

  pendingTransfers(): number {
    let total = 0;
    for (const session of this.sessions.values()) total += session.received.size;
    return total;
  }

  /**
   * The session a token names; undefined for a call without a token.
   * @throws UNAUTHENTICATED UNKNOWN_SESSION, SESSION_CLOSED
   */
  authenticate(token: string | undefined): Session | undefined {
    if (token === undefined) return undefined;
    const session = this.byToken.get(token);
    if (session === undefined) throw unauthenticated('UNKNOWN_SESSION', 'the session token names no open session');
    if (session.closing) throw unauthenticated('SESSION_CLOSED', `session ${session.id} is closed`);
    return session;
  }

  /**
   * Sends a descriptor to the session; the caller keeps (and closes) its own fd.
   * @returns the transfer id the client pairs it with
   */
  sendTransfer(session: Session, fd: number, about: { allocation: bigint; size: bigint }): string {
    const transfer = session.newOutgoingTransferId();
    session.send({ type: 'transfer', transfer, allocation: String(about.allocation), size: String(about.size) }, fd);
    return transfer;
  }

  /**
   * The descriptor the session sent as `transfer`, waiting for it if needed.
   * The caller owns the returned fd.
   * @throws DEADLINE_EXCEEDED TRANSFER_NOT_RECEIVED; FAILED_PRECONDITION TRANSFER_USED; UNAVAILABLE SESSION_CLOSED
   */
  takeTransfer(session: Session, transfer: string): Promise<number> {
    const pending = session.received.get(transfer);
    if (pending !== undefined) {
      clearTimeout(pending.timer);
      session.received.delete(transfer);
      return Promise.resolve(pending.fd);
    }
    if (session.waiters.has(transfer)) {
      return Promise.reject(failedPrecondition('TRANSFER_USED', `transfer ${transfer} is already being claimed`));
    }
    if (BigInt(transfer) <= session.highestReceived) {
      return Promise.reject(
        failedPrecondition('TRANSFER_USED', `transfer ${transfer} was already claimed, refused or expired`),
      );
    }
    if (session.closing) return Promise.reject(unavailable('SESSION_CLOSED', `session ${session.id} is closed`));
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        session.waiters.delete(transfer);
        reject(
          deadlineExceeded(
            'TRANSFER_NOT_RECEIVED',
            `no descriptor arrived as transfer ${transfer} on session ${session.id}'s socket within ${this.options.transferWaitMs} ms`,
          ),
        );
      }, this.options.transferWaitMs);
      session.waiters.set(transfer, { resolve, reject, timer });
    });
  }

  /** Stops accepting sessions, closes every one and waits for their reclaim. */
  async close(): Promise<void> {
    this.listener?.close();
    for (const session of this.sessions.values()) session.connection.close();
    await Promise.all([...this.reclaims]);
  }

  /** The uid of a session's peer. */
  uidOf(session: bigint): number | undefined {
    return this.sessions.get(session)?.peer.uid;
  }

  private open(connection: SeqpacketConnection): void {
    const peer = connection.peer ?? { pid: 0, uid: -1, gid: -1 };
    const refusal = this.options.authorize?.(peer);
    if (refusal !== undefined) {
      this.log.warn({ peerPid: peer.pid, peerUid: peer.uid, peerGid: peer.gid }, `session refused: ${refusal}`);
      try {
        connection.send(encodeMessage({ type: 'error', code: 'PERMISSION_DENIED', message: refusal }));
      } catch {
        // the peer left already
      }
      connection.close();
      return;
    }
    const session = new Session(this.nextId++, peer, connection, this.log);
    this.sessions.set(session.id, session);
    this.byToken.set(session.token, session);
    connection.on('message', (message: SeqpacketMessage) => this.onMessage(session, message));
    connection.on('close', () => this.onClose(session));
    try {
      session.send({
        type: 'hello',
        protocol: PROTOCOL_VERSION,
        session: String(session.id),
        token: session.token,
        pid: peer.pid,
        uid: peer.uid,
        gid: peer.gid,
      });
    } catch (error) {
      session.log.debug({ err: error }, 'the peer left before its greeting; closing the session');
      connection.close();
      return;
    }
    session.log.info('session opened');
    this.emit('opened', session);
  }

  private refuse(session: Session, fd: number, code: string, message: string, transfer?: string): void {
    if (fd >= 0) addon.close(fd);
    session.log.warn({ code, transfer }, message);
    try {
      session.send({ type: 'error', code, message, ...(transfer === undefined ? {} : { transfer }) });
    } catch {
      // The client is not reading its socket: it will see its calls fail instead.
    }
  }

  private onMessage(session: Session, raw: SeqpacketMessage): void {
    if (session.closing) {
      if (raw.fd >= 0) addon.close(raw.fd);
      return;
    }
    if (raw.truncated) {
      this.refuse(session, raw.fd, 'MESSAGE_TOO_LARGE', 'the message is longer than 4096 bytes');
      return;
    }
    if (raw.extraFds > 0) {
      this.refuse(session, raw.fd, 'TOO_MANY_DESCRIPTORS', `a message may carry one descriptor, not ${raw.extraFds + 1}`);
      return;
    }
    const message = decodeMessage(raw.data);
    if (typeof message === 'string') {
      this.refuse(session, raw.fd, 'BAD_MESSAGE', message);
      return;
    }
    switch (message.type) {
      case 'transfer':
        this.onTransfer(session, message.transfer, raw.fd);
        return;
      case 'allocate':
        if (raw.fd >= 0) {
          this.refuse(session, raw.fd, 'UNEXPECTED_DESCRIPTOR', 'only transfer messages may carry a descriptor');
          return;
        }
        void this.onAllocate(session, message);
        return;
      case 'ping':
        if (raw.fd >= 0) {
          this.refuse(session, raw.fd, 'UNEXPECTED_DESCRIPTOR', 'only transfer messages may carry a descriptor');
          return;
        }
        try {
          session.send({ type: 'pong', ...(message.nonce === undefined ? {} : { nonce: String(message.nonce).slice(0, 64) }) });
        } catch {
          // not reading: nothing to answer
        }
        return;
      default:
        this.refuse(session, raw.fd, 'BAD_MESSAGE', `clients may not send "${message.type}" messages`);
    }
  }

  /** Answers an allocate request: the allocation with its descriptor, or the refusal as gRPC would give it. */
  private async onAllocate(session: Session, message: AllocateMessage): Promise<void> {
    const handler = this.allocateHandler;
    try {
      if (handler === undefined) throw unavailable('NOT_SERVING', 'the daemon does not answer allocate requests yet');
      const { reply, fd } = await session.track(() => handler(session, message));
      try {
        session.send(reply, fd);
      } finally {
        // The kernel holds its own reference while the descriptor is in flight.
        addon.close(fd);
      }
    } catch (error) {
      const wire = toServiceError(error);
      try {
        session.send({
          type: 'error',
          request: message.request,
          status: wire.code ?? Status.UNKNOWN,
          code: String(wire.metadata?.get(ERROR_CODE_KEY)[0] ?? 'INTERNAL'),
          message: wire.details ?? String(error),
        });
      } catch {
        // Not reading its socket: its request times out on its side. The allocation, if made, is the session's and goes with it.
      }
    }
  }

  private onTransfer(session: Session, transfer: string, fd: number): void {
    if (fd < 0) {
      this.refuse(session, fd, 'NO_DESCRIPTOR', `transfer ${transfer} carries no descriptor`, transfer);
      return;
    }
    const id = BigInt(transfer);
    if (id <= session.highestReceived) {
      this.refuse(
        session,
        fd,
        'TRANSFER_USED',
        `transfer ids must increase: ${transfer} is not above ${session.highestReceived}, already used in this session`,
        transfer,
      );
      return;
    }
    session.highestReceived = id;
    const waiter = session.waiters.get(transfer);
    if (waiter !== undefined) {
      clearTimeout(waiter.timer);
      session.waiters.delete(transfer);
      waiter.resolve(fd);
      return;
    }
    if (session.received.size >= this.options.maxPendingTransfers) {
      this.refuse(
        session,
        fd,
        'TOO_MANY_TRANSFERS',
        `session ${session.id} already holds ${session.received.size} unclaimed descriptors`,
        transfer,
      );
      return;
    }
    const timer = setTimeout(() => {
      session.received.delete(transfer);
      addon.close(fd);
      session.log.warn({ transfer }, 'an unclaimed descriptor expired');
    }, this.options.transferKeepMs);
    timer.unref();
    session.received.set(transfer, { fd, timer });
  }

  private onClose(session: Session): void {
    if (session.closing) return;
    session.closing = true;
    if (session.connection.closeReason !== undefined) {
      session.log.warn({ reason: session.connection.closeReason }, 'the session socket failed; closing the session');
    }
    for (const [transfer, waiter] of session.waiters) {
      clearTimeout(waiter.timer);
      waiter.reject(unavailable('SESSION_CLOSED', `session ${session.id} closed before transfer ${transfer} arrived`));
    }
    session.waiters.clear();
    for (const pending of session.received.values()) {
      clearTimeout(pending.timer);
      addon.close(pending.fd);
    }
    session.received.clear();
    const reclaim = (async () => {
      await session.drained();
      // Each step runs whatever the one before it did: a failure is logged, never a reason to leave objects behind.
      for (const step of [...this.reclaimers, (id: bigint) => this.registry.reclaim(id)]) {
        try {
          await step(session.id);
        } catch (error) {
          session.log.error({ err: error, failures: (error as AggregateError).errors?.length }, 'reclaiming the session failed in part');
        }
      }
      this.byToken.delete(session.token);
      this.sessions.delete(session.id);
      session.log.info('session closed and reclaimed');
      this.emit('reclaimed', session);
    })();
    this.reclaims.add(reclaim);
    void reclaim.finally(() => this.reclaims.delete(reclaim));
  }
}
