/**
 * 2. Pooled memalloc + free through the NBEP 7 manager.
 * 3. Cold memalloc: a new allocation from the daemon (create, export,
 *    descriptor, import, map, access) against the same steps in one process,
 *    and (cuda) against cuMemAlloc.
 * 4. Descriptor handoff: export → received → imported and mapped.
 */
import type { VmmdClient } from '../../client';
import { VmmdMemoryManager } from '../../client/emm/vmmd-manager';
import type { MemoryPointer } from '../../client/emm/memory';
import { addon, CU_LOCATION, HOST_ACCESS } from '../../native';
import { ratio, Row, sample, sampleSync, Section, summarize } from '../lib/stats';

const KiB = 1024n;
const MiB = 1024n * KiB;
const GiB = 1024n * MiB;

export const sizeName = (size: bigint) =>
  size >= GiB ? `${size / GiB} GiB` : size >= MiB ? `${size / MiB} MiB` : size >= KiB ? `${size / KiB} KiB` : `${size} B`;

/** A manager whose every memalloc is pooled (the default pool) or, with `cold`, its own allocation from the daemon. */
export async function manager(client: VmmdClient, cold: boolean): Promise<VmmdMemoryManager> {
  const made = new VmmdMemoryManager({
    client,
    device: 0,
    backend: client.backend as 'host' | 'cuda',
    // Cold: nothing pooled, and frees run at once, so each memalloc goes to the daemon.
    ...(cold ? { pool: { chunkSize: 2n * MiB, largeThreshold: 0n }, deferred: { count: 0, ratio: 1 } } : {}),
  });
  await made.initialize();
  return made;
}

export const POOLED_SIZES = [1n * KiB, 64n * KiB, 1n * MiB];

export async function pooled(client: VmmdClient, iterations: number): Promise<Section> {
  const emm = await manager(client, false);
  const rows: Row[] = [];
  for (const size of POOLED_SIZES) {
    let pointer: MemoryPointer;
    const samples = await sample(iterations, async () => {
      pointer = await emm.memalloc(size);
      await pointer.free();
    }, { warmup: 2000 });
    rows.push({ allocator: 'vmmd NBEP 7 manager (pooled)', size: sizeName(size), ...summarize(samples) });
  }
  await emm.reset();
  return { id: 'pooled', title: 'Pooled memalloc + free through the NBEP 7 manager', rows };
}

export const COLD_SIZES: Array<[bigint, number]> = [
  [2n * MiB, 1],
  [64n * MiB, 0.5],
  [1n * GiB, 0.15],
];

/** The daemon's steps in this process: create, export, import, reserve, map, set access. Torn down untimed. */
function inProcessSteps(backend: string, size: bigint): { run: () => Promise<() => Promise<void>> } {
  if (backend === 'cuda') {
    const access = [{ type: CU_LOCATION.DEVICE, id: 0, flags: 3 }];
    return {
      run: async () => {
        const handle = addon.cudaCreate(0, CU_LOCATION.DEVICE, 0, size, 1);
        const fd = await addon.cudaExportFd(0, handle);
        const imported = addon.cudaImportFd(fd);
        const address = addon.cudaReserve(size, 0n, 0n);
        addon.cudaMap(address, size, 0n, imported);
        addon.cudaSetAccess(address, size, access);
        return async () => {
          await addon.cudaUnmap(0, address, size);
          addon.cudaFreeAddress(address, size);
          await addon.cudaRelease(0, imported);
          await addon.cudaRelease(0, handle);
          addon.close(fd);
        };
      },
    };
  }
  return {
    run: async () => {
      const fd = addon.hostMemfdCreate('bench', size);
      const exported = addon.dup(fd);
      const address = addon.hostReserve(size, 2n * MiB, 0n);
      addon.hostMap(address, size, exported, 0n);
      addon.hostProtect(address, size, HOST_ACCESS.READWRITE);
      return async () => {
        addon.hostUnmap(address, size);
        addon.hostFreeAddress(address, size);
        addon.close(exported);
        addon.close(fd);
      };
    },
  };
}

export async function cold(client: VmmdClient, iterations: number): Promise<Section> {
  const emm = await manager(client, true);
  const rows: Row[] = [];
  const targets = [];
  for (const [size, share] of COLD_SIZES) {
    const count = Math.max(10, Math.round(iterations * share));
    const daemon = summarize(await sample(count, () => emm.memalloc(size), { warmup: 5, after: (pointer) => pointer.free() }));
    const steps = inProcessSteps(client.backend, size);
    const local = summarize(await sample(count, steps.run, { warmup: 5, after: (teardown) => teardown() }));
    rows.push({ path: 'vmmd memalloc across processes', size: sizeName(size), ...daemon, p50_vs_in_process: ratio(daemon.p50_us, local.p50_us) });
    rows.push({ path: 'same steps in one process', size: sizeName(size), ...local, p50_vs_in_process: 1 });
    if (client.backend === 'cuda') {
      const memAlloc = summarize(sampleSync(count, () => addon.cudaMemAlloc(0, size), (pointer) => addon.cudaMemFree(0, pointer), 5));
      rows.push({ path: 'cuMemAlloc in one process', size: sizeName(size), ...memAlloc, p50_vs_in_process: ratio(memAlloc.p50_us, local.p50_us) });
    }
    if (size === 2n * MiB) {
      targets.push({
        target: 'cold 2 MiB memalloc across processes, p50 < 400 µs (GPU host)',
        measured: `${daemon.p50_us} µs (${client.backend})`,
        limit: '400 µs',
        met: daemon.p50_us < 400,
      });
    }
  }
  await emm.reset();
  return {
    id: 'cold',
    title: 'Cold memalloc: a new allocation from the daemon, mapped here',
    rows,
    targets,
    notes: [
      'vmmd: one Allocate RPC (create + export), the descriptor on the session socket, import, reserve, map and set access in this process.',
      'Published reference: legacy cuIpcOpenMemHandle about 1.3 ms.',
    ],
  };
}

export async function handoff(client: VmmdClient, iterations: number): Promise<Section> {
  const size = 2n * MiB;
  const allocation = await client.vmm.create({ size });
  const samples = await sample(iterations, () => client.vmm.import(allocation.id), { warmup: 20, after: (memory) => memory.close() });
  await client.vmm.release({ allocationId: allocation.id });
  return {
    id: 'handoff',
    title: 'Descriptor handoff: export → received → imported and mapped (2 MiB)',
    rows: [{ step: 'Export RPC + descriptor on the session socket + import + map + access', size: sizeName(size), ...summarize(samples) }],
  };
}
