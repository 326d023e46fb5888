/**
 * Runs tasks one at a time, in order. Every operation that touches a
 * reservation's address space (map, unmap, set access, free, reads and writes)
 * runs in that reservation's queue, so no two can interleave around an await:
 * a slow unmap can never race a map into the same range or a copy from it.
 */
export class SerialQueue {
  private tail: Promise<unknown> = Promise.resolve();
  // Invariant: running counts tasks started and not settled, at most 1.
  private running = 0;
  private waiting = 0;

  /** Tasks started or waiting. */
  get size(): number {
    return this.running + this.waiting;
  }

  run<T>(task: () => T | Promise<T>): Promise<T> {
    if (this.size === 0) {
      // Fast path: nothing queued, start now without a trip through the microtask queue.
      return this.track(this.start(task));
    }
    this.waiting++;
    const result = this.tail.then(() => {
      this.waiting--;
      return this.start(task);
    });
    return this.track(result);
  }

  private start<T>(task: () => T | Promise<T>): Promise<T> {
    this.running++;
    try {
      return Promise.resolve(task()).finally(() => {
        this.running--;
      });
    } catch (error) {
      this.running--;
      return Promise.reject(error);
    }
  }

  private track<T>(result: Promise<T>): Promise<T> {
    this.tail = result.catch(() => undefined);
    return result;
  }
}
