import { status as Status } from '@grpc/grpc-js';
import pino from 'pino';
import { ERROR_CODE_KEY, invalidArgument, toServiceError } from '../../server/errors';

describe('toServiceError', () => {
  it('sends an RpcError with its status, message and code', () => {
    const wire = toServiceError(invalidArgument('NOT_ALIGNED', 'size 3 is not a multiple of the granularity 2'));
    expect(wire.code).toBe(Status.INVALID_ARGUMENT);
    expect(wire.details).toBe('size 3 is not a multiple of the granularity 2');
    expect(wire.metadata?.get(ERROR_CODE_KEY)).toEqual(['NOT_ALIGNED']);
  });
  it.each([
    ['OUT_OF_MEMORY', Status.RESOURCE_EXHAUSTED],
    ['ENOMEM', Status.RESOURCE_EXHAUSTED],
    ['EMFILE', Status.RESOURCE_EXHAUSTED],
    ['BAD_DESCRIPTOR', Status.INVALID_ARGUMENT],
    ['CUDA_ERROR_OUT_OF_MEMORY', Status.RESOURCE_EXHAUSTED],
    ['CUDA_ERROR_INVALID_VALUE', Status.INVALID_ARGUMENT],
  ])('maps native code %s', (code, status) => {
    const wire = toServiceError(Object.assign(new Error(`${code}: something`), { code }));
    expect(wire.code).toBe(status);
    expect(wire.metadata?.get(ERROR_CODE_KEY)).toEqual([code]);
  });
  it('hides anything unmapped behind INTERNAL and logs it whole', () => {
    const lines: string[] = [];
    const log = pino({ level: 'error' }, { write: (line: string) => lines.push(line) });
    const wire = toServiceError(new TypeError('secret detail at /some/path'), log);
    expect(wire.code).toBe(Status.INTERNAL);
    expect(wire.details).not.toMatch(/secret/);
    expect(lines.join('')).toMatch(/secret detail/);
  });
  it('never forwards a numeric code as a status', () => {
    const wire = toServiceError(Object.assign(new Error('x'), { code: 5 }));
    expect(wire.code).toBe(Status.INTERNAL);
  });
});
