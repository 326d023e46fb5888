/**
 * A release answered before its free (the session socket's) must not make
 * the next create fail for want of device memory that is on its way out:
 * a create refused OUT_OF_MEMORY while frees are in flight waits for them
 * and asks once more; with nothing being freed it is refused at once.
 */
import type { BackendHandle } from '../../server/backends/backend';
import { Registry } from '../../server/registry';
import { FakeBackend, GRANULARITY } from './fake-backend';

const SESSION = 7n;
const ARGS = { size: GRANULARITY, location: { type: 'DEVICE' as const, id: 0 }, handleType: 'POSIX_FD' as const };

/** A fake backend of two granules whose frees wait until the test lets them go. */
class SlowFreeBackend extends FakeBackend {
  readonly waiting: Array<() => void> = [];

  constructor() {
    super({ capacity: 2n * GRANULARITY });
  }

  override async release(handle: BackendHandle): Promise<void> {
    await new Promise<void>((go) => this.waiting.push(go));
    await super.release(handle);
  }
}

describe('a create out of device memory while frees are in flight', () => {
  it('waits for the frees and succeeds', async () => {
    const backend = new SlowFreeBackend();
    const registry = new Registry(backend);
    const a = await registry.create(SESSION, ARGS);
    await registry.create(SESSION, ARGS);
    const { result } = await registry.releaseAnswering(SESSION, a.id);
    expect(result.freed).toBe(true);
    let made = false;
    const c = registry.create(SESSION, ARGS).then((record) => {
      made = true;
      return record;
    });
    for (let i = 0; i < 10; i++) await new Promise((resolve) => setImmediate(resolve));
    expect(made).toBe(false);
    backend.waiting.shift()!();
    await expect(c).resolves.toMatchObject({ size: GRANULARITY });
    expect(backend.memoryInfo().freeBytes).toBe(0n);
  });

  it('is refused at once when nothing is being freed', async () => {
    const registry = new Registry(new SlowFreeBackend());
    await registry.create(SESSION, ARGS);
    await registry.create(SESSION, ARGS);
    await expect(registry.create(SESSION, ARGS)).rejects.toMatchObject({ code: 'OUT_OF_MEMORY' });
  });
});
