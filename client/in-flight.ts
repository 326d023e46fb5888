/**
 * The copies a piece of mapped memory has in flight, so that unmapping it can
 * wait for them: no unmap, address free or release may run while a copy this
 * process issued into the range is still running (issue 15).
 */
export class InFlight {
  // Invariant: every copy tracked and not yet settled is in `pending`.
  private readonly pending = new Set<Promise<unknown>>();

  /** Whether no copy is in flight. */
  get idle(): boolean {
    return this.pending.size === 0;
  }

  /** Tracks a copy until it settles; returns it unchanged. */
  track<T>(copy: Promise<T>): Promise<T> {
    this.pending.add(copy);
    const settled = () => this.pending.delete(copy);
    copy.then(settled, settled);
    return copy;
  }

  /** Resolves once every copy tracked so far has settled, whether it succeeded or failed. */
  async drain(): Promise<void> {
    while (this.pending.size > 0) await Promise.allSettled([...this.pending]);
  }
}
