/**
 * Copies in flight against unmaps on the cuda backend: every path of the client library that
 * copies into memory it later unmaps, each closed or freed while its write is
 * still in flight (not awaited), over and over: LocalDeviceMemory (what
 * createFbmem takes), a store opened writable, and the NBEP 7 manager's pooled
 * and large allocations given back to the daemon. No error, and the bytes are
 * there for whoever reads the memory next. (The 4- and 32-process form of the
 * same race for imported memory is test/gpu/write-close-cuda.test.ts.)
 */
import { connect, VmmdClient, VmmdMemoryManager } from '../../client';
import { LocalDeviceMemory } from '../../client/shared-memory';
import { MiB, TestDaemon } from '../e2e/harness';
import { describeGpu } from './gpu';

const ROUNDS = 10;

describeGpu('copies and unmaps on the cuda backend: every path waits for copies in flight', () => {
  let daemon: TestDaemon;
  let client: VmmdClient;

  beforeAll(async () => {
    daemon = await TestDaemon.start([], 'cuda');
    client = await connect({ socketDir: daemon.dir });
  });

  afterAll(async () => {
    client.close();
    expect(await daemon.stop()).toBe(0);
  });

  it('LocalDeviceMemory: free() while a write is in flight waits for it', async () => {
    for (let round = 0; round < ROUNDS; round++) {
      const memory = await LocalDeviceMemory.allocate(0, 2n * MiB);
      const data = Buffer.alloc(1 << 20, round + 1);
      const writing = memory.write(0n, data);
      const checking = memory.read(0n, 16n);
      await Promise.all([writing, memory.free()]);
      expect((await checking).equals(data.subarray(0, 16))).toBe(true);
    }
    const after = await LocalDeviceMemory.allocate(0, 2n * MiB);
    await after.write(0n, Buffer.from('still usable'));
    expect((await after.read(0n, 12n)).toString()).toBe('still usable');
    await after.free();
  });

  it('an opened store: close() while a write is in flight; the bytes are in the store', async () => {
    for (let round = 0; round < ROUNDS; round++) {
      const allocation = await client.vmm.create({ size: 2n * MiB });
      const store = await client.stores.createStore({ allocationId: allocation.id });
      const opened = await client.stores.open({ id: store.id }, { writable: true });
      const data = Buffer.alloc(1 << 20, round + 1);
      const writing = opened.memory.write(0, data);
      await Promise.all([writing, opened.close()]);
      const again = await client.stores.open({ id: store.id });
      expect((await again.memory.read(0, data.length)).equals(data)).toBe(true);
      await again.close();
      await client.stores.detach({ id: store.id });
      await client.vmm.release({ allocationId: allocation.id });
    }
  });

  it('the NBEP 7 manager: chunks and large allocations given back while writes are in flight', async () => {
    const manager = new VmmdMemoryManager({ device: 0, backend: 'cuda', client });
    await manager.initialize();
    for (let round = 0; round < ROUNDS; round++) {
      const small = await manager.memalloc(64 << 10);
      const large = await manager.memalloc(8n * MiB);
      const writes = [manager.write(small.pointer, Buffer.alloc(64 << 10, round + 1)), manager.write(large.pointer, Buffer.alloc(4 << 20, round + 2))];
      await small.free();
      await large.free();
      await Promise.all([...writes, manager.clearCaches()]);
    }
    const last = await manager.memalloc(4096);
    await manager.write(last.pointer, Buffer.from('manager still usable'));
    expect((await manager.read(last.pointer, 20)).toString()).toBe('manager still usable');
    await manager.reset();
  });
});
