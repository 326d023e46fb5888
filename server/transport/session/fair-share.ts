/**
 * The daemon's turns shared over uids, not sockets: a readable session socket
 * waits under its peer's uid, and each round every uid with a socket waiting
 * is read at most `perUid` messages, spread over its sockets one message at a
 * time. A uid with many sessions flooding requests gets one uid's share per
 * round, as a uid with one session does; another uid's message is read in the
 * round after it arrived. Rounds run from setImmediate: the event loop polls
 * sockets and runs timers between two rounds.
 */
import type { SeqpacketConnection } from '../../../native/seqpacket';

/** What one uid may be read per round: the per-socket cap of a plain readable callback. */
export const MESSAGES_PER_UID_TURN = 32;

export class FairShare {
  // Invariant: a connection is in `waiting` (once, under its peer's uid) exactly from its ready() until a
  // read drains it (SeqpacketConnection.scheduleReads); a uid with no connection waiting has no entry.
  private readonly waiting = new Map<number, SeqpacketConnection[]>();
  private scheduled = false;
  private rounds = 0;
  private readonly served = new Map<number, number>();

  constructor(private readonly perUid = MESSAGES_PER_UID_TURN) {}

  /** Takes over a connection's reads: from now on it is read in its uid's turns. */
  adopt(connection: SeqpacketConnection, uid: number): void {
    connection.scheduleReads(() => this.wait(connection, uid));
  }

  /** Rounds run since start, and messages read per uid (for metrics and tests). */
  stats(): { rounds: number; served: ReadonlyMap<number, number> } {
    return { rounds: this.rounds, served: this.served };
  }

  private wait(connection: SeqpacketConnection, uid: number): void {
    const queue = this.waiting.get(uid);
    if (queue === undefined) this.waiting.set(uid, [connection]);
    else queue.push(connection);
    if (!this.scheduled) {
      this.scheduled = true;
      setImmediate(() => this.round());
    }
  }

  private round(): void {
    this.scheduled = false;
    this.rounds++;
    // Each uid waiting when the round starts gets its share; one that comes during the round waits for the next.
    for (const [uid, queue] of [...this.waiting]) {
      let left = this.perUid;
      while (left > 0 && queue.length > 0) {
        const connection = queue.shift()!;
        const outcome = connection.readMessages(1);
        left--;
        if (outcome === 'more') queue.push(connection);
      }
      this.served.set(uid, (this.served.get(uid) ?? 0) + this.perUid - left);
      // A uid still waiting goes to the back: the next round starts with the others.
      this.waiting.delete(uid);
      if (queue.length > 0) this.waiting.set(uid, queue);
    }
    if (this.waiting.size > 0 && !this.scheduled) {
      this.scheduled = true;
      setImmediate(() => this.round());
    }
  }
}
