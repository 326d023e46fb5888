/**
 * The fast paths, over the real sockets: Allocate (create and
 * export in one call), the stock of allocations created and exported ahead,
 * and the staging buffer of bulk Read/Write. Each keeps the rules of the slow
 * path it shortens: refusals change nothing, and everything is reclaimed.
 */
import * as grpc from '@grpc/grpc-js';
import { connect, VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import type { AccessDescriptor } from '../../generated/vmmd/v1/AccessDescriptor';
import { addon } from '../../native';
import { call, eventually, MiB, TestDaemon } from './harness';

const RW: AccessDescriptor[] = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];
const READ: AccessDescriptor[] = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READ' }];

function objectsOf(stats: Awaited<ReturnType<TestDaemon['stats']>>) {
  const { reservations, allocations, mappings, allocatedBytes, mappedBytes, pendingTransfers } = stats;
  return { reservations, allocations, mappings, allocatedBytes, mappedBytes, pendingTransfers };
}

function sessionMetadata(client: VmmdClient): grpc.Metadata {
  const metadata = new grpc.Metadata();
  metadata.set(SESSION_METADATA_KEY, client.session.token);
  return metadata;
}

/** Mapped memory of the client's own session, with `access`. */
async function mapped(client: VmmdClient, size: bigint, access = RW) {
  const allocation = await client.vmm.create({ size });
  const reservation = await client.vmm.reserve({ size });
  await client.vmm.map({ address: reservation.address, size, allocationId: allocation.id });
  await client.vmm.setAccess({ address: reservation.address, size, descriptors: access });
  return reservation.address;
}

/** A daemon for a describe block, and clients of it that each test's end closes. */
function daemonWithClients(args: string[] = []) {
  const state = { daemon: undefined as unknown as TestDaemon, clients: [] as VmmdClient[] };
  beforeAll(async () => {
    state.daemon = await TestDaemon.start(args);
  });
  afterAll(async () => {
    expect(await state.daemon.stop()).toBe(0);
  });
  const client = async (options: { stagingBytes?: number } = {}) => {
    const made = await connect({ socketDir: state.daemon.dir, ...options });
    state.clients.push(made);
    return made;
  };
  const closeClients = () => {
    for (const made of state.clients.splice(0)) made.close();
  };
  return { state, client, closeClients };
}

describe('with a stock of 2 MiB allocations', () => {
  const { state, client, closeClients } = daemonWithClients(['--stock', '2MiB:2']);
  let daemon: TestDaemon;
  beforeAll(() => {
    daemon = state.daemon;
  });
  afterEach(async () => {
    closeClients();
    await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'sessions to close');
  });

  it('reports the stock, full, in GetReport', async () => {
    const c = await client();
    const report = (await c.admin.getReport()) as { stock: { levels: Array<{ size: string; depth: number; held: number }> } };
    expect(report.stock.levels).toEqual([{ device: 0, size: String(2n * MiB), depth: 2, held: 2 }]);
  });

  it('Allocate gives the session a new allocation mapped here, from the stock and past it', async () => {
    const c = await client();
    const memories = [];
    // Three in a row: the stock holds two, the third is made on the spot.
    for (let i = 0; i < 3; i++) memories.push(await c.vmm.allocate({ size: 2n * MiB }));
    for (const [index, memory] of memories.entries()) {
      memory.bytes().fill(index + 1);
      const properties = await c.vmm.getProperties({ allocationId: memory.allocationId });
      expect(properties).toMatchObject({ ownerSession: c.session.id, size: String(2n * MiB), imported: false });
    }
    // Each is its own memory: another import of each sees its own bytes.
    for (const [index, memory] of memories.entries()) {
      const again = await c.vmm.import(memory.allocationId);
      expect(again.bytes()[12345]).toBe(index + 1);
      await again.close();
    }
    const report = (await c.admin.getReport()) as { stock: { hits: number; misses: number } };
    expect(report.stock.hits).toBeGreaterThanOrEqual(2);
    for (const memory of memories) {
      await memory.close();
      await c.vmm.release({ allocationId: memory.allocationId });
    }
    expect((await daemon.stats()).allocations).toBe('0');
  });

  it('refuses Allocate without a session or with a bad size, and changes nothing', async () => {
    const c = await client();
    const before = objectsOf(await daemon.stats());
    const fds = daemon.openFds();
    await expect(call(daemon.raw.vmm, 'Allocate', { size: String(2n * MiB) })).rejects.toMatchObject({
      code: grpc.status.FAILED_PRECONDITION,
      details: expect.stringMatching(/Allocate needs a session/),
    });
    await expect(call(daemon.raw.vmm, 'Allocate', { size: String(MiB) }, sessionMetadata(c))).rejects.toMatchObject({
      code: grpc.status.INVALID_ARGUMENT,
      details: expect.stringMatching(/0x100000 is not a multiple of the granularity 2097152/),
    });
    await expect(call(daemon.raw.vmm, 'Allocate', { size: '0' }, sessionMetadata(c))).rejects.toMatchObject({ code: grpc.status.INVALID_ARGUMENT });
    expect(objectsOf(await daemon.stats())).toEqual(before);
    expect(daemon.openFds()).toBe(fds);
  });

  it('answers allocate on the session socket with the same rules as the RPC, and changes nothing when it refuses', async () => {
    const c = await client();
    const before = objectsOf(await daemon.stats());
    const fds = daemon.openFds();
    await expect(c.session.allocate(MiB)).rejects.toMatchObject({ status: grpc.status.INVALID_ARGUMENT, code: 'NOT_ALIGNED' });
    await expect(c.session.allocate(0n)).rejects.toMatchObject({ status: grpc.status.INVALID_ARGUMENT, code: 'ZERO_SIZE' });
    await expect(c.session.allocate(2n * MiB, { type: 'LOCATION_TYPE_DEVICE', id: 7 })).rejects.toMatchObject({ status: grpc.status.OUT_OF_RANGE });
    expect(objectsOf(await daemon.stats())).toEqual(before);
    expect(daemon.openFds()).toBe(fds);
    // Out of memory: refused as well, and the stock gives its memory back (it refills on the next Create).
    await expect(c.session.allocate(1n << 50n)).rejects.toMatchObject({ status: grpc.status.RESOURCE_EXHAUSTED, code: 'OUT_OF_MEMORY' });
    expect(objectsOf(await daemon.stats())).toEqual(before);
    const report = (await c.admin.getReport()) as { stock: { levels: Array<{ held: number }> } };
    expect(report.stock.levels[0].held).toBe(0);
    const { message, fd } = await c.session.allocate(2n * MiB);
    expect(message).toMatchObject({
      transferId: '0',
      size: String(2n * MiB),
      granularity: String(2n * MiB),
      device: 0,
      location: { type: 'LOCATION_TYPE_DEVICE', id: 0 },
    });
    expect(addon.hostFdInfo(fd)).toMatchObject({ memfd: true, size: 2n * MiB });
    addon.close(fd);
    expect((await c.vmm.getProperties({ allocationId: message.allocationId })).ownerSession).toBe(c.session.id);
    await c.vmm.release({ allocationId: message.allocationId });
  });

  it("releases a stocked allocation's ready descriptor when it is released without an export", async () => {
    const c = await client();
    // A Create of the stocked size starts a refill (the shelf may be empty after an earlier test's out-of-memory).
    await c.vmm.release({ allocationId: (await c.vmm.create({ size: 2n * MiB })).id });
    // The shelf's depth when full: as deep as configured, or as its bursts made it.
    const fullDepth = async () => {
      const report = (await c.admin.getReport()) as { stock: { levels: Array<{ held: number; depth: number }> } };
      const level = report.stock.levels[0];
      return level.held === level.depth ? level.depth : undefined;
    };
    const depth = await eventually(fullDepth, 10_000, 'the stock to refill');
    const fds = daemon.openFds();
    const created = await c.vmm.create({ size: 2n * MiB });
    await c.vmm.release({ allocationId: created.id });
    // The shelf refills (a memfd and its ready copy each, two more for each level a burst deepened it);
    // the taken one's pair is closed.
    await eventually(
      async () => {
        const now = await fullDepth();
        return now !== undefined && daemon.openFds() === fds + 2 * (now - depth) ? true : undefined;
      },
      10_000,
      `daemon fds back to ${fds} (net of the stock's depth)`,
    );
  });

  it('reclaims allocations handed out from the stock with the session', async () => {
    const c = await client();
    const before = objectsOf(await daemon.stats());
    await c.vmm.allocate({ size: 2n * MiB });
    await c.vmm.allocate({ size: 2n * MiB });
    c.close();
    await eventually(
      async () => {
        const now = objectsOf(await daemon.stats());
        return JSON.stringify(now) === JSON.stringify(before) ? true : undefined;
      },
      10_000,
      'objects back to the baseline',
    );
  });
});

describe('allocate on the session socket under a quota', () => {
  let daemon: TestDaemon;
  beforeAll(async () => {
    daemon = await TestDaemon.start(['--quota-per-session', '4MiB']);
  });
  afterAll(async () => {
    expect(await daemon.stop()).toBe(0);
  });

  it('charges the quota as Create does, concurrent requests included', async () => {
    const c = await connect({ socketDir: daemon.dir });
    try {
      const results = await Promise.allSettled([1, 2, 3, 4].map(() => c.vmm.allocate({ size: 2n * MiB })));
      expect(results.filter((result) => result.status === 'fulfilled')).toHaveLength(2);
      for (const result of results.filter((result) => result.status === 'rejected')) {
        expect((result as PromiseRejectedResult).reason).toMatchObject({ status: grpc.status.RESOURCE_EXHAUSTED, errorCode: 3 });
      }
      expect((await daemon.stats()).allocatedBytes).toBe(String(4n * MiB));
    } finally {
      c.close();
    }
  });
});

describe('bulk Read and Write through the staging buffer', () => {
  const { state, client, closeClients } = daemonWithClients();
  let daemon: TestDaemon;
  beforeAll(() => {
    daemon = state.daemon;
  });
  afterEach(closeClients);

  it('round-trips bytes of any length and offset, staged and streamed alike', async () => {
    const staged = await client({ stagingBytes: 1 << 20 });
    const size = 8n * MiB;
    const address = BigInt(await mapped(staged, size));
    const data = Buffer.alloc(5 * (1 << 20) + 4321);
    for (let i = 0; i < data.length; i++) data[i] = (i * 7 + (i >> 13)) & 0xff;
    // More than the staging buffer's halves, at an odd offset: several slices and a ragged end.
    await staged.vmm.write(address + 777n, data);
    expect((await staged.vmm.read(address + 777n, data.length)).equals(data)).toBe(true);
    const into = Buffer.alloc(data.length);
    await staged.vmm.readInto(address + 777n, into);
    expect(into.equals(data)).toBe(true);
    // Small reads stream over gRPC and see the same bytes.
    expect((await staged.vmm.read(address + 777n, 1000)).equals(data.subarray(0, 1000))).toBe(true);
  });

  it('serializes concurrent staged transfers of one session (they share the buffer)', async () => {
    const staged = await client({ stagingBytes: 1 << 20 });
    const address = BigInt(await mapped(staged, 4n * MiB));
    const a = Buffer.alloc(2 << 20, 0xa1);
    const b = Buffer.alloc(2 << 20, 0xb2);
    await Promise.all([staged.vmm.write(address, a), staged.vmm.write(address + 2n * MiB, b)]);
    const [backA, backB] = await Promise.all([staged.vmm.read(address, a.length), staged.vmm.read(address + 2n * MiB, b.length)]);
    expect(backA.equals(a) && backB.equals(b)).toBe(true);
  });

  it('applies the rules of Read and Write: access, mapping, ownership', async () => {
    const owner = await client();
    const readOnly = BigInt(await mapped(owner, 2n * MiB, READ));
    await expect(owner.vmm.write(readOnly, Buffer.alloc(1 << 20))).rejects.toMatchObject({ code: 'NO_ACCESS' });
    await expect(owner.vmm.read(0x1000n, 1 << 20)).rejects.toMatchObject({ status: grpc.status.NOT_FOUND });
    const other = await client();
    await expect(other.vmm.read(readOnly, 1 << 20)).rejects.toMatchObject({ status: grpc.status.PERMISSION_DENIED });
    await expect(other.vmm.write(readOnly, Buffer.alloc(1 << 20))).rejects.toMatchObject({ status: grpc.status.PERMISSION_DENIED });
  });

  it('refuses bad staging calls with a clear error and changes nothing', async () => {
    await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'sessions to close');
    const baseline = daemon.openFds();
    const c = await client({ stagingBytes: 0 });
    const address = await mapped(c, 2n * MiB);
    const metadata = sessionMetadata(c);
    const before = objectsOf(await daemon.stats());
    const fds = daemon.openFds();
    await expect(call(daemon.raw.vmm, 'ReadStaged', { address, length: '4096' }, metadata)).rejects.toMatchObject({
      code: grpc.status.FAILED_PRECONDITION,
      details: expect.stringMatching(/no staging buffer/),
    });
    await expect(call(daemon.raw.vmm, 'ReadStaged', { address, length: '4096' })).rejects.toMatchObject({ code: grpc.status.FAILED_PRECONDITION });
    // Not a memfd: a pipe.
    const pipeTransfer = c.session.sendDescriptor(0);
    await expect(call(daemon.raw.vmm, 'OpenStaging', { transferId: pipeTransfer }, metadata)).rejects.toMatchObject({
      code: grpc.status.INVALID_ARGUMENT,
      details: expect.stringMatching(/memfd/),
    });
    // Too small to be page-sized.
    const tiny = addon.hostMemfdCreate('tiny', 100n);
    const tinyTransfer = c.session.sendDescriptor(tiny);
    addon.close(tiny);
    await expect(call(daemon.raw.vmm, 'OpenStaging', { transferId: tinyTransfer }, metadata)).rejects.toMatchObject({
      code: grpc.status.INVALID_ARGUMENT,
      details: expect.stringMatching(/size 100 must be a positive multiple/),
    });
    // A good one, then copies outside it and of nothing.
    const good = addon.hostMemfdCreate('staging', 1n << 20n);
    const goodTransfer = c.session.sendDescriptor(good);
    addon.close(good);
    await expect(call(daemon.raw.vmm, 'OpenStaging', { transferId: goodTransfer }, metadata)).resolves.toEqual({ size: String(1 << 20) });
    await expect(call(daemon.raw.vmm, 'ReadStaged', { address, length: '4096', stagingOffset: String((1 << 20) - 100) }, metadata)).rejects.toMatchObject({
      code: grpc.status.OUT_OF_RANGE,
      details: expect.stringMatching(/outside the staging buffer of 1048576 bytes/),
    });
    await expect(call(daemon.raw.vmm, 'WriteStaged', { address, length: '0' }, metadata)).rejects.toMatchObject({ code: grpc.status.INVALID_ARGUMENT });
    await expect(call(daemon.raw.vmm, 'ReadStaged', { address, length: '4096' }, metadata)).resolves.toEqual({ bytes: '4096' });
    expect(objectsOf(await daemon.stats())).toEqual(before);
    // The staging buffer is one mapping and one descriptor more, until the session ends.
    expect(daemon.openFds()).toBe(fds + 1);
    c.close();
    // With the session go its objects, its staging buffer and its sockets.
    await eventually(() => (daemon.openFds() === baseline ? true : undefined), 10_000, `daemon fds back to ${baseline}`);
  });

  it('refuses a staging size that is not 0 or a multiple of two pages, before connecting', async () => {
    await expect(connect({ socketDir: daemon.dir, stagingBytes: 1000 })).rejects.toMatchObject({ code: 'BAD_STAGING_SIZE' });
  });
});
