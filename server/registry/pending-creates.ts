/**
 * The creates still awaiting their memory, by owner: a reclaim abandons its
 * owner's and waits for them to settle, so that no memory made for an owner
 * lands after its reclaim (a create whose owner was abandoned releases what
 * arrives instead of recording it).
 */

/** A create awaiting its memory; a reclaim of its owner abandons it. */
export interface PendingCreate {
  /** Set when the owner's reclaim began: the memory is released as it arrives. */
  readonly abandoned: boolean;
  /** Called once the create has settled, done or failed. */
  settle(): void;
}

interface Entry {
  abandoned: boolean;
  settled: Promise<void>;
  settle(): void;
}

export class PendingCreates {
  // Invariant: every create begun and not yet settled, by owner; no entry holds an empty set.
  private readonly creating = new Map<bigint, Set<Entry>>();

  /** Records a create for `owner`; the caller settles it once the create is over, either way. */
  begin(owner: bigint): PendingCreate {
    let resolve!: () => void;
    const waiting = this.creating.get(owner) ?? new Set<Entry>();
    const entry: Entry = {
      abandoned: false,
      settled: new Promise((done) => (resolve = done)),
      settle: () => {
        waiting.delete(entry);
        if (waiting.size === 0 && this.creating.get(owner) === waiting) this.creating.delete(owner);
        resolve();
      },
    };
    this.creating.set(owner, waiting.add(entry));
    return entry;
  }

  /**
   * Abandons the owner's creates in flight (their memory is released as it
   * arrives) and waits for them to settle: what a reclaim does first, so
   * that no memory made for the owner lands after it.
   */
  async abandon(owner: bigint): Promise<void> {
    const waiting = [...(this.creating.get(owner) ?? [])];
    for (const entry of waiting) entry.abandoned = true;
    await Promise.all(waiting.map((entry) => entry.settled));
  }
}
