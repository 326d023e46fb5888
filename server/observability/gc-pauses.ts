/**
 * The daemon's garbage-collection pauses as V8 reports them ('gc' performance
 * entries), kept for a while: so that the longest turn (server/observability/turns.ts) can
 * be split into the daemon's own code and a collector's pause that ran inside
 * it (under many clients the longest turns and the scavenges are of the
 * same order, and only this split tells which one a long turn was).
 */
import { PerformanceEntry, PerformanceObserver } from 'node:perf_hooks';

/** Pauses remembered (a few minutes of them at the daemon's rate under load). */
export const KEEP_PAUSES = 4096;

export class GcPauses {
  // Invariant: a ring of the last KEEP_PAUSES pauses, [start, start + duration] in performance.now() milliseconds.
  private readonly starts = new Float64Array(KEEP_PAUSES);
  private readonly durations = new Float64Array(KEEP_PAUSES);
  private next = 0;
  private kept = 0;
  // Since the last reset() (pauses that began after it): how many, and the longest (milliseconds).
  private windowCount = 0;
  private windowMaxMs = 0;
  private windowStartMs = -Infinity;
  private observer?: PerformanceObserver;

  /** Starts listening for V8's pauses. */
  start(): this {
    if (this.observer === undefined) {
      this.observer = new PerformanceObserver((list) => this.addEntries(list.getEntries()));
      this.observer.observe({ entryTypes: ['gc'] });
    }
    return this;
  }

  stop(): void {
    this.observer?.disconnect();
    this.observer = undefined;
  }

  /** Notes a pause of `durationMs` that began at `startMs` (performance.now() time). */
  add(startMs: number, durationMs: number): void {
    this.starts[this.next] = startMs;
    this.durations[this.next] = durationMs;
    this.next = (this.next + 1) % KEEP_PAUSES;
    this.kept = Math.min(this.kept + 1, KEEP_PAUSES);
    // V8 reports a pause a little after it: one that began before the window did is not the window's.
    if (startMs < this.windowStartMs) return;
    this.windowCount++;
    this.windowMaxMs = Math.max(this.windowMaxMs, durationMs);
  }

  private addEntries(entries: PerformanceEntry[]): void {
    for (const entry of entries) this.add(entry.startTime, entry.duration);
  }

  /** Milliseconds of the remembered pauses that fall inside [fromMs, toMs]. */
  within(fromMs: number, toMs: number): number {
    let total = 0;
    for (let i = 0; i < this.kept; i++) {
      const start = this.starts[i];
      const overlap = Math.min(toMs, start + this.durations[i]) - Math.max(fromMs, start);
      if (overlap > 0) total += overlap;
    }
    return total;
  }

  /** Pauses since the last reset() and the longest of them (milliseconds). */
  snapshot(): { count: number; maxMs: number } {
    // The entries V8 has queued and not yet handed to the observer's callback.
    this.addEntries(this.observer?.takeRecords() ?? []);
    return { count: this.windowCount, maxMs: this.windowMaxMs };
  }

  /** Starts a new window now: pauses that began before it are not counted in it (within() still sees them). */
  reset(): void {
    this.windowCount = 0;
    this.windowMaxMs = 0;
    this.windowStartMs = performance.now();
  }
}
