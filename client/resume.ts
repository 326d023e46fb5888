/**
 * The client's side of a session's resumption: after the session socket
 * closes under a daemon that parks its sessions (its hello carried a resume
 * token), the client connects again, with backoff, until the daemon that
 * restarted serves, and presents the token; the daemon answers with the same
 * session (docs/PROTOCOL.md, "Resuming a session"). Also the hello every
 * connection starts with: the client speaks first.
 */
import { status as Status } from '@grpc/grpc-js';
import { type DaemonFrame__Output, decodeDaemonFrame, encodeClientFrame, isProtocol1, lateHelloRefusal, PROTOCOL_VERSION } from '../common/protocol';
import type { HelloResponse__Output } from '../generated/vmmd/v1/HelloResponse';
import type { ReleaseResponse__Output } from '../generated/vmmd/v1/ReleaseResponse';
import { native } from '../native/client';
import { SeqpacketConnection, SeqpacketMessage } from '../native/seqpacket';
import { type DeclaredCode, VmmdError } from './errors';

/** How long a client tries to resume its session, unless VMMD_RESUME_WAIT_MS or the option says otherwise. */
export const DEFAULT_RESUME_WAIT_MS = 30_000;

/** How many connections a connect opens while the daemon takes its hello, come late, for silence (HELLO_LATE). */
export const HELLO_TRIES = 3;

/** The first wait between two attempts to reach the restarted daemon, doubled up to RESUME_BACKOFF_MAX_MS. */
const RESUME_BACKOFF_MS = 25;
const RESUME_BACKOFF_MAX_MS = 500;

/** The daemon's refusals that end the attempts: the session cannot come back. */
const FINAL_REFUSALS = new Set([
  'RESUME_UNKNOWN',
  'SESSION_RECLAIMED',
  'RESUME_OF_ANOTHER_UID',
  'RESUME_DUPLICATE',
  'BAD_MESSAGE',
  'NOT_ALLOWED',
  'PERMISSION_DENIED',
  'PROTOCOL_VERSION',
]);

/**
 * The answer a release sent again after a resume gets where the daemon's refusal says the first one was done
 * before the daemon went (its answer lost with it): UNKNOWN_ALLOCATION, it freed the allocation; NO_REFERENCE,
 * it gave back the session's reference and the allocation lives on, held by a store or another session (the
 * counts left are not known here: 0). Undefined for any other refusal, which goes to the caller.
 */
export function releasedBefore(code: string | undefined): ReleaseResponse__Output | undefined {
  if (code === 'UNKNOWN_ALLOCATION') return { freed: true, handleReferences: 0, mappingCount: 0 };
  if (code === 'NO_REFERENCE') return { freed: false, handleReferences: 0, mappingCount: 0 };
  return undefined;
}

/**
 * The resume wait: the option, else VMMD_RESUME_WAIT_MS, else the default.
 * @throws VmmdError INVALID_ARGUMENT BAD_OPTION naming the value and the rule
 */
export function resumeWaitMs(option: number | undefined, env = process.env.VMMD_RESUME_WAIT_MS): number {
  const [value, from] =
    option !== undefined ? [option, 'resumeWaitMs'] : env !== undefined && env !== '' ? [Number(env), 'VMMD_RESUME_WAIT_MS'] : [DEFAULT_RESUME_WAIT_MS, ''];
  if (!Number.isInteger(value) || value < 0 || value > 3_600_000) {
    throw new VmmdError('BAD_OPTION', Status.INVALID_ARGUMENT, `${from} must be a whole number of milliseconds from 0 to 3600000, got ${option ?? env}`);
  }
  return value;
}

/**
 * The daemon's next frame on a connection (its descriptor closed): what it answers a hello with.
 * @throws VmmdError DEADLINE_EXCEEDED NO_GREETING; UNAVAILABLE DAEMON_UNREACHABLE when the connection closes first,
 *   HELLO_LATE (the daemon took the hello, come late, for a client of protocol 1's silence); FAILED_PRECONDITION
 *   PROTOCOL_VERSION (a daemon of protocol 1, which speaks JSON)
 */
function nextFrame(connection: SeqpacketConnection, path: string, timeoutMs: number): Promise<DaemonFrame__Output | string> {
  return new Promise((resolve, reject) => {
    const done = () => {
      clearTimeout(timer);
      connection.removeAllListeners('message');
      connection.removeAllListeners('close');
    };
    const timer = setTimeout(() => {
      done();
      reject(new VmmdError('NO_GREETING', Status.DEADLINE_EXCEEDED, `vmmd at ${path} sent no greeting within ${timeoutMs} ms`));
    }, timeoutMs);
    connection.once('close', () => {
      done();
      reject(new VmmdError('DAEMON_UNREACHABLE', Status.UNAVAILABLE, `vmmd at ${path} closed the session socket`));
    });
    connection.once('message', (message: SeqpacketMessage) => {
      done();
      if (message.fd >= 0) native.close(message.fd);
      // A daemon of protocol 1 speaks first, in JSON; so does a daemon of this one that took a late hello for silence.
      const late = isProtocol1(message.data) ? lateHelloRefusal(message.data) : undefined;
      if (late !== undefined) {
        reject(new VmmdError('HELLO_LATE', Status.UNAVAILABLE, `vmmd at ${path} took this client's hello, come late, for a client of protocol 1: ${late}`));
        return;
      }
      if (isProtocol1(message.data)) {
        reject(
          new VmmdError(
            'PROTOCOL_VERSION',
            Status.FAILED_PRECONDITION,
            `vmmd at ${path} speaks session protocol 1; this client speaks ${PROTOCOL_VERSION}: upgrade the daemon`,
          ),
        );
        return;
      }
      resolve(decodeDaemonFrame(message.data));
    });
  });
}

/**
 * Says hello on a new connection (the protocol this client speaks, and the resume token of the session to
 * resume, if any) and returns the daemon's answer, or its refusal as an error. The connection is left open
 * either way.
 * @throws VmmdError the daemon's refusal (its code), NO_GREETING, DAEMON_UNREACHABLE, BAD_GREETING, PROTOCOL_VERSION, HELLO_LATE
 */
export async function greeting(
  connection: SeqpacketConnection,
  path: string,
  timeoutMs: number,
  resumeToken = '',
  what = 'the session',
): Promise<HelloResponse__Output> {
  const answer = nextFrame(connection, path, timeoutMs);
  try {
    connection.send(encodeClientFrame({ hello: { protocol: PROTOCOL_VERSION, resumeToken } }));
  } catch {
    // The daemon refused the connection at once and closed (EPIPE): its refusal, already queued, is read.
  }
  const frame = await answer;
  if (typeof frame !== 'string' && frame.error != null) {
    const refused = frame.error;
    throw new VmmdError(
      refused.code as DeclaredCode,
      refused.status === 0 ? Status.PERMISSION_DENIED : (refused.status as Status),
      `vmmd refused ${what}: ${refused.message}`,
    );
  }
  if (typeof frame === 'string' || frame.hello == null || frame.hello.protocol !== PROTOCOL_VERSION) {
    throw new VmmdError('BAD_GREETING', Status.UNAVAILABLE, `vmmd at ${path} greeted with an unexpected frame`);
  }
  return frame.hello;
}

/**
 * Connects to the restarted daemon and resumes session `session` with its
 * resume token, trying again (backoff) while no daemon serves `path`, until
 * `deadline` (ms since the epoch). Resolves with the connection that now
 * serves the session.
 * @throws VmmdError the daemon's refusal (NOT_FOUND RESUME_UNKNOWN, SESSION_RECLAIMED…), or the last
 *   attempt's failure (DAEMON_UNREACHABLE…) once the deadline has passed
 */
export async function resumeConnection(path: string, session: string, resumeToken: string, deadline: number): Promise<SeqpacketConnection> {
  let backoff = RESUME_BACKOFF_MS;
  let last: VmmdError = new VmmdError('DAEMON_UNREACHABLE', Status.UNAVAILABLE, `no vmmd served ${path}`);
  while (Date.now() < deadline) {
    let connection: SeqpacketConnection | undefined;
    try {
      connection = SeqpacketConnection.connect(path);
      const resumed = await greeting(connection, path, Math.max(1, deadline - Date.now()), resumeToken, `to resume session ${session}`);
      if (!resumed.resumed || resumed.session !== session) {
        throw new VmmdError(
          'BAD_GREETING',
          Status.UNAVAILABLE,
          `vmmd at ${path} answered the resume of session ${session} with session ${resumed.session}, not resumed`,
        );
      }
      return connection;
    } catch (error) {
      connection?.close();
      last =
        error instanceof VmmdError
          ? error
          : new VmmdError('DAEMON_UNREACHABLE', Status.UNAVAILABLE, `cannot reach vmmd at ${path}: ${(error as Error).message}`);
      if (FINAL_REFUSALS.has(last.code)) throw last;
    }
    await new Promise((resolve) => setTimeout(resolve, Math.min(backoff, Math.max(0, deadline - Date.now()))));
    backoff = Math.min(backoff * 2, RESUME_BACKOFF_MAX_MS);
  }
  throw last;
}
