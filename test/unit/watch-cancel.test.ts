/**
 * A Watch its client cancelled ends at once: it gives its server-stream
 * budget back at the cancel, so one that kept waiting for the next store
 * event would let a uid open and cancel watchers without bound (each one a
 * listener, a queue and a call the daemon holds), however quiet the stores
 * are and whatever its budget says.
 */
import { EventEmitter } from 'node:events';
import { StoresService } from '../../server/transport/grpc/services/stores';

/** The part of the store registry a Watch uses: its events, none yet. */
function quietStores() {
  const emitter = new EventEmitter();
  return Object.assign(emitter, { eventsSince: () => [], lastSequence: 0n });
}

describe('Watch, cancelled by its client', () => {
  it('ends and unsubscribes while no store event comes', async () => {
    const stores = quietStores();
    const service = new StoresService({} as never, stores as never, {} as never);
    const controller = new AbortController();
    const watcher = (service.watch as (request: object, signal?: AbortSignal) => AsyncGenerator<unknown>)({ since: '0' }, controller.signal);
    const next = watcher.next();
    await new Promise((resolve) => setImmediate(resolve));
    expect(stores.listenerCount('event')).toBe(1);
    controller.abort();
    const ended = await Promise.race([next, new Promise((resolve) => setTimeout(() => resolve('still waiting'), 1_000))]);
    expect(ended).toEqual({ done: true, value: undefined });
    expect(stores.listenerCount('event')).toBe(0);
  });
});
