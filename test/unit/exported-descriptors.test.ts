/**
 * The cuda backend's kept export descriptors (server/backends/exported-descriptors.ts),
 * on real descriptors (memfds): a later export is a dup of the same memory,
 * the bound holds with the least recently used closed first, a handle taken
 * out for its release never hands out its old descriptor again (a handle
 * value the driver reuses gets its own memory's), and two exports at once
 * keep one descriptor, not two.
 */
import { addon } from '../../native';
import { ExportedDescriptors } from '../../server/backends/exported-descriptors';

const MiB = 1024n * 1024n;

/** A memfd standing for one exported allocation; its inode names the memory. */
function memory(): number {
  return addon.hostMemfdCreate('exported', 2n * MiB);
}
const inode = (fd: number) => addon.hostFdInfo(fd).inode;

/** Counts the cache's dups and closes, and closes for real. */
function counted() {
  const open = new Set<number>();
  const calls = {
    dup: (fd: number) => {
      const copy = addon.dup(fd);
      open.add(copy);
      return copy;
    },
    close: (fd: number) => {
      open.delete(fd);
      addon.close(fd);
    },
  };
  /** The caller closes a descriptor the cache handed out. */
  const done = (fd: number) => calls.close(fd);
  return { calls, open, done };
}

describe('the kept export descriptors', () => {
  const made: number[] = [];
  const make = () => {
    const fd = memory();
    made.push(fd);
    return fd;
  };
  afterEach(() => {
    for (const fd of made.splice(0)) addon.close(fd);
  });

  it('hands out a new descriptor of the same memory for a handle exported before', () => {
    const { calls, open, done } = counted();
    const cache = new ExportedDescriptors(4, calls);
    const a = make();
    expect(cache.duplicate(1n)).toBeUndefined();
    cache.keep(1n, a);
    const copy = cache.duplicate(1n)!;
    expect(copy).not.toBe(a);
    expect(inode(copy)).toBe(inode(a));
    done(copy);
    cache.clear();
    expect(open.size).toBe(0);
  });

  it('keeps at most `limit` descriptors, closing the least recently used first', () => {
    const { calls, open, done } = counted();
    const cache = new ExportedDescriptors(2, calls);
    const [a, b, c] = [make(), make(), make()];
    cache.keep(1n, a);
    cache.keep(2n, b);
    // 1 used again: 2 is now the least recently used.
    done(cache.duplicate(1n)!);
    cache.keep(3n, c);
    expect(cache.size).toBe(2);
    expect(open.size).toBe(2);
    expect(cache.duplicate(2n)).toBeUndefined();
    const one = cache.duplicate(1n)!;
    const three = cache.duplicate(3n)!;
    expect([inode(one), inode(three)]).toEqual([inode(a), inode(c)]);
    for (const fd of [one, three]) done(fd);
    cache.clear();
    expect(open.size).toBe(0);
  });

  it('never hands out the old memory for a handle value taken out for its release and reused', () => {
    const { calls, open, done } = counted();
    const cache = new ExportedDescriptors(4, calls);
    const old = make();
    cache.keep(7n, old);
    // The release takes it out first and closes it once the driver freed the handle.
    const taken = cache.remove(7n)!;
    calls.close(taken);
    // The driver hands out handle 7 again, for other memory: its first export asks the driver.
    expect(cache.duplicate(7n)).toBeUndefined();
    const fresh = make();
    cache.keep(7n, fresh);
    const copy = cache.duplicate(7n)!;
    expect(inode(copy)).toBe(inode(fresh));
    expect(inode(copy)).not.toBe(inode(old));
    done(copy);
    cache.clear();
    expect(open.size).toBe(0);
  });

  it('puts a descriptor back after a release that failed, and keeps one when two exports race', () => {
    const { calls, open, done } = counted();
    const cache = new ExportedDescriptors(4, calls);
    const a = make();
    cache.keep(1n, a);
    const taken = cache.remove(1n)!;
    cache.restore(1n, taken);
    const copy = cache.duplicate(1n)!;
    expect(inode(copy)).toBe(inode(a));
    done(copy);
    // A second export of the same memory finished after the first: nothing more is kept.
    cache.keep(1n, a);
    expect(cache.size).toBe(1);
    expect(open.size).toBe(1);
    cache.clear();
    expect(open.size).toBe(0);
  });

  it('keeps nothing with a bound of 0, and nothing when the dup fails', () => {
    const none = new ExportedDescriptors(0);
    none.keep(1n, make());
    expect(none.size).toBe(0);
    const failing = new ExportedDescriptors(4, {
      dup: () => {
        throw Object.assign(new Error('dup: EMFILE'), { code: 'EMFILE' });
      },
      close: () => undefined,
    });
    failing.keep(1n, make());
    expect(failing.size).toBe(0);
    expect(failing.duplicate(1n)).toBeUndefined();
  });
});

describe('the close of a descriptor taken out for a release', () => {
  it('resolves only once the descriptor is closed off the event loop (the memory lives while it is open)', async () => {
    let finish!: () => void;
    const closing: number[] = [];
    const cache = new ExportedDescriptors(4, {
      dup: (fd) => fd + 100,
      close: () => undefined,
      closeAwaited: (fd) =>
        new Promise<void>((resolve) => {
          closing.push(fd);
          finish = resolve;
        }),
    });
    cache.keep(1n, 7);
    const taken = cache.remove(1n)!;
    let closed = false;
    const done = cache.close(taken).then(() => (closed = true));
    await new Promise((resolve) => setImmediate(resolve));
    expect(closing).toEqual([107]);
    expect(closed).toBe(false);
    finish();
    await done;
    expect(closed).toBe(true);
  });

  it('warns, never fails, when that close fails', async () => {
    const warned = jest.spyOn(process, 'emitWarning').mockImplementation(() => undefined);
    try {
      const cache = new ExportedDescriptors(4, { dup: (fd) => fd + 100, close: () => undefined, closeAwaited: () => Promise.reject(new Error('EIO')) });
      cache.keep(2n, 8);
      await expect(cache.close(cache.remove(2n)!)).resolves.toBeUndefined();
      expect(warned).toHaveBeenCalledWith(expect.stringContaining('closing kept descriptor 108 failed: EIO'));
    } finally {
      warned.mockRestore();
    }
  });
});
