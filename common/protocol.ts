/**
 * The session socket protocol (docs/PROTOCOL.md): one JSON object per
 * SEQPACKET message, UTF-8, at most MAX_MESSAGE_BYTES; a message of type
 * "transfer" carries exactly one descriptor with SCM_RIGHTS. Both the daemon
 * and the client library speak it through these types.
 */

export const PROTOCOL_VERSION = 1;

/** gRPC metadata key that carries the session token on every call. */
export const SESSION_METADATA_KEY = 'vmmd-session-token';

/** Daemon → client, first message on every connection. */
export interface HelloMessage {
  type: 'hello';
  protocol: number;
  session: string;
  token: string;
  pid: number;
  uid: number;
  gid: number;
}

/** Either direction: the descriptor attached to this message is transfer `transfer`. */
export interface TransferMessage {
  type: 'transfer';
  transfer: string;
  /** Daemon → client only: what the descriptor is. */
  allocation?: string;
  size?: string;
}

/** Daemon → client: a message the daemon could not accept. */
export interface ErrorMessage {
  type: 'error';
  code: string;
  message: string;
  transfer?: string;
}

export interface PingMessage {
  type: 'ping';
  nonce?: string;
}

export interface PongMessage {
  type: 'pong';
  nonce?: string;
}

export type SessionMessage = HelloMessage | TransferMessage | ErrorMessage | PingMessage | PongMessage;

/** Transfer ids are decimal uint64 strings, 1 or more, without leading zeros. */
export const TRANSFER_ID_PATTERN = /^[1-9][0-9]{0,19}$/;

export function encodeMessage(message: SessionMessage): Buffer {
  return Buffer.from(JSON.stringify(message), 'utf8');
}

/**
 * Parses one message. Returns an error string instead of throwing: a peer's
 * bad message is answered, never fatal.
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
  switch (type) {
    case 'hello':
    case 'error':
    case 'ping':
    case 'pong':
      return value as SessionMessage;
    case 'transfer': {
      const transfer = (value as { transfer?: unknown }).transfer;
      if (typeof transfer !== 'string' || !TRANSFER_ID_PATTERN.test(transfer) || BigInt(transfer) >= 1n << 64n) {
        return `transfer id ${JSON.stringify(transfer)} is not a decimal uint64 string above 0`;
      }
      return value as TransferMessage;
    }
    default:
      return `unknown message type ${JSON.stringify(type).slice(0, 64)}`;
  }
}
