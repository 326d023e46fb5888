/**
 * The thread's CPU clock (native/src/thread_clock.cc): it advances while the
 * thread runs and stands still while the thread waits, which is what lets the
 * turn meter tell the daemon's own work from the time the OS took from it.
 */
import { addon } from '../../native';

describe('threadCpuNanos', () => {
  it('advances by the time the thread computes, not by the time it waits', () => {
    const start = addon.threadCpuNanos();
    const wallStart = process.hrtime.bigint();
    // 20 ms asleep: the clock stands (the kernel's accounting may add a little).
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 20);
    const asleep = addon.threadCpuNanos() - start;
    expect(Number(process.hrtime.bigint() - wallStart)).toBeGreaterThanOrEqual(19e6);
    expect(asleep).toBeLessThan(5e6);
    // Work until the clock has moved 10 ms: it gets there (within 5 s, however loaded the machine), and not
    // before 10 ms of wall time have passed.
    const busyStart = addon.threadCpuNanos();
    const busyWall = process.hrtime.bigint();
    const giveUp = busyWall + 5_000_000_000n;
    while (addon.threadCpuNanos() - busyStart < 10e6 && process.hrtime.bigint() < giveUp) {
      // computing on purpose
    }
    expect(addon.threadCpuNanos() - busyStart).toBeGreaterThanOrEqual(10e6);
    expect(Number(process.hrtime.bigint() - busyWall)).toBeGreaterThanOrEqual(9e6);
    expect(Number.isInteger(addon.threadCpuNanos())).toBe(true);
  });
});
