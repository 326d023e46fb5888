/**
 * Who calls a service method and how its answer travels, for both transports:
 * a gRPC call (server/transport/grpc/services/handler.ts) and a session-socket
 * request (server/transport/session/session-dispatcher.ts) run the same
 * service methods with the same request and response messages; what differs
 * between them is said here, once, in `socket`.
 */
import type { Logger } from 'pino';
import type { Caller } from './grpc/access';
import type { Session } from './session/session';

/**
 * What a session-socket request does differently from its RPC: a descriptor
 * rides the answer's datagram instead of a transfer (the response's
 * transfer_id stays 0), what the request made is undone when that answer
 * cannot be sent, and a release is answered once its free has started.
 */
export interface SocketAnswer {
  /** The frame's request id (recorded with what an allocate makes: the same request sent again finds it). */
  request: string;
  /** The frame says it was sent before, on a session since resumed (ClientFrame.again). */
  again: boolean;
  /** The descriptor to attach to the answer; the transport sends it, then closes this copy. */
  fd?: number;
  /** Undoes what the request made (an allocation released, an open dropped) when its answer cannot be sent. */
  unsent?: () => Promise<unknown>;
  /** A free that fails after its release was answered: told to the session, tried again. */
  freeFailed(allocation: bigint, error: Error): void;
}

/** Who is calling: a session, or nobody (owner 0, the daemon). */
export interface CallContext {
  /** The owner id new objects get and permissions are checked against. */
  caller: bigint;
  session?: Session;
  /** The connection's peer: its uid, whether it is an admin (server/transport/grpc/access.ts). */
  who?: Caller;
  log: Logger;
  /** Aborted when the client cancels (unary calls and server streams): a body that waits for something ends on it. */
  signal?: AbortSignal;
  /** Set for a session-socket request: how its answer travels (see SocketAnswer). */
  socket?: SocketAnswer;
}
