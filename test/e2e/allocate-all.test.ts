/**
 * AllocateAll, the daemon as referee between processes on one device, on
 * the host backend (its capacity is the device's memory): all or none, one
 * request at a time per device in arrival order, a request that does not fit
 * waits until releases free its memory or its deadline passes
 * (OUT_OF_MEMORY, nothing held), and a session that ends while its request
 * waits leaves nothing. Bad requests are refused with their rule and change
 * nothing.
 */
import * as grpc from '@grpc/grpc-js';
import { connect, VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import type { ImportedMemory } from '../../client';
import { MAX_ALLOCATE_ALL_SIZES, MAX_ALLOCATE_ALL_WAIT_MS } from '../../common/client-constants';
import { call, eventually, freePort, MiB, Peer, scrapeMetrics, sleep, stopWhenClean, TestDaemon } from './harness';

const CAPACITY = 64n * MiB;
const DEVICE0 = { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 };

let daemon: TestDaemon;
let metricsPort: number;
const clients: VmmdClient[] = [];

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

async function closeAll(memory: ImportedMemory[], owner: VmmdClient): Promise<void> {
  for (const mapped of memory) {
    await mapped.close();
    await owner.vmm.release({ allocationId: mapped.allocationId });
  }
}

const allocations = async () => Number((await daemon.stats()).allocations);

/** Holds `bytes` of the capacity in 2 MiB allocations (each releasable alone). */
async function hold(owner: VmmdClient, bytes: bigint): Promise<string[]> {
  const ids: string[] = [];
  for (let held = 0n; held < bytes; held += 2n * MiB) ids.push((await owner.vmm.create({ size: 2n * MiB })).id);
  return ids;
}

async function releaseIds(owner: VmmdClient, ids: string[]): Promise<void> {
  for (const id of ids) await owner.vmm.release({ allocationId: id });
}

describe('AllocateAll', () => {
  test("makes every allocation, each mapped here and the session's, in the order of the sizes", async () => {
    const waker = await client();
    const { memory, waitedMs } = await waker.vmm.allocateAll({ sizes: [2n * MiB, 4n * MiB, 2n * MiB], location: DEVICE0, deadlineMs: 1000 });
    expect(memory.map((mapped) => mapped.size)).toEqual([2n * MiB, 4n * MiB, 2n * MiB]);
    expect(waitedMs).toBeLessThan(1000);
    for (const [index, mapped] of memory.entries()) Buffer.from(mapped.buffer).write(`allocation ${index}`);
    expect(memory.map((mapped) => Buffer.from(mapped.buffer).toString('utf8', 0, 12))).toEqual(['allocation 0', 'allocation 1', 'allocation 2']);
    expect(await allocations()).toBe(3);
    await closeAll(memory, waker);
    expect(await allocations()).toBe(0);
  });

  test('refuses bad requests with their rule, and makes nothing', async () => {
    const waker = await client();
    const refused = (request: object) =>
      waker.vmm.allocateAllRaw(request).then(
        () => 'served',
        (error) => ({ code: error.code, message: error.message }),
      );
    expect(await refused({ sizes: [], deadlineMs: 0 })).toMatchObject({ code: 'ZERO_SIZE', message: expect.stringContaining('at least one size') });
    expect(await refused({ sizes: [2n * MiB, 0n] })).toMatchObject({ code: 'ZERO_SIZE', message: expect.stringContaining('sizes[1] is 0') });
    expect(await refused({ sizes: [MiB] })).toMatchObject({ code: 'NOT_ALIGNED', message: expect.stringContaining('sizes[0]') });
    expect(await refused({ sizes: Array(MAX_ALLOCATE_ALL_SIZES + 1).fill(2n * MiB) })).toMatchObject({
      code: 'TOO_MANY_SIZES',
      message: expect.stringContaining(`at most ${MAX_ALLOCATE_ALL_SIZES}`),
    });
    expect(await refused({ sizes: [CAPACITY, 2n * MiB] })).toMatchObject({
      code: 'BEYOND_DEVICE',
      message: expect.stringContaining(`${CAPACITY} bytes in all`),
    });
    expect(await refused({ sizes: [2n * MiB], location: { type: 'LOCATION_TYPE_DEVICE', id: 5 } })).toMatchObject({ code: 'UNKNOWN_DEVICE' });
    expect(await refused({ sizes: [2n * MiB], deadlineMs: MAX_ALLOCATE_ALL_WAIT_MS + 1 })).toMatchObject({
      code: 'BAD_DEADLINE',
      message: expect.stringContaining(String(MAX_ALLOCATE_ALL_WAIT_MS)),
    });
    expect(await refused({ sizes: [2n * MiB], handleType: 'HANDLE_TYPE_FABRIC' })).toMatchObject({ code: 'UNSUPPORTED_HANDLE_TYPE' });
    // Without a session there is nowhere to send the descriptors.
    await expect(call(daemon.raw.vmm, 'AllocateAll', { sizes: [String(2n * MiB)] })).rejects.toMatchObject({
      code: 9,
      message: expect.stringContaining('AllocateAll'),
    });
    expect(await allocations()).toBe(0);
    expect(daemon.process.exitCode).toBeNull();
  });

  test('waits for a release that frees its memory, then is served', async () => {
    const sleeper = await client();
    const waker = await client();
    const held = await hold(sleeper, 48n * MiB);
    let answered = false;
    const woken = waker.vmm.allocateAll({ sizes: [16n * MiB, 16n * MiB], deadlineMs: 20_000 }).finally(() => (answered = true));
    await sleep(300);
    expect(answered).toBe(false);
    expect(await scrapeMetrics(metricsPort)).toMatch(/^vmmd_allocate_all_waiting\{queue="device 0"\} 1$/m);
    // The sleeper gives back 32 MiB: the waiting request takes it.
    await releaseIds(sleeper, held.slice(0, 16));
    const { memory, waitedMs } = await woken;
    expect(memory).toHaveLength(2);
    expect(waitedMs).toBeGreaterThanOrEqual(100);
    await closeAll(memory, waker);
    await releaseIds(sleeper, held.slice(16));
    expect(await allocations()).toBe(0);
  });

  test('at its deadline fails OUT_OF_MEMORY naming what it waited for, and holds nothing', async () => {
    const sleeper = await client();
    const waker = await client();
    const held = await hold(sleeper, 48n * MiB);
    const started = Date.now();
    const error = await waker.vmm.allocateAllRaw({ sizes: [16n * MiB, 16n * MiB], deadlineMs: 400 }).catch((caught) => caught);
    expect(Date.now() - started).toBeGreaterThanOrEqual(350);
    expect(error).toMatchObject({ code: 'OUT_OF_MEMORY', status: 8 });
    expect(error.message).toContain(`${32n * MiB} bytes in 2 allocation(s) on device 0 waited 400 ms`);
    expect(error.message).toContain(`${16n * MiB} bytes are free there now`);
    expect(error.message).toContain('nothing was allocated');
    expect(await allocations()).toBe(held.length);
    // Deadline 0: answered at once.
    await expect(waker.vmm.allocateAllRaw({ sizes: [32n * MiB], deadlineMs: 0 })).rejects.toMatchObject({ code: 'OUT_OF_MEMORY' });
    expect(await allocations()).toBe(held.length);
    await releaseIds(sleeper, held);
    expect(await scrapeMetrics(metricsPort)).toMatch(/^vmmd_allocate_all_total\{outcome="out_of_memory"\} [1-9]/m);
  });

  test('two requests on one device never interleave their allocations', async () => {
    const first = await client();
    const second = await client();
    const sizes = Array(8).fill(2n * MiB);
    const [a, b] = await Promise.all([first.vmm.allocateAll({ sizes, deadlineMs: 5000 }), second.vmm.allocateAll({ sizes, deadlineMs: 5000 })]);
    const ids = (memory: ImportedMemory[]) => memory.map((mapped) => BigInt(mapped.allocationId));
    const [idsA, idsB] = [ids(a.memory), ids(b.memory)];
    // One sequence numbers every allocation: one request's are all made before the other's first.
    const maxA = idsA.reduce((x, y) => (x > y ? x : y));
    const minA = idsA.reduce((x, y) => (x < y ? x : y));
    expect(idsB.every((id) => id > maxA) || idsB.every((id) => id < minA)).toBe(true);
    await closeAll(a.memory, first);
    await closeAll(b.memory, second);
  });

  test('is served in arrival order: a small request waits behind a large one that does not fit yet', async () => {
    const sleeper = await client();
    const large = await client();
    const small = await client();
    const held = await hold(sleeper, 48n * MiB);
    const order: string[] = [];
    const bigWake = large.vmm.allocateAll({ sizes: [32n * MiB], deadlineMs: 20_000 }).then((result) => (order.push('large'), result));
    await sleep(100);
    const smallWake = small.vmm.allocateAll({ sizes: [2n * MiB], deadlineMs: 20_000 }).then((result) => (order.push('small'), result));
    await sleep(300);
    expect(order).toEqual([]);
    await releaseIds(sleeper, held.slice(0, 16));
    const [big, little] = await Promise.all([bigWake, smallWake]);
    expect(order).toEqual(['large', 'small']);
    await closeAll(big.memory, large);
    await closeAll(little.memory, small);
    await releaseIds(sleeper, held.slice(16));
  });

  test('a session killed while its request waits leaves nothing, and the queue goes on', async () => {
    const sleeper = await client();
    const held = await hold(sleeper, 48n * MiB);
    const peer = await Peer.start(daemon.dir);
    void peer.do({ op: 'call', api: 'vmm', method: 'allocateAllRaw', args: { sizes: [String(32n * MiB)], deadlineMs: 60_000 } }).catch(() => undefined);
    await eventually(
      async () => ((await scrapeMetrics(metricsPort)).match(/^vmmd_allocate_all_waiting\{queue="device 0"\} 1$/m) ? true : undefined),
      10_000,
      'the request to wait',
    );
    const waiter = await client();
    const queued = waiter.vmm.allocateAll({ sizes: [2n * MiB], deadlineMs: 20_000 });
    peer.process.kill('SIGKILL');
    await peer.exited;
    // The dead session's request leaves the queue at once (not at its deadline); the one behind it is served from what is free.
    const { memory } = await queued;
    await eventually(async () => ((await daemon.stats()).sessions === clients.length ? true : undefined), 10_000, 'the session to be reclaimed');
    await releaseIds(sleeper, held);
    await sleep(100);
    expect(await allocations()).toBe(1);
    expect(await scrapeMetrics(metricsPort)).toMatch(/^vmmd_allocate_all_total\{outcome="abandoned"\} [1-9]/m);
    await closeAll(memory, waiter);
  }, 30_000);

  test('a call cancelled while its request waits takes it out of the queue', async () => {
    const sleeper = await client();
    const held = await hold(sleeper, 48n * MiB);
    const waker = await client();
    // The gRPC deadline passes long before the request's own.
    const metadata = new grpc.Metadata();
    metadata.set(SESSION_METADATA_KEY, waker.session.token);
    const cancelled = await new Promise((resolve) =>
      daemon.raw.vmm.AllocateAll(
        { sizes: [String(32n * MiB)], deadlineMs: 60_000 },
        metadata,
        { deadline: Date.now() + 300 },
        (error: grpc.ServiceError | null) => resolve(error?.code),
      ),
    );
    expect(cancelled).toBe(4); // DEADLINE_EXCEEDED, on the client's side
    await eventually(async () => ((await scrapeMetrics(metricsPort)).match(/^vmmd_allocate_all_waiting\{/m) ? undefined : true), 20_000, 'the queue to empty');
    await releaseIds(sleeper, held);
    await sleep(100);
    expect(await allocations()).toBe(0);
  });

  test('a uid has at most so many requests waiting; past it BUDGET_EXCEEDED', async () => {
    const sleeper = await client();
    const held = await hold(sleeper, 64n * MiB);
    const waker = await client();
    const waits = Array.from({ length: 64 }, () => waker.vmm.allocateAllRaw({ sizes: [2n * MiB], deadlineMs: 2_000 }).catch((error) => error.code));
    await eventually(
      async () => ((await scrapeMetrics(metricsPort)).match(/^vmmd_allocate_all_waiting\{queue="device 0"\} 64$/m) ? true : undefined),
      10_000,
      '64 requests to wait',
    );
    await expect(waker.vmm.allocateAllRaw({ sizes: [2n * MiB], deadlineMs: 2_000 })).rejects.toMatchObject({
      code: 'BUDGET_EXCEEDED',
      message: expect.stringContaining('AllocateAll requests waiting per uid'),
    });
    expect(new Set(await Promise.all(waits))).toEqual(new Set(['OUT_OF_MEMORY']));
    await releaseIds(sleeper, held);
    expect(await allocations()).toBe(0);
  }, 30_000);
});
