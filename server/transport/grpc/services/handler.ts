/**
 * The wiring between grpc-js and the services' plain async methods, shared by
 * every service: it resolves the caller's session from metadata, counts the
 * call as in flight for that session, and sends every rejection through
 * server/errors.ts. grpc-js does not await handlers; nothing else may.
 */
import * as grpc from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { ERROR_CODE_KEY, SESSION_METADATA_KEY } from '../../../../common/protocol';
import type { AccessPolicy } from '../access';
import type { CallContext } from '../../call-context';
import { deadlineExceeded, failedPrecondition, resourceExhausted, toServiceError } from '../../../errors';
import { DAEMON_OWNER } from '../../../registry/records';
import type { Session, SessionManager } from '../../session/sessions';
import type { TurnMeter } from '../../../observability/turns';
import type { Budget } from '../../../registry/budgets';
import { TCP_HOLDER, takeOnce, TransportBudgets } from '../../budgets';
import type { FairCalls } from './fair-calls';

export type { CallContext } from '../../call-context';

export interface HandlerDeps {
  sessions: SessionManager;
  /** Who may call what: checked before every call. */
  access: AccessPolicy;
  /** How long a server stream waits for a reader that takes nothing (READER_STALLED). */
  streamStallMs: number;
  log: Logger;
  /** Sees every call's method, status name, error code and duration (metrics). */
  observe?: (method: string, status: string, code: string | undefined, seconds: number) => void;
  /** A stream of this method opened (+1) or ended (-1). */
  streams?: (method: string, delta: 1 | -1) => void;
  /** Bytes that a call moved, by method and direction (read: to the client). */
  moved?: (method: string, direction: 'read' | 'write', bytes: number) => void;
  /** Measures each call's turn of the event loop from its handler on (server/observability/turns.ts). */
  turns?: TurnMeter;
  /** Streams per uid and bytes in flight per stream (server/transport/budgets.ts); absent: no bounds. */
  budgets?: TransportBudgets;
  /** Starts calls in turns shared over uids (./fair-calls.ts); absent: each at once. */
  fair?: FairCalls;
}

/** What startFairly needs of a call. */
interface StartingCall {
  getPeer(): string;
  getAuthContext(): { sslPeerCertificate?: unknown };
  getDeadline(): grpc.Deadline;
  readonly cancelled: boolean;
}

/**
 * Runs a call's start in its uid's turn (at once without deps.fair, or when
 * the peer cannot be read: the call refuses itself). A call whose deadline
 * passed, or that its client cancelled, while it waited is not started:
 * `late` answers it instead (its client was told already; work done for it
 * would be memory made for an answer nobody receives).
 */
function startFairly(deps: HandlerDeps, call: StartingCall, start: () => void, late: (error: Error) => void): void {
  const begin = () => {
    const deadline = call.getDeadline();
    const passed = (deadline instanceof Date ? deadline.getTime() : deadline) <= Date.now();
    if (!call.cancelled && !passed) return start();
    late(
      deadlineExceeded('DEADLINE_PASSED', `${passed ? 'the deadline passed' : 'the client cancelled the call'} while it waited for its turn; nothing was done`),
    );
  };
  if (deps.fair === undefined) return begin();
  let holder: number | string;
  try {
    holder = deps.access.identify(call.getPeer(), call.getAuthContext()).peer?.uid ?? TCP_HOLDER;
  } catch {
    return begin();
  }
  deps.fair.run(holder, begin);
}

/**
 * Counts a stream against its uid's budget until it ends or is cancelled, whichever comes first.
 * @throws RESOURCE_EXHAUSTED BUDGET_EXCEEDED
 */
function holdStream(budget: Budget | undefined, context: CallContext, call: { once(event: 'cancelled', listener: () => void): unknown }): () => void {
  if (budget === undefined) return () => undefined;
  const give = takeOnce(budget, context.who?.peer?.uid ?? TCP_HOLDER);
  call.once('cancelled', give);
  // Cancelled while it waited for its turn: no 'cancelled' comes again.
  if ((call as { cancelled?: boolean }).cancelled) give();
  return give;
}

/** The bytes of a message's `data` field (DataChunk, WriteRequest, DataWriteRequest), 0 without one. */
function dataBytes(message: unknown): number {
  const data = (message as { data?: unknown } | null)?.data;
  return data instanceof Uint8Array ? data.length : 0;
}

/** Counts a stream as open from now until `settled` resolves or the client cancels, whichever comes first. */
function countStream(deps: HandlerDeps, method: string, call: { once(event: 'cancelled', listener: () => void): unknown }, settled: Promise<unknown>): void {
  deps.streams?.(method, 1);
  let open = true;
  const end = () => {
    if (open) deps.streams?.(method, -1);
    open = false;
  };
  call.once('cancelled', end);
  void settled.finally(end);
}

/** The requests of a client stream, each one's data counted as written. */
async function* countingWrites<Req>(deps: HandlerDeps, method: string, requests: AsyncIterable<Req>): AsyncIterable<Req> {
  for await (const request of requests) {
    deps.moved?.(method, 'write', dataBytes(request));
    yield request;
  }
}

/** Staged copies (StagedCopyResponse.bytes) and Fill/Copy (bytes_written) move bytes without streams. */
function countUnaryBytes(deps: HandlerDeps, method: string, response: unknown): void {
  const moved = response as { bytes?: unknown; bytesWritten?: unknown } | null | undefined;
  if (moved?.bytes !== undefined) deps.moved?.(method, method.startsWith('Read') ? 'read' : 'write', Number(moved.bytes));
  else if (moved?.bytesWritten !== undefined) deps.moved?.(method, 'write', Number(moved.bytesWritten));
}

/**
 * Runs a call, observes its outcome and duration, and translates a failure
 * once into what goes on the wire (for the callback, or the stream's error).
 */
async function settle<T>(deps: HandlerDeps, method: string, promise: Promise<T>): Promise<{ value?: T; error?: Partial<grpc.ServiceError> }> {
  const start = process.hrtime.bigint();
  const seconds = () => Number(process.hrtime.bigint() - start) / 1e9;
  try {
    const value = await promise;
    deps.observe?.(method, 'OK', undefined, seconds());
    return { value };
  } catch (caught) {
    const error = toServiceError(caught, deps.log.child({ method }));
    deps.log.debug({ method, status: error.code, details: error.details }, 'call refused');
    const status = grpc.status[error.code ?? grpc.status.UNKNOWN] ?? 'UNKNOWN';
    deps.observe?.(method, status, String(error.metadata?.get(ERROR_CODE_KEY)[0] ?? ''), seconds());
    return { error };
  }
}

/**
 * The caller's session, for calls whose descriptors travel on the session socket.
 * @throws FAILED_PRECONDITION NO_SESSION
 */
export function requireSession(context: CallContext, what: string): Session {
  if (context.session === undefined) {
    throw failedPrecondition('NO_SESSION', `${what} needs a session: descriptors travel only over the session socket (see docs/PROTOCOL.md)`);
  }
  return context.session;
}

function metadataToken(metadata: grpc.Metadata): string | undefined {
  const values = metadata.get(SESSION_METADATA_KEY);
  return values.length > 0 ? String(values[0]) : undefined;
}

async function withContext<T>(
  deps: HandlerDeps,
  call: { metadata: grpc.Metadata; getPeer(): string; getAuthContext(): { sslPeerCertificate?: unknown } },
  method: string,
  run: (context: CallContext) => Promise<T>,
  tracked = true,
): Promise<T> {
  const token = metadataToken(call.metadata);
  const who = deps.access.identify(call.getPeer(), call.getAuthContext());
  let session: Session | undefined;
  deps.access.check(method, who, token, () => (session = deps.sessions.authenticate(token)));
  const log = session?.log ?? deps.log;
  const context: CallContext = { caller: session?.id ?? DAEMON_OWNER, session, who, log: log.child({ method }) };
  return session === undefined || !tracked ? run(context) : session.track(() => run(context));
}

/**
 * @param undo undoes what `body` made (given its answer) when the call's deadline passed, or its client
 *   cancelled it, while it ran: the answer reaches nobody, and nobody would know to free what it names.
 */
export function unary<Req, Res>(
  deps: HandlerDeps,
  method: string,
  body: (request: Req, context: CallContext) => Promise<Res> | Res,
  undo?: (made: Res, context: CallContext, request: Req) => unknown,
): grpc.handleUnaryCall<Req, Res> {
  const run = async (call: grpc.ServerUnaryCall<Req, Res>, context: CallContext): Promise<Res> => {
    const made = await body(call.request, context);
    if (!call.cancelled || undo === undefined) return made;
    // Undone within the call: a session's reclaim waits for it.
    try {
      await undo(made, context, call.request);
    } catch (error) {
      context.log.warn({ err: error }, 'undoing what a call made after its client stopped waiting failed');
    }
    throw deadlineExceeded('DEADLINE_PASSED', 'the deadline passed (or the client cancelled the call) while it ran; what it made was undone');
  };
  return (call, callback) =>
    startFairly(
      deps,
      call,
      () => {
        deps.turns?.enter('grpc', method);
        // A body that waits (AllocateAll) stops waiting when the client cancels.
        const cancelled = new AbortController();
        call.once('cancelled', () => cancelled.abort());
        void settle(
          deps,
          method,
          withContext(deps, call, method, (context) => run(call, { ...context, signal: cancelled.signal })),
        ).then(({ value, error }) => {
          if (error !== undefined) return callback(error as grpc.ServiceError);
          countUnaryBytes(deps, method, value);
          callback(null, value);
        });
      },
      (error) => void settle(deps, method, Promise.reject(error)).then(({ error: answer }) => callback(answer as grpc.ServiceError)),
    );
}

/** What a server stream hands grpc-js before its reader has taken it, without a TransportBudgets. */
const BYTES_IN_FLIGHT = 64 << 10;

/** A message's size as far as the bound goes: its bytes field, else a small constant (store events). */
const sizeOf = (message: unknown) => (message as { data?: { length?: number } }).data?.length ?? 512;

/**
 * A data message ({offset, data}) cut into pieces of at most `most` bytes,
 * each with its own offset (the readers join them in order); other messages whole.
 */
function* pieces(message: unknown, most: number): Generator<unknown> {
  const { data, offset } = message as { data?: unknown; offset?: unknown };
  if (!(data instanceof Uint8Array) || data.length <= most || typeof offset !== 'string') {
    yield message;
    return;
  }
  for (let at = 0; at < data.length; at += most) {
    yield { ...(message as object), offset: String(BigInt(offset) + BigInt(at)), data: data.subarray(at, at + most) };
  }
}

/**
 * Writes a stream's messages with at most `bytesInFlight` not yet taken by
 * the transport (HTTP/2 flow control holds them while the reader reads
 * nothing): the next message is made only once grpc-js has taken the last
 * ones, so that a reader that stops holds a bounded amount of the daemon's
 * memory, and is cut off after stallMs.
 */
class BoundedWriter {
  private bytesInFlight = 0;
  private wake?: () => void;

  constructor(
    private readonly call: grpc.ServerWritableStream<unknown, unknown>,
    private readonly stallMs: number,
    readonly bytesLimit: number,
  ) {}

  /** @throws RESOURCE_EXHAUSTED READER_STALLED when the reader takes nothing for stallMs */
  async write(message: unknown): Promise<void> {
    const bytes = sizeOf(message);
    this.bytesInFlight += bytes;
    const more = this.call.write(message, () => {
      this.bytesInFlight -= bytes;
      if (this.bytesInFlight < this.bytesLimit) this.wake?.();
    });
    if (more && this.bytesInFlight < this.bytesLimit) return;
    await new Promise<void>((resolve, reject) => {
      const done = () => {
        clearTimeout(timer);
        this.wake = undefined;
        this.call.off('cancelled', done);
        resolve();
      };
      const timer = setTimeout(() => {
        this.wake = undefined;
        this.call.off('cancelled', done);
        reject(
          resourceExhausted(
            'READER_STALLED',
            `the reader took nothing for ${this.stallMs} ms while the stream had more for it; the stream is ended (--stream-stall-ms)`,
          ),
        );
      }, this.stallMs);
      this.wake = done;
      this.call.on('cancelled', done);
      if (this.bytesInFlight < this.bytesLimit) done();
    });
  }
}

/**
 * @param options.tracked false for streams that never end by themselves (Watch):
 *   a session's reclaim waits for its tracked calls, and must not wait for those.
 */
export function serverStream<Req, Res>(
  deps: HandlerDeps,
  method: string,
  body: (request: Req, context: CallContext) => AsyncIterable<Res>,
  options: { tracked?: boolean } = {},
): grpc.handleServerStreamingCall<Req, Res> {
  return (call) =>
    startFairly(
      deps,
      call,
      () => {
        deps.turns?.enter('grpc', method);
        const run = withContext(
          deps,
          call,
          method,
          async (context) => {
            const give = holdStream(deps.budgets?.serverStreams, context, call);
            // The budget goes back at the cancel: the body must end then too, not at its next message.
            const cancelled = new AbortController();
            const abort = () => cancelled.abort();
            call.once('cancelled', abort);
            if (call.cancelled) abort();
            const streaming: CallContext = { ...context, signal: cancelled.signal };
            try {
              const most = deps.budgets?.limits.streamBytesInFlight ?? BYTES_IN_FLIGHT;
              const writer = new BoundedWriter(call as grpc.ServerWritableStream<unknown, unknown>, deps.streamStallMs, most);
              for await (const message of body(call.request, streaming)) {
                deps.moved?.(method, 'read', dataBytes(message));
                for (const piece of pieces(message, most)) {
                  if (call.cancelled) return;
                  await writer.write(piece);
                }
              }
            } finally {
              call.off('cancelled', abort);
              give();
            }
          },
          options.tracked ?? true,
        );
        // grpc-js turns an 'error' event on a server stream into the call's status.
        const settled = settle(deps, method, run);
        countStream(deps, method, call, settled);
        void settled.then(({ error }) => (error === undefined ? call.end() : call.emit('error', error)));
      },
      (error) => void settle(deps, method, Promise.reject(error)).then(({ error: answer }) => call.emit('error', answer)),
    );
}

export function clientStream<Req, Res>(
  deps: HandlerDeps,
  method: string,
  body: (requests: AsyncIterable<Req>, context: CallContext) => Promise<Res>,
): grpc.handleClientStreamingCall<Req, Res> {
  return (call, callback) =>
    startFairly(
      deps,
      call,
      () => {
        deps.turns?.enter('grpc', method);
        const requests = countingWrites(deps, method, call as AsyncIterable<Req>);
        const settled = settle(
          deps,
          method,
          withContext(deps, call, method, async (context) => {
            const give = holdStream(deps.budgets?.clientStreams, context, call);
            try {
              return await body(requests, context);
            } finally {
              give();
            }
          }),
        );
        countStream(deps, method, call, settled);
        void settled.then(({ value, error }) => (error === undefined ? callback(null, value as Res) : callback(error as grpc.ServiceError)));
      },
      (error) => void settle(deps, method, Promise.reject(error)).then(({ error: answer }) => callback(answer as grpc.ServiceError)),
    );
}
