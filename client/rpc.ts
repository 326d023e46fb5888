/** Promise wrappers over grpc-js calls, shared by the client's service APIs. */
import * as grpc from '@grpc/grpc-js';
import { VmmdError } from './errors';

/** A request type whose uint64 fields also take bigint (sent as decimal strings). */
export type Input<T> = { [K in keyof T]?: T[K] | bigint | (NonNullable<T[K]> extends ReadonlyArray<infer E> ? Array<E | bigint> : never) };

type UnaryMethod<Req, Res> = (
  request: Req,
  metadata: grpc.Metadata,
  options: grpc.CallOptions,
  callback: grpc.requestCallback<Res>,
) => grpc.ClientUnaryCall;

/** bigint fields become decimal strings, at any depth. */
export function toWire<T>(value: T): T {
  if (typeof value === 'bigint') return String(value) as T;
  if (Array.isArray(value)) return value.map(toWire) as T;
  if (value !== null && typeof value === 'object' && !Buffer.isBuffer(value)) {
    return Object.fromEntries(Object.entries(value).map(([key, field]) => [key, toWire(field)])) as T;
  }
  return value;
}

export interface CallSettings {
  metadata: () => grpc.Metadata;
  deadlineMs: number;
}

export function unaryCall<Req, Res>(
  client: grpc.Client,
  method: UnaryMethod<Req, Res>,
  request: Input<Req>,
  settings: CallSettings,
): Promise<Res> {
  return new Promise((resolve, reject) => {
    method.call(client, toWire(request) as Req, settings.metadata(), { deadline: Date.now() + settings.deadlineMs }, (error, response) => {
      if (error) reject(VmmdError.fromServiceError(error));
      else resolve(response as Res);
    });
  });
}

/** Largest message a client stream sends. */
export const STREAM_CHUNK_BYTES = 1 << 20;

/**
 * Collects a server stream of `{ data }` messages into one Buffer; `onChunk`
 * sees each chunk as it arrives (and may slow the stream down).
 */
export async function collectStream(
  call: AsyncIterable<{ data: Buffer }>,
  onChunk?: (chunk: Buffer) => void | Promise<void>,
): Promise<Buffer> {
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
