/**
 * The copies a piece of mapped memory has in flight: no unmap, address free or
 * release may run while a copy this process issued into the range is still
 * running (the copy engine would fault the context), and copies that overlap run in the order they were
 * issued, as `cuMemcpy` calls on one stream would (a read started after a
 * write, neither awaited, sees the write).
 */
type Kind = 'read' | 'write';

interface Copy {
  readonly kind: Kind;
  readonly start: bigint;
  readonly end: bigint;
}

export class InFlight {
  // Invariant: every copy tracked and not yet settled is a key of `pending`;
  // its range and kind are the value where it was issued through `ordered`.
  private readonly pending = new Map<Promise<unknown>, Copy | undefined>();

  /** Whether no copy is in flight. */
  get idle(): boolean {
    return this.pending.size === 0;
  }

  /** Tracks a copy until it settles, ordered before every later copy; returns it unchanged. */
  track<T>(copy: Promise<T>): Promise<T> {
    return this.add(copy, undefined);
  }

  private add<T>(copy: Promise<T>, range: Copy | undefined): Promise<T> {
    this.pending.set(copy, range);
    const settled = () => this.pending.delete(copy);
    copy.then(settled, settled);
    return copy;
  }

  /**
   * Starts a copy of `length` bytes at `offset` once every copy in flight that
   * it conflicts with (overlapping, and one of the two a write) has settled —
   * at once where none does, which is the usual case — and tracks it.
   */
  ordered<T>(kind: Kind, offset: bigint, length: bigint, start: () => Promise<T>): Promise<T> {
    const range: Copy = { kind, start: offset, end: offset + length };
    const before: Array<Promise<unknown>> = [];
    for (const [copy, other] of this.pending) {
      if (other === undefined || (other.start < range.end && range.start < other.end && (kind === 'write' || other.kind === 'write'))) {
        before.push(copy);
      }
    }
    const copy = before.length === 0 ? start() : Promise.allSettled(before).then(start);
    return this.add(copy, range);
  }

  /** Resolves once every copy tracked so far has settled, whether it succeeded or failed. */
  async drain(): Promise<void> {
    while (this.pending.size > 0) await Promise.allSettled([...this.pending.keys()]);
  }
}
