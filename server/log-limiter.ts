/**
 * Keeps what a peer can make the daemon log bounded: per key (a uid, a
 * cause), one line per interval, the next one saying how many were held back.
 */
export class LogLimiter {
  // Invariant: one entry per key logged within the last interval.
  private readonly last = new Map<string, { at: number; suppressed: number }>();

  constructor(private readonly intervalMs = 10_000) {}

  /**
   * Whether to log now for `key`; when so, how many lines were held back since the last one.
   * @returns undefined when the line is to be held back
   */
  allow(key: string, now = Date.now()): { suppressed: number } | undefined {
    const entry = this.last.get(key);
    if (entry !== undefined && now - entry.at < this.intervalMs) {
      entry.suppressed++;
      return undefined;
    }
    const suppressed = entry?.suppressed ?? 0;
    this.last.set(key, { at: now, suppressed: 0 });
    if (this.last.size > 4096) {
      for (const [stale, value] of this.last) if (now - value.at >= this.intervalMs) this.last.delete(stale);
    }
    return { suppressed };
  }
}
