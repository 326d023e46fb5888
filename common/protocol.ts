/**
 * The session socket protocol (docs/PROTOCOL.md): one JSON object per
 * SEQPACKET message, UTF-8, at most MAX_MESSAGE_BYTES; a message of type
 * "transfer" carries exactly one descriptor with SCM_RIGHTS. Both the daemon
 * and the client library speak it through these types.
 */

export const PROTOCOL_VERSION = 1;

/** gRPC metadata key that carries the session token on every call. */
export const SESSION_METADATA_KEY = 'vmmd-session-token';

/** gRPC trailer key that carries a refusal's string code (NOT_ALIGNED, QUOTA_EXCEEDED…). */
export const ERROR_CODE_KEY = 'vmmd-error-code';

/** Daemon → client, first message on every connection. */
export interface HelloMessage {
  type: 'hello';
  protocol: number;
  session: string;
  token: string;
  pid: number;
  uid: number;
  gid: number;
  /**
   * The daemon's backend ("host", "cuda"): what a client needs before its first
   * request, without a ListDevices RPC. Absent from daemons before it.
   */
  backend?: string;
  /**
   * The secret that resumes this session after the daemon restarts: sent
   * back in a client's `hello` (HelloRequest) on a new connection. Bound to
   * the uid. Absent from daemons before it.
   */
  resumeToken?: string;
  /** True when this hello answers a client's resume: the session is the parked one, with its objects. */
  resumed?: boolean;
}

/** Client → daemon, the first message of a new connection: resume the parked session this token names. */
export interface HelloRequest {
  type: 'hello';
  resumeToken: string;
}

/** Either direction: the descriptor attached to this message is transfer `transfer`. */
export interface TransferMessage {
  type: 'transfer';
  transfer: string;
  /** Daemon → client only: what the descriptor is. */
  allocation?: string;
  size?: string;
}

/** Daemon → client: a message the daemon could not accept, or a request it refused. */
export interface ErrorMessage {
  type: 'error';
  code: string;
  message: string;
  transfer?: string;
  /** The refused request's id (allocate, release, share, export, open). */
  request?: string;
  /** The gRPC status the same refusal has over gRPC. */
  status?: number;
}

/**
 * Client → daemon: the Allocate RPC on the session socket (the cold path's
 * fast lane: one SEQPACKET round trip, and the descriptor comes with the answer).
 */
export interface AllocateMessage {
  type: 'allocate';
  /** The client's id for the request, echoed in the answer (a decimal uint64 string above 0). */
  request: string;
  size: string;
  /** Default: device 0. */
  location?: { type: 'DEVICE' | 'HOST_NUMA'; id: number };
  /**
   * The same request (same id) sent again on a resumed session: if the daemon made its allocation before a
   * restart cut off the answer, that allocation is the answer; else it is made now.
   */
  again?: boolean;
}

/** Daemon → client: the allocation made for `request`; its descriptor is attached. */
export interface AllocatedMessage {
  type: 'allocated';
  request: string;
  allocation: string;
  size: string;
  device: number;
  deviceUuid: string;
  granularity: string;
  location: { type: 'DEVICE' | 'HOST' | 'HOST_NUMA'; id: number };
}

/** Client → daemon: the Release RPC on the session socket. */
export interface ReleaseMessage {
  type: 'release';
  request: string;
  allocation: string;
}

/** Daemon → client: what `request`'s release left (ReleaseResponse's fields). */
export interface ReleasedMessage {
  type: 'released';
  request: string;
  allocation: string;
  freed: boolean;
  handleReferences: number;
  mappingCount: number;
}

/** Client → daemon: the Share RPC on the session socket. */
export interface ShareMessage {
  type: 'share';
  request: string;
  allocation: string;
}

/** Daemon → client: the allocation's share key. */
export interface SharedMessage {
  type: 'shared';
  request: string;
  allocation: string;
  shareKey: string;
}

/** Client → daemon: the Export RPC (a descriptor, POSIX_FD) on the session socket. */
export interface ExportMessage {
  type: 'export';
  request: string;
  allocation: string;
  /** Needed for another session's allocation: the key its owner got from share. */
  shareKey?: string;
}

/** Daemon → client: the allocation exported for `request`; its descriptor is attached. */
export interface ExportedMessage extends Omit<AllocatedMessage, 'type'> {
  type: 'exported';
}

/** Client → daemon: the Stores.Open RPC on the session socket. */
export interface OpenMessage {
  type: 'open';
  request: string;
  /** The store by id (a decimal uint64 string) or by name, as StoreRef. */
  store: { id?: string; name?: string };
  writable?: boolean;
}

/** Daemon → client: the store opened for `request` (the Store message's JSON fields); its descriptor is attached. */
export interface OpenedMessage {
  type: 'opened';
  request: string;
  store: {
    id: string;
    name: string;
    target: string;
    device: number;
    size: string;
    readOnly: boolean;
    attached: boolean;
    ownerSession: string;
    state: string;
    opens: number;
    allocationId: string;
  };
  granularity: string;
  mappedSize: string;
  /** The descriptor cannot write (a read-only store, or a caller that may only read it): map it read-only. */
  descriptorReadOnly: boolean;
}

/** The answers to a request message, by the request's type. */
export type RequestAnswer = AllocatedMessage | ReleasedMessage | SharedMessage | ExportedMessage | OpenedMessage;

export interface PingMessage {
  type: 'ping';
  nonce?: string;
}

export interface PongMessage {
  type: 'pong';
  nonce?: string;
}

export type SessionMessage =
  | HelloMessage
  | TransferMessage
  | ErrorMessage
  | PingMessage
  | PongMessage
  | AllocateMessage
  | AllocatedMessage
  | ReleaseMessage
  | ReleasedMessage
  | ShareMessage
  | SharedMessage
  | ExportMessage
  | ExportedMessage
  | OpenMessage
  | OpenedMessage;

/** Transfer ids are decimal uint64 strings, 1 or more, without leading zeros. */
export const TRANSFER_ID_PATTERN = /^[1-9][0-9]{0,19}$/;

/**
 * The request id of a message that names one readably (an `allocate`, a `release`…), even
 * when the rest of it is bad: a refusal echoes it so that the client's waiter
 * for that id gets the answer instead of a timeout. Undefined when there is none.
 */
export function readableRequestId(data: Buffer): string | undefined {
  try {
    const request = (JSON.parse(data.toString('utf8')) as { request?: unknown } | null)?.request;
    return typeof request === 'string' && TRANSFER_ID_PATTERN.test(request) && BigInt(request) < 1n << 64n ? request : undefined;
  } catch {
    return undefined;
  }
}

export function encodeMessage(message: SessionMessage | HelloRequest): Buffer {
  return Buffer.from(JSON.stringify(message), 'utf8');
}

/**
 * Frames one message: a JSON object with a string type; a transfer's id is
 * checked here (transfers are the transport's own). Other types and fields
 * are the receiver's to check (the daemon: server/transport/session/session-dispatcher.ts), so
 * the result may be a type this union does not name. Returns an
 * error string instead of throwing: a peer's bad message is answered, never fatal.
 */
export function decodeMessage(data: Buffer): SessionMessage | string {
  let value: unknown;
  try {
    value = JSON.parse(data.toString('utf8'));
  } catch {
    return 'message is not valid JSON';
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value)) return 'message is not a JSON object';
  const type = (value as { type?: unknown }).type;
  if (typeof type !== 'string') return 'message has no string "type"';
  if (type === 'transfer') {
    const transfer = (value as { transfer?: unknown }).transfer;
    if (typeof transfer !== 'string' || !TRANSFER_ID_PATTERN.test(transfer) || BigInt(transfer) >= 1n << 64n) {
      return `transfer id ${JSON.stringify(transfer)} is not a decimal uint64 string above 0`;
    }
  }
  return value as SessionMessage;
}
