/**
 * What the session transport and the rest of the daemon promise each other:
 * the daemon answers request frames and reclaims closed sessions
 * (SessionServices), the transport reports its requests (SessionHooks).
 */
import type { ClientFrame__Output, DaemonFrame } from '../../../common/protocol';
import type { TurnMeter } from '../../observability/turns';
import type { Session } from './session';

/** What answers a request: the reply, and a descriptor sent with it (the transport closes its copy). */
export interface Answer {
  reply: DaemonFrame;
  fd?: number;
  /** Undoes what the request did when its answer cannot be sent (the client is not reading its socket). */
  unsent?: () => Promise<unknown>;
}

/**
 * What the daemon does for sessions, wired in daemon.ts: answering their
 * request frames, and reclaiming what a closed one owned.
 */
export interface SessionServices {
  /**
   * Answers one request frame (anything but a hello or a transfer). A refusal is
   * thrown: refuseMessage() refuses the message itself (BAD_MESSAGE…; the
   * transport closes `fd`), any other error is the request's answer. Past a
   * refusal of the message, `fd` (-1: none) is the services' to close.
   */
  answer(session: Session, frame: ClientFrame__Output, fd: number): Promise<Answer> | Answer;
  /** Frees everything a closed session owned (or a parked one nobody resumed); runs once its calls have drained. Says what it freed, for the log. */
  reclaim(session: ReclaimTarget): Promise<ReclaimSummary | void>;
  /** The RPC a request frame's body is the socket's form of (its metrics are counted under that name). */
  methodOf?(body: string | undefined): string | undefined;
}

/** What the transport tells the rest of the daemon about its requests. */
export interface SessionHooks {
  /** Sees every request's method (the RPC's name), status name, error code and duration (metrics). */
  observe?: (method: string, status: string, code: string | undefined, seconds: number) => void;
  /** Measures each message's turn of the event loop (server/observability/turns.ts). */
  turns?: TurnMeter;
  /** Told of each session when it opens; what it returns is called once the session's socket closes. */
  connected?: () => () => void;
}

/** What a reclaim needs of a session: its id (the owner of its objects) and its log. */
export type ReclaimTarget = Pick<Session, 'id' | 'log'>;

/** What a closed session's reclaim freed: its allocations (and their bytes) and reservations. */
export interface ReclaimSummary {
  allocations: number;
  bytes: string;
  reservations: number;
}
