/**
 * The client's memory model for mapped memory: close() waits for
 * every copy in flight before it unmaps, copies after close() are refused,
 * and a failed copy neither blocks nor skips the unmap.
 */
import { ImportedMemory } from '../../client/local-memory';
import { InFlight } from '../../client/in-flight';

/** Mapped memory whose copies finish when the test says so, recording the order of events. */
class SlowMemory extends ImportedMemory {
  readonly events: string[] = [];
  readonly finish: Array<(error?: Error) => void> = [];

  constructor() {
    super(1n, 0x1000n, 4096n, 0, false);
  }

  protected copyIn(offset: bigint, data: Buffer): Promise<void> {
    this.events.push(`copy ${offset}+${data.length} started`);
    return new Promise<void>((resolve, reject) => {
      this.finish.push((error) => {
        this.events.push(`copy ${offset}+${data.length} ${error ? 'failed' : 'landed'}`);
        if (error) reject(error);
        else resolve();
      });
    });
  }

  protected copyOut(offset: bigint, length: bigint): Promise<Buffer> {
    return this.copyIn(offset, Buffer.alloc(Number(length))).then(() => Buffer.alloc(Number(length)));
  }

  protected async unmapHere(): Promise<void> {
    this.events.push('unmapped');
  }
}

const turn = () => new Promise((resolve) => setImmediate(resolve));

describe('ImportedMemory.close() and copies in flight', () => {
  it('unmaps only after a write in flight has landed', async () => {
    const memory = new SlowMemory();
    const write = memory.write(0, Buffer.alloc(16));
    const closed = memory.close();
    await turn();
    expect(memory.events).toEqual(['copy 0+16 started']);
    memory.finish[0]();
    await write;
    await closed;
    expect(memory.events).toEqual(['copy 0+16 started', 'copy 0+16 landed', 'unmapped']);
  });

  it('waits for every read and write in flight, in any order of completion', async () => {
    const memory = new SlowMemory();
    const copies = [memory.write(0, Buffer.alloc(8)), memory.read(64, 8), memory.write(128, Buffer.alloc(8))];
    const closed = memory.close();
    memory.finish[2]();
    memory.finish[0]();
    await turn();
    expect(memory.events).not.toContain('unmapped');
    memory.finish[1]();
    await Promise.all(copies);
    await closed;
    expect(memory.events[memory.events.length - 1]).toBe('unmapped');
  });

  it('still unmaps after a copy in flight fails, and the copy keeps its own error', async () => {
    const memory = new SlowMemory();
    const write = memory.write(0, Buffer.alloc(16));
    const closed = memory.close();
    memory.finish[0](new Error('CUDA_ERROR_ILLEGAL_ADDRESS: cuMemcpyHtoD(16)'));
    await expect(write).rejects.toThrow('CUDA_ERROR_ILLEGAL_ADDRESS');
    await closed;
    expect(memory.events).toEqual(['copy 0+16 started', 'copy 0+16 failed', 'unmapped']);
  });

  it('refuses copies started after close() with CLOSED', async () => {
    const memory = new SlowMemory();
    const write = memory.write(0, Buffer.alloc(16));
    const closed = memory.close();
    await expect(memory.write(0, Buffer.alloc(4))).rejects.toMatchObject({ code: 'CLOSED' });
    await expect(memory.read(0, 4)).rejects.toMatchObject({ code: 'CLOSED' });
    memory.finish[0]();
    await Promise.all([write, closed]);
    expect(memory.events.filter((event) => event.includes('started'))).toHaveLength(1);
  });

  it('returns the same promise to every close() and unmaps once', async () => {
    const memory = new SlowMemory();
    const write = memory.write(0, Buffer.alloc(16));
    const first = memory.close();
    const second = memory.close();
    expect(second).toBe(first);
    memory.finish[0]();
    await Promise.all([write, first, second, memory.close()]);
    expect(memory.events.filter((event) => event === 'unmapped')).toHaveLength(1);
  });

  it('unmaps in the same turn when nothing is in flight', () => {
    const memory = new SlowMemory();
    void memory.close();
    expect(memory.events).toEqual(['unmapped']);
    expect(memory.isClosed).toBe(true);
  });
});

describe('InFlight', () => {
  it('drain waits for copies tracked while it waits', async () => {
    const copies = new InFlight();
    let finishFirst!: () => void;
    let finishSecond!: () => void;
    copies.track(new Promise<void>((resolve) => (finishFirst = resolve)));
    let drained = false;
    const drain = copies.drain().then(() => (drained = true));
    copies.track(new Promise<void>((resolve) => (finishSecond = resolve)));
    finishFirst();
    await turn();
    expect(drained).toBe(false);
    finishSecond();
    await drain;
    expect(copies.idle).toBe(true);
  });

  it('starts an overlapping copy only after the write before it settled (a read started after a write sees it)', async () => {
    const copies = new InFlight();
    const started: string[] = [];
    let finishWrite!: () => void;
    const write = copies.ordered('write', 0n, 1024n, () => {
      started.push('write');
      return new Promise<void>((resolve) => (finishWrite = resolve));
    });
    const overlapping = copies.ordered('read', 512n, 16n, async () => void started.push('overlapping read'));
    const elsewhere = copies.ordered('read', 1024n, 16n, async () => void started.push('read elsewhere'));
    const secondWrite = copies.ordered('write', 2048n, 16n, async () => void started.push('write elsewhere'));
    await turn();
    expect(started).toEqual(['write', 'read elsewhere', 'write elsewhere']);
    finishWrite();
    await Promise.all([write, overlapping, elsewhere, secondWrite]);
    expect(started).toEqual(['write', 'read elsewhere', 'write elsewhere', 'overlapping read']);
    expect(copies.idle).toBe(true);
  });

  it('lets overlapping reads run together, and a write wait for the reads before it; a failed copy does not block the next', async () => {
    const copies = new InFlight();
    const started: string[] = [];
    let finishRead!: (error: Error) => void;
    const read = copies.ordered('read', 0n, 64n, () => {
      started.push('read 1');
      return new Promise<void>((_resolve, reject) => (finishRead = reject));
    });
    const read2 = copies.ordered('read', 0n, 64n, async () => void started.push('read 2'));
    const write = copies.ordered('write', 32n, 64n, async () => void started.push('write'));
    await turn();
    expect(started).toEqual(['read 1', 'read 2']);
    finishRead(new Error('copy failed'));
    await expect(read).rejects.toThrow('copy failed');
    await Promise.all([read2, write]);
    expect(started).toEqual(['read 1', 'read 2', 'write']);
  });
});
