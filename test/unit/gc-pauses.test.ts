/**
 * The daemon's GC pauses (server/observability/gc-pauses.ts): what falls inside a span of
 * time, the window's count and longest pause, the ring's bound, and V8's own
 * pauses seen through the observer.
 */
import * as v8 from 'node:v8';
import * as vm from 'node:vm';
import { GcPauses, KEEP_PAUSES } from '../../server/observability/gc-pauses';

describe('GC pauses', () => {
  it('tells how much of a span of time was spent in pauses, counting only the overlap', () => {
    const pauses = new GcPauses();
    pauses.add(10, 2); // [10, 12]
    pauses.add(20, 3); // [20, 23]
    expect(pauses.within(0, 5)).toBe(0);
    expect(pauses.within(9, 13)).toBe(2);
    expect(pauses.within(11, 21)).toBeCloseTo(2); // 1 of the first, 1 of the second
    expect(pauses.within(0, 100)).toBe(5);
    expect(pauses.snapshot()).toEqual({ count: 2, maxMs: 3 });
    pauses.reset();
    expect(pauses.snapshot()).toEqual({ count: 0, maxMs: 0 });
    // The pauses themselves stay: a reset starts a new window, it does not forget the longest turn's.
    expect(pauses.within(0, 100)).toBe(5);
  });

  it('remembers the last KEEP_PAUSES pauses only', () => {
    const pauses = new GcPauses();
    for (let i = 0; i <= KEEP_PAUSES; i++) pauses.add(i * 10, 1);
    expect(pauses.within(0, 5)).toBe(0); // the first went out
    expect(pauses.within(10, 15)).toBe(1);
    expect(pauses.within(0, KEEP_PAUSES * 10 + 5)).toBe(KEEP_PAUSES);
  });

  it("sees V8's own collections", async () => {
    v8.setFlagsFromString('--expose-gc');
    const gc = vm.runInNewContext('gc') as () => void;
    const pauses = new GcPauses().start();
    try {
      const before = performance.now();
      gc();
      // The observer hears of it after the pause, in a later task.
      for (let i = 0; i < 50 && pauses.snapshot().count === 0; i++) await new Promise((resolve) => setTimeout(resolve, 10));
      expect(pauses.snapshot().count).toBeGreaterThan(0);
      expect(pauses.within(before, performance.now())).toBeGreaterThan(0);
    } finally {
      pauses.stop();
    }
  });

  it('counts in a window only the pauses that began after its reset, even those V8 reports later', async () => {
    v8.setFlagsFromString('--expose-gc');
    const gc = vm.runInNewContext('gc') as () => void;
    const pauses = new GcPauses().start();
    try {
      gc();
      // GetStats with reset_event_loop_delay, in the same turn as the pause (or the next one).
      // (V8's entry reaches the observer two immediates later: this snapshot has not seen it yet.)
      pauses.snapshot();
      pauses.reset();
      for (let i = 0; i < 10; i++) await new Promise((resolve) => setImmediate(resolve));
      // The pause ran before the reset: it does not belong to the new window (gc_pauses, gc_pause_max_us).
      expect(pauses.snapshot()).toEqual({ count: 0, maxMs: 0 });
    } finally {
      pauses.stop();
    }
  });
});
