/**
 * The TypeScript NBEP 7 manager's frees carry no stream, so a batch of deferred
 * frees waits for the device's work before its blocks go back to the pool (as
 * cuMemFree does for Numba's own manager): PendingDeallocations awaits
 * beforeBatch() once per batch, before any free of the batch runs.
 */
import { PendingDeallocations } from '../../client/emm/deallocations';

describe('deferred frees', () => {
  it('run only after the batch has waited for the device', async () => {
    const deallocations = new PendingDeallocations({ count: 1, ratio: 1 }, 1n << 30n);
    const ran: string[] = [];
    let deviceDone!: () => void;
    let waits = 0;
    deallocations.beforeBatch = () => {
      waits++;
      ran.push('wait');
      return new Promise<void>((resolve) => (deviceDone = resolve));
    };
    void deallocations.add(() => void ran.push('first'), 256);
    const flushed = deallocations.add(() => void ran.push('second'), 256); // past count: the batch runs
    await new Promise((resolve) => setImmediate(resolve));
    expect(ran).toEqual(['wait']); // no block is back in the pool while a kernel may still use it
    deviceDone();
    await flushed;
    expect(ran).toEqual(['wait', 'first', 'second']);
    expect(waits).toBe(1); // one wait for the whole batch
  });

  it('wait for nothing where no batch runs', async () => {
    const deallocations = new PendingDeallocations({ count: 10, ratio: 1 }, 1n << 30n);
    const before = jest.fn(async () => undefined);
    deallocations.beforeBatch = before;
    await deallocations.flush();
    expect(before).not.toHaveBeenCalled();
  });
});
