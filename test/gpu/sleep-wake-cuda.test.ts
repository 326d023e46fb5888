/**
 * Sleep and wake on the cuda backend: device pointers and contents kept
 * across offload (the bytes in the daemon's pinned host memory meanwhile),
 * discard gives the same pointers back, a store's mapping comes back with no
 * copy, and two clients that each need 60% of the device alternate through
 * the daemon's referee with no out-of-memory and equal checksums, waking at
 * once too (one waits for the other's sleep).
 */
import { createHash } from 'node:crypto';
import { connect, ImportedMemory, VmmdClient } from '../../client';
import { stopWhenClean, TestDaemon } from '../e2e/harness';
import { describeGpu } from './gpu';

const MiB = 1n << 20n;
let daemon: TestDaemon;
const clients: VmmdClient[] = [];

async function client(): Promise<VmmdClient> {
  const made = await connect({ socketDir: daemon.dir });
  clients.push(made);
  return made;
}

/** A pattern of `size` bytes that differs per seed (every 4 KiB and the last byte). */
function pattern(size: number, seed: number): Buffer {
  const bytes = Buffer.alloc(size);
  for (let i = 0; i < size; i += 4096) bytes[i] = (i / 4096 + seed) & 0xff;
  bytes[size - 1] = seed & 0xff;
  return bytes;
}

const digest = async (memory: ImportedMemory) =>
  createHash('sha256')
    .update(await memory.read(0, memory.size))
    .digest('hex');

async function freeAll(owner: VmmdClient, memory: ImportedMemory[]): Promise<void> {
  for (const mapped of memory) {
    await mapped.close();
    await owner.vmm.release({ allocationId: mapped.allocationId });
  }
}

describeGpu('sleep and wake (cuda)', () => {
  beforeAll(async () => {
    daemon = await TestDaemon.start([], 'cuda');
  }, 120_000);

  afterAll(async () => {
    await stopWhenClean(daemon, clients);
  });

  test("offload keeps device pointers and contents; the bytes sleep in the daemon's host memory", async () => {
    const owner = await client();
    const sizes = [2n * MiB, 64n * MiB, 130n * MiB];
    const memory: ImportedMemory[] = [];
    for (const [index, size] of sizes.entries()) {
      const mapped = await owner.vmm.allocate({ size });
      await mapped.write(0, pattern(Number(size), index + 1));
      memory.push(mapped);
      owner.tags.group('weights').add(mapped);
    }
    const pointers = memory.map((mapped) => mapped.address);
    const digests = await Promise.all(memory.map(digest));
    const report = await owner.sleep('weights', { mode: 'offload' });
    expect(report.offloadedBytes).toBe(196n * MiB);
    const objects = await owner.admin.listObjects({});
    expect(JSON.stringify(objects)).toContain('HOST_NUMA');
    await owner.wake('weights', { deadlineMs: 30_000 });
    expect(memory.map((mapped) => mapped.address)).toEqual(pointers);
    expect(await Promise.all(memory.map(digest))).toEqual(digests);
    await freeAll(owner, memory);
  });

  test('a member of 8 GiB sleeps with offload and wakes: copied by address, bytes past 4 GiB intact', async () => {
    const owner = await client();
    const size = 8n << 30n;
    const mapped = await owner.vmm.allocate({ size });
    const marks = [0n, (4n << 30n) + 12345n, size - 4096n];
    for (const [index, offset] of marks.entries()) await mapped.write(offset, pattern(4096, 70 + index));
    owner.tags.group('large').add(mapped);
    const pointer = mapped.address;
    expect((await owner.sleep('large', { mode: 'offload', deadlineMs: 120_000 })).offloadedBytes).toBe(size);
    await owner.wake('large', { deadlineMs: 120_000 });
    expect(mapped.address).toBe(pointer);
    for (const [index, offset] of marks.entries()) expect((await mapped.read(offset, 4096)).equals(pattern(4096, 70 + index))).toBe(true);
    await freeAll(owner, [mapped]);
  }, 300_000);

  test('prepareOffload: the host copy is made ahead while awake and the first sleep copies into it', async () => {
    const owner = await client();
    const group = owner.tags.group('prepared', { prepareOffload: true });
    const mapped = await owner.vmm.allocate({ size: 256n * MiB });
    await mapped.write(0, pattern(Number(256n * MiB), 5));
    group.add(mapped);
    const deadline = Date.now() + 60_000;
    while (group.prepared.preparedBytes < 256n * MiB && Date.now() < deadline) await new Promise((resolve) => setTimeout(resolve, 20));
    expect(group.prepared).toEqual({ preparedBytes: 256n * MiB, pending: 0 });
    expect(JSON.stringify(await owner.admin.listObjects({}))).toContain('HOST_NUMA');
    const before = await digest(mapped);
    await owner.sleep('prepared');
    await owner.wake('prepared', { deadlineMs: 30_000 });
    expect(await digest(mapped)).toBe(before);
    expect(group.prepared.preparedBytes).toBe(256n * MiB);
    await group.forget(mapped);
    await freeAll(owner, [mapped]);
  }, 120_000);

  test('discard gives the same pointers back, writable', async () => {
    const owner = await client();
    const mapped = await owner.vmm.allocate({ size: 64n * MiB });
    owner.tags.group('kv').add(mapped);
    const pointer = mapped.address;
    expect((await owner.sleep('kv', { mode: 'discard' })).offloadedBytes).toBe(0n);
    await owner.wake('kv');
    expect(mapped.address).toBe(pointer);
    await mapped.write(0, pattern(4096, 9));
    expect((await mapped.read(0, 4096)).equals(pattern(4096, 9))).toBe(true);
    await freeAll(owner, [mapped]);
  });

  test("a read-only store's mapping comes back at its pointer with the same bytes", async () => {
    const owner = await client();
    const source = await owner.vmm.allocate({ size: 64n * MiB });
    await source.write(0, pattern(Number(64n * MiB), 42));
    const store = await owner.stores.createStore({ allocationId: source.allocationId, readOnly: true, name: 'gpu-model' });
    const opened = await owner.stores.open('gpu-model');
    owner.tags.group('model').addStore(opened);
    const pointer = opened.memory.address;
    const before = await digest(opened.memory);
    expect(await owner.sleep('model')).toEqual({ offloadedBytes: 0n, releasedBytes: 0n });
    await owner.wake('model');
    expect(opened.memory.address).toBe(pointer);
    expect(await digest(opened.memory)).toBe(before);
    await opened.close();
    await owner.stores.detach({ id: store.id });
    await freeAll(owner, [source]);
  });

  test('two clients needing 60% of the device each alternate 10 times with no out-of-memory, and wake at once', async () => {
    const probe = await client();
    const total = BigInt((await probe.devices.getMemoryInfo({ device: 0 })).totalBytes);
    const granularity = BigInt((await probe.devices.listDevices()).devices[0].granularityMinimum);
    const share = ((total * 6n) / 10n / granularity) * granularity;
    const weights = 256n * MiB;
    const engines = await Promise.all([client(), client()]);
    const held = await Promise.all(
      engines.map(async (engine, index) => {
        // Each engine: weights offloaded, the rest (a KV cache) discarded.
        const w = (await engine.vmm.allocateAll({ sizes: [weights], deadlineMs: 60_000 })).memory[0];
        await w.write(0, pattern(Number(weights), 10 + index));
        engine.tags.group('weights').add(w);
        engine.tags.group('cache').add((await engine.vmm.allocateAll({ sizes: [share - weights], deadlineMs: 60_000 })).memory[0]);
        await engine.sleep('weights', { mode: 'offload' });
        await engine.sleep('cache', { mode: 'discard' });
        return w;
      }),
    ).catch((error) => {
      throw new Error(`setting up the two engines failed: ${error.message}`);
    });
    const expected = await Promise.all(
      engines.map((_, index) =>
        createHash('sha256')
          .update(pattern(Number(weights), 10 + index))
          .digest('hex'),
      ),
    );
    for (let cycle = 0; cycle < 10; cycle++) {
      for (const [index, engine] of engines.entries()) {
        await engine.wake('weights', { deadlineMs: 60_000 });
        await engine.wake('cache', { deadlineMs: 60_000 });
        expect(await digest(held[index])).toBe(expected[index]);
        await engine.sleep('weights', { mode: 'offload' });
        await engine.sleep('cache', { mode: 'discard' });
      }
    }
    // Both at once: one is served, the other waits for its sleep.
    const wakeBoth = (engine: VmmdClient) => engine.wake('weights', { deadlineMs: 60_000 }).then(() => engine.wake('cache', { deadlineMs: 60_000 }));
    const first = wakeBoth(engines[0]);
    const second = wakeBoth(engines[1]);
    const winner = await Promise.race([first.then(() => 0), second.then(() => 1)]);
    await engines[winner].sleep('weights', { mode: 'offload' });
    await engines[winner].sleep('cache', { mode: 'discard' });
    await Promise.all([first, second]);
    const other = 1 - winner;
    expect(await digest(held[other])).toBe(expected[other]);
    await engines[other].sleep('weights', { mode: 'discard' });
    for (const engine of engines) engine.close();
  }, 600_000);
});
