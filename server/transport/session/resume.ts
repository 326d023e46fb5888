/**
 * Sessions across a restart of the daemon. A session's record (its id, its
 * peer's uid and gid, its gRPC token and its resume token) is what the daemon
 * parks beside the memory its objects hold; the daemon that starts from the
 * parked state hands those records to awaitResume, and each then waits, for
 * the grace period (--parked-grace-ms), for its client to reconnect and
 * present the resume token in a `hello`. A client that does adopts its
 * session back: the same id, the same gRPC token, the same objects. A session
 * nobody resumes in time is reclaimed as if its socket had closed.
 *
 * The park side reads the live records with SessionManager.parkRecords() (or
 * is told of each as it opens and ends, through a SessionJournal), and
 * SessionManager.park() stops serving sessions without reclaiming them, for a
 * hand-over to a successor.
 */
import { randomBytes } from 'node:crypto';
import { failedPrecondition, invalidArgument, notFound, permissionDenied } from '../../errors';

/** What the daemon parks for a live session, and what a restarted daemon waits for its client with. */
export interface ParkedSession {
  /** The session id: the owner of the session's objects. */
  id: bigint;
  /** The peer's uid: only a peer of this uid may resume the session. */
  uid: number;
  gid: number;
  /** The gRPC token (metadata vmmd-session-token) the client goes on sending. */
  token: string;
  /** The secret the client presents to resume: 64 hex digits, never sent anywhere but to its client. */
  resumeToken: string;
}

/**
 * Told of sessions as they open and end, so that parked state written at any
 * instant names every live session (a crash does not ask before it comes).
 * Both calls are synchronous: `opened` runs before the session's hello is
 * sent, `ended` once a closed or unclaimed session's objects are reclaimed.
 */
export interface SessionJournal {
  opened(session: ParkedSession): void;
  ended(id: bigint): void;
}

/** A fresh resume token: 256 random bits, hex. */
export function newResumeToken(): string {
  return randomBytes(32).toString('hex');
}

/** A resume token as the wire carries it: 64 lowercase hex digits. */
export const RESUME_TOKEN_PATTERN = /^[0-9a-f]{64}$/;

/** Resume tokens of reclaimed sessions remembered, so that a late client hears "reclaimed", not "unknown". */
const RECLAIMED_REMEMBERED = 4_096;

/**
 * Parked sessions waiting for their clients.
 * Invariant: a session is in `byResumeToken` and `byToken` exactly while it waits (its timer armed).
 */
export class ResumeTable {
  private readonly byResumeToken = new Map<string, { session: ParkedSession; timer: NodeJS.Timeout }>();
  private readonly byToken = new Map<string, ParkedSession>();
  private readonly byId = new Map<bigint, ParkedSession>();
  // Oldest first; bounded, so that a daemon that reclaims many does not grow without end.
  private readonly reclaimed = new Map<string, bigint>();

  /**
   * Waits `graceMs` for each session's client; `expire` is called for each one not resumed in time.
   * @throws FAILED_PRECONDITION RESUME_DUPLICATE when a record repeats an id or a token already waiting
   */
  wait(parked: readonly ParkedSession[], graceMs: number, expire: (session: ParkedSession) => void): void {
    for (const session of parked) {
      if (this.byId.has(session.id) || this.byResumeToken.has(session.resumeToken) || this.byToken.has(session.token)) {
        throw failedPrecondition('RESUME_DUPLICATE', `parked session ${session.id} repeats an id or token of a session already waiting for resume`);
      }
    }
    for (const session of parked) {
      const timer = setTimeout(() => {
        if (this.forget(session.resumeToken) === undefined) return;
        this.remember(session);
        expire(session);
      }, graceMs);
      timer.unref();
      this.byResumeToken.set(session.resumeToken, { session, timer });
      this.byToken.set(session.token, session);
      this.byId.set(session.id, session);
    }
  }

  /**
   * Takes the waiting session a resume token names, for the fresh session of a
   * new connection, which must have done nothing yet; it waits no more.
   * @throws INVALID_ARGUMENT BAD_MESSAGE; NOT_FOUND RESUME_UNKNOWN, SESSION_RECLAIMED;
   *   PERMISSION_DENIED RESUME_OF_ANOTHER_UID; FAILED_PRECONDITION RESUME_DUPLICATE
   */
  claim(resumeToken: unknown, fresh: { id: bigint; peer: { uid: number }; used: boolean; resumed: boolean }): ParkedSession {
    if (typeof resumeToken !== 'string' || !RESUME_TOKEN_PATTERN.test(resumeToken)) {
      throw invalidArgument('BAD_MESSAGE', `hello: resumeToken ${JSON.stringify(resumeToken)?.slice(0, 80)} is not 64 lowercase hex digits`);
    }
    if (fresh.used || fresh.resumed) {
      throw failedPrecondition('RESUME_DUPLICATE', `session ${fresh.id} was used or resumed already: only a fresh connection may resume a session`);
    }
    const uid = fresh.peer.uid;
    const waiting = this.byResumeToken.get(resumeToken)?.session;
    if (waiting === undefined) {
      const reclaimed = this.reclaimed.get(resumeToken);
      if (reclaimed !== undefined) {
        throw notFound('SESSION_RECLAIMED', `session ${reclaimed} was not resumed within the grace period and has been reclaimed; open a new session`);
      }
      throw notFound('RESUME_UNKNOWN', 'the resume token names no session waiting for its client; open a new session');
    }
    if (waiting.uid !== uid) {
      throw permissionDenied('RESUME_OF_ANOTHER_UID', `uid ${uid} may not resume a session of another uid`);
    }
    this.forget(resumeToken);
    return waiting;
  }

  /** The waiting session a gRPC token names, if any. */
  byGrpcToken(token: string): ParkedSession | undefined {
    return this.byToken.get(token);
  }

  /** The waiting session of an id, if any. */
  get(id: bigint): ParkedSession | undefined {
    return this.byId.get(id);
  }

  /** Sessions waiting now. */
  list(): ParkedSession[] {
    return [...this.byId.values()];
  }

  get count(): number {
    return this.byId.size;
  }

  /** Stops waiting for every session (the daemon stops); returns them, unreclaimed. */
  drain(): ParkedSession[] {
    const all = this.list();
    for (const session of all) this.forget(session.resumeToken);
    return all;
  }

  private forget(resumeToken: string): ParkedSession | undefined {
    const entry = this.byResumeToken.get(resumeToken);
    if (entry === undefined) return undefined;
    clearTimeout(entry.timer);
    this.byResumeToken.delete(resumeToken);
    this.byToken.delete(entry.session.token);
    this.byId.delete(entry.session.id);
    return entry.session;
  }

  private remember(session: ParkedSession): void {
    this.reclaimed.set(session.resumeToken, session.id);
    if (this.reclaimed.size > RECLAIMED_REMEMBERED) this.reclaimed.delete(this.reclaimed.keys().next().value as string);
  }
}

/** A live session's record, as parked (what it needs of a Session, named here: session.ts imports this file). */
export function recordOf(session: { id: bigint; peer: { uid: number; gid: number }; token: string; resumeToken: string }): ParkedSession {
  return { id: session.id, uid: session.peer.uid, gid: session.peer.gid, token: session.token, resumeToken: session.resumeToken };
}

/** A promise and what settles it, for a value that comes later. */
export function deferred<T>(): { promise: Promise<T>; resolve(value: T): void } {
  let resolve!: (value: T) => void;
  const promise = new Promise<T>((settle) => (resolve = settle));
  return { promise, resolve };
}
