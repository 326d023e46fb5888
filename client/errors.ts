/** The one error class of the client library. */
import { Metadata, status as Status } from '@grpc/grpc-js';

const ERROR_CODE_KEY = 'vmmd-error-code';

/**
 * An error from the daemon or the client library. `code` names the rule or
 * condition ("NOT_ALIGNED", "ALREADY_MAPPED", "SESSION_LOST"); `status` is the
 * gRPC status number and `statusName` its name.
 */
export class VmmdError extends Error {
  constructor(
    readonly code: string,
    readonly status: Status,
    message: string,
  ) {
    super(message);
    this.name = 'VmmdError';
  }

  get statusName(): string {
    return Status[this.status] ?? String(this.status);
  }

  /** Wraps a grpc-js error, taking the string code from the trailers. */
  static fromServiceError(error: { code?: number; details?: string; message?: string; metadata?: Metadata }): VmmdError {
    const status = typeof error.code === 'number' ? (error.code as Status) : Status.UNKNOWN;
    const fromTrailers = error.metadata?.get(ERROR_CODE_KEY)[0];
    const code = fromTrailers !== undefined ? String(fromTrailers) : (Status[status] ?? 'UNKNOWN');
    return new VmmdError(code, status, error.details || error.message || 'unknown error');
  }
}
