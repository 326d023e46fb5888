/**
 * The driver trace's JavaScript side: with VMMD_DRIVER_TRACE=1, session
 * requests (the client's from send to answer, the daemon's from receipt to
 * its answer's send) are written to stderr in the addon's line format
 * (native/src/cuda_driver.cc TraceCall), on the same clock (CLOCK_MONOTONIC:
 * process.hrtime), so that bench/cold_timeline.py lines them up with
 * the driver calls of both processes. Off, it costs one boolean test.
 */
import { writeSync } from 'node:fs';

export const tracing = ((value) => value !== undefined && value !== '' && value !== '0')(process.env.VMMD_DRIVER_TRACE);

/** The clock of trace lines, in nanoseconds. */
export const traceClock = (): bigint => process.hrtime.bigint();

/** One trace line for `call`, which ran from `begin` to now (thread 0: the event loop). */
export function traceSince(call: string, begin: bigint, end = traceClock()): void {
  if (!tracing) return;
  const line = `vmmd-trace pid=${process.pid} tid=0 begin=${begin} end=${end} result=0 address=0x0 call=${call}\n`;
  try {
    writeSync(2, line);
  } catch {
    // a diagnostic: a full or closed stderr costs only the line
  }
}

/** A zero-length trace line: a point in time a diagnostic lines up with the rest. */
export function traceMark(call: string): void {
  if (!tracing) return;
  const at = traceClock();
  traceSince(call, at, at);
}
