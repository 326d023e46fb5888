/**
 * What only the cuda backend has: real devices, host-located memory, the
 * driver's own errors, fabric handles where permitted, peers, and slow calls
 * kept off the event loop.
 */
import * as grpc from '@grpc/grpc-js';
import { connect, mapFabricHandle, VmmdClient } from '../../client';
import { addon, CU_LOCATION } from '../../native';
import type { AccessDescriptor } from '../../generated/vmmd/v1/AccessDescriptor';
import { call, MiB, Peer, TestDaemon } from '../e2e/harness';
import { cuda, describeGpu } from './gpu';

const RW: AccessDescriptor[] = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];

describeGpu('the cuda backend', () => {
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

  it('lists every device with name, UUID, compute capability, memory, granularity and fabric status', async () => {
    const { devices, backend } = await client.devices.listDevices();
    expect(backend).toBe('cuda');
    expect(devices).toHaveLength(cuda.deviceCount);
    for (const device of devices) {
      expect(device.kind).toBe('DEVICE_KIND_CUDA');
      expect(device.uuid).toMatch(/^GPU-[0-9a-f]{8}-/);
      expect(device.computeCapability).toMatch(/^\d+\.\d+$/);
      expect(BigInt(device.totalBytes)).toBeGreaterThan(0n);
      expect(BigInt(device.freeBytes)).toBeLessThanOrEqual(BigInt(device.totalBytes));
      expect(BigInt(device.granularityMinimum) % 4096n).toBe(0n);
      expect(device.handleTypes).toContain('HANDLE_TYPE_POSIX_FD');
      expect(device.fabricStatus).not.toBe('');
      expect(device.handleTypes.includes('HANDLE_TYPE_FABRIC')).toBe(device.fabricUsable);
    }
    console.log(`devices: ${JSON.stringify(devices, null, 1)}`);
  });

  it('selects devices by UUID as well as by index', async () => {
    const { devices } = await client.devices.listDevices();
    for (const device of devices) {
      const allocation = await client.vmm.create({ size: 2n * MiB, location: { type: 'LOCATION_TYPE_DEVICE', deviceUuid: device.uuid } });
      expect(allocation.device).toBe(device.index);
      expect((await client.devices.getMemoryInfo({ deviceUuid: device.uuid })).device).toBe(device.index);
      await client.vmm.release({ allocationId: allocation.id });
    }
    await expect(client.vmm.create({ size: 2n * MiB, location: { type: 'LOCATION_TYPE_DEVICE', deviceUuid: 'GPU-0000' } })).rejects.toMatchObject({
      code: 'UNKNOWN_DEVICE',
      status: grpc.status.OUT_OF_RANGE,
    });
  });

  it('answers out of memory with RESOURCE_EXHAUSTED, the requested and the free bytes, and the CUresult name', async () => {
    const { devices } = await client.devices.listDevices();
    const granularity = BigInt(devices[0].granularityMinimum);
    const tooMuch = (BigInt(devices[0].totalBytes) / granularity + 1n) * granularity;
    const error = await client.vmm.create({ size: tooMuch }).catch((e) => e);
    expect(error).toMatchObject({ code: 'CUDA_ERROR_OUT_OF_MEMORY', status: grpc.status.RESOURCE_EXHAUSTED });
    expect(error.message).toMatch(new RegExp(`requested ${tooMuch} bytes, \\d+ bytes free on device 0`));
  });

  it("refuses a plain HOST location with the driver's INVALID_VALUE as INVALID_ARGUMENT", async () => {
    const error = await client.vmm.create({ size: 2n * MiB, location: { type: 'LOCATION_TYPE_HOST', id: 0 } }).catch((e) => e);
    expect(error).toMatchObject({ code: 'CUDA_ERROR_INVALID_VALUE', status: grpc.status.INVALID_ARGUMENT });
  });

  it('creates HOST_NUMA memory that the device writes and, with host access set, the CPU reads at its mapped address', async () => {
    const { devices } = await client.devices.listDevices();
    const numa = Math.max(0, devices[0].hostNumaId);
    const granularity = BigInt((await client.devices.getGranularity({ location: { type: 'LOCATION_TYPE_HOST_NUMA', id: numa } })).minimum);
    const size = granularity;
    const allocation = await client.vmm.create({ size, location: { type: 'LOCATION_TYPE_HOST_NUMA', id: numa } });
    expect(allocation.location).toMatchObject({ type: 'LOCATION_TYPE_HOST_NUMA', id: numa });
    // In this process, through the driver directly: map, give the device and the host access, write on the device, read with the CPU.
    const exported = await client.vmm.export({ allocationId: allocation.id });
    const fd = await client.session.takeTransfer(exported.transferId);
    const handle = await addon.cudaImportFd(fd);
    addon.close(fd);
    const address = addon.cudaReserve(size, granularity, 0n);
    await addon.cudaMap(address, size, 0n, handle);
    await addon.cudaSetAccess(address, size, [
      { type: CU_LOCATION.DEVICE, id: 0, flags: 3 },
      { type: CU_LOCATION.HOST_NUMA, id: numa, flags: 3 },
    ]);
    await addon.cudaCopyToDevice(0, address, Buffer.from('numa bytes'));
    expect((await addon.hostCopyFromAddress(address, 10)).toString()).toBe('numa bytes');
    await addon.cudaUnmap(0, address, size);
    addon.cudaFreeAddress(address, size);
    await addon.cudaRelease(0, handle);
    await client.vmm.release({ allocationId: allocation.id });
  });

  it('keeps the event loop free and queries answered while many exports and unmaps run', async () => {
    const count = 256;
    const size = 2n * MiB;
    const reservation = await client.vmm.reserve({ size: size * BigInt(count) });
    const ids: string[] = [];
    for (let i = 0; i < count; i++) {
      const allocation = await client.vmm.create({ size });
      ids.push(allocation.id);
      await client.vmm.map({ address: BigInt(reservation.address) + size * BigInt(i), size, allocationId: allocation.id });
    }
    await client.admin.getStats({ resetEventLoopDelay: true });
    let batchDone = false;
    const answered = { stats: [] as number[], devices: [] as number[] };
    const start = performance.now();
    const probe = async (kind: 'stats' | 'devices', query: () => Promise<unknown>) => {
      while (!batchDone) {
        const sent = performance.now();
        await query();
        if (!batchDone) answered[kind].push(Math.round((performance.now() - sent) * 1000));
      }
    };
    const probes = [probe('stats', () => client.admin.getStats()), probe('devices', () => client.devices.listDevices())];
    const exported = await Promise.all(ids.map((id) => client.vmm.export({ allocationId: id })));
    const exportMs = performance.now() - start;
    await Promise.all(ids.map((_, i) => client.vmm.unmap({ address: BigInt(reservation.address) + size * BigInt(i), size })));
    const batchMs = performance.now() - start;
    batchDone = true;
    await Promise.all(probes);
    const loop = await client.admin.getStats();
    for (const response of exported) addon.close(await client.session.takeTransfer(response.transferId));
    for (const id of ids) await client.vmm.release({ allocationId: id });
    await client.vmm.freeAddress({ address: reservation.address, size: size * BigInt(count) });
    const summary = (values: number[]) => {
      const sorted = [...values].sort((a, b) => a - b);
      return `${values.length} answered, p50 ${sorted[sorted.length >> 1] ?? '-'} µs, max ${sorted[sorted.length - 1] ?? '-'} µs`;
    };
    console.log(
      `${count} exports took ${exportMs.toFixed(1)} ms, then ${count} unmaps: ${batchMs.toFixed(1)} ms in all. ` +
        `Meanwhile GetStats: ${summary(answered.stats)}; ListDevices: ${summary(answered.devices)}; ` +
        `daemon event loop delay max ${loop.eventLoopDelayMaxUs} µs, p99 ${loop.eventLoopDelayP99Us} µs`,
    );
    expect(answered.stats.length).toBeGreaterThanOrEqual(3);
    expect(answered.devices.length).toBeGreaterThanOrEqual(1);
  });

  it('hands fabric allocations out as bytes that a process without a descriptor maps, where the host permits fabric', async () => {
    const { devices } = await client.devices.listDevices();
    if (!devices[0].fabricUsable) {
      console.warn(`fabric test skipped: ${devices[0].fabricStatus}`);
      await expect(client.vmm.create({ size: 2n * MiB, handleType: 'HANDLE_TYPE_FABRIC' })).rejects.toMatchObject({
        code: 'UNSUPPORTED_HANDLE_TYPE',
      });
      return;
    }
    const allocation = await call(daemon.raw.vmm, 'Create', { size: String(2n * MiB), handleType: 'HANDLE_TYPE_FABRIC' });
    const exported = await call(daemon.raw.vmm, 'Export', { allocationId: allocation.id, handleType: 'HANDLE_TYPE_FABRIC' });
    expect(exported.fabricHandle).toHaveLength(64);
    const memory = await mapFabricHandle(exported.fabricHandle, 2n * MiB, BigInt(exported.granularity), 0);
    await memory.write(0, Buffer.from('fabric'));
    expect((await memory.read(0, 6)).toString()).toBe('fabric');
    await memory.close();
    await call(daemon.raw.vmm, 'Release', { allocationId: allocation.id });
  });

  (cuda.deviceCount >= 2 ? it : it.skip)('gives a second device access where peer access exists, and refuses clearly where not', async () => {
    const allocation = await client.vmm.create({ size: 2n * MiB });
    const reservation = await client.vmm.reserve({ size: 2n * MiB });
    await client.vmm.map({ address: reservation.address, size: 2n * MiB, allocationId: allocation.id });
    const both: AccessDescriptor[] = [...RW, { location: { type: 'LOCATION_TYPE_DEVICE', id: 1 }, flags: 'ACCESS_FLAGS_READWRITE' }];
    const peer = addon.cudaCanAccessPeer(1, 0);
    const result = client.vmm.setAccess({ address: reservation.address, size: 2n * MiB, descriptors: both });
    if (peer) await result;
    else await expect(result).rejects.toMatchObject({ code: 'PEER_ACCESS_UNSUPPORTED', status: grpc.status.FAILED_PRECONDITION });
    await client.vmm.unmap({ address: reservation.address, size: 2n * MiB });
  });

  (cuda.deviceCount >= 2 ? it : it.skip)('creates on the last device, and another process maps it onto that device', async () => {
    const last = cuda.deviceCount - 1;
    const allocation = await client.vmm.create({ size: 2n * MiB, location: { type: 'LOCATION_TYPE_DEVICE', id: last } });
    expect(allocation.device).toBe(last);
    const reservation = await client.vmm.reserve({ size: 2n * MiB });
    await client.vmm.map({ address: reservation.address, size: 2n * MiB, allocationId: allocation.id });
    const access: AccessDescriptor[] = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: last }, flags: 'ACCESS_FLAGS_READWRITE' }];
    await client.vmm.setAccess({ address: reservation.address, size: 2n * MiB, descriptors: access });
    await client.vmm.write(reservation.address, Buffer.from(`on device ${last}`));
    const { shareKey } = await client.vmm.share({ allocationId: allocation.id });
    const other = await Peer.start(daemon.dir);
    try {
      const mapped = await other.do({ op: 'import', allocationId: allocation.id, shareKey });
      expect((await other.do({ op: 'peek', handle: mapped.handle, offset: 0, length: 11 })).text).toBe(`on device ${last}`);
    } finally {
      await other.stop();
    }
    await client.vmm.unmap({ address: reservation.address, size: 2n * MiB });
  });

  it('imports a device pointer into another process that reads what the daemon wrote', async () => {
    const allocation = await client.vmm.create({ size: 4n * MiB });
    const reservation = await client.vmm.reserve({ size: 4n * MiB });
    await client.vmm.map({ address: reservation.address, size: 4n * MiB, allocationId: allocation.id });
    await client.vmm.setAccess({ address: reservation.address, size: 4n * MiB, descriptors: RW });
    await client.vmm.write(BigInt(reservation.address) + 123n, Buffer.from('written by the daemon'));
    const { shareKey } = await client.vmm.share({ allocationId: allocation.id });
    const other = await Peer.start(daemon.dir);
    try {
      const mapped = await other.do({ op: 'import', allocationId: allocation.id, shareKey });
      expect((await other.do({ op: 'peek', handle: mapped.handle, offset: 123, length: 21 })).text).toBe('written by the daemon');
    } finally {
      await other.stop();
    }
  });
});
