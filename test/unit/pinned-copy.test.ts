/**
 * The bulk copy pipeline of vmmctl store load and dump on cuda,
 * with plain buffers standing in for page-locked ones and memory whose
 * copies take their time: every byte lands at its offset, several chunks are
 * in flight at once, a dump writes in order, and no buffer is freed while a
 * file read or a copy still uses it, also after a failure.
 */
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { randomBytes } from 'node:crypto';
import { ImportedMemory } from '../../client/local-memory';
import { copyFileToMemory, copyMemoryToWriter, CopyBuffers } from '../../client/pinned-copy';

const KiB = 1024;

/** Memory in a Buffer, whose copies finish a few turns later, counting how many run at once. */
class SlowMemory extends ImportedMemory {
  readonly content: Buffer;
  running = 0;
  mostAtOnce = 0;
  failAt: number | undefined;

  constructor(size: number) {
    super(1n, 0x1000n, BigInt(size), 0, false);
    this.content = Buffer.alloc(size);
  }

  private async slowly<T>(body: () => T): Promise<T> {
    this.running++;
    this.mostAtOnce = Math.max(this.mostAtOnce, this.running);
    try {
      for (let i = 0; i < 3; i++) await new Promise((resolve) => setImmediate(resolve));
      return body();
    } finally {
      this.running--;
    }
  }

  protected copyIn(offset: bigint, data: Buffer): Promise<void> {
    if (this.failAt !== undefined && Number(offset) >= this.failAt) return Promise.reject(new Error('CUDA_ERROR_ILLEGAL_ADDRESS: cuMemcpyHtoDAsync'));
    const copy = Buffer.from(data); // what the DMA takes: the bytes at the time of the call
    return this.slowly(() => {
      copy.copy(this.content, Number(offset));
    });
  }

  protected copyOut(offset: bigint, length: bigint, into?: Buffer): Promise<Buffer> {
    return this.slowly(() => {
      const out = into ?? Buffer.alloc(Number(length));
      this.content.copy(out, 0, Number(offset), Number(offset + length));
      return out;
    });
  }

  protected async unmapHere(): Promise<void> {}
}

/** Buffers that record how many copies of `memory` still ran when they were freed, and refuse a second free. */
function buffers(count: number, bytes: number, memory: SlowMemory): CopyBuffers & { freed: number; runningAtFree: number } {
  const made = {
    buffers: Array.from({ length: count }, () => Buffer.alloc(bytes)),
    freed: 0,
    runningAtFree: -1,
    free() {
      made.freed++;
      made.runningAtFree = memory.running;
      if (made.freed > 1) throw new Error('freed twice');
    },
  };
  return made;
}

describe('bulk copies through page-locked buffers', () => {
  let dir: string;
  beforeAll(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-pinned-'));
  });
  afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

  it('loads a file whole, every chunk at its offset, several in flight at once', async () => {
    const size = 1000 * KiB + 123; // not a multiple of the buffer size
    const data = randomBytes(size);
    const file = path.join(dir, 'load');
    fs.writeFileSync(file, data);
    const memory = new SlowMemory(size + 4096);
    const pinned = buffers(4, 64 * KiB, memory);
    const seen: number[] = [];
    const fd = fs.openSync(file, 'r');
    try {
      await copyFileToMemory(memory, fd, size, file, (done) => seen.push(done), pinned);
    } finally {
      fs.closeSync(fd);
    }
    expect(memory.content.subarray(0, size).equals(data)).toBe(true);
    expect(memory.content.subarray(size).every((byte) => byte === 0)).toBe(true);
    expect(memory.mostAtOnce).toBeGreaterThan(1);
    expect(seen[seen.length - 1]).toBe(size);
    expect(pinned.freed).toBe(1);
  });

  it('fails with FILE_CHANGED when the file is shorter than said, and frees the buffers once nothing uses them', async () => {
    const file = path.join(dir, 'short');
    fs.writeFileSync(file, randomBytes(100 * KiB));
    const memory = new SlowMemory(400 * KiB);
    const pinned = buffers(4, 16 * KiB, memory);
    const fd = fs.openSync(file, 'r');
    try {
      await expect(copyFileToMemory(memory, fd, 400 * KiB, file, () => undefined, pinned)).rejects.toMatchObject({ code: 'FILE_CHANGED' });
    } finally {
      fs.closeSync(fd);
    }
    expect(pinned.runningAtFree).toBe(0);
    expect(pinned.freed).toBe(1);
  });

  it("passes on a copy's failure, after the other buffers' copies finished", async () => {
    const size = 512 * KiB;
    const file = path.join(dir, 'fail');
    fs.writeFileSync(file, randomBytes(size));
    const memory = new SlowMemory(size);
    memory.failAt = 256 * KiB;
    const pinned = buffers(4, 32 * KiB, memory);
    const fd = fs.openSync(file, 'r');
    try {
      await expect(copyFileToMemory(memory, fd, size, file, () => undefined, pinned)).rejects.toThrow('CUDA_ERROR_ILLEGAL_ADDRESS');
    } finally {
      fs.closeSync(fd);
    }
    expect(pinned.runningAtFree).toBe(0);
    expect(pinned.freed).toBe(1);
  });

  it('dumps memory in order, the copies of later chunks running ahead of the writes', async () => {
    const size = 700 * KiB + 5;
    const memory = new SlowMemory(size);
    randomBytes(size).copy(memory.content);
    const pinned = buffers(3, 64 * KiB, memory);
    const parts: Buffer[] = [];
    let writesAtOnce = 0;
    let mostWritesAtOnce = 0;
    await copyMemoryToWriter(
      memory,
      size,
      async (bytes) => {
        writesAtOnce++;
        mostWritesAtOnce = Math.max(mostWritesAtOnce, writesAtOnce);
        await new Promise((resolve) => setImmediate(resolve));
        parts.push(Buffer.from(bytes));
        writesAtOnce--;
      },
      () => undefined,
      pinned,
    );
    expect(Buffer.concat(parts).equals(memory.content)).toBe(true);
    expect(mostWritesAtOnce).toBe(1);
    expect(memory.mostAtOnce).toBeGreaterThan(1);
    expect(pinned.freed).toBe(1);
  });

  it("passes on a writer's failure and frees the buffers only once no copy runs", async () => {
    const memory = new SlowMemory(512 * KiB);
    const pinned = buffers(4, 32 * KiB, memory);
    let calls = 0;
    const failing = async () => {
      if (++calls === 2) throw Object.assign(new Error('EPIPE: broken pipe, write'), { code: 'EPIPE' });
    };
    await expect(copyMemoryToWriter(memory, 512 * KiB, failing, () => undefined, pinned)).rejects.toMatchObject({ code: 'EPIPE' });
    expect(pinned.runningAtFree).toBe(0);
    expect(pinned.freed).toBe(1);
  });
});
