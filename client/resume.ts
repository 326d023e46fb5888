/**
 * The client's side of a session's resumption: after the session socket
 * closes under a daemon that parks its sessions (its hello carried a resume
 * token), the client connects again, with backoff, until the daemon that
 * restarted serves, and presents the token; the daemon answers with the same
 * session (docs/PROTOCOL.md, "Resuming a session"). Also the greeting every
 * connection starts with.
 */
import { status as Status } from '@grpc/grpc-js';
import { decodeMessage, encodeMessage, HelloMessage, PROTOCOL_VERSION } from '../common/protocol';
import { native } from '../native/client';
import { SeqpacketConnection, SeqpacketMessage } from '../native/seqpacket';
import { type DeclaredCode, VmmdError } from './errors';

/** How long a client tries to resume its session, unless VMMD_RESUME_WAIT_MS or the option says otherwise. */
export const DEFAULT_RESUME_WAIT_MS = 30_000;

/** The first wait between two attempts to reach the restarted daemon, doubled up to RESUME_BACKOFF_MAX_MS. */
const RESUME_BACKOFF_MS = 25;
const RESUME_BACKOFF_MAX_MS = 500;

/** The daemon's refusals that end the attempts: the session cannot come back. */
const FINAL_REFUSALS = new Set(['RESUME_UNKNOWN', 'SESSION_RECLAIMED', 'RESUME_OF_ANOTHER_UID', 'RESUME_DUPLICATE', 'BAD_MESSAGE', 'NOT_ALLOWED', 'PERMISSION_DENIED']);

/**
 * The resume wait: the option, else VMMD_RESUME_WAIT_MS, else the default.
 * @throws VmmdError INVALID_ARGUMENT BAD_OPTION naming the value and the rule
 */
export function resumeWaitMs(option: number | undefined, env = process.env.VMMD_RESUME_WAIT_MS): number {
  const [value, from] = option !== undefined ? [option, 'resumeWaitMs'] : env !== undefined && env !== '' ? [Number(env), 'VMMD_RESUME_WAIT_MS'] : [DEFAULT_RESUME_WAIT_MS, ''];
  if (!Number.isInteger(value) || value < 0 || value > 3_600_000) {
    throw new VmmdError('BAD_OPTION', Status.INVALID_ARGUMENT, `${from} must be a whole number of milliseconds from 0 to 3600000, got ${option ?? env}`);
  }
  return value;
}

/**
 * The next message on a connection (its descriptor closed): what the daemon greets or answers a hello with.
 * @throws VmmdError DEADLINE_EXCEEDED NO_GREETING; UNAVAILABLE DAEMON_UNREACHABLE when the connection closes first
 */
function nextMessage(connection: SeqpacketConnection, path: string, timeoutMs: number): Promise<ReturnType<typeof decodeMessage>> {
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
      resolve(decodeMessage(message.data));
    });
  });
}

/**
 * The daemon's hello on a new connection, or its refusal as an error. The connection is left open either way.
 * @throws VmmdError the daemon's refusal (its code), NO_GREETING, DAEMON_UNREACHABLE, BAD_GREETING
 */
export async function greeting(connection: SeqpacketConnection, path: string, timeoutMs: number, what = 'the session'): Promise<HelloMessage> {
  const hello = await nextMessage(connection, path, timeoutMs);
  if (typeof hello !== 'string' && hello.type === 'error') {
    throw new VmmdError(hello.code as DeclaredCode, typeof hello.status === 'number' ? hello.status : Status.PERMISSION_DENIED, `vmmd refused ${what}: ${hello.message}`);
  }
  if (typeof hello === 'string' || hello.type !== 'hello' || hello.protocol !== PROTOCOL_VERSION) {
    throw new VmmdError('BAD_GREETING', Status.UNAVAILABLE, `vmmd at ${path} greeted with an unexpected message`);
  }
  return hello;
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
      const remaining = () => Math.max(1, deadline - Date.now());
      await greeting(connection, path, remaining());
      connection.send(encodeMessage({ type: 'hello', resumeToken }));
      const resumed = await greeting(connection, path, remaining(), `to resume session ${session}`);
      if (resumed.resumed !== true || resumed.session !== session) {
        throw new VmmdError('BAD_GREETING', Status.UNAVAILABLE, `vmmd at ${path} answered the resume of session ${session} with session ${resumed.session}, not resumed`);
      }
      return connection;
    } catch (error) {
      connection?.close();
      last = error instanceof VmmdError ? error : new VmmdError('DAEMON_UNREACHABLE', Status.UNAVAILABLE, `cannot reach vmmd at ${path}: ${(error as Error).message}`);
      if (FINAL_REFUSALS.has(last.code)) throw last;
    }
    await new Promise((resolve) => setTimeout(resolve, Math.min(backoff, Math.max(0, deadline - Date.now()))));
    backoff = Math.min(backoff * 2, RESUME_BACKOFF_MAX_MS);
  }
  throw last;
}
