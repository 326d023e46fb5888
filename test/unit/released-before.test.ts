/**
 * A release the daemon's restart cut off, sent again once the session is
 * resumed: where the daemon's refusal says the first one was done before it
 * went, the caller is answered as by a release; any other refusal is the
 * caller's.
 */
import { releasedBefore } from '../../client/resume';

describe('a release sent again after a resume', () => {
  it('finding the allocation gone: the first one freed it', () => {
    expect(releasedBefore('UNKNOWN_ALLOCATION')).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
  });

  it("finding the session's reference gone while a store or another session holds the allocation: the first one gave it back", () => {
    expect(releasedBefore('NO_REFERENCE')).toEqual({ freed: false, handleReferences: 0, mappingCount: 0 });
  });

  it.each(['NOT_OWNER', 'ALREADY_RELEASED', 'SESSION_LOST', undefined])('refused with %s: the refusal goes to the caller', (code) => {
    expect(releasedBefore(code)).toBeUndefined();
  });
});
