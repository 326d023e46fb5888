/**
 * Keeps what a peer can make the daemon log bounded: per key (a uid, a
 * cause), one line per interval, the next one saying how many were held back.
 */
export class LogLimiter {
  // Invariant: one entry per key logged within the last interval; `lines` of at most `burst` logged in it.
  private readonly last = new Map<string, { at: number; lines: number; suppressed: number }>();

  /** @param burst lines per key and interval (the rest are held back) */
  constructor(
    private readonly intervalMs = 10_000,
    private readonly burst = 1,
  ) {}

  /**
   * Whether to log now for `key`; when so, how many lines were held back since the last one.
   * @returns undefined when the line is to be held back
   */
  allow(key: string, now = Date.now()): { suppressed: number } | undefined {
    const entry = this.last.get(key);
    if (entry !== undefined && now - entry.at < this.intervalMs) {
      if (entry.lines >= this.burst) {
        entry.suppressed++;
        return undefined;
      }
      entry.lines++;
      const suppressed = entry.suppressed;
      entry.suppressed = 0;
      return { suppressed };
    }
    const suppressed = entry?.suppressed ?? 0;
    this.last.set(key, { at: now, lines: 1, suppressed: 0 });
    if (this.last.size > 4096) {
      for (const [stale, value] of this.last) if (now - value.at >= this.intervalMs) this.last.delete(stale);
    }
    return { suppressed };
  }
}

/** The field saying how many like lines went to debug since the last one, when any did. */
export function heldBack(allowed: { suppressed: number } | undefined): { heldBack?: number } {
  return allowed !== undefined && allowed.suppressed > 0 ? { heldBack: allowed.suppressed } : {};
}
