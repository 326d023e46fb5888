import { decodeClientFrame, decodeDaemonFrame, encodeClientFrame, encodeDaemonFrame, isProtocol1, protocol1Refusal } from '../../common/protocol';

describe('session protocol frames', () => {
  it("round-trips an allocate request into the RPC's generated CreateRequest, with and without a location", () => {
    expect(decodeClientFrame(encodeClientFrame({ request: '3', allocate: { size: '2097152' } }))).toEqual({
      request: '3',
      again: false,
      body: 'allocate',
      allocate: { size: '2097152', location: null, handleType: 'HANDLE_TYPE_UNSPECIFIED' },
    });
    const located = decodeClientFrame(
      encodeClientFrame({ request: '18446744073709551615', allocate: { size: '2097152', location: { type: 'LOCATION_TYPE_HOST_NUMA', id: 1 } } }),
    );
    expect(located).toMatchObject({ request: '18446744073709551615', allocate: { location: { type: 'LOCATION_TYPE_HOST_NUMA', id: 1, deviceUuid: '' } } });
  });

  it('round-trips a transfer and an error', () => {
    expect(decodeClientFrame(encodeClientFrame({ transfer: { id: '17' } }))).toMatchObject({ body: 'transfer', transfer: { id: '17' } });
    expect(decodeDaemonFrame(encodeDaemonFrame({ request: '4', error: { code: 'NOT_ALIGNED', status: 3, message: 'm' } }))).toMatchObject({
      request: '4',
      body: 'error',
      error: { code: 'NOT_ALIGNED', status: 3, message: 'm', transfer: '0' },
    });
  });

  it.each([
    ['a length past the frame', Buffer.from([0x12, 0x05, 0x01]), /not a ClientFrame/],
    ['an unterminated varint', Buffer.from([0x08, 0xff]), /not a ClientFrame/],
    ['a JSON frame of protocol 1', Buffer.from('{"type":"ping"}'), /session protocol 1; this side speaks protocol 2/],
  ])('refuses %s with a reason, never throwing', (_what, bytes, reason) => {
    const decoded = decodeClientFrame(bytes);
    expect(typeof decoded).toBe('string');
    expect(decoded).toMatch(reason);
  });

  it('reads a body it does not know as a frame without one (the receiver refuses it by name)', () => {
    expect(decodeClientFrame(Buffer.from([0x08, 0x07, 0x62, 0x00]))).toEqual({ request: '7', again: false });
  });

  it('tells a client of protocol 1 in its own JSON which protocol it needs', () => {
    const refusal = protocol1Refusal('this client sent a JSON frame');
    expect(isProtocol1(refusal)).toBe(true);
    expect(JSON.parse(refusal.toString('utf8'))).toMatchObject({
      type: 'error',
      code: 'PROTOCOL_VERSION',
      protocol: 2,
      message: expect.stringContaining('upgrade this client to one of protocol 2'),
    });
  });
});
