/**
 * 5. Read/Write throughput of the VirtualMemory service (client library, the
 * path it picks) against memcpy of the same bytes in one process.
 */
import { connect, VmmdClient } from '../../client';
import { Section } from '../lib/stats';

const MiB = 1n << 20n;

const median = (values: number[]) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];

/** Memory of `client`'s own, mapped with read-write access for device 0. */
async function mappedRange(client: VmmdClient, size: bigint) {
  const granularity = BigInt((await client.devices.getGranularity()).minimum);
  const rounded = ((size + granularity - 1n) / granularity) * granularity;
  const allocation = await client.vmm.create({ size: rounded });
  const reservation = await client.vmm.reserve({ size: rounded });
  await client.vmm.map({ address: reservation.address, size: rounded, allocationId: allocation.id });
  await client.vmm.setAccess({
    address: reservation.address,
    size: rounded,
    descriptors: [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }],
  });
  return {
    address: reservation.address,
    release: async () => {
      await client.vmm.unmap({ address: reservation.address, size: rounded });
      await client.vmm.freeAddress({ address: reservation.address, size: rounded });
      await client.vmm.release({ allocationId: allocation.id });
    },
  };
}

/** The same bytes over the gRPC streams alone (a client without a staging buffer): what grpcurl and TCP clients get. */
async function streamedOnly(client: VmmdClient, data: Buffer) {
  const plain = await connect({ socketDir: client.socketDir, stagingBytes: 0 });
  try {
    const slice = data.subarray(0, 64 << 20);
    const { address } = await mappedRange(plain, BigInt(slice.length));
    let start = performance.now();
    await plain.vmm.write(address, slice);
    const write = slice.length / ((performance.now() - start) / 1000) / 1e9;
    start = performance.now();
    await plain.vmm.read(address, slice.length);
    const read = slice.length / ((performance.now() - start) / 1000) / 1e9;
    return [
      { operation: 'vmmd Write, gRPC stream only (64 MiB)', GB_s: +write.toFixed(2), best_GB_s: null, vs_memcpy: null },
      { operation: 'vmmd Read, gRPC stream only (64 MiB)', GB_s: +read.toFixed(2), best_GB_s: null, vs_memcpy: null },
    ];
  } finally {
    plain.close();
  }
}

export async function streaming(client: VmmdClient, megabytes: number, repeats: number): Promise<Section> {
  const size = BigInt(megabytes) * MiB;
  const { address, release } = await mappedRange(client, size);
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
  const freshReads: number[] = [];
  const copies: number[] = [];
  // Warm targets, as memcpy's: a fresh buffer's page faults cost as much as the copy on some machines.
  const target = Buffer.alloc(data.length, 1);
  const back = Buffer.alloc(data.length, 2);
  for (let i = 0; i < repeats; i++) {
    writes.push(gbps(await time(() => client.vmm.write(address, data))));
    back.fill(0, 0, 4096);
    reads.push(gbps(await time(() => client.vmm.readInto(address, back))));
    if (!back.equals(data)) throw new Error('streaming: the bytes read back differ from those written');
    freshReads.push(gbps(await time(() => client.vmm.read(address, size))));
    copies.push(gbps(await time(() => data.copy(target))));
  }
  await release();
  const write = median(writes);
  const read = median(reads);
  const memcpy = median(copies);
  return {
    id: 'streaming',
    title: `Read/Write throughput, ${megabytes} MiB (median of ${repeats})`,
    rows: [
      { operation: 'vmmd Write', GB_s: write, best_GB_s: Math.max(...writes), vs_memcpy: +(write / memcpy).toFixed(3) },
      { operation: 'vmmd Read (readInto a warm buffer)', GB_s: read, best_GB_s: Math.max(...reads), vs_memcpy: +(read / memcpy).toFixed(3) },
      {
        operation: 'vmmd Read (read: a new buffer each time)',
        GB_s: median(freshReads),
        best_GB_s: Math.max(...freshReads),
        vs_memcpy: +(median(freshReads) / memcpy).toFixed(3),
      },
      { operation: 'memcpy in one process (reference)', GB_s: memcpy, best_GB_s: Math.max(...copies), vs_memcpy: 1 },
      ...(await streamedOnly(client, data)),
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
