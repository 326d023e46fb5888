/**
 * 5. Read/Write throughput of the VirtualMemory service (client library, the
 * path it picks) against memcpy of the same bytes in one process.
 */
import type { VmmdClient } from '../../client';
import { Section } from '../lib/stats';

const MiB = 1n << 20n;

const median = (values: number[]) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];

export async function streaming(client: VmmdClient, megabytes: number, repeats: number): Promise<Section> {
  const size = BigInt(megabytes) * MiB;
  const { granularity } = { granularity: BigInt((await client.devices.getGranularity()).minimum) };
  const rounded = ((size + granularity - 1n) / granularity) * granularity;
  const allocation = await client.vmm.create({ size: rounded });
  const reservation = await client.vmm.reserve({ size: rounded });
  await client.vmm.map({ address: reservation.address, size: rounded, allocationId: allocation.id });
  await client.vmm.setAccess({
    address: reservation.address,
    size: rounded,
    descriptors: [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }],
  });
  const data = Buffer.alloc(Number(size));
  for (let i = 0; i < data.length; i += 4096) data[i] = i & 0xff;
  const gbps = (seconds: number) => +(Number(size) / seconds / 1e9).toFixed(2);
  const time = async (body: () => Promise<unknown> | unknown) => {
    const start = performance.now();
    await body();
    return (performance.now() - start) / 1000;
  };
  const writes: number[] = [];
  const reads: number[] = [];
  const copies: number[] = [];
  const target = Buffer.alloc(data.length, 1);
  for (let i = 0; i < repeats; i++) {
    writes.push(gbps(await time(() => client.vmm.write(reservation.address, data))));
    let back: Buffer | undefined;
    reads.push(gbps(await time(async () => (back = await client.vmm.read(reservation.address, size)))));
    if (!back!.equals(data)) throw new Error('streaming: the bytes read back differ from those written');
    copies.push(gbps(await time(() => data.copy(target))));
  }
  await client.vmm.unmap({ address: reservation.address, size: rounded });
  await client.vmm.freeAddress({ address: reservation.address, size: rounded });
  await client.vmm.release({ allocationId: allocation.id });
  const write = median(writes);
  const read = median(reads);
  const memcpy = median(copies);
  return {
    id: 'streaming',
    title: `Read/Write throughput, ${megabytes} MiB (median of ${repeats})`,
    rows: [
      { operation: 'vmmd Write', GB_s: write, best_GB_s: Math.max(...writes), vs_memcpy: +(write / memcpy).toFixed(3) },
      { operation: 'vmmd Read', GB_s: read, best_GB_s: Math.max(...reads), vs_memcpy: +(read / memcpy).toFixed(3) },
      { operation: 'memcpy in one process (reference)', GB_s: memcpy, best_GB_s: Math.max(...copies), vs_memcpy: 1 },
    ],
    targets: [
      {
        target: 'Read and Write ≥ 1 GB/s (host backend)',
        measured: `write ${write} GB/s, read ${read} GB/s (${client.backend})`,
        limit: '1 GB/s',
        met: Math.min(write, read) >= 1,
      },
    ],
  };
}
