/**
 * The session socket's frames (docs/PROTOCOL.md, proto/vmmd/v1/session.proto):
 * one SEQPACKET datagram is one ClientFrame or DaemonFrame in protobuf's
 * binary encoding, at most MAX_MESSAGE_BYTES, decoded into the same generated
 * types, with the same loader options, as the RPCs' messages. A frame of type
 * transfer carries exactly one descriptor with SCM_RIGHTS.
 */
import * as path from 'node:path';
import { status as Status } from '@grpc/grpc-js';
import * as protobuf from 'protobufjs';
import type { ClientFrame, ClientFrame__Output } from '../generated/vmmd/v1/ClientFrame';
import type { DaemonFrame, DaemonFrame__Output } from '../generated/vmmd/v1/DaemonFrame';
import { decodePlain, encodePlain, planOf, type TypePlan } from './plain-codec';
import { LOADER_OPTIONS, PROTO_DIR } from './proto';

export type { ClientFrame, ClientFrame__Output, DaemonFrame, DaemonFrame__Output };

/** The session protocol this tree speaks: 2, its frames from session.proto (1 was hand-typed JSON). */
export const PROTOCOL_VERSION = 2;

/** gRPC metadata key that carries the session token on every call. */
export const SESSION_METADATA_KEY = 'vmmd-session-token';

/** gRPC trailer key that carries a refusal's string code (NOT_ALIGNED, QUOTA_EXCEEDED…). */
export const ERROR_CODE_KEY = 'vmmd-error-code';

/** The longest frame either side reads; a longer one is cut by the receiver and refused (MESSAGE_TOO_LARGE). */
export const MAX_MESSAGE_BYTES = 4096;

/** What a ClientFrame's body may be, and a DaemonFrame's. */
export type ClientCase = NonNullable<ClientFrame__Output['body']>;
export type DaemonCase = NonNullable<DaemonFrame__Output['body']>;

// The frames' types from the same .proto files and options the RPCs load with: the same objects come out.
const root = new protobuf.Root();
root.resolvePath = (_origin, target) => (path.isAbsolute(target) ? target : path.join(PROTO_DIR, target));
root.loadSync('vmmd/v1/session.proto', { keepCase: LOADER_OPTIONS.keepCase ?? false });
root.resolveAll();
// Each frame type's conversions, planned once from its reflection: the objects protobufjs's
// toObject makes with the loader's options, without its per-call cost (common/plain-codec.ts).
const CLIENT_FRAME = planOf(root.lookupType('vmmd.v1.ClientFrame'));
const DAEMON_FRAME = planOf(root.lookupType('vmmd.v1.DaemonFrame'));

function encode(plan: TypePlan, frame: object): Buffer {
  const bytes = encodePlain(plan, frame);
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
}

/**
 * A frame of `plan`'s type, or why the bytes are not one (never throws: a peer's bad
 * frame is answered, not fatal). A frame with no body it knows (empty, or a
 * case this side does not read) is one too: the receiver refuses it by name.
 */
function decode<T>(plan: TypePlan, data: Buffer): T | string {
  if (isProtocol1(data)) return `the frame is JSON, a frame of session protocol 1; this side speaks protocol ${PROTOCOL_VERSION} (proto/vmmd/v1/session.proto)`;
  try {
    return decodePlain<T>(plan, data);
  } catch (error) {
    return `the frame is not a ${plan.type.name} (${(error as Error).message})`;
  }
}

/** The bytes of a frame the client sends. */
export function encodeClientFrame(frame: ClientFrame): Buffer {
  return encode(CLIENT_FRAME, frame);
}

/** The bytes of a frame the daemon sends. */
export function encodeDaemonFrame(frame: DaemonFrame): Buffer {
  return encode(DAEMON_FRAME, frame);
}

/** A frame a client sent, or why the bytes are not one. */
export function decodeClientFrame(data: Buffer): ClientFrame__Output | string {
  return decode<ClientFrame__Output>(CLIENT_FRAME, data);
}

/** A frame the daemon sent, or why the bytes are not one. */
export function decodeDaemonFrame(data: Buffer): DaemonFrame__Output | string {
  return decode<DaemonFrame__Output>(DAEMON_FRAME, data);
}

/** The bytes start a JSON object, a frame of session protocol 1 ("{" would open a protobuf group, which no frame has). */
export function isProtocol1(data: Buffer): boolean {
  return data[0] === 0x7b;
}

/**
 * Where `data` is a daemon's protocol-1 refusal naming this protocol as its own (it took a client's hello, come
 * late on a loaded machine, for the silence of a client of protocol 1, which waits for the daemon to speak
 * first): the refusal's message; else undefined (a daemon of protocol 1 itself).
 */
export function lateHelloRefusal(data: Buffer): string | undefined {
  try {
    const parsed = JSON.parse(data.toString('utf8')) as { type?: unknown; code?: unknown; protocol?: unknown; message?: unknown };
    return parsed.type === 'error' && parsed.code === 'PROTOCOL_VERSION' && parsed.protocol === PROTOCOL_VERSION ? String(parsed.message) : undefined;
  } catch {
    return undefined;
  }
}

/**
 * The refusal a client of protocol 1 reads: its own kind of frame, a JSON
 * error, naming the protocol it needs (a client of protocol 1 reads the
 * daemon's first frame as its hello and reports an error frame's message).
 */
export function protocol1Refusal(why: string): Buffer {
  const message = `vmmd speaks session protocol ${PROTOCOL_VERSION} (proto/vmmd/v1/session.proto, docs/PROTOCOL.md) and ${why}: upgrade this client to one of protocol ${PROTOCOL_VERSION}`;
  return Buffer.from(
    JSON.stringify({ type: 'error', code: 'PROTOCOL_VERSION', status: Status.FAILED_PRECONDITION, protocol: PROTOCOL_VERSION, message }),
    'utf8',
  );
}
