/**
 * Sleep and wake of tagged memory on the host backend: a sleeping group or
 * pool keeps every address, gives its memory back to the daemon (offloaded
 * into the daemon's host memory, charged to the session, or discarded), and
 * wakes at the same addresses with the same contents (offload); a store's
 * mapping comes back without a copy; a wake that cannot get its memory
 * leaves the memory asleep and intact; a wake waits for another process's
 * sleep; a process killed while asleep leaves nothing in the daemon. With
 * prepareOffload the host copies are made ahead, charged while awake, used by
 * the first sleep, waited for by a sleep that meets them still being made,
 * and made by the sleep itself when preparing them was refused.
 */
import { connect, ImportedMemory, TaggedMemory, VmmdClient, VmmdMemoryManager } from '../../client';
import { eventually, freePort, MiB, Peer, scrapeMetrics, sleep, stopWhenClean, TestDaemon } from './harness';

let daemon: TestDaemon;
let metricsPort: number;
const clients: VmmdClient[] = [];
let nextTag = 1;

beforeAll(async () => {
  metricsPort = await freePort();
  daemon = await TestDaemon.start(['--host-capacity', '64MiB', '--metrics-port', String(metricsPort)]);
}, 90_000);

afterAll(async () => {
  await stopWhenClean(daemon, clients);
});

async function client(): Promise<VmmdClient> {
  const made = await connect({ socketDir: daemon.dir });
  clients.push(made);
  return made;
}

const stats = () => daemon.stats();
const allocations = async () => Number((await stats()).allocations);

/** A pattern of `size` bytes that differs per seed. */
function pattern(size: bigint, seed: number): Uint8Array {
  const bytes = new Uint8Array(Number(size));
  for (let i = 0; i < bytes.length; i += 4096) bytes[i] = (i / 4096 + seed) & 0xff;
  bytes[bytes.length - 1] = seed;
  return bytes;
}

async function filled(owner: VmmdClient, size: bigint, seed: number): Promise<ImportedMemory> {
  const memory = await owner.vmm.allocate({ size });
  new Uint8Array(memory.buffer).set(pattern(size, seed));
  return memory;
}

async function freeAll(owner: VmmdClient, memory: ImportedMemory[]): Promise<void> {
  for (const mapped of memory) {
    await mapped.close();
    await owner.vmm.release({ allocationId: mapped.allocationId });
  }
}

describe('sleep and wake of tagged memory', () => {
  test('offload: the same addresses and contents after wake; while asleep the daemon holds the bytes in host memory, charged to the session', async () => {
    const owner = await client();
    const tag = `weights-${nextTag++}`;
    const memory = [await filled(owner, 2n * MiB, 1), await filled(owner, 4n * MiB, 2), await filled(owner, 2n * MiB, 3)];
    for (const mapped of memory) owner.tags.group(tag).add(mapped);
    const addresses = memory.map((mapped) => mapped.address);
    const before = memory.map((mapped) => mapped.allocationId);
    const report = await owner.sleep(tag, { mode: 'offload' });
    expect(report).toEqual({ offloadedBytes: 8n * MiB, releasedBytes: 8n * MiB });
    expect(owner.tags.isAsleep(tag)).toBe(true);
    await expect(memory[0].read(0, 4)).rejects.toMatchObject({ code: 'ASLEEP' });
    // The device memory went back; its bytes are host memory of the daemon's, the session's.
    expect(await allocations()).toBe(3);
    expect(await scrapeMetrics(metricsPort)).toMatch(
      new RegExp(`^vmmd_uid_location_bytes\\{uid="${process.getuid!()}",location="HOST_NUMA:0"\\} ${8n * MiB}$`, 'm'),
    );
    const woken = await owner.wake(tag, { deadlineMs: 5000 });
    expect(woken.restoredBytes).toBe(8n * MiB);
    expect(memory.map((mapped) => mapped.address)).toEqual(addresses);
    expect(memory.map((mapped) => mapped.allocationId)).not.toEqual(before);
    for (const [index, mapped] of memory.entries()) expect(Buffer.from(mapped.buffer).equals(Buffer.from(pattern(mapped.size, index + 1)))).toBe(true);
    // The host copies went back: the daemon holds the three device allocations again.
    expect(await allocations()).toBe(3);
    expect(await scrapeMetrics(metricsPort)).not.toMatch(/location="HOST_NUMA:0"/);
    await freeAll(owner, memory);
  });

  test('discard: nothing copied, nothing held while asleep, the same addresses writable after wake', async () => {
    const owner = await client();
    const tag = `cache-${nextTag++}`;
    const memory = [await filled(owner, 4n * MiB, 9), await filled(owner, 2n * MiB, 8)];
    for (const mapped of memory) owner.tags.group(tag).add(mapped);
    const addresses = memory.map((mapped) => mapped.address);
    expect(await owner.sleep(tag, { mode: 'discard' })).toEqual({ offloadedBytes: 0n, releasedBytes: 6n * MiB });
    expect(await allocations()).toBe(0);
    await owner.wake(tag);
    expect(memory.map((mapped) => mapped.address)).toEqual(addresses);
    new Uint8Array(memory[0].buffer).fill(5);
    expect(new Uint8Array(memory[0].buffer)[4n * MiB > 0n ? 4096 : 0]).toBe(5);
    expect(await allocations()).toBe(2);
    await freeAll(owner, memory);
  });

  test("a read-only store's mapping is unmapped and mapped again at its address, nothing copied", async () => {
    const owner = await client();
    const tag = `model-${nextTag++}`;
    const source = await filled(owner, 4n * MiB, 42);
    const store = await owner.stores.createStore({ allocationId: source.allocationId, readOnly: true, name: `model-${tag}` });
    const opened = await owner.stores.open(`model-${tag}`);
    owner.tags.group(tag).addStore(opened);
    const address = opened.memory.address;
    expect(await owner.sleep(tag)).toEqual({ offloadedBytes: 0n, releasedBytes: 0n });
    // Only the store's own allocation: no host copy, nothing else.
    expect(await allocations()).toBe(1);
    await expect(opened.memory.read(0, 4)).rejects.toMatchObject({ code: 'ASLEEP' });
    await owner.wake(tag);
    expect(opened.memory.address).toBe(address);
    expect(Buffer.from(opened.memory.buffer).equals(Buffer.from(pattern(4n * MiB, 42)))).toBe(true);
    expect((await owner.stores.list()).find((listed) => listed.id === store.id)?.opens).toBe(1);
    await opened.close();
    await owner.stores.detach({ id: store.id });
    await freeAll(owner, [source]);
  });

  test('a wake that cannot get its memory fails OUT_OF_MEMORY and leaves the memory asleep and intact', async () => {
    const owner = await client();
    const hog = await client();
    const tag = `weights-${nextTag++}`;
    const memory = await filled(owner, 16n * MiB, 77);
    owner.tags.group(tag).add(memory);
    await owner.sleep(tag);
    // 16 MiB of host copy + 48 MiB held by another: the device has no room for the wake.
    const held: ImportedMemory[] = [];
    for (let i = 0; i < 24; i++) held.push(await hog.vmm.allocate({ size: 2n * MiB }));
    await expect(owner.wake(tag, { deadlineMs: 300 })).rejects.toMatchObject({ code: 'OUT_OF_MEMORY' });
    expect(owner.tags.isAsleep(tag)).toBe(true);
    expect(memory.isAsleep).toBe(true);
    await freeAll(hog, held.splice(0, 8));
    await owner.wake(tag, { deadlineMs: 5000 });
    expect(Buffer.from(memory.buffer).equals(Buffer.from(pattern(16n * MiB, 77)))).toBe(true);
    await freeAll(hog, held);
    await freeAll(owner, [memory]);
  });

  test("a wake waits for another process's sleep to free its memory", async () => {
    const first = await client();
    const second = await client();
    const [tagA, tagB] = [`engine-a-${nextTag}`, `engine-b-${nextTag++}`];
    // The second engine sleeps; the first takes the device.
    const b = await filled(second, 40n * MiB, 2);
    second.tags.group(tagB).add(b);
    await second.sleep(tagB, { mode: 'discard' });
    const a = await filled(first, 40n * MiB, 1);
    first.tags.group(tagA).add(a);
    let woke = false;
    const waking = second.wake(tagB, { deadlineMs: 20_000 }).then((report) => ((woke = true), report));
    await sleep(300);
    expect(woke).toBe(false);
    await first.sleep(tagA, { mode: 'discard' });
    const report = await waking;
    expect(report.waitedMs).toBeGreaterThanOrEqual(100);
    expect(b.isAsleep).toBe(false);
    await freeAll(second, [b]);
    await first.wake(tagA);
    await freeAll(first, [a]);
  }, 30_000);

  test('an offload sleep does not queue behind a wake that waits for memory: host copies have their queue', async () => {
    const first = await client();
    const second = await client();
    const [tagA, tagB] = [`engine-a-${nextTag}`, `engine-b-${nextTag++}`];
    const b = await filled(second, 40n * MiB, 4);
    second.tags.group(tagB).add(b);
    await second.sleep(tagB, { mode: 'discard' });
    const a = await filled(first, 28n * MiB, 3);
    first.tags.group(tagA).add(a);
    // 28 MiB in use: the 40 MiB wake waits; the 28 MiB offload fits at once and must not wait behind it.
    let wakeEnded = false;
    const waking = second.wake(tagB, { deadlineMs: 4000 }).then(
      () => ((wakeEnded = true), 'woke'),
      (error: { code?: string }) => ((wakeEnded = true), error.code),
    );
    await sleep(200);
    await first.sleep(tagA, { mode: 'offload', deadlineMs: 3000 });
    expect(wakeEnded).toBe(false);
    expect(await waking).toBe('OUT_OF_MEMORY');
    await first.wake(tagA, { deadlineMs: 5000 });
    expect(Buffer.from(a.buffer).equals(Buffer.from(pattern(28n * MiB, 3)))).toBe(true);
    await freeAll(first, [a]);
  }, 30_000);

  test('refuses what does not fit the state: sleep twice, wake awake, an unknown tag', async () => {
    const owner = await client();
    const tag = `x-${nextTag++}`;
    const memory = await filled(owner, 2n * MiB, 3);
    owner.tags.group(tag).add(memory);
    await expect(owner.wake(tag)).resolves.toEqual({ restoredBytes: 0n, waitedMs: 0 });
    await expect(owner.tags.group(tag).wake()).rejects.toMatchObject({ code: 'ASLEEP' });
    await owner.sleep(tag);
    await expect(owner.tags.group(tag).sleep()).rejects.toMatchObject({ code: 'ASLEEP' });
    expect(() => owner.tags.group(tag).add(memory)).toThrow(expect.objectContaining({ code: 'ASLEEP' }));
    await expect(owner.sleep('no such tag')).rejects.toMatchObject({ code: 'NOT_VMMD_MEMORY' });
    await owner.wake(tag);
    await freeAll(owner, [memory]);
  });

  test('a process killed while asleep leaves nothing in the daemon', async () => {
    const peer = await Peer.start(daemon.dir);
    const slept = await peer.do({ op: 'sleepTagged', size: String(8n * MiB), mode: 'offload' });
    expect(slept.offloadedBytes).toBe(String(8n * MiB));
    expect(await allocations()).toBe(1);
    peer.process.kill('SIGKILL');
    await peer.exited;
    await eventually(async () => ((await allocations()) === 0 ? true : undefined), 10_000, 'the session to be reclaimed');
  });

  test("the NBEP 7 manager's pool sleeps by tag and wakes with the same pointers and bytes", async () => {
    const owner = await client();
    const tag = `pool-${nextTag++}`;
    const manager = new VmmdMemoryManager({ device: 0, backend: 'host', client: owner, tag, pool: { chunkSize: 4n * MiB, largeThreshold: 2n * MiB } });
    await manager.initialize();
    const small = await manager.memalloc(4096);
    const large = await manager.memalloc(6n * MiB);
    await manager.write(small.devicePointer, Buffer.from('pooled block'));
    await manager.write(large.devicePointer + 1000n, Buffer.from('large allocation'));
    await owner.sleep(tag);
    expect(manager.asleep).toBe(true);
    await expect(manager.memalloc(4096)).rejects.toMatchObject({ code: 'ASLEEP' });
    await owner.wake(tag);
    expect((await manager.read(small.devicePointer, 12)).toString()).toBe('pooled block');
    expect((await manager.read(large.devicePointer + 1000n, 16)).toString()).toBe('large allocation');
    const after = await manager.memalloc(4096);
    expect(after.devicePointer).not.toBe(small.devicePointer);
    small.free();
    large.free();
    after.free();
    await manager.reset();
  });
});

describe('frees that arrive while the NBEP 7 pool sleeps or wakes', () => {
  test('a free during a sleep drops its copy once the sleep is done, a free during a wake releases its memory once awake; no rejection goes unhandled', async () => {
    const unhandled: unknown[] = [];
    const onUnhandled = (reason: unknown) => unhandled.push(reason);
    process.on('unhandledRejection', onUnhandled);
    const owner = await client();
    const hog = await client();
    const tag = `pool-frees-${nextTag++}`;
    const manager = new VmmdMemoryManager({
      device: 0,
      backend: 'host',
      client: owner,
      tag,
      ahead: { maxBytes: 0n, idleMs: 1000, depth: 1 },
      pool: { chunkSize: 4n * MiB, largeThreshold: 2n * MiB },
    });
    try {
      const before = await allocations();
      await manager.initialize();
      const small = await manager.memalloc(4096);
      const large = await manager.memalloc(6n * MiB);
      const other = await manager.memalloc(6n * MiB);
      await manager.write(small.devicePointer, Buffer.from('pooled block'));
      await manager.write(other.devicePointer, Buffer.from('the other one'));
      const fill = async (bytes: bigint) => {
        const held: ImportedMemory[] = [];
        for (let i = 0n; i < bytes / (2n * MiB); i++) held.push(await hog.vmm.allocate({ size: 2n * MiB }));
        return held;
      };
      // 16 MiB of the 64 are the pool's: the hog takes the rest, so the sleep waits for room for its copies.
      let held = await fill(48n * MiB);
      const sleeping = owner.sleep(tag, { mode: 'offload', deadlineMs: 20_000 });
      await eventually(() => (manager.asleep ? true : undefined), 10_000, 'the sleep to start');
      large.free();
      const freedAsleep = manager.flush();
      await freeAll(hog, held);
      await sleeping;
      await freedAsleep;
      // The freed allocation's copy went: the daemon holds the copies of the chunk and of the other allocation.
      expect({ allocations: await allocations(), large: manager.stats().large.allocations, unhandled }).toEqual({
        allocations: before + 2,
        large: 1,
        unhandled: [],
      });
      // 10 MiB of copies are held: the hog takes the rest, so the wake waits for room for its memory.
      held = await fill(54n * MiB);
      const waking = owner.wake(tag, { deadlineMs: 20_000 });
      // A second wake while the first runs is refused, and the first goes on as it was.
      await expect(manager.wake()).rejects.toMatchObject({ code: 'ASLEEP' });
      other.free();
      const freedAwake = manager.flush();
      await sleep(200);
      await freeAll(hog, held);
      await waking;
      await freedAwake;
      await manager.flush();
      expect({ allocations: await allocations(), large: manager.stats().large.allocations, unhandled }).toEqual({
        allocations: before + 1,
        large: 0,
        unhandled: [],
      });
      expect((await manager.read(small.devicePointer, 12)).toString()).toBe('pooled block');
      small.free();
      await manager.reset();
    } finally {
      process.off('unhandledRejection', onUnhandled);
    }
  });
});

describe('offload with host copies prepared ahead', () => {
  const hostBytes = async () => {
    const line = (await scrapeMetrics(metricsPort)).match(
      new RegExp(`^vmmd_uid_location_bytes\\{uid="${process.getuid!()}",location="HOST_NUMA:0"\\} (\\d+)$`, 'm'),
    );
    return line === null ? 0n : BigInt(line[1]);
  };
  const ready = (group: TaggedMemory, bytes: bigint) =>
    eventually(() => (group.prepared.pending === 0 && group.prepared.preparedBytes === bytes ? true : undefined), 10_000, `${bytes} bytes prepared`);
  const take = async (hog: VmmdClient, count: number) => {
    const held: ImportedMemory[] = [];
    for (let i = 0; i < count; i++) held.push(await hog.vmm.allocate({ size: 2n * MiB }));
    return held;
  };

  test('the copy is made ahead and charged while awake; the first sleep needs no memory beyond it; wake keeps it; forget releases it', async () => {
    const owner = await client();
    const hog = await client();
    const tag = `prepared-${nextTag++}`;
    const memory = await filled(owner, 16n * MiB, 21);
    const group = owner.tags.group(tag, { prepareOffload: true });
    group.add(memory);
    await ready(group, 16n * MiB);
    expect(await allocations()).toBe(2);
    expect(await hostBytes()).toBe(16n * MiB);
    // The rest of the capacity goes elsewhere: a sleep that made its copy now would find no room.
    const held = await take(hog, 16);
    for (let cycle = 0; cycle < 2; cycle++) {
      expect(await owner.sleep(tag, { mode: 'offload', deadlineMs: 300 })).toEqual({ offloadedBytes: 16n * MiB, releasedBytes: 16n * MiB });
      expect(await allocations()).toBe(1 + held.length);
      await owner.wake(tag, { deadlineMs: 5000 });
      expect(Buffer.from(memory.buffer).equals(Buffer.from(pattern(16n * MiB, 21)))).toBe(true);
      expect(group.prepared.preparedBytes).toBe(16n * MiB);
      expect(await allocations()).toBe(2 + held.length);
    }
    expect(group.prepared.lastError).toBeUndefined();
    await freeAll(hog, held);
    expect(await group.forget(memory)).toBe(false);
    expect(await allocations()).toBe(1);
    expect(await hostBytes()).toBe(0n);
    await freeAll(owner, [memory]);
  });

  test('a sleep that meets the copy still being made waits for it and makes no second one', async () => {
    const owner = await client();
    const hog = await client();
    const tag = `prepared-${nextTag++}`;
    const memory = await filled(owner, 16n * MiB, 22);
    // Room for exactly one copy: a second one, made by the sleep or by the preparation, would be refused.
    const held = await take(hog, 16);
    const group = owner.tags.group(tag, { prepareOffload: true });
    group.add(memory);
    expect(group.prepared.pending).toBe(1);
    await owner.sleep(tag, { mode: 'offload', deadlineMs: 300 });
    expect(await allocations()).toBe(1 + held.length);
    await owner.wake(tag, { deadlineMs: 5000 });
    expect(Buffer.from(memory.buffer).equals(Buffer.from(pattern(16n * MiB, 22)))).toBe(true);
    expect(group.prepared).toEqual({ preparedBytes: 16n * MiB, pending: 0 });
    await freeAll(hog, held);
    await group.forget(memory);
    await freeAll(owner, [memory]);
    expect(await allocations()).toBe(0);
  });

  test('a preparation refused for room says why; the sleep then makes the copy itself and keeps it after wake', async () => {
    const owner = await client();
    const hog = await client();
    const tag = `prepared-${nextTag++}`;
    const memory = await filled(owner, 16n * MiB, 23);
    const held = await take(hog, 24);
    const group = owner.tags.group(tag, { prepareOffload: true });
    group.add(memory);
    await eventually(() => (group.prepared.pending === 0 ? true : undefined), 10_000, 'the preparation to end');
    expect(group.prepared.preparedBytes).toBe(0n);
    expect(group.prepared.lastError).toMatchObject({ code: 'OUT_OF_MEMORY' });
    await freeAll(hog, held.splice(0, 8));
    await owner.sleep(tag, { mode: 'offload', deadlineMs: 3000 });
    await owner.wake(tag, { deadlineMs: 5000 });
    expect(Buffer.from(memory.buffer).equals(Buffer.from(pattern(16n * MiB, 23)))).toBe(true);
    expect(group.prepared.preparedBytes).toBe(16n * MiB);
    await freeAll(hog, held);
    await group.forget(memory);
    await freeAll(owner, [memory]);
  });

  test('a discard sleep holds nothing while asleep; wake makes the copies again; turning preparation off drops them', async () => {
    const owner = await client();
    const tag = `prepared-${nextTag++}`;
    const memory = [await filled(owner, 4n * MiB, 24), await filled(owner, 2n * MiB, 25)];
    const group = owner.tags.group(tag, { prepareOffload: true });
    for (const mapped of memory) group.add(mapped);
    await ready(group, 6n * MiB);
    await owner.sleep(tag, { mode: 'discard' });
    expect(await allocations()).toBe(0);
    await owner.wake(tag);
    await ready(group, 6n * MiB);
    expect(await allocations()).toBe(4);
    await group.setPrepareOffload(false);
    expect(group.prepared.preparedBytes).toBe(0n);
    expect(await allocations()).toBe(2);
    await freeAll(owner, memory);
  });
});

describe('copies made ahead count against the session quota', () => {
  let limited: TestDaemon;

  beforeAll(async () => {
    limited = await TestDaemon.start(['--host-capacity', '64MiB', '--quota-per-session', '24MiB']);
  }, 90_000);

  afterAll(async () => {
    await stopWhenClean(limited, []);
  });

  test('a copy past the quota is refused QUOTA_EXCEEDED, the offload sleep then fails with the memory awake and intact, a discard still sleeps', async () => {
    const owner = await connect({ socketDir: limited.dir });
    try {
      const memory = await owner.vmm.allocate({ size: 16n * MiB });
      new Uint8Array(memory.buffer).set(pattern(16n * MiB, 31));
      const group = owner.tags.group('quota', { prepareOffload: true });
      group.add(memory);
      await eventually(() => (group.prepared.pending === 0 ? true : undefined), 10_000, 'the preparation to end');
      expect(group.prepared.lastError).toMatchObject({ code: 'QUOTA_EXCEEDED' });
      await expect(owner.sleep('quota', { mode: 'offload', deadlineMs: 300 })).rejects.toMatchObject({ code: 'QUOTA_EXCEEDED' });
      expect(memory.isAsleep).toBe(false);
      expect(Buffer.from(memory.buffer).equals(Buffer.from(pattern(16n * MiB, 31)))).toBe(true);
      await owner.sleep('quota', { mode: 'discard' });
      await owner.wake('quota', { deadlineMs: 5000 });
      expect(memory.isAsleep).toBe(false);
      await group.forget(memory);
      await freeAll(owner, [memory]);
    } finally {
      owner.close();
    }
  });
});

describe('the NBEP 7 manager with copies made ahead', () => {
  test('each chunk and large allocation gets its copy as it is leased; the first sleep needs no more memory; a freed one takes its copy along', async () => {
    const owner = await client();
    const hog = await client();
    const tag = `pool-prepared-${nextTag++}`;
    const manager = new VmmdMemoryManager({
      device: 0,
      backend: 'host',
      client: owner,
      tag,
      prepareOffload: true,
      pool: { chunkSize: 4n * MiB, largeThreshold: 2n * MiB },
    });
    await manager.initialize();
    const small = await manager.memalloc(4096);
    const large = await manager.memalloc(6n * MiB);
    await manager.write(small.devicePointer, Buffer.from('pooled block'));
    await manager.write(large.devicePointer + 1000n, Buffer.from('large allocation'));
    await eventually(
      () => (manager.prepared?.pending === 0 && manager.prepared.preparedBytes === 10n * MiB ? true : undefined),
      10_000,
      'the copies made ahead',
    );
    const held: ImportedMemory[] = [];
    for (let i = 0; i < 22; i++) held.push(await hog.vmm.allocate({ size: 2n * MiB }));
    await owner.sleep(tag, { mode: 'offload', deadlineMs: 300 });
    await owner.wake(tag, { deadlineMs: 5000 });
    expect((await manager.read(small.devicePointer, 12)).toString()).toBe('pooled block');
    expect((await manager.read(large.devicePointer + 1000n, 16)).toString()).toBe('large allocation');
    await freeAll(hog, held);
    large.free();
    await manager.flush();
    await eventually(() => (manager.prepared?.preparedBytes === 4n * MiB ? true : undefined), 10_000, "the large allocation's copy to go");
    small.free();
    await manager.reset();
    await eventually(async () => ((await allocations()) === 0 ? true : undefined), 10_000, 'everything given back');
  });
});
