/**
 * One request's way back over the session socket: the dispatcher's answer
 * sent with its descriptor, or the refusal as the gRPC call would give it
 * (status, code and message, naming the request); an answer that cannot be
 * sent undoes what the request made where it can, and its failure is sent
 * instead.
 */
import { status as Status } from '@grpc/grpc-js';
import { traceMark, traceSince } from '../../../common/trace';
import type { ClientFrame__Output } from '../../../common/protocol';
import { addon } from '../../../native';
import { heldBack, type LogLimiter } from '../../observability/log-limiter';
import { type ErrorCode, ERROR_CODE_KEY, type RpcError, toServiceError } from '../../errors';
import type { Session } from './session';
import type { Answer, SessionHooks, SessionServices } from './session-services';

/** What answering needs of the session manager. */
export interface Answering {
  services: SessionServices;
  hooks: SessionHooks;
  /** Bounds the lines a peer can make the daemon log. */
  logLimiter: LogLimiter;
  /** Closes the request's descriptor and sends an error frame for a message refused before it ran. */
  refuse(session: Session, fd: number, code: ErrorCode, message: string, transfer?: string, request?: string): void;
}

/**
 * Hands a request to the dispatcher and sends its answer, or the refusal as
 * gRPC would give it. Never rejects: every failure becomes an error frame.
 */
export async function answerRequest(answering: Answering, session: Session, frame: ClientFrame__Output, fd: number, received = 0n): Promise<void> {
  const request = frame.request === '0' ? undefined : frame.request;
  const what = frame.body ?? 'unknown';
  const started = process.hrtime.bigint();
  const observe = (status: Status, code?: string) =>
    answering.hooks.observe?.(
      answering.services.methodOf?.(frame.body) ?? 'unknown',
      Status[status] ?? 'UNKNOWN',
      code,
      Number(process.hrtime.bigint() - started) / 1e9,
    );
  // The request's failure as the RPC would answer it: status, code and message, naming the request.
  const fail = (error: unknown) => {
    const wire = toServiceError(error, session.log);
    const code = String(wire.metadata?.get(ERROR_CODE_KEY)[0] ?? 'INTERNAL');
    observe(wire.code ?? Status.UNKNOWN, code);
    session.trySend({ request: frame.request, error: { status: wire.code ?? Status.UNKNOWN, code, message: wire.details ?? String(error) } });
  };
  let answer: Answer;
  try {
    answer = await session.track(async () => answering.services.answer(session, frame, fd));
  } catch (error) {
    if ((error as { messageRefused?: boolean }).messageRefused) {
      observe(Status.INVALID_ARGUMENT, (error as RpcError).code);
      return answering.refuse(session, fd, (error as RpcError).code, (error as RpcError).message, undefined, request);
    }
    return fail(error);
  }
  let unsent: unknown;
  traceMark(`mark:${what} answered`);
  try {
    session.send(answer.reply, answer.fd ?? -1);
  } catch (error) {
    unsent = error;
  } finally {
    // The kernel holds its own reference while the descriptor is in flight.
    if (answer.fd !== undefined) addon.close(answer.fd);
  }
  if (unsent === undefined) {
    traceSince(`session:${what}`, received);
    return observe(Status.OK);
  }
  // The answer (and its descriptor) did not go: what the request made is undone where it can be (an
  // allocation released, an open dropped), and the send's failure is the answer, which, smaller and
  // without a descriptor, may still get through; if not, the client's wait for it times out.
  if (answer.unsent !== undefined) {
    await session.track(answer.unsent).catch((error: unknown) => {
      const allowed = answering.logLimiter.allow(`undo:${session.peer.uid}`);
      session.log[allowed === undefined ? 'debug' : 'error'](
        { err: error, ...heldBack(allowed) },
        `undoing ${what} request ${request} after its answer could not be sent failed`,
      );
    });
  }
  fail(unsent);
}
