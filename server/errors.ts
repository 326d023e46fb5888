/**
 * One error class for every refusal, and the one status of every error code
 * (declared in common/error-codes.ts). Business code throws RpcError through
 * the helpers below; handlers never build statuses.
 */
import { Metadata, status as Status, ServiceError } from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { ERROR_CODE_KEY } from '../common/protocol';
import { LogLimiter } from './observability/log-limiter';

// A client that finds a way to an internal error can repeat it at will: the lines are bounded, the rest counted.
const internalErrors = new LogLimiter(10_000, 20);
import { type CodeWithStatus, type ErrorCode, ERROR_CODES, type StatusName } from '../common/error-codes';

export { ERROR_CODE_KEY };
export type { CodeWithStatus, ErrorCode };

/**
 * A refused request: a gRPC status, a stable string code naming the rule
 * ("NOT_ALIGNED", "ALREADY_MAPPED") and a message naming the value and rule.
 * The code is one of common/error-codes.ts; the helpers below take only the
 * codes declared with their status.
 */
export class RpcError extends Error {
  constructor(
    readonly status: Status,
    readonly code: ErrorCode,
    message: string,
  ) {
    super(message);
    this.name = 'RpcError';
  }
}

/** A helper that refuses with `status`, taking only the codes declared with it. */
const refusal =
  <S extends StatusName>(status: S) =>
  (code: CodeWithStatus<S>, message: string): RpcError =>
    new RpcError(Status[status], code, message);

/** Refusals by status: each takes only the codes declared with that status (a misspelt code does not compile). */
export const invalidArgument = refusal('INVALID_ARGUMENT');
export const notFound = refusal('NOT_FOUND');
export const failedPrecondition = refusal('FAILED_PRECONDITION');
export const outOfRange = refusal('OUT_OF_RANGE');
export const permissionDenied = refusal('PERMISSION_DENIED');
export const resourceExhausted = refusal('RESOURCE_EXHAUSTED');
export const unauthenticated = refusal('UNAUTHENTICATED');
export const deadlineExceeded = refusal('DEADLINE_EXCEEDED');
export const alreadyExists = refusal('ALREADY_EXISTS');
export const unavailable = refusal('UNAVAILABLE');

/**
 * Codes of native and backend errors (errno names, CUresult names, the host
 * backend's OUT_OF_MEMORY) that are the caller's to see, with their status:
 * every code of common/error-codes.ts, so that a backend that throws a
 * daemon code (BAD_DESCRIPTOR, UNSUPPORTED_HANDLE_TYPE) answers with the
 * code's one status. Anything else is INTERNAL with generic details; the full
 * error is logged.
 */
const NATIVE_STATUS: ReadonlyMap<string, Status> = new Map(
  Object.entries(ERROR_CODES)
    .filter(([, declared]) => declared.by === 'backend' || declared.by === 'daemon')
    .map(([code, declared]) => [code, Status[declared.status]]),
);

/** The error as it goes on the wire, and whether it is worth an error log. */
export function toServiceError(error: unknown, log?: Logger): Partial<ServiceError> {
  const metadata = new Metadata();
  if (error instanceof RpcError) {
    metadata.set(ERROR_CODE_KEY, error.code);
    return { code: error.status, details: error.message, metadata };
  }
  const code = (error as { code?: unknown })?.code;
  const status = typeof code === 'string' ? NATIVE_STATUS.get(code) : undefined;
  if (status !== undefined) {
    metadata.set(ERROR_CODE_KEY, code as string);
    return { code: status, details: (error as Error).message, metadata };
  }
  const allowed = internalErrors.allow('internal');
  if (allowed !== undefined) log?.error({ err: error, ...(allowed.suppressed > 0 ? { heldBack: allowed.suppressed } : {}) }, 'internal error');
  metadata.set(ERROR_CODE_KEY, 'INTERNAL');
  return { code: Status.INTERNAL, details: 'internal error (the daemon log has the details)', metadata };
}
