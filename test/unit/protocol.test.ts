import { decodeMessage, encodeMessage } from '../../common/protocol';

describe('session protocol frames', () => {
  it('round-trips an allocate request, with and without a location (its fields are the dispatcher\'s to check)', () => {
    const plain = { type: 'allocate' as const, request: '3', size: '2097152' };
    expect(decodeMessage(encodeMessage(plain))).toEqual(plain);
    const located = { ...plain, location: { type: 'HOST_NUMA' as const, id: 1 } };
    expect(decodeMessage(encodeMessage(located))).toEqual(located);
  });

  it('round-trips a transfer', () => {
    expect(decodeMessage(encodeMessage({ type: 'transfer', transfer: '17' }))).toEqual({ type: 'transfer', transfer: '17' });
  });
  it.each([
    ['not json', /not valid JSON/],
    ['[1,2]', /not a JSON object/],
    ['{"transfer":"1"}', /no string "type"/],
    ['{"type":"transfer","transfer":"0"}', /not a decimal uint64/],
    ['{"type":"transfer","transfer":7}', /not a decimal uint64/],
    ['{"type":"transfer","transfer":"18446744073709551616"}', /not a decimal uint64/],
    ['{"type":"transfer","transfer":"007"}', /not a decimal uint64/],
  ])('refuses %s with a reason, never throwing', (text, reason) => {
    const decoded = decodeMessage(Buffer.from(text));
    expect(typeof decoded).toBe('string');
    expect(decoded).toMatch(reason);
  });
});
