/**
 * First numbers for the host backend: latency of the cheapest RPC, of
 * create/release, of the full daemon-side map cycle, of import into this
 * process (export, descriptor, map), and Read/Write throughput.
 * Run: npm run build && node dist/bench/host-latency.js [--json FILE]
 * It starts its own daemon on a temporary socket directory.
 */
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { connect, VmmdClient } from '../client';
import type { AccessDescriptor } from '../generated/vmmd/v1/AccessDescriptor';

const MiB = 1n << 20n;
const RW: AccessDescriptor[] = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];

function percentile(sorted: number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

async function measure(name: string, iterations: number, body: () => Promise<unknown>) {
  for (let i = 0; i < Math.min(50, iterations); i++) await body();
  const samples: number[] = [];
  for (let i = 0; i < iterations; i++) {
    const start = process.hrtime.bigint();
    await body();
    samples.push(Number(process.hrtime.bigint() - start) / 1000);
  }
  samples.sort((a, b) => a - b);
  return { name, iterations, p50_us: +percentile(samples, 50).toFixed(1), p99_us: +percentile(samples, 99).toFixed(1) };
}

async function throughput(client: VmmdClient, size: bigint) {
  const allocation = await client.vmm.create({ size });
  const reservation = await client.vmm.reserve({ size });
  await client.vmm.map({ address: reservation.address, size, allocationId: allocation.id });
  await client.vmm.setAccess({ address: reservation.address, size, descriptors: RW });
  const data = Buffer.alloc(Number(size), 0x5a);
  let start = process.hrtime.bigint();
  await client.vmm.write(reservation.address, data);
  const writeSeconds = Number(process.hrtime.bigint() - start) / 1e9;
  start = process.hrtime.bigint();
  const back = await client.vmm.read(reservation.address, size);
  const readSeconds = Number(process.hrtime.bigint() - start) / 1e9;
  if (!back.equals(data)) throw new Error('read back differs');
  // The reference: one memcpy between two warm buffers of the same size, in this process.
  const target = Buffer.alloc(data.length, 1);
  start = process.hrtime.bigint();
  data.copy(target);
  const memcpySeconds = Number(process.hrtime.bigint() - start) / 1e9;
  await client.vmm.unmap({ address: reservation.address, size });
  await client.vmm.freeAddress({ address: reservation.address, size });
  await client.vmm.release({ allocationId: allocation.id });
  const gbps = (seconds: number) => +(Number(size) / seconds / 1e9).toFixed(2);
  return { bytes: Number(size), write_GBps: gbps(writeSeconds), read_GBps: gbps(readSeconds), memcpy_GBps: gbps(memcpySeconds) };
}

async function main() {
  const jsonAt = process.argv.indexOf('--json');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-bench-'));
  const root = path.resolve(__dirname, '..', '..');
  const daemon = spawn(process.execPath, [path.join(root, 'bin', 'vmmd.js'), '--backend', 'host', '--socket-dir', dir, '--log-level', 'warn'], {
    stdio: 'inherit',
  });
  let client: VmmdClient | undefined;
  for (let attempt = 0; client === undefined; attempt++) {
    try {
      client = await connect({ socketDir: dir });
    } catch (error) {
      if (attempt > 100) throw error;
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  }
  const c = client;
  const granule = 2n * MiB;
  const reservation = await c.vmm.reserve({ size: granule });
  const results = [
    await measure('ListDevices (RPC floor)', 2000, () => c.devices.listDevices()),
    await measure('Create + Release 2 MiB', 1000, async () => {
      const allocation = await c.vmm.create({ size: granule });
      await c.vmm.release({ allocationId: allocation.id });
    }),
    await measure('Map + SetAccess + Unmap 2 MiB (daemon side)', 1000, async () => {
      const allocation = await c.vmm.create({ size: granule });
      await c.vmm.map({ address: reservation.address, size: granule, allocationId: allocation.id });
      await c.vmm.setAccess({ address: reservation.address, size: granule, descriptors: RW });
      await c.vmm.unmap({ address: reservation.address, size: granule });
      await c.vmm.release({ allocationId: allocation.id });
    }),
    await measure('Create + import into this process + close + Release 2 MiB', 1000, async () => {
      const allocation = await c.vmm.create({ size: granule });
      const memory = await c.vmm.import(allocation.id);
      await memory.close();
      await c.vmm.release({ allocationId: allocation.id });
    }),
  ];
  const streaming = await throughput(c, 256n * MiB);
  const report = {
    machine: `${os.cpus()[0]?.model ?? 'unknown cpu'}, ${os.cpus().length} cores, ${Math.round(os.totalmem() / 2 ** 30)} GiB, ${os.release()}`,
    node: process.version,
    date: new Date().toISOString(),
    latency: results,
    streaming,
  };
  console.table(results);
  console.table([streaming]);
  if (jsonAt > 0) fs.writeFileSync(process.argv[jsonAt + 1], `${JSON.stringify(report, null, 2)}\n`);
  c.close();
  daemon.kill('SIGTERM');
  await new Promise((resolve) => daemon.once('exit', resolve));
  fs.rmSync(dir, { recursive: true, force: true });
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
