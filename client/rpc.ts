/** Promise wrappers over grpc-js calls, shared by the client's service APIs. */
import * as grpc from '@grpc/grpc-js';
import { VmmdError } from './errors';

/** A request type whose uint64 fields also take bigint (sent as decimal strings). */
export type Input<T> = { [K in keyof T]?: T[K] | bigint | (NonNullable<T[K]> extends ReadonlyArray<infer E> ? Array<E | bigint> : never) };

type UnaryMethod<Req, Res> = (request: Req, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<Res>) => grpc.ClientUnaryCall;

/** bigint fields become decimal strings, at any depth. */
export function toWire<T>(value: T): T {
  if (typeof value === 'bigint') return String(value) as T;
  if (Array.isArray(value)) return value.map(toWire) as T;
  if (value !== null && typeof value === 'object' && !Buffer.isBuffer(value)) {
    return Object.fromEntries(Object.entries(value).map(([key, field]) => [key, toWire(field)])) as T;
  }
  return value;
}

/** What a call needs of the session whose token it carries: whether it is coming back after a restart of the daemon. */
export interface ResumableSession {
  readonly resumeToken: string | undefined;
  readonly closed: boolean;
  readonly isResuming: boolean;
  /** Resolves once the session serves (or has ended, or at `deadline`). */
  ready(deadline: number): Promise<void>;
}

export interface CallSettings {
  metadata: () => grpc.Metadata;
  deadlineMs: number;
  /** The session: a call waits while it resumes, and one that met the restart is sent again where that is safe. */
  session?: ResumableSession;
}

/**
 * The RPCs sent again when the daemon's going away cut them off (UNAVAILABLE
 * or CANCELLED): they change nothing, or change it to the same end however
 * often they run (Detach: the store detached). The rest (Create, Release, Map,
 * Open, Close, Copy of overlapping ranges, FreeAddress and Unmap, whose range
 * may be reserved or mapped again in between…) fail to their caller, who
 * knows whether doing it twice is right.
 */
const SAFE_AGAIN = new Set([
  'GetStats',
  'GetReport',
  'ListSessions',
  'ListObjects',
  'GetVersion',
  'ListDevices',
  'GetMemoryInfo',
  'GetGranularity',
  'List',
  'Read',
  'GetAccess',
  'GetProperties',
  'Share',
  'Export',
  'SetAccess',
  'Fill',
  'Detach',
]);

/**
 * Calls of SAFE_AGAIN whose repeat the daemon refuses when the attempt cut off
 * did the work: the refusal codes that say so, and the answer the caller gets
 * instead (a Detach repeated finds the store detached, or gone with its name).
 */
const DONE_BY_THE_CUT: Record<string, { codes: ReadonlySet<string>; answer: (request: unknown) => unknown }> = {
  Detach: {
    codes: new Set(['STORE_DETACHED', 'UNKNOWN_STORE']),
    answer: (request) => {
      const ref = (request as { store?: { id?: string; name?: string } }).store ?? {};
      return { ...DETACHED_STORE, id: String(ref.id ?? '0'), name: ref.name ?? '' };
    },
  },
};

/** A Store as the daemon writes one it detached, with the fields the caller did not name at their defaults. */
const DETACHED_STORE = {
  id: '0',
  name: '',
  target: 'STORE_TARGET_UNSPECIFIED',
  device: 0,
  size: '0',
  readOnly: false,
  attached: false,
  ownerSession: '0',
  state: 'STORE_STATE_DETACHED',
  opens: 0,
  allocationId: '0',
};

/**
 * How a daemon going away reaches a call in flight: UNAVAILABLE (no channel), or CANCELLED (its stream reset
 * by a daemon that stopped with the call in flight; this client never cancels a unary call itself).
 */
const CUT_OFF = new Set<grpc.status>([grpc.status.UNAVAILABLE, grpc.status.CANCELLED]);

/** How often a call of SAFE_AGAIN goes again after being cut off (each after the session serves again). */
const SAFE_ATTEMPTS = 3;

/** The method's name, from its path (/vmmd.v1.Devices/ListDevices). */
function methodName(method: UnaryMethod<unknown, unknown>): string {
  const path = (method as { path?: unknown }).path;
  return typeof path === 'string' ? path.slice(path.lastIndexOf('/') + 1) : '';
}

/**
 * One unary call. Under a daemon that parks its sessions the call waits while
 * the session resumes (up to its deadline), and a call the daemon's restart
 * refused (SESSION_RESUMING, which the daemon answers having done nothing, or
 * cut off, UNAVAILABLE or CANCELLED, for a method of SAFE_AGAIN) goes again once the session is back.
 */
export async function unaryCall<Req, Res>(client: grpc.Client, method: UnaryMethod<Req, Res>, request: Input<Req>, settings: CallSettings): Promise<Res> {
  const deadline = Date.now() + settings.deadlineMs;
  const session = settings.session;
  const resumable = session !== undefined && session.resumeToken !== undefined;
  const once = () =>
    new Promise<Res>((resolve, reject) => {
      const metadata = settings.metadata();
      // A session that can resume waits for the daemon's channel rather than failing at once while the daemon restarts.
      if (resumable && !session.closed) metadata.setOptions({ waitForReady: true });
      method.call(client, toWire(request) as Req, metadata, { deadline }, (error, response) => {
        if (error) reject(VmmdError.fromServiceError(error));
        else resolve(response as Res);
      });
    });
  if (!resumable) return once();
  await session.ready(deadline);
  const name = methodName(method as UnaryMethod<unknown, unknown>);
  // Whether an attempt was cut off: the work may be done, and a refusal of the repeat may say so.
  let cut = false;
  for (let attempt = 0; ; attempt++) {
    try {
      return await once();
    } catch (error) {
      const failed = error as VmmdError;
      const done = DONE_BY_THE_CUT[name];
      if (cut && done?.codes.has(failed.code)) return done.answer(request) as Res;
      const cutOff = CUT_OFF.has(failed.status) && attempt < SAFE_ATTEMPTS && SAFE_AGAIN.has(name);
      cut ||= cutOff;
      const again = failed.code === 'SESSION_RESUMING' || cutOff;
      if (!again || session.closed || Date.now() >= deadline) throw failed;
      // The session socket may notice the restart a moment after the call did.
      await new Promise((resolve) => setTimeout(resolve, 20));
      await session.ready(deadline);
    }
  }
}

/** Largest message a client stream sends. */
export const STREAM_CHUNK_BYTES = 1 << 20;

/**
 * Collects a server stream of `{ data }` messages into one Buffer; `onChunk`
 * sees each chunk as it arrives (and may slow the stream down).
 */
export async function collectStream(call: AsyncIterable<{ data: Buffer }>, onChunk?: (chunk: Buffer) => void | Promise<void>): Promise<Buffer> {
  const chunks: Buffer[] = [];
  try {
    for await (const message of call) {
      chunks.push(message.data);
      await onChunk?.(message.data);
    }
  } catch (error) {
    throw VmmdError.fromServiceError(error as grpc.ServiceError);
  }
  return Buffer.concat(chunks);
}

/**
 * Sends `data` over a client stream in chunks, waiting for 'drain' when
 * grpc-js asks to, so a large write never sits in memory twice; then ends it.
 * `message` builds each message from the chunk's offset and bytes.
 */
export function writeChunks<M>(
  call: grpc.ClientWritableStream<M>,
  data: Uint8Array,
  message: (offset: number, chunk: Buffer) => M,
  onProgress?: (written: number) => void,
): void {
  const bytes = Buffer.from(data.buffer, data.byteOffset, data.byteLength);
  let offset = 0;
  const pump = () => {
    do {
      const more = call.write(message(offset, bytes.subarray(offset, offset + STREAM_CHUNK_BYTES)));
      offset += STREAM_CHUNK_BYTES;
      onProgress?.(Math.min(offset, bytes.length));
      if (!more && offset < bytes.length) {
        call.once('drain', pump);
        return;
      }
    } while (offset < bytes.length);
    call.end();
  };
  pump();
}
