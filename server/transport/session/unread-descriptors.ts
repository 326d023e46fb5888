/**
 * Answers carrying a descriptor that a session's client has not read yet.
 * Each one counts against the daemon's own uid in the kernel until it is read
 * (unix_inflight): past RLIMIT_NOFILE every descriptor the daemon sends fails
 * ETOOMANYREFS, for every uid. So they are counted per session, per uid and
 * daemon-wide, and a request whose answer would carry one more is refused
 * (BUDGET_EXCEEDED) before it is sent. The protocol has no receipt: what the
 * client has read is learned from the socket (SIOCOUTQ, the bytes of the
 * messages it has not read). Once nothing is queued it has read every
 * descriptor; until then no more can be unread than messages fit in what is
 * queued, each at least MIN_QUEUED_MESSAGE_BYTES, so a client that reads as
 * it goes is never refused however many answers it has in flight.
 */
import type { Budget } from '../../registry/budgets';
import { DAEMON_HOLDER, TransportBudgets } from '../budgets';
import type { DescriptorsInFlight, Session } from './session';

const sessionHolder = (session: Session) => `session ${session.id}`;

/**
 * The fewest bytes SIOCOUTQ counts for one queued message: the kernel charges
 * a message's buffer with its bookkeeping (768 bytes for a 1-byte message on
 * x86-64 Linux); smaller than any, so the bound never counts too few.
 */
export const MIN_QUEUED_MESSAGE_BYTES = 512;

export class UnreadDescriptors implements DescriptorsInFlight {
  constructor(private readonly budgets: TransportBudgets) {}

  /** The budgets one session's unread descriptor counts in, with the holder each counts it under. */
  private counted(session: Session): Array<[Budget, string | number]> {
    return [
      [this.budgets.unreadDescriptorsOfSession, sessionHolder(session)],
      [this.budgets.unreadDescriptorsOfUid, session.peer.uid],
      [this.budgets.allUnreadDescriptors, DAEMON_HOLDER],
    ];
  }

  /** @throws RESOURCE_EXHAUSTED BUDGET_EXCEEDED naming the first budget that has no room */
  check(session: Session, count = 1): void {
    this.settle(session);
    for (const [budget, holder] of this.counted(session)) if (!budget.fits(holder, count)) throw budget.refusal(holder, budget.usedBy(holder), count);
  }

  sent(session: Session): void {
    for (const [budget, holder] of this.counted(session)) budget.take(holder);
  }

  /** A closed session's unread descriptors went back to the kernel with its socket. */
  closed(session: Session): void {
    this.forget(session);
  }

  /** Forgets a session's descriptors once its client has read everything it was sent. */
  settle(session: Session): void {
    if (this.budgets.unreadDescriptorsOfSession.usedBy(sessionHolder(session)) === 0) return;
    let queued: number;
    try {
      queued = session.connection.unsentBytes();
    } catch {
      return; // the socket is closing: closed() forgets them
    }
    this.forget(session, Math.floor(queued / MIN_QUEUED_MESSAGE_BYTES));
  }

  /** Counts at most `left` unread for the session: what the client has read for certain goes back. */
  private forget(session: Session, left = 0): void {
    const read = this.budgets.unreadDescriptorsOfSession.usedBy(sessionHolder(session)) - left;
    if (read <= 0) return;
    for (const [budget, holder] of this.counted(session)) budget.give(holder, read);
  }
}
