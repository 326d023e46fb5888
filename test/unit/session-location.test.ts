/**
 * The session socket's allocate takes a location spelled as this protocol
 * spells it ("DEVICE") or as the proto's JSON and grpcurl do
 * ("LOCATION_TYPE_DEVICE"); anything else is refused, naming both spellings.
 */
import pino from 'pino';
import { Registry } from '../../server/registry';
import { SessionDispatcher } from '../../server/transport/session/session-dispatcher';
import { StoreRegistry } from '../../server/stores/stores';
import type { Session } from '../../server/transport/session/sessions';
import { FakeBackend, GRANULARITY } from './fake-backend';

const session = { id: 7n, log: pino({ level: 'silent' }), checkDescriptorRoom: () => undefined } as unknown as Session;

describe('allocate on the session socket: location spellings', () => {
  it.each([['DEVICE'], ['LOCATION_TYPE_DEVICE']])('%s is device memory', async (type) => {
    const registry = new Registry(new FakeBackend());
    const answer = await new SessionDispatcher({ registry, stores: new StoreRegistry(registry), reclaimers: [] }).answer(session, { type: 'allocate', request: '1', size: String(GRANULARITY), location: { type, id: 0 } }, -1);
    expect(answer.reply).toMatchObject({ type: 'allocated', request: '1', location: { type: 'DEVICE', id: 0 } });
    expect(registry.snapshot().allocations).toHaveLength(1);
  });

  it.each([['LOCATION_TYPE_HOST'], ['LOCATION_TYPE_'], ['location_type_device'], ['HOST']])('%s is refused, and nothing is made', (type) => {
    const registry = new Registry(new FakeBackend());
    expect(() => new SessionDispatcher({ registry, stores: new StoreRegistry(registry), reclaimers: [] }).answer(session, { type: 'allocate', request: '1', size: String(GRANULARITY), location: { type, id: 0 } }, -1)).toThrow(
      expect.objectContaining({ code: 'BAD_MESSAGE', message: expect.stringContaining('LOCATION_TYPE_DEVICE') }),
    );
    expect(registry.snapshot().allocations).toEqual([]);
  });
});
