/**
 * The hot operations on the session socket (release, share, export,
 * open) on the cuda backend: the descriptors they attach are CUDA shareable
 * handles this process imports and maps, the memory is the same device memory,
 * and the rules, quota and reclaim are those of the RPCs.
 */
import * as grpc from '@grpc/grpc-js';
import { connect, CudaImportedMemory, VmmdClient } from '../../client';
import { addon } from '../../native';
import { eventually, MiB, objectsOf, TestDaemon } from '../e2e/harness';
import { describeGpu } from './gpu';

describeGpu('session socket operations on the cuda backend', () => {
  let daemon: TestDaemon;
  const clients: VmmdClient[] = [];

  beforeAll(async () => {
    daemon = await TestDaemon.start(['--quota-per-session', '8MiB'], 'cuda');
  });

  afterAll(async () => {
    for (const client of clients.splice(0)) client.close();
    await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'the sessions to close');
    expect(await daemon.stats()).toMatchObject({ reservations: '0', allocations: '0', mappings: '0', pendingTransfers: 0 });
    expect(await daemon.stop()).toBe(0);
  });

  async function client(): Promise<VmmdClient> {
    const connected = await connect({ socketDir: daemon.dir });
    clients.push(connected);
    return connected;
  }

  it('exports on the socket a descriptor that maps the same device memory, and another session only with the share key', async () => {
    const owner = await client();
    const other = await client();
    const memory = await owner.vmm.allocate({ size: 2n * MiB });
    const bytes = Buffer.alloc(4096, 0x3c);
    await memory.write(8192, bytes);
    await expect(other.session.export(memory.allocationId)).rejects.toMatchObject({ code: 'NOT_OWNER', status: grpc.status.PERMISSION_DENIED });
    const shareKey = await owner.session.share(memory.allocationId);
    // The library's import takes the socket's export: a CUDA handle imported and mapped in this process.
    const seen = await other.vmm.import(memory.allocationId, { shareKey });
    expect((await addon.cudaCopyFromDevice(0, seen.address + 8192n, 16n)).equals(bytes.subarray(0, 16))).toBe(true);
    await seen.close();
    await memory.close();
    expect(await owner.session.release(memory.allocationId)).toMatchObject({ freed: true, handleReferences: 0 });
    await expect(owner.session.release(memory.allocationId)).rejects.toMatchObject({ code: 'UNKNOWN_ALLOCATION', status: grpc.status.NOT_FOUND });
  });

  it('exports an allocation again as a copy of the descriptor kept from its first export, closed when the memory is freed', async () => {
    const owner = await client();
    // 4 MiB: a size the stock does not keep, so the first export is the driver's (the stock's own are the next case).
    const memory = await owner.vmm.allocate({ size: 4n * MiB });
    await memory.write(0, Buffer.from('kept export'));
    // The stock refills what the allocation took once the daemon is quiet (QUIET_MS, 1 ms): settled before counting.
    await new Promise((resolve) => setTimeout(resolve, 100));
    // The allocate's own export asked the driver and kept a descriptor (counted in what the daemon holds):
    // the exports after it are copies of that one, and add none.
    const before = daemon.openFds();
    const exports = [];
    for (let i = 0; i < 4; i++) exports.push(await owner.session.export(memory.allocationId));
    expect(daemon.openFds()).toBe(before);
    for (const { fd } of exports) {
      const mapped = await CudaImportedMemory.map(BigInt(memory.allocationId), { fd }, 4n * MiB, 2n * MiB, 0, false);
      expect((await mapped.read(0, 11)).toString()).toBe('kept export');
      await mapped.close();
    }
    await memory.close();
    await owner.vmm.release({ allocationId: memory.allocationId });
    // Freed: the kept descriptor is closed with it.
    await eventually(async () => (daemon.openFds() === before - 1 ? true : undefined), 5_000, 'the kept descriptor to close');
    // Another allocation (the driver may hand out the same handle value) exports its own memory, not the freed one's.
    const next = await owner.vmm.allocate({ size: 2n * MiB });
    await next.write(0, Buffer.from('new memory!'));
    const { fd } = await owner.session.export(next.allocationId);
    const mapped = await CudaImportedMemory.map(BigInt(next.allocationId), { fd }, 2n * MiB, 2n * MiB, 0, false);
    expect((await mapped.read(0, 11)).toString()).toBe('new memory!');
    await mapped.close();
    await next.close();
    await owner.vmm.release({ allocationId: next.allocationId });
  });

  it('exports a stocked allocation as copies of the descriptor its allocate handed out (the stock keeps one), closed when the memory is freed', async () => {
    const owner = await client();
    const stock = async () => ((await owner.admin.getReport()) as { stock: { hits: number } }).stock;
    const settle = () => new Promise((resolve) => setTimeout(resolve, 300));
    await settle();
    const hits = (await stock()).hits;
    const memory = await owner.vmm.allocate({ size: 2n * MiB });
    expect((await stock()).hits).toBe(hits + 1);
    await memory.write(0, Buffer.from('from stock!'));
    // The shelf refills once the daemon is quiet: settled before counting.
    await settle();
    const before = daemon.openFds();
    // The allocate handed out the stock's ready descriptor and the stock kept a copy: no export asks the driver, nothing more is kept.
    const exports = [];
    for (let i = 0; i < 4; i++) exports.push(await owner.session.export(memory.allocationId));
    await owner.session.ping();
    expect(daemon.openFds()).toBe(before);
    for (const { fd } of exports) {
      const mapped = await CudaImportedMemory.map(BigInt(memory.allocationId), { fd }, 2n * MiB, 2n * MiB, 0, false);
      expect((await mapped.read(0, 11)).toString()).toBe('from stock!');
      await mapped.close();
    }
    await memory.close();
    await owner.vmm.release({ allocationId: memory.allocationId });
    await eventually(async () => (daemon.openFds() === before - 1 ? true : undefined), 5_000, "the stock's kept descriptor to close");
  });

  it('answers a release on the socket before the driver has freed the memory; the quota is refunded once it has, and a release-allocate loop at the quota is never refused', async () => {
    const c = await client();
    // The session's quota is 8 MiB: four 2 MiB allocations fill it.
    // Both on the socket: the socket and gRPC are not ordered with each other.
    const allocate = async () => {
      const { message, fd } = await c.session.allocate(2n * MiB);
      addon.close(fd);
      return message.allocationId;
    };
    const live: string[] = [];
    for (let i = 0; i < 4; i++) live.push(await allocate());
    for (let round = 0; round < 20; round++) {
      // The allocate goes out right behind the release, not waiting for its answer.
      const released = c.session.release(live.shift()!);
      live.push(await allocate());
      expect(await released).toMatchObject({ freed: true });
    }
    for (const allocation of live) await c.session.release(allocation);
    const charged = async () => ((await c.admin.getReport()) as { quotas: { bySession: Record<string, string> } }).quotas.bySession[c.session.id];
    await eventually(async () => ((await charged()) === undefined ? true : undefined), 5_000, "the session's quota to be refunded");
  });

  it('refunds the quota on a release over the socket', async () => {
    const c = await client();
    const before = objectsOf(await daemon.stats());
    const a = await c.session.allocate(4n * MiB);
    addon.close(a.fd);
    const b = await c.session.allocate(4n * MiB);
    addon.close(b.fd);
    await expect(c.session.allocate(2n * MiB)).rejects.toMatchObject({ code: 'QUOTA_EXCEEDED' });
    await c.session.release(a.message.allocationId);
    const again = await c.session.allocate(2n * MiB);
    addon.close(again.fd);
    await c.session.release(b.message.allocationId);
    await c.session.release(again.message.allocationId);
    expect(objectsOf(await daemon.stats())).toEqual(before);
  });

  it('opens a device store on the socket and maps it here, counted as an open and dropped with the session', async () => {
    const owner = await client();
    const memory = await owner.vmm.allocate({ size: 2n * MiB });
    const bytes = Buffer.alloc(1024, 0x7e);
    await memory.write(0, bytes);
    const store = await owner.stores.createStore({ allocationId: memory.allocationId, name: 'cuda-socket-open' });
    const reader = await client();
    const opened = await reader.stores.open('cuda-socket-open');
    expect(opened.store).toMatchObject({ id: store.id, opens: 1 });
    expect((await addon.cudaCopyFromDevice(0, opened.memory.address, 16n)).equals(bytes.subarray(0, 16))).toBe(true);
    await opened.close();
    const raw = await reader.session.open({ name: 'cuda-socket-open' }, false);
    addon.close(raw.fd);
    expect((await owner.stores.list()).find((listed) => listed.id === store.id)?.opens).toBe(1);
    reader.close();
    await eventually(
      async () => ((await owner.stores.list()).find((listed) => listed.id === store.id)?.opens === 0 ? true : undefined),
      10_000,
      'the open to go with the session',
    );
    await owner.stores.detach('cuda-socket-open');
    await memory.close();
    await owner.vmm.release({ allocationId: memory.allocationId });
  });
});
