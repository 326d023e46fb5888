/**
 * A client's own unmaps gathered into one driver job per device
 * (native/unmap-batch.ts), over a stand-in for the addon's cudaUnmapMany:
 * they go when UNMAP_BATCH wait, at the end of the turn they came in, at flushUnmaps(), or
 * at flushUnmapsIfIdle() when no job of their device runs; each gets its own outcome.
 */
import { addon } from '../../native';
import { flushUnmaps, flushUnmapsIfIdle, UNMAP_BATCH, unmapGathered } from '../../native/unmap-batch';

const turnEnd = () => new Promise((resolve) => setImmediate(resolve));

type Call = { device: number; addresses: bigint[]; sizes: bigint[]; synchronize: boolean | undefined };

describe('gathered unmaps', () => {
  let calls: Call[];
  let answer: (call: Call) => Promise<Array<string | null>>;
  let spy: jest.SpyInstance;
  beforeEach(() => {
    jest.useFakeTimers({ doNotFake: ['nextTick', 'queueMicrotask', 'setImmediate'] });
    calls = [];
    answer = async (call) => call.addresses.map(() => null);
    spy = jest.spyOn(addon, 'cudaUnmapMany').mockImplementation((device, addresses, sizes, synchronize) => {
      const call = { device, addresses, sizes, synchronize };
      calls.push(call);
      return answer(call);
    });
  });
  afterEach(() => {
    flushUnmaps();
    spy.mockRestore();
    jest.useRealTimers();
  });

  /** Jobs answered only when the test says: finish[i]() ends the i-th job, every unmap of it done. */
  function heldAnswers(): Array<() => void> {
    const finish: Array<() => void> = [];
    answer = (call) => new Promise((resolve) => finish.push(() => resolve(call.addresses.map(() => null))));
    return finish;
  }

  it('go together at the end of the turn they came in (no timer), one job per device, synchronized first', async () => {
    const done: bigint[] = [];
    const a = unmapGathered(0, 0x1000n, 0x200000n).then(() => done.push(0x1000n));
    const b = unmapGathered(0, 0x3000n, 0x200000n).then(() => done.push(0x3000n));
    const c = unmapGathered(1, 0x5000n, 0x400000n);
    await Promise.resolve();
    expect(calls).toEqual([]);
    expect(jest.getTimerCount()).toBe(0);
    await turnEnd();
    await Promise.all([a, b, c]);
    expect(calls).toEqual([
      { device: 0, addresses: [0x1000n, 0x3000n], sizes: [0x200000n, 0x200000n], synchronize: true },
      { device: 1, addresses: [0x5000n], sizes: [0x400000n], synchronize: true },
    ]);
    expect(done).toEqual([0x1000n, 0x3000n]);
  });

  it('go at once when UNMAP_BATCH wait', async () => {
    const all = Array.from({ length: UNMAP_BATCH }, (_, index) => unmapGathered(0, BigInt(index) << 21n, 2n << 20n));
    expect(calls).toHaveLength(1);
    expect(calls[0].addresses).toHaveLength(UNMAP_BATCH);
    await Promise.all(all);
  });

  it('go at flushUnmaps(), which a caller that needs the memory gone calls', async () => {
    const one = unmapGathered(0, 0x1000n, 0x200000n);
    flushUnmaps();
    expect(calls).toHaveLength(1);
    await one;
    flushUnmaps();
    expect(calls).toHaveLength(1);
  });

  it('go at flushUnmapsIfIdle() only where no job of their device is running: one job at a time per device', async () => {
    const finish = heldAnswers();
    const first = unmapGathered(0, 0x1000n, 0x200000n);
    flushUnmapsIfIdle();
    expect(calls).toHaveLength(1);
    // The first job still runs (its synchronization waits for the GPU): the next unmap waits.
    const second = unmapGathered(0, 0x3000n, 0x200000n);
    flushUnmapsIfIdle();
    expect(calls).toHaveLength(1);
    // Another device has no job running: its unmap goes.
    const other = unmapGathered(1, 0x5000n, 0x200000n);
    flushUnmapsIfIdle();
    expect(calls.map((call) => call.device)).toEqual([0, 1]);
    finish[0]();
    await first;
    await new Promise((resolve) => setImmediate(resolve));
    flushUnmapsIfIdle();
    expect(calls.map((call) => call.addresses)).toEqual([[0x1000n], [0x5000n], [0x3000n]]);
    finish[1]();
    finish[2]();
    await Promise.all([second, other]);
  });

  it('a synchronous throw of cudaUnmapMany rejects its batch and leaves the device flushable', async () => {
    spy.mockImplementationOnce(() => {
      throw new Error('device 7 does not exist');
    });
    const first = unmapGathered(7, 0x1000n, 0x200000n);
    expect(() => flushUnmapsIfIdle()).not.toThrow();
    await expect(first).rejects.toThrow('device 7 does not exist');
    // The failed job's end (after its unmaps' rejections) lets the device run the next one.
    await new Promise((resolve) => setImmediate(resolve));
    const second = unmapGathered(7, 0x3000n, 0x200000n);
    flushUnmapsIfIdle();
    await expect(second).resolves.toBeUndefined();
    expect(calls.map((call) => call.addresses)).toEqual([[0x3000n]]);
  });

  it.each([
    ['one unmap', 1],
    ['a full batch', UNMAP_BATCH],
  ])("%s waiting while a job runs: neither the turn's end nor the batch starts a second job; the job ending hands it on", async (_what, count) => {
    const finish = heldAnswers();
    const first = unmapGathered(0, 0x1000n, 0x200000n);
    flushUnmapsIfIdle();
    const more = Array.from({ length: count }, (_, index) => unmapGathered(0, BigInt(index + 1) << 21n, 2n << 20n));
    for (let turn = 0; turn < 5; turn++) await turnEnd();
    expect(calls).toHaveLength(1);
    finish[0]();
    await first;
    // A full batch goes at the job's end; fewer at the end of that turn, armed there (after this test's own turn end).
    await turnEnd();
    await turnEnd();
    expect(calls.map((call) => call.addresses.length)).toEqual([1, count]);
    finish[1]();
    await Promise.all(more);
    expect(jest.getTimerCount()).toBe(0);
  });

  it('an answer shorter than its batch still settles every unmap (a missing outcome is an error)', async () => {
    answer = async () => [null];
    const a = unmapGathered(0, 0x1000n, 0x200000n);
    const b = unmapGathered(0, 0x3000n, 0x200000n);
    flushUnmaps();
    const outcome = await Promise.race([
      Promise.allSettled([a, b]).then((all) => all.map((o) => o.status)),
      new Promise((resolve) => setImmediate(() => setImmediate(() => resolve('hung')))),
    ]);
    expect(outcome).toEqual(['fulfilled', 'rejected']);
  });
  it('each gets its own outcome: a failed range rejects with the driver error, the others resolve', async () => {
    answer = async () => [null, 'CUDA_ERROR_INVALID_VALUE'];
    const good = unmapGathered(0, 0x1000n, 0x200000n);
    const bad = unmapGathered(0, 0x3000n, 0x200000n);
    flushUnmaps();
    await expect(good).resolves.toBeUndefined();
    await expect(bad).rejects.toMatchObject({ code: 'CUDA_ERROR_INVALID_VALUE', message: expect.stringContaining('0x3000') });
  });

  it('all reject when the job fails as a whole (the synchronization)', async () => {
    answer = async () => {
      throw Object.assign(new Error('CUDA_ERROR_LAUNCH_FAILED: cuCtxSynchronize'), { code: 'CUDA_ERROR_LAUNCH_FAILED' });
    };
    const both = [unmapGathered(0, 0x1000n, 0x200000n), unmapGathered(0, 0x3000n, 0x200000n)];
    flushUnmaps();
    for (const one of both) await expect(one).rejects.toMatchObject({ code: 'CUDA_ERROR_LAUNCH_FAILED' });
  });
});
