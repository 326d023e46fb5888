/**
 * Unread descriptor answers are counted until the client has read them: a
 * client that reads as it goes is never refused, however many answers it has
 * in flight; one that reads nothing is refused at its budget.
 */
import { DAEMON_HOLDER, DEFAULT_TRANSPORT_LIMITS, TransportBudgets } from '../../server/transport/budgets';
import type { Session } from '../../server/transport/session/session';
import { MIN_QUEUED_MESSAGE_BYTES, UnreadDescriptors } from '../../server/transport/session/unread-descriptors';

/** A session whose socket has `queued()` bytes its client has not read. */
function sessionWith(queued: () => number): Session {
  return { id: 1n, peer: { uid: 1000 }, connection: { unsentBytes: queued } } as unknown as Session;
}

describe('unread descriptors', () => {
  const budgets = () => new TransportBudgets({ ...DEFAULT_TRANSPORT_LIMITS, unreadDescriptorsPerSession: 4, unreadDescriptorsPerUid: 8 });

  it('refuse a session whose client reads nothing, at its budget', () => {
    let queued = 0;
    const unread = new UnreadDescriptors(budgets());
    const session = sessionWith(() => queued);
    for (let i = 0; i < 4; i++) {
      unread.check(session);
      unread.sent(session);
      queued += 768;
    }
    expect(() => unread.check(session)).toThrow(
      expect.objectContaining({ code: 'BUDGET_EXCEEDED', message: expect.stringContaining('unread descriptors per session') }),
    );
  });

  it('never refuse a client that reads as it goes, with many answers sent while its socket is never empty', () => {
    let queued = 0;
    const unread = new UnreadDescriptors(budgets());
    const session = sessionWith(() => queued);
    for (let i = 0; i < 256; i++) {
      unread.check(session);
      unread.sent(session);
      // The client has read all but the last two messages: the socket never empties.
      queued = 2 * 768;
    }
  });

  it('count no fewer than the messages that fit in what is queued', () => {
    const transport = budgets();
    const unread = new UnreadDescriptors(transport);
    let queued = 0;
    const session = sessionWith(() => queued);
    for (let i = 0; i < 3; i++) unread.sent(session);
    queued = 3 * MIN_QUEUED_MESSAGE_BYTES;
    unread.settle(session);
    expect(transport.unreadDescriptorsOfSession.usedBy('session 1')).toBe(3);
    queued = MIN_QUEUED_MESSAGE_BYTES;
    unread.settle(session);
    expect(transport.unreadDescriptorsOfSession.usedBy('session 1')).toBe(1);
    expect(transport.unreadDescriptorsOfUid.usedBy(1000)).toBe(1);
    expect(transport.allUnreadDescriptors.usedBy(DAEMON_HOLDER)).toBe(1);
    queued = 0;
    unread.settle(session);
    expect(transport.unreadDescriptorsOfSession.usedBy('session 1')).toBe(0);
    expect(transport.allUnreadDescriptors.usedBy(DAEMON_HOLDER)).toBe(0);
  });
});
