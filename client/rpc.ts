/** Promise wrappers over grpc-js calls, shared by the client's service APIs. */
import * as grpc from '@grpc/grpc-js';
import { VmmdError } from './errors';

/** A request type whose uint64 fields also take bigint (sent as decimal strings). */
export type Input<T> = { [K in keyof T]?: T[K] | bigint };

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
