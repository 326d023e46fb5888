/**
 * The session socket's requests: a table from a ClientFrame's body to the
 * service method of the RPC it is the socket's form of. Both transports
 * decode into the same generated messages and run the same methods; the
 * socket's context says what differs (server/transport/call-context.ts: the
 * descriptor rides the answer). Adding a socket request is adding one entry to
 * REQUESTS and one case to session.proto.
 */
import { status as Status } from '@grpc/grpc-js';
import type { ClientCase, ClientFrame__Output, DaemonFrame } from '../../../common/protocol';
import type { CreateRequest__Output } from '../../../generated/vmmd/v1/CreateRequest';
import type { ExportRequest__Output } from '../../../generated/vmmd/v1/ExportRequest';
import type { ExportResponse } from '../../../generated/vmmd/v1/ExportResponse';
import type { OpenRequest__Output } from '../../../generated/vmmd/v1/OpenRequest';
import type { OpenResponse } from '../../../generated/vmmd/v1/OpenResponse';
import type { ReleaseRequest__Output } from '../../../generated/vmmd/v1/ReleaseRequest';
import type { ReleaseResponse } from '../../../generated/vmmd/v1/ReleaseResponse';
import type { ShareRequest__Output } from '../../../generated/vmmd/v1/ShareRequest';
import type { ShareResponse } from '../../../generated/vmmd/v1/ShareResponse';
import type { Registry } from '../../registry';
import type { CallContext, SocketAnswer } from '../call-context';
import { Answer, ReclaimSummary, ReclaimTarget, refuseMessage, Session, SessionServices } from './sessions';

type Method<Req, Res> = (request: Req, context: CallContext) => Promise<Res> | Res;

/** The service methods the socket's requests run: the RPCs' own (wired in server/app/daemon.ts). */
export interface SocketMethods {
  allocate: Method<CreateRequest__Output, ExportResponse>;
  release: Method<ReleaseRequest__Output, ReleaseResponse>;
  share: Method<ShareRequest__Output, ShareResponse>;
  export: Method<ExportRequest__Output, ExportResponse>;
  open: Method<OpenRequest__Output, OpenResponse>;
}

/** What the dispatcher needs from the daemon. */
export interface DispatcherDeps {
  registry: Registry;
  methods: SocketMethods;
  /** Runs before the registry reclaims a closed session's objects, in order (stores drop its opens, staging unmaps). */
  reclaimers: Array<(session: bigint) => Promise<void>>;
  /**
   * Who may call what (server/transport/grpc/access.ts), checked before each request as
   * before the RPC of the same name; throws the RPC's refusal.
   */
  check?: (session: Session, method: string) => void;
  /** Who the session's peer is for the store rules (its uid, whether it is an admin: server/transport/grpc/access.ts); default: its uid, no admin. */
  who?: (session: Session) => CallContext['who'];
}

/** One request case: the RPC it is (its access rule and metrics name), the answer's case, and the method that answers it. */
interface Request {
  method: string;
  answer: keyof DaemonFrame;
  run(methods: SocketMethods, body: never, context: CallContext): Promise<object> | object;
}

const REQUESTS: Partial<Record<ClientCase, Request>> = {
  allocate: { method: 'Allocate', answer: 'allocated', run: (m, body: CreateRequest__Output, c) => m.allocate(body, c) },
  release: { method: 'Release', answer: 'released', run: (m, body: ReleaseRequest__Output, c) => m.release(body, c) },
  share: { method: 'Share', answer: 'shared', run: (m, body: ShareRequest__Output, c) => m.share(body, c) },
  export: { method: 'Export', answer: 'exported', run: (m, body: ExportRequest__Output, c) => m.export({ ...body, handleType: 'HANDLE_TYPE_POSIX_FD' }, c) },
  open: { method: 'Open', answer: 'opened', run: (m, body: OpenRequest__Output, c) => m.open(body, c) },
};

/** A free that failed after its release was answered is tried again after these delays; then the reclaim tries. */
export const FREE_RETRY_MS = [100, 1_000, 10_000];

/**
 * A free that failed after the release was answered (the client was told
 * `freed`): the session hears of it once (an error frame without a request
 * id: the client's 'daemon-error'), and the daemon tries the free again
 * after each of FREE_RETRY_MS; the allocation stays recorded and charged to
 * the session meanwhile. Past the last, the session's reclaim frees it (or a
 * Release by id).
 */
function freeFailedAfterAnswer(session: Session, registry: Registry, allocation: bigint, error: Error, attempt = 0): void {
  const delay = FREE_RETRY_MS[attempt];
  session.log.error(
    { err: error, allocation: String(allocation), attempt },
    `release: freeing the memory failed after the answer; the allocation stays, charged, ${delay === undefined ? "until a Release or the session's reclaim frees it" : `and the daemon tries again in ${delay} ms`}`,
  );
  if (attempt === 0) {
    session.trySend({
      error: {
        code: 'FREE_FAILED',
        status: Status.INTERNAL,
        message: `allocation ${allocation} was released, but freeing its memory failed (${error.message}); it stays charged to this session until the daemon's retries (${FREE_RETRY_MS.join(', ')} ms), a Release or the session's end free it`,
      },
    });
  }
  if (delay === undefined) return;
  setTimeout(
    () => registry.retryFree(allocation).catch((again: Error) => freeFailedAfterAnswer(session, registry, allocation, again, attempt + 1)),
    delay,
  ).unref();
}

export class SessionDispatcher implements SessionServices {
  constructor(private readonly deps: DispatcherDeps) {}

  /** @throws refuseMessage BAD_MESSAGE, UNEXPECTED_DESCRIPTOR; the method's errors */
  async answer(session: Session, frame: ClientFrame__Output, fd: number): Promise<Answer> {
    const body = frame.body;
    if (body === 'ping') {
      if (fd >= 0) throw refuseMessage('UNEXPECTED_DESCRIPTOR', 'only transfer frames may carry a descriptor');
      return { reply: { request: frame.request, pong: { nonce: frame.ping?.nonce.slice(0, 64) ?? '' } } };
    }
    const request = body === undefined ? undefined : REQUESTS[body];
    if (request === undefined) {
      throw refuseMessage(
        'BAD_MESSAGE',
        body === 'hello'
          ? 'the session was greeted already: hello comes once, first'
          : 'the frame names no request this daemon knows (an empty or unknown body)',
      );
    }
    if (frame.request === '0') throw refuseMessage('BAD_MESSAGE', `${body}: the frame's request id must be set (above 0): its answer echoes it`);
    if (fd >= 0) throw refuseMessage('UNEXPECTED_DESCRIPTOR', 'only transfer frames may carry a descriptor');
    this.deps.check?.(session, request.method);
    const socket: SocketAnswer = {
      request: frame.request,
      again: frame.again,
      freeFailed: (allocation, error) => freeFailedAfterAnswer(session, this.deps.registry, allocation, error),
    };
    const who = this.deps.who?.(session) ?? { transport: 'unix', peer: session.peer, mutualTls: false, admin: false };
    const context: CallContext = { caller: session.id, session, who, log: session.log, socket };
    const response = await request.run(this.deps.methods, frame[body as keyof ClientFrame__Output] as never, context);
    return { reply: { request: frame.request, [request.answer]: response }, fd: socket.fd, unsent: socket.unsent };
  }

  /** The RPC a frame's body is the socket's form of; undefined for bodies no request takes. */
  methodOf(body: string | undefined): string | undefined {
    if (body === 'ping') return 'Ping';
    return body !== undefined && Object.hasOwn(REQUESTS, body) ? REQUESTS[body as ClientCase]?.method : undefined;
  }

  /** Each step runs whatever the one before it did: a failure is logged, never a reason to leave objects behind. */
  async reclaim(session: ReclaimTarget): Promise<ReclaimSummary> {
    // What the session holds once its calls have drained is what the steps below free.
    const held = this.deps.registry.snapshot();
    const owner = String(session.id);
    const allocations = held.allocations.filter((allocation) => allocation.owner === owner);
    const summary: ReclaimSummary = {
      allocations: allocations.length,
      bytes: String(allocations.reduce((total, allocation) => total + BigInt(allocation.size), 0n)),
      reservations: held.reservations.filter((reservation) => reservation.owner === owner).length,
    };
    for (const step of [...this.deps.reclaimers, (id: bigint) => this.deps.registry.reclaim(id)]) {
      try {
        await step(session.id);
      } catch (error) {
        session.log.error({ err: error, failures: (error as AggregateError).errors?.length }, 'reclaiming the session failed in part');
      }
    }
    return summary;
  }
}
