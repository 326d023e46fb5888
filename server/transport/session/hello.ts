/**
 * The hello that opens every session connection. The client speaks first
 * (HelloRequest: the protocol it speaks, and the resume token of a parked
 * session, if it resumes one); the daemon answers with the session's
 * HelloResponse, or with an error frame. A client of protocol 1 waits for
 * the daemon to speak first, in JSON: it is told, in its own JSON, which
 * protocol it needs. A connection the daemon refuses at once (too many
 * sessions, not allowed) is refused only after its hello is read: a socket
 * closed with a frame unread resets its peer, whose read of the refusal then
 * fails.
 */
import { status as Status } from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { type DaemonFrame, encodeDaemonFrame, PROTOCOL_VERSION, protocol1Refusal } from '../../../common/protocol';
import type { ErrorCode } from '../../errors';
import type { Credentials } from '../../../native';
import type { SeqpacketConnection } from '../../../native/seqpacket';
import type { LogLimiter } from '../../observability/log-limiter';
import type { Session, SessionOptions } from './session';

/**
 * How long a connection may stay silent before its hello: a client of protocol 1 waits for the daemon
 * to speak first, and is told then, in its own JSON, which protocol it needs.
 */
export const HELLO_WAIT_MS = 1_000;

/** The daemon's hello for `session`: its tokens, its peer as read, what the daemon can do. */
export function helloFrame(session: Session, options: SessionOptions, resumed: boolean): DaemonFrame {
  const { peer } = session;
  return {
    hello: {
      protocol: PROTOCOL_VERSION,
      session: String(session.id),
      token: session.token,
      pid: peer.pid,
      uid: peer.uid,
      gid: peer.gid,
      capabilities: options.capabilities ?? [],
      // Only a daemon that parks its sessions can resume them after a restart.
      resumeToken: options.resumable === true ? session.resumeToken : '',
      resumed,
    },
  };
}

/**
 * Tells a client of another protocol which one it needs, in its own kind of frame, and closes the
 * connection: nothing it sends can be read.
 */
export function refuseProtocol1(session: Session, logLimiter: LogLimiter, why: string): void {
  const allowed = logLimiter.allow(`protocol:${session.peer.uid}`);
  if (allowed !== undefined) session.log.warn({ code: 'PROTOCOL_VERSION', heldBack: allowed.suppressed }, `a client of session protocol 1: ${why}`);
  try {
    session.connection.send(protocol1Refusal(why));
  } catch {
    // the peer left already
  }
  session.connection.close();
}

/**
 * Refuses a connection that gets no session (too many sessions, not allowed): logged (bounded per uid and
 * code), then, once its hello is read (or after HELLO_WAIT_MS of silence), the refusal goes as an error
 * frame and the connection closes.
 */
export function turnAway(
  connection: SeqpacketConnection,
  peer: Credentials,
  log: Logger,
  logLimiter: LogLimiter,
  code: ErrorCode,
  status: Status,
  refusal: string,
): void {
  const allowed = logLimiter.allow(`refused:${peer.uid}:${code}`);
  if (allowed !== undefined) {
    log.warn({ peerPid: peer.pid, peerUid: peer.uid, peerGid: peer.gid, code, heldBack: allowed.suppressed }, `session refused: ${refusal}`);
  }
  const refuse = () => {
    clearTimeout(silent);
    connection.removeListener('message', refuse);
    try {
      connection.send(encodeDaemonFrame({ error: { code, status, message: refusal } }));
    } catch (error) {
      log.debug({ err: error, code }, 'the peer left before its refusal');
    }
    connection.close();
  };
  const silent = setTimeout(refuse, HELLO_WAIT_MS);
  connection.once('message', refuse);
  connection.once('close', () => clearTimeout(silent));
}
