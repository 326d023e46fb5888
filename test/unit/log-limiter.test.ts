import { LogLimiter } from '../../server/observability/log-limiter';

describe('LogLimiter', () => {
  it('logs one line per key and interval by default, the next one saying how many were held back', () => {
    const limiter = new LogLimiter(10_000);
    expect(limiter.allow('a', 0)).toEqual({ suppressed: 0 });
    expect(limiter.allow('a', 5_000)).toBeUndefined();
    expect(limiter.allow('a', 9_999)).toBeUndefined();
    expect(limiter.allow('b', 9_999)).toEqual({ suppressed: 0 });
    expect(limiter.allow('a', 10_000)).toEqual({ suppressed: 2 });
  });

  it('logs up to `burst` lines per key and interval', () => {
    const limiter = new LogLimiter(10_000, 3);
    expect([0, 1, 2, 3, 4].map((t) => limiter.allow('uid', t))).toEqual([{ suppressed: 0 }, { suppressed: 0 }, { suppressed: 0 }, undefined, undefined]);
    expect(limiter.allow('uid', 10_004)).toEqual({ suppressed: 2 });
    expect(limiter.allow('uid', 10_005)).toEqual({ suppressed: 0 });
  });
});
