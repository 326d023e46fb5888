/**
 * The session socket as a transport: it accepts connections, authenticates
 * each peer (SO_PEERCRED and the allow lists), frames messages, holds the
 * descriptors clients send until a call claims them, and hands every request
 * message to the dispatcher (server/transport/session/session-dispatcher.ts), whose answer it
 * sends back (session-answers.ts). The connection is the lease: when it closes, the session's
 * in-flight calls drain and the daemon reclaims everything it owns.
 */
import { exitSignal, sessionEnding, stillRunning } from './peer-process';
import type { Logger } from 'pino';
import { status as Status } from '@grpc/grpc-js';
import { traceClock, tracing } from '../../../common/trace';
import { decodeClientFrame, encodeDaemonFrame, isProtocol1, PROTOCOL_VERSION, type ClientFrame__Output } from '../../../common/protocol';
import { addon, Credentials } from '../../../native';
import { SeqpacketConnection, SeqpacketListener, SeqpacketMessage } from '../../../native/seqpacket';
import { heldBack, LogLimiter } from '../../observability/log-limiter';
import { type ErrorCode, failedPrecondition, RpcError, unauthenticated, unavailable } from '../../errors';
import { ERROR_CODES } from '../../../common/error-codes';
import { FairShare } from './fair-share';
import { DEFAULT_SESSION_OPTIONS, refuseMessage, Session, SessionOptions } from './session';
import { UnreadDescriptors } from './unread-descriptors';
import type { ReclaimSummary, SessionHooks, SessionServices } from './session-services';
import { answerRequest, type Answering } from './session-answers';
import { HELLO_WAIT_MS, helloFrame, refuseProtocol1, turnAway } from './hello';
import { deferred, ParkedSession, recordOf, ResumeTable, SessionJournal } from './resume';

export { refuseMessage, Session };

export { DEFAULT_SESSION_OPTIONS } from './session';
export type { SessionOptions } from './session';
export type { Answer, ReclaimSummary, ReclaimTarget, SessionHooks, SessionServices } from './session-services';
export { HELLO_WAIT_MS } from './hello';

/**
 * What a session frame's turn is called (GetStats, the long-turn log): its
 * body where the daemon knows it (a request, a transfer, the hello), else
 * "unknown message".
 */
export function sessionTurnLabel(body: string | undefined, isRequest: (body: string) => boolean): string {
  return body !== undefined && (body === 'transfer' || body === 'hello' || isRequest(body)) ? body : 'unknown message';
}

/** Accepts session connections and owns every live session. */
export class SessionManager {
  private listener?: SeqpacketListener;
  private services?: SessionServices;
  // A parked session's grace can end before listen() (a restore with a short grace): its reclaim waits for the services.
  private readonly listening: { promise: Promise<SessionServices>; resolve(services: SessionServices): void } = deferred();
  private hooks: SessionHooks = {};
  private answering?: Answering;
  // The daemon is stopping: the sessions it closes now are closed by it, not by their clients.
  private stopping = false;
  private nextId = 1n;
  private readonly byToken = new Map<string, Session>();
  private readonly sessions = new Map<bigint, Session>();
  // The session each connection serves now: a resume hello moves a connection from its fresh session to a parked one.
  private readonly byConnection = new Map<SeqpacketConnection, Session>();
  // Parked sessions waiting for their clients after a restart.
  private readonly waiting = new ResumeTable();
  private journal?: SessionJournal;
  private readonly reclaims = new Set<Promise<void>>();
  // What a peer can make the daemon log is bounded: one line per uid and cause per 10 s.
  private readonly logLimiter = new LogLimiter();
  // Sessions opening and ending are worth a line each, but one uid's hundreds are no flood: 20 per uid
  // and kind per 10 s at their level, the rest at debug.
  private readonly lifeLogLimiter = new LogLimiter(10_000, 20);
  /** The event loop's turns for session messages, shared over uids. */
  readonly fairShare = new FairShare();
  private readonly unread?: UnreadDescriptors;

  constructor(
    private readonly log: Logger,
    private readonly options: SessionOptions = DEFAULT_SESSION_OPTIONS,
  ) {
    if (options.budgets !== undefined) this.unread = new UnreadDescriptors(options.budgets);
  }

  /** Starts accepting sessions on `path`; `services` answers their requests and reclaims them. */
  listen(path: string, services: SessionServices, hooks: SessionHooks = {}): void {
    this.services = services;
    this.listening.resolve(services);
    this.hooks = hooks;
    this.answering = {
      services,
      hooks,
      logLimiter: this.logLimiter,
      refuse: (session, fd, code, message, transfer, request) => this.refuse(session, fd, code, message, transfer, request),
    };
    const refusal = encodeDaemonFrame({
      error: {
        code: 'OUT_OF_DESCRIPTORS',
        status: Status.RESOURCE_EXHAUSTED,
        message: 'the daemon is out of descriptors and opens no session now; try again later',
      },
    });
    this.listener = new SeqpacketListener(path, 128, refusal);
    this.listener.on('connection', (connection: SeqpacketConnection) => this.open(connection));
    this.listener.on('error', (error: Error) => {
      const allowed = this.logLimiter.allow(`accept:${(error as { code?: string }).code}`);
      if (allowed !== undefined) {
        this.log.warn(
          { err: error, heldBack: allowed.suppressed },
          'cannot accept a session connection: new sessions are refused until it can (logged at most every 10 s)',
        );
      }
    });
    this.listener.on('recovered', (failures: number) => this.log.warn({ failedAccepts: failures }, 'accepting session connections again'));
  }

  /** Open sessions (closing ones included until reclaimed). */
  get count(): number {
    return this.sessions.size;
  }

  /** Gives new sessions ids above `last` (the sessions an earlier daemon process had: their objects came back with their ids). */
  skipIdsThrough(last: bigint): void {
    if (last >= this.nextId) this.nextId = last + 1n;
  }

  list(): Session[] {
    return [...this.sessions.values()];
  }

  /** Closes every received descriptor nobody claimed; returns how many. */
  closePendingTransfers(): number {
    let closed = 0;
    for (const session of this.sessions.values()) closed += session.inbox.closeHeld();
    return closed;
  }

  pendingTransfers(): number {
    let total = 0;
    for (const session of this.sessions.values()) total += session.inbox.held;
    return total;
  }

  /**
   * The session a token names; undefined for a call without a token.
   * @throws UNAUTHENTICATED UNKNOWN_SESSION, SESSION_CLOSING; UNAVAILABLE SESSION_RESUMING (a parked session not resumed yet)
   */
  authenticate(token: string | undefined): Session | undefined {
    if (token === undefined) return undefined;
    const session = this.byToken.get(token);
    if (session === undefined) {
      const parked = this.waiting.byGrpcToken(token);
      if (parked !== undefined)
        throw unavailable('SESSION_RESUMING', `session ${parked.id} waits for its client to resume it on the session socket; call again once it has`);
      throw unauthenticated('UNKNOWN_SESSION', 'the session token names no open session');
    }
    if (session.closing) throw unauthenticated('SESSION_CLOSING', `session ${session.id} is closed`);
    session.used = true;
    return session;
  }

  /**
   * The descriptor the session sent as `transfer`, waiting for it if needed. The caller owns the returned fd.
   * @throws DEADLINE_EXCEEDED TRANSFER_NOT_RECEIVED; FAILED_PRECONDITION TRANSFER_USED; UNAVAILABLE SESSION_CLOSED
   */
  takeTransfer(session: Session, transfer: string): Promise<number> {
    return session.inbox.take(transfer, this.options.transferWaitMs);
  }

  /** Stops accepting sessions, closes every one and waits for their reclaim. */
  async close(): Promise<void> {
    this.stopping = true;
    this.waiting.drain();
    this.listener?.close();
    for (const session of this.sessions.values()) session.connection.close();
    await Promise.all([...this.reclaims]);
  }

  /** Told of each session as it opens and ends from now on (the park side's journal). */
  setJournal(journal: SessionJournal | undefined): void {
    this.journal = journal;
  }

  /** The record of a session open or waiting to be resumed, as parked; undefined for any other id. */
  recordOf(id: bigint): ParkedSession | undefined {
    const open = this.sessions.get(id);
    return open !== undefined && !open.closing ? recordOf(open) : this.waiting.get(id);
  }

  /** The records of every session to park now: the open ones and those still waiting for their clients. */
  parkRecords(): ParkedSession[] {
    const open = [...this.sessions.values()].filter((session) => !session.closing).map(recordOf);
    return [...open, ...this.waiting.list()];
  }

  /** Sessions waiting for their clients to resume them. */
  get waitingCount(): number {
    return this.waiting.count;
  }

  /**
   * Hands every session over, for a successor: stops accepting, lets the calls
   * in flight finish (their answers sent), then closes each session socket
   * without reclaiming anything. Returns the records to park; the successor
   * passes them to awaitResume.
   */
  async park(): Promise<ParkedSession[]> {
    this.stopping = true;
    this.listener?.close();
    const open = [...this.sessions.values()].filter((session) => !session.closing);
    // A request that arrives from now on is not started: its client sends it again once resumed.
    for (const session of open) session.parked = true;
    await Promise.all(open.map((session) => session.drained()));
    const records = [...open.map(recordOf), ...this.waiting.drain()];
    for (const session of open) session.connection.close();
    return records;
  }

  /**
   * Serves again after park() when nobody took the sessions over (a successor
   * that went away before it served): each parked session waits `graceMs` for
   * its client as after a restore, and sessions are accepted on `path` anew.
   */
  reopen(path: string, parked: readonly ParkedSession[], graceMs: number): void {
    this.stopping = false;
    this.awaitResume(parked, graceMs);
    this.listen(path, this.services!, this.hooks);
  }

  /**
   * At restore: each parked session waits `graceMs` for its client to present
   * its resume token in a hello; one not resumed by then is reclaimed as a
   * closed session is (`reclaim`, default the services' own). Session ids
   * from here on are above every parked one. A daemon that parks its sessions
   * starts its SessionManager with `resumable` (the hello's resume token).
   * @throws FAILED_PRECONDITION RESUME_DUPLICATE when a record repeats a session already open or waiting
   */
  awaitResume(parked: readonly ParkedSession[], graceMs: number, reclaim?: (session: ParkedSession) => Promise<unknown>): void {
    for (const record of parked) {
      if (this.sessions.has(record.id)) throw failedPrecondition('RESUME_DUPLICATE', `parked session ${record.id} is open already`);
    }
    this.waiting.wait(parked, graceMs, (record) => {
      const target = { id: record.id, log: this.log.child({ session: String(record.id), peerUid: record.uid }) };
      const done = (async () => {
        try {
          const reclaimed = await (reclaim === undefined ? (await this.listening.promise).reclaim(target) : reclaim(record));
          target.log.info({ end: 'not-resumed', reclaimed }, `session ${record.id} was not resumed within ${graceMs} ms; reclaimed`);
        } catch (error) {
          target.log.error({ err: error }, 'reclaiming a session nobody resumed failed in part');
        }
        this.journal?.ended(record.id);
      })();
      this.reclaims.add(done);
      void done.finally(() => this.reclaims.delete(done));
    });
    for (const record of parked) this.skipIdsThrough(record.id);
    if (parked.length > 0) this.log.info({ sessions: parked.length, graceMs }, 'parked sessions wait for their clients to resume them');
  }

  /** The uid of a session's peer. */
  uidOf(session: bigint): number | undefined {
    return this.sessions.get(session)?.peer.uid ?? this.waiting.get(session)?.uid;
  }

  /** The credentials of a session's peer. */
  peerOf(session: bigint): Credentials | undefined {
    const parked = this.waiting.get(session);
    return this.sessions.get(session)?.peer ?? (parked === undefined ? undefined : { pid: 0, uid: parked.uid, gid: parked.gid });
  }

  private limitsFor(uid: number): ConstructorParameters<typeof Session>[5] {
    return { logLimiter: this.logLimiter, mayHold: () => this.transferBound(uid), descriptors: this.unread };
  }

  /** Sessions open (closing ones included) by a uid. */
  private sessionsOf(uid: number): Session[] {
    return [...this.sessions.values()].filter((session) => session.peer.uid === uid);
  }

  /** Why a uid's sessions may hold no more unclaimed descriptors, or undefined. */
  private transferBound(uid: number): string | undefined {
    const held = this.sessionsOf(uid).reduce((total, session) => total + session.inbox.held, 0);
    if (held < this.options.maxTransfersPerUid) return undefined;
    return `uid ${uid}'s sessions already hold ${held} unclaimed descriptors, the most one uid may (--max-transfers-per-uid ${this.options.maxTransfersPerUid})`;
  }

  private open(connection: SeqpacketConnection): void {
    const peer = connection.peer ?? { pid: 0, uid: -1, gid: -1 };
    const refusal = this.options.authorize?.(peer);
    if (refusal !== undefined) return turnAway(connection, peer, this.log, this.logLimiter, 'PERMISSION_DENIED', Status.PERMISSION_DENIED, refusal);
    const held = this.sessionsOf(peer.uid).length;
    if (held >= this.options.maxSessionsPerUid) {
      return turnAway(
        connection,
        peer,
        this.log,
        this.logLimiter,
        'TOO_MANY_SESSIONS',
        Status.RESOURCE_EXHAUSTED,
        `uid ${peer.uid} holds ${held} sessions, the most one uid may (--max-sessions-per-uid ${this.options.maxSessionsPerUid}); close some first`,
      );
    }
    const session = new Session(this.nextId++, peer, connection, this.log, this.options, this.limitsFor(peer.uid));
    this.fairShare.adopt(connection, peer.uid);
    this.serve(connection, session);
    const left = this.hooks.connected?.();
    connection.on('message', (message: SeqpacketMessage) => this.onMessage(this.byConnection.get(connection)!, message));
    connection.on('close', () => this.onClose(this.byConnection.get(connection)!));
    if (left !== undefined) connection.once('close', left);
    // Checked once the loop has read what came meanwhile (setImmediate runs after the poll phase): a hello
    // that arrived during a long turn is taken before the connection counts as silent.
    const silent = setTimeout(
      () =>
        setImmediate(() => {
          const current = this.byConnection.get(connection);
          if (current !== undefined && !current.greeted && !current.closing)
            refuseProtocol1(current, this.logLimiter, `this client sent no hello within ${HELLO_WAIT_MS} ms`);
        }),
      HELLO_WAIT_MS,
    );
    silent.unref();
    connection.once('close', () => clearTimeout(silent));
    const allowed = this.lifeLogLimiter.allow(`opened:${peer.uid}`);
    session.log[allowed === undefined ? 'debug' : 'info']({ cgroup: session.process.cgroup, peerGid: peer.gid, ...heldBack(allowed) }, 'session opened');
  }

  /** Makes `session` the one its connection serves, recorded (and journaled) before its hello goes. */
  private serve(connection: SeqpacketConnection, session: Session): void {
    this.sessions.set(session.id, session);
    this.byToken.set(session.token, session);
    this.byConnection.set(connection, session);
    this.journal?.opened(recordOf(session));
  }

  private refuse(session: Session, fd: number, code: ErrorCode, message: string, transfer?: string, request?: string): void {
    if (fd >= 0) addon.close(fd);
    const allowed = this.logLimiter.allow(`frame:${session.peer.uid}:${code}`);
    if (allowed !== undefined) session.log.warn({ code, transfer, request, heldBack: allowed.suppressed }, message);
    session.trySend({ request: request ?? '0', error: { code, message, status: Status[ERROR_CODES[code].status], transfer: transfer ?? '0' } });
  }

  /**
   * The client's hello, its first frame: answered with a new session's hello, or, where it presents the
   * resume token of a parked session, with that session's (resumed), or with why not.
   */
  private greet(session: Session, frame: ClientFrame__Output, fd: number): void {
    if (fd >= 0) addon.close(fd);
    if (frame.body !== 'hello' || frame.hello == null) {
      this.refuse(session, -1, 'BAD_MESSAGE', `a session's first frame is its hello, not ${frame.body ?? 'an empty frame'}`);
      return session.connection.close();
    }
    if (frame.hello.protocol !== PROTOCOL_VERSION) {
      const message = `this daemon speaks session protocol ${PROTOCOL_VERSION}, not ${frame.hello.protocol}: use a client of protocol ${PROTOCOL_VERSION}`;
      session.trySend({ error: { code: 'PROTOCOL_VERSION', status: Status.FAILED_PRECONDITION, message, protocol: PROTOCOL_VERSION } });
      return session.connection.close();
    }
    session.greeted = true;
    if (frame.hello.resumeToken !== '' && this.resume(session, frame.hello.resumeToken)) return;
    this.sendHello(session, false);
  }

  /**
   * A hello that presents the resume token of a parked session: the connection, fresh and unused, becomes
   * that session's (same id, tokens and objects); the fresh session it was given goes, owning nothing.
   * @returns false when refused: the refusal went as an error frame, and the connection stays the fresh session
   */
  private resume(fresh: Session, resumeToken: string): boolean {
    let parked: ParkedSession;
    try {
      parked = this.waiting.claim(resumeToken, fresh);
    } catch (error) {
      const refusal = error as RpcError;
      const allowed = this.logLimiter.allow(`resume:${fresh.peer.uid}:${refusal.code}`);
      if (allowed !== undefined) fresh.log.warn({ code: refusal.code, heldBack: allowed.suppressed }, `resume refused: ${refusal.message}`);
      fresh.trySend({ error: { code: refusal.code, status: refusal.status, message: refusal.message } });
      return false;
    }
    this.byToken.delete(fresh.token);
    this.sessions.delete(fresh.id);
    fresh.inbox.close();
    this.unread?.closed(fresh);
    this.journal?.ended(fresh.id);
    const adopted = new Session(parked.id, fresh.peer, fresh.connection, this.log, this.options, this.limitsFor(fresh.peer.uid), parked);
    adopted.resumed = true;
    adopted.greeted = true;
    this.serve(fresh.connection, adopted);
    if (this.sendHello(adopted, true)) adopted.log.info({ cgroup: adopted.process.cgroup }, 'session resumed');
    return true;
  }

  /** Sends the session's hello; a peer that left is closed. @returns whether it went */
  private sendHello(session: Session, resumed: boolean): boolean {
    try {
      session.send(helloFrame(session, this.options, resumed));
      return true;
    } catch (error) {
      session.log.debug({ err: error }, 'the peer left before its greeting; closing the session');
      session.connection.close();
      return false;
    }
  }

  private onMessage(session: Session, raw: SeqpacketMessage): void {
    const turn = this.hooks.turns?.enter('session');
    const received = tracing ? traceClock() : 0n;
    // A session being handed over starts nothing more: its client sends the request again once resumed.
    if (session.closing || session.parked) {
      if (raw.fd >= 0) addon.close(raw.fd);
      return;
    }
    if (raw.truncated) return this.refuse(session, raw.fd, 'MESSAGE_TOO_LARGE', 'the message is longer than 4096 bytes');
    if (raw.extraFds > 0) return this.refuse(session, raw.fd, 'TOO_MANY_DESCRIPTORS', `a message may carry one descriptor, not ${raw.extraFds + 1}`);
    // Before its hello a JSON frame is a client of protocol 1, told so in its own JSON; after it, a bad frame.
    if (!session.greeted && isProtocol1(raw.data)) {
      if (raw.fd >= 0) addon.close(raw.fd);
      return refuseProtocol1(session, this.logLimiter, 'this client sent a JSON frame');
    }
    const frame = decodeClientFrame(raw.data);
    if (typeof frame === 'string') return this.refuse(session, raw.fd, 'BAD_MESSAGE', frame);
    if (turn !== undefined) turn.what = sessionTurnLabel(frame.body, (body) => this.services?.methodOf?.(body) !== undefined);
    if (!session.greeted) return this.greet(session, frame, raw.fd);
    if (frame.body === 'transfer') {
      const transfer = frame.transfer?.id ?? '0';
      if (transfer === '0') return this.refuse(session, raw.fd, 'BAD_MESSAGE', "a transfer's id must be above 0");
      if (raw.descriptorsDropped) {
        const dropped = `the daemon is out of descriptors: the one sent as transfer ${transfer} was dropped; send it again later`;
        return this.refuse(session, raw.fd, 'OUT_OF_DESCRIPTORS', dropped, transfer);
      }
      return this.onTransfer(session, transfer, raw.fd);
    }
    // listen() set the answering up before the first connection.
    void answerRequest(this.answering!, session, frame, raw.fd, received);
  }

  private onTransfer(session: Session, transfer: string, fd: number): void {
    if (fd < 0) return this.refuse(session, fd, 'NO_DESCRIPTOR', `transfer ${transfer} carries no descriptor`, transfer);
    const delivery = session.inbox.deliver(transfer, fd);
    if (delivery.kind === 'refused') {
      const message =
        delivery.code === 'TOO_MANY_TRANSFERS' && delivery.message.startsWith('already') ? `session ${session.id} ${delivery.message}` : delivery.message;
      this.refuse(session, -1, delivery.code, message, transfer);
    }
  }

  private onClose(session: Session): void {
    if (session.closing) return;
    session.end();
    this.byConnection.delete(session.connection);
    if (session.parked) {
      // Handed over: its objects and its record live on in the parked state; only this process forgets it.
      session.inbox.close();
      this.unread?.closed(session);
      this.byToken.delete(session.token);
      this.sessions.delete(session.id);
      return;
    }
    if (session.connection.closeReason !== undefined) {
      // A peer that closes with answers unread makes this happen at will: bounded per uid like the other lines of a session's life.
      const allowed = this.lifeLogLimiter.allow(`failed:${session.peer.uid}`);
      session.log[allowed === undefined ? 'debug' : 'warn'](
        { reason: session.connection.closeReason, ...heldBack(allowed) },
        'the session socket failed; closing the session',
      );
    }
    session.inbox.close();
    this.unread?.closed(session);
    const signal = exitSignal(session.peer.pid, session.process.startTime);
    const reclaim = (async () => {
      await session.drained();
      let reclaimed: ReclaimSummary | void = undefined;
      try {
        reclaimed = await this.services?.reclaim(session);
      } catch (error) {
        session.log.error({ err: error, failures: (error as AggregateError).errors?.length }, 'reclaiming the session failed in part');
      }
      this.byToken.delete(session.token);
      this.sessions.delete(session.id);
      this.journal?.ended(session.id);
      const what = reclaimed ? `; reclaimed ${reclaimed.allocations} allocation(s), ${reclaimed.bytes} bytes` : '';
      // Checked after the reclaim: a killed process has become a zombie (or is gone) by then.
      const ending = sessionEnding(this.stopping, stillRunning(session.peer.pid, session.process.startTime), signal);
      const allowed = this.lifeLogLimiter.allow(`${ending.end}:${session.peer.uid}`);
      session.log[allowed === undefined ? 'debug' : ending.level]({ end: ending.end, signal, reclaimed, ...heldBack(allowed) }, `${ending.message}${what}`);
    })();
    this.reclaims.add(reclaim);
    void reclaim.finally(() => this.reclaims.delete(reclaim));
  }
}
