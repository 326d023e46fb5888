/**
 * One error class for every refusal, and one table from error codes to gRPC
 * status. Business code throws RpcError; handlers never build statuses.
 */
import { Metadata, status as Status, ServiceError } from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { ERROR_CODE_KEY } from '../common/protocol';
import { LogLimiter } from './observability/log-limiter';

// A client that finds a way to an internal error can repeat it at will: the lines are bounded, the rest counted.
const internalErrors = new LogLimiter(10_000, 20);

export { ERROR_CODE_KEY };

/**
 * A refused request: a gRPC status, a stable string code naming the rule
 * ("NOT_ALIGNED", "ALREADY_MAPPED") and a message naming the value and rule.
 */
export class RpcError extends Error {
  constructor(
    readonly status: Status,
    readonly code: string,
    message: string,
  ) {
    super(message);
    this.name = 'RpcError';
  }
}

export const invalidArgument = (code: string, message: string) => new RpcError(Status.INVALID_ARGUMENT, code, message);
export const notFound = (code: string, message: string) => new RpcError(Status.NOT_FOUND, code, message);
export const failedPrecondition = (code: string, message: string) =>
  new RpcError(Status.FAILED_PRECONDITION, code, message);
export const outOfRange = (code: string, message: string) => new RpcError(Status.OUT_OF_RANGE, code, message);
export const permissionDenied = (code: string, message: string) =>
  new RpcError(Status.PERMISSION_DENIED, code, message);
export const resourceExhausted = (code: string, message: string) =>
  new RpcError(Status.RESOURCE_EXHAUSTED, code, message);
export const unauthenticated = (code: string, message: string) => new RpcError(Status.UNAUTHENTICATED, code, message);
export const deadlineExceeded = (code: string, message: string) =>
  new RpcError(Status.DEADLINE_EXCEEDED, code, message);
export const alreadyExists = (code: string, message: string) => new RpcError(Status.ALREADY_EXISTS, code, message);
export const unavailable = (code: string, message: string) => new RpcError(Status.UNAVAILABLE, code, message);

/**
 * Codes of native and backend errors (errno names, CUresult names, the host
 * backend's OUT_OF_MEMORY) that are the caller's to see, with their status.
 * Anything else is INTERNAL with generic details; the full error is logged.
 */
const NATIVE_STATUS: Record<string, Status> = {
  OUT_OF_MEMORY: Status.RESOURCE_EXHAUSTED,
  ENOMEM: Status.RESOURCE_EXHAUSTED,
  EMFILE: Status.RESOURCE_EXHAUSTED,
  ENFILE: Status.RESOURCE_EXHAUSTED,
  ENOSPC: Status.RESOURCE_EXHAUSTED,
  ETOOMANYREFS: Status.RESOURCE_EXHAUSTED,
  // The kernel had no buffer for a session-socket message (found by fault injection: it was INTERNAL).
  ENOBUFS: Status.RESOURCE_EXHAUSTED,
  BAD_DESCRIPTOR: Status.INVALID_ARGUMENT,
  // Memory a client sealed through a descriptor of it refuses what the seals forbid (host backend).
  MEMORY_SEALED: Status.FAILED_PRECONDITION,
  EAGAIN: Status.UNAVAILABLE,
  EPIPE: Status.UNAVAILABLE,
  ECONNRESET: Status.UNAVAILABLE,
  CUDA_ERROR_OUT_OF_MEMORY: Status.RESOURCE_EXHAUSTED,
  CUDA_ERROR_INVALID_VALUE: Status.INVALID_ARGUMENT,
  CUDA_ERROR_INVALID_DEVICE: Status.OUT_OF_RANGE,
  CUDA_ERROR_NOT_SUPPORTED: Status.FAILED_PRECONDITION,
  CUDA_ERROR_NOT_PERMITTED: Status.PERMISSION_DENIED,
};

/** The error as it goes on the wire, and whether it is worth an error log. */
export function toServiceError(error: unknown, log?: Logger): Partial<ServiceError> {
  const metadata = new Metadata();
  if (error instanceof RpcError) {
    metadata.set(ERROR_CODE_KEY, error.code);
    return { code: error.status, details: error.message, metadata };
  }
  const code = (error as { code?: unknown })?.code;
  if (typeof code === 'string' && code in NATIVE_STATUS) {
    metadata.set(ERROR_CODE_KEY, code);
    return { code: NATIVE_STATUS[code], details: (error as Error).message, metadata };
  }
  const allowed = internalErrors.allow('internal');
  if (allowed !== undefined) log?.error({ err: error, ...(allowed.suppressed > 0 ? { heldBack: allowed.suppressed } : {}) }, 'internal error');
  metadata.set(ERROR_CODE_KEY, 'INTERNAL');
  return { code: Status.INTERNAL, details: 'internal error (the daemon log has the details)', metadata };
}
