/**
 * The fast paths on a GPU: Allocate served from the default stock
 * (created and exported ahead), memory usable by this process's CUDA
 * context, and bulk Read/Write through the staging buffer with device copies.
 */
import { connect, VmmdClient } from '../../client';
import { addon } from '../../native';
import type { AccessDescriptor } from '../../generated/vmmd/v1/AccessDescriptor';
import { eventually, MiB, TestDaemon } from '../e2e/harness';
import { describeGpu } from './gpu';
import { defaultStock } from '../../server/app/config';

const RW: AccessDescriptor[] = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];

describeGpu('fast paths on the cuda backend', () => {
  let daemon: TestDaemon;
  let client: VmmdClient;

  beforeAll(async () => {
    daemon = await TestDaemon.start([], 'cuda');
    client = await connect({ socketDir: daemon.dir, stagingBytes: 4 << 20 });
  });

  afterAll(async () => {
    client.close();
    expect(await daemon.stop()).toBe(0);
  });

  it('stocks 2 MiB and 32 MiB allocations by default, and Allocate takes them', async () => {
    const report = (await client.admin.getReport()) as { stock: { levels: Array<{ size: string; held: number }>; hits: number } };
    expect(report.stock.levels.filter((level) => level.size === String(2n * MiB))[0].held).toBe(
      defaultStock('cuda').find((level) => level.size === 2n * MiB)!.depth,
    );
    const memory = await client.vmm.allocate({ size: 2n * MiB });
    const bytes = Buffer.alloc(1 << 20, 0x5c);
    await memory.write(4096, bytes);
    expect((await memory.read(4096, bytes.length)).equals(bytes)).toBe(true);
    // The device pointer is this process's: a copy through its own context sees the same bytes.
    expect((await addon.cudaCopyFromDevice(0, memory.address + 4096n, 16n)).equals(bytes.subarray(0, 16))).toBe(true);
    const after = (await client.admin.getReport()) as { stock: { hits: number } };
    expect(after.stock.hits).toBe(report.stock.hits + 1);
    await memory.close();
    await client.vmm.release({ allocationId: memory.allocationId });
    await eventually(
      async () => {
        const now = (await client.admin.getReport()) as { stock: { levels: Array<{ size: string; held: number }> } };
        return now.stock.levels.every((level) => level.held > 0) ? true : undefined;
      },
      10_000,
      'the stock to refill',
    );
  });

  it('reads and writes device memory through the staging buffer, in slices', async () => {
    const size = 8n * MiB;
    const allocation = await client.vmm.create({ size });
    const reservation = await client.vmm.reserve({ size });
    await client.vmm.map({ address: reservation.address, size, allocationId: allocation.id });
    await client.vmm.setAccess({ address: reservation.address, size, descriptors: RW });
    const data = Buffer.alloc(7 * (1 << 20) + 123);
    for (let i = 0; i < data.length; i++) data[i] = (i * 31) & 0xff;
    await client.vmm.write(BigInt(reservation.address) + 100n, data);
    expect((await client.vmm.read(BigInt(reservation.address) + 100n, data.length)).equals(data)).toBe(true);
    await client.vmm.unmap({ address: reservation.address, size });
    await client.vmm.freeAddress({ address: reservation.address, size });
    await client.vmm.release({ allocationId: allocation.id });
  });
});
