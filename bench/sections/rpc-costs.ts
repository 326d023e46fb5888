/**
 * Where the time of a cold allocation goes: each VirtualMemory RPC on its
 * own, p50 over many calls, next to the cheapest RPC. The difference between
 * a call and GetGranularity is what the daemon adds to the transport for it.
 */
import * as grpc from '@grpc/grpc-js';
import type { VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import { addon } from '../../native';
import { Row, sample, Section, summarize } from '../lib/stats';

const MiB = 1n << 20n;
const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' as const }];

export async function rpcCosts(client: VmmdClient, iterations: number): Promise<Section> {
  const vmm = client.vmm;
  const granule = 2n * MiB;
  // The library's release() takes the session socket (bench/sections/session-ops.ts): this row is the RPC's.
  const metadata = new grpc.Metadata();
  metadata.set(SESSION_METADATA_KEY, client.session.token);
  const raw = (vmm as unknown as { client: { Release(request: object, metadata: grpc.Metadata, callback: (error: Error | null) => void): void } }).client;
  const releaseRpc = (allocationId: string) =>
    new Promise<void>((resolve, reject) => raw.Release({ allocationId }, metadata, (error) => (error ? reject(error) : resolve())));
  const rows: Row[] = [];
  const add = (call: string, samples: number[]) => rows.push({ call, ...summarize(samples) });
  add('GetGranularity', await sample(iterations, () => client.devices.getGranularity()));
  if (client.backend === 'cuda') {
    // Does a CUDA context in this (client) process slow its RPCs down? Measured, not assumed.
    addon.cudaLoad();
    const pointer = addon.cudaMemAlloc(0, 2n * MiB);
    addon.cudaMemFree(0, pointer);
    add('GetGranularity, once this process has a CUDA context', await sample(iterations, () => client.devices.getGranularity()));
  }
  const times = {
    reserve: [] as number[],
    free: [] as number[],
    create: [] as number[],
    create4: [] as number[],
    map: [] as number[],
    access: [] as number[],
    unmap: [] as number[],
    release: [] as number[],
    exportCall: [] as number[],
    allocate: [] as number[],
  };
  const at = () => performance.now() * 1000;
  for (let i = 0; i < iterations + 20; i++) {
    const keep = i >= 20;
    let t = at();
    const reservation = await vmm.reserve({ size: granule });
    if (keep) times.reserve.push(at() - t);
    t = at();
    const allocation = await vmm.create({ size: granule });
    if (keep) times.create.push(at() - t);
    t = at();
    await vmm.map({ address: reservation.address, size: granule, allocationId: allocation.id });
    if (keep) times.map.push(at() - t);
    t = at();
    await vmm.setAccess({ address: reservation.address, size: granule, descriptors: RW });
    if (keep) times.access.push(at() - t);
    t = at();
    const exported = await vmm.export({ allocationId: allocation.id, handleType: 'HANDLE_TYPE_POSIX_FD' });
    if (keep) times.exportCall.push(at() - t);
    addon.close(await client.session.takeTransfer(exported.transferId));
    t = at();
    await vmm.unmap({ address: reservation.address, size: granule });
    if (keep) times.unmap.push(at() - t);
    t = at();
    await releaseRpc(allocation.id);
    if (keep) times.release.push(at() - t);
    t = at();
    await vmm.freeAddress({ address: reservation.address, size: granule });
    if (keep) times.free.push(at() - t);
    t = at();
    const other = await vmm.create({ size: 2n * granule });
    if (keep) times.create4.push(at() - t);
    await vmm.release({ allocationId: other.id });
    t = at();
    const allocated = await vmm.allocateRaw({ size: granule });
    if (keep) times.allocate.push(at() - t);
    addon.close(await client.session.takeTransfer(allocated.transferId));
    await vmm.release({ allocationId: allocated.allocationId });
  }
  add('Reserve', times.reserve);
  add('Create 2 MiB (stocked where the stock has it)', times.create);
  add('Create 4 MiB (never stocked)', times.create4);
  add('Map', times.map);
  add('SetAccess', times.access);
  add('Export (a driver thread on cuda)', times.exportCall);
  add('Allocate 2 MiB (create + export)', times.allocate);
  add('Unmap (a driver thread on cuda)', times.unmap);
  add('Release (a driver thread on cuda)', times.release);
  add('FreeAddress', times.free);
  return { id: 'rpc-costs', title: 'Each VirtualMemory RPC alone (where a cold allocation spends its time)', rows };
}
