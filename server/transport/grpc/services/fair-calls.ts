/**
 * gRPC calls started in turns shared over uids: grpc-js runs a handler for
 * each call as it decodes the call's frames, so one connection's pipelined
 * calls would all start in the turn that read them. Here a handler only
 * queues its call's start under the caller's uid, and each round (from
 * setImmediate, in the same turn of the event loop) starts at most `perUid`
 * calls of each uid waiting, in arrival order within a uid. Another uid's call
 * starts in the round after it was read, whatever one uid has pipelined.
 */
import type { Holder } from '../../../registry/budgets';

/** Calls of one uid started per round: as many as session messages one uid is read per round. */
export const CALLS_PER_UID_TURN = 32;

export class FairCalls {
  // Invariant: every queued start runs exactly once, in order within its holder; a holder with none queued has no entry.
  private readonly waiting = new Map<Holder, Array<() => void>>();
  private scheduled = false;

  constructor(private readonly perUid = CALLS_PER_UID_TURN) {}

  /** Starts `start` in `holder`'s next turn. */
  run(holder: Holder, start: () => void): void {
    const queue = this.waiting.get(holder);
    if (queue === undefined) this.waiting.set(holder, [start]);
    else queue.push(start);
    if (!this.scheduled) {
      this.scheduled = true;
      setImmediate(() => this.round());
    }
  }

  private round(): void {
    this.scheduled = false;
    for (const [holder, queue] of [...this.waiting]) {
      for (let started = 0; started < this.perUid && queue.length > 0; started++) queue.shift()!();
      // A holder with more waiting goes to the back: the next round starts with the others.
      this.waiting.delete(holder);
      if (queue.length > 0) this.waiting.set(holder, queue);
    }
    if (this.waiting.size > 0 && !this.scheduled) {
      this.scheduled = true;
      setImmediate(() => this.round());
    }
  }
}
