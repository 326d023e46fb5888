import { SerialQueue } from '../../server/serial-queue';

describe('SerialQueue', () => {
  it('runs tasks one at a time in order, across awaits', async () => {
    const queue = new SerialQueue();
    const events: string[] = [];
    const task = (name: string, ms: number) => async () => {
      events.push(`${name} start`);
      await new Promise((resolve) => setTimeout(resolve, ms));
      events.push(`${name} end`);
      return name;
    };
    const results = await Promise.all([queue.run(task('a', 20)), queue.run(task('b', 1)), queue.run(task('c', 5))]);
    expect(results).toEqual(['a', 'b', 'c']);
    expect(events).toEqual(['a start', 'a end', 'b start', 'b end', 'c start', 'c end']);
    expect(queue.size).toBe(0);
  });
  it('goes on after a task fails, synchronously or not', async () => {
    const queue = new SerialQueue();
    const failing = queue.run(() => {
      throw new Error('sync');
    });
    const rejecting = queue.run(async () => Promise.reject(new Error('async')));
    const after = queue.run(() => 'after');
    await expect(failing).rejects.toThrow('sync');
    await expect(rejecting).rejects.toThrow('async');
    await expect(after).resolves.toBe('after');
  });
  it('starts a task on an idle queue at once', () => {
    const queue = new SerialQueue();
    let started = false;
    void queue.run(() => {
      started = true;
    });
    expect(started).toBe(true);
  });
});
