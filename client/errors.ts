/** The one error class of the client library. */
import { Metadata, status as Status } from '@grpc/grpc-js';
import { ERROR_CODE_KEY } from '../common/protocol';
import { ERROR_CODES, type ErrorCode as DeclaredCode } from '../common/error-codes';

export { ERROR_CODES, type DeclaredCode };

/** Futhark's error codes: every VmmdError carries one as `errorCode`. */
export enum ErrorCode {
  SUCCESS = 0,
  PROGRAM_ERROR = 2,
  OUT_OF_MEMORY = 3,
}

/**
 * An error from the daemon or the client library. `code` names the rule or
 * condition ("NOT_ALIGNED", "ALREADY_MAPPED", "SESSION_LOST"); `status` is the
 * gRPC status number and `statusName` its name.
 */
export class VmmdError extends Error {
  /** The code: one of ERROR_CODES, unless a newer daemon answered with one this client does not know. */
  readonly code: string;

  /** `code` must be declared in common/error-codes.ts: a misspelt one does not compile. */
  constructor(
    code: DeclaredCode,
    readonly status: Status,
    message: string,
  ) {
    super(message);
    this.code = code;
    this.name = 'VmmdError';
  }

  get statusName(): string {
    return Status[this.status] ?? String(this.status);
  }

  /** OUT_OF_MEMORY (3) for memory and quota exhaustion, PROGRAM_ERROR (2) for everything else. */
  get errorCode(): ErrorCode {
    return this.status === Status.RESOURCE_EXHAUSTED || /OUT_OF_MEMORY/.test(this.code) ? ErrorCode.OUT_OF_MEMORY : ErrorCode.PROGRAM_ERROR;
  }

  /** Wraps any error as a VmmdError (PROGRAM_ERROR unless it already is one). */
  static from(error: unknown): VmmdError {
    if (error instanceof VmmdError) return error;
    const code = typeof (error as { code?: unknown })?.code === 'string' ? (error as { code: string }).code : 'PROGRAM_ERROR';
    return new VmmdError(code as DeclaredCode, Status.INTERNAL, (error as Error)?.message ?? String(error));
  }

  /** Wraps a grpc-js error, taking the string code from the trailers. */
  static fromServiceError(error: { code?: number; details?: string; message?: string; metadata?: Metadata }): VmmdError {
    const status = typeof error.code === 'number' ? (error.code as Status) : Status.UNKNOWN;
    const fromTrailers = error.metadata?.get(ERROR_CODE_KEY)[0];
    const code = fromTrailers !== undefined ? String(fromTrailers) : (Status[status] ?? 'UNKNOWN');
    // The daemon's code as it came, declared or not (a newer daemon may know more).
    return new VmmdError(code as DeclaredCode, status, error.details || error.message || 'unknown error');
  }
}
