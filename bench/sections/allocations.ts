/**
 * 2. Pooled memalloc + free through the NBEP 7 manager.
 * 3. Cold memalloc: a new allocation from the daemon (create, export,
 *    descriptor, import, map, access) against the same steps in one process,
 *    and (cuda) against cuMemAlloc.
 * 4. Descriptor handoff: export → received → imported and mapped.
 */
import type { VmmdClient } from '../../client';
import { DEFAULT_AHEAD } from '../../client/emm/ahead';
import { VmmdMemoryManager } from '../../client/emm/vmmd-manager';
import type { MemoryPointer } from '../../client/emm/memory';
import { CudaImportedMemory, HostImportedMemory } from '../../client/local-memory';
import { addon, CU_LOCATION, HOST_ACCESS } from '../../native';
import { execFileSync } from 'node:child_process';
import * as os from 'node:os';
import * as path from 'node:path';
import { packageRoot } from '../lib/daemon';
import { ratio, Row, sample, sampleSync, Section, summarize, Target } from '../lib/stats';

const KiB = 1024n;
const MiB = 1024n * KiB;
const GiB = 1024n * MiB;

export const sizeName = (size: bigint) =>
  size >= GiB ? `${size / GiB} GiB` : size >= MiB ? `${size / MiB} MiB` : size >= KiB ? `${size / KiB} KiB` : `${size} B`;

/**
 * A manager whose every memalloc is pooled (the default pool) or, with `cold`, its own allocation from the daemon
 * (with `nothingAhead`, none received before it is asked for: each waits for its allocate round trip).
 */
export async function manager(client: VmmdClient, cold: boolean, nothingAhead = false): Promise<VmmdMemoryManager> {
  const made = new VmmdMemoryManager({
    client,
    device: 0,
    backend: client.backend as 'host' | 'cuda',
    // Cold: nothing pooled, and frees run at once, so each memalloc goes to the daemon.
    ...(cold ? { pool: { chunkSize: 2n * MiB, largeThreshold: 0n }, deferred: { count: 0, ratio: 1 } } : {}),
    ...(nothingAhead ? { ahead: { ...DEFAULT_AHEAD, maxBytes: 0n } } : {}),
  });
  await made.initialize();
  return made;
}

export const POOLED_SIZES = [1n * KiB, 64n * KiB, 1n * MiB];

/** Rounds of the pooled comparison: vmmd's loop, then CuPy's, each round (the median round counts). */
export const POOLED_ROUNDS = 3;

/**
 * Pins this process (every thread) to one CPU, by taskset, so that vmmd's
 * loop and CuPy's (pinned to the same CPU) run on the same core: a process
 * otherwise lands in a fast or a slow state of its own (one twice the other
 * for the same loop).
 * @returns the CPU and how to give the process back the CPUs it had (later
 *   sections, and the processes they start, which inherit it, must not run
 *   pinned: they would all share one CPU), or undefined where taskset is missing or refused
 */
function pinToOneCpu(): { cpu: number; unpin(): void } | undefined {
  const cpu = os.cpus().length - 1;
  try {
    const mask = /affinity mask: ([0-9a-f,]+)/i.exec(execFileSync('taskset', ['-p', String(process.pid)], { encoding: 'utf8' }))?.[1];
    if (mask === undefined) return undefined;
    execFileSync('taskset', ['-a', '-cp', String(cpu), String(process.pid)], { stdio: 'ignore' });
    return { cpu, unpin: () => execFileSync('taskset', ['-a', '-p', mask, String(process.pid)], { stdio: 'ignore' }) };
  } catch {
    return undefined;
  }
}

/** CuPy's MemoryPool (and, with `numba`, Numba's default allocator), by bench/reference/cupy_numba.py, in this run, on `cpu` when given. */
function pythonReferences(iterations: number, numba: boolean, cpu: number | undefined): { rows: Row[]; errors: string[] } {
  const script = path.join(packageRoot, 'bench', 'reference', 'cupy_numba.py');
  const args = [script, POOLED_SIZES.join(','), String(iterations), numba ? 'all' : 'cupy'];
  try {
    const output =
      cpu === undefined
        ? execFileSync('python3', args, { encoding: 'utf8', timeout: 300_000, stdio: ['ignore', 'pipe', 'inherit'] })
        : execFileSync('taskset', ['-c', String(cpu), 'python3', ...args], { encoding: 'utf8', timeout: 300_000, stdio: ['ignore', 'pipe', 'inherit'] });
    const parsed = JSON.parse(output) as { rows: Row[]; errors: string[] };
    return { rows: parsed.rows.map((row) => ({ ...row, size: sizeName(BigInt(row.size as number)) })), errors: parsed.errors };
  } catch (error) {
    return { rows: [], errors: [`python3 ${script}: ${(error as Error).message.split('\n')[0]}`] };
  }
}

/** Of one allocator's rows for one size, one a round: the median round's, with every round's p50 beside it. */
function medianRound(rounds: Row[]): Row {
  const sorted = [...rounds].sort((a, b) => (a.p50_us as number) - (b.p50_us as number));
  return { ...sorted[Math.floor((sorted.length - 1) / 2)], round_p50s_us: rounds.map((row) => row.p50_us).join(' / ') };
}

async function pooledRound(emm: VmmdMemoryManager, iterations: number, warmup: number): Promise<Row[]> {
  const rows: Row[] = [];
  for (const size of POOLED_SIZES) {
    let pointer: MemoryPointer;
    const samples = await sample(
      iterations,
      async () => {
        pointer = await emm.memalloc(size);
        await pointer.free();
      },
      { warmup },
    );
    rows.push({ allocator: 'vmmd NBEP 7 manager (pooled)', size: sizeName(size), ...summarize(samples) });
  }
  return rows;
}

export async function pooled(client: VmmdClient, iterations: number): Promise<Section> {
  const emm = await manager(client, false);
  const cuda = client.backend === 'cuda';
  // On a GPU host vmmd and CuPy alternate, POOLED_ROUNDS rounds on one CPU: neither gets a better core or a later, warmer machine.
  const pinned = cuda ? pinToOneCpu() : undefined;
  const cpu = pinned?.cpu;
  const rounds = cuda ? POOLED_ROUNDS : 1;
  const ours: Row[][] = [];
  const theirs: Row[][] = [];
  const notes: string[] = [];
  try {
    for (let round = 0; round < rounds; round++) {
      // A long first warm-up: the JIT settles and V8's young generation grows to its working size, as in a running program.
      ours.push(await pooledRound(emm, iterations, round === 0 ? 100_000 : 10_000));
      if (!cuda) continue;
      const references = pythonReferences(iterations, round === rounds - 1, cpu);
      theirs.push(references.rows);
      notes.push(...references.errors.filter((error) => !notes.includes(error)));
    }
  } finally {
    pinned?.unpin();
  }
  await emm.reset();
  const roundsOf = (table: Row[][], allocator: string, size: bigint) =>
    table
      .map((rows) => rows.find((row) => row.size === sizeName(size) && String(row.allocator).startsWith(allocator)))
      .filter((row): row is Row => row !== undefined);
  const rows: Row[] = [];
  for (const size of POOLED_SIZES) rows.push(rounds > 1 ? medianRound(roundsOf(ours, 'vmmd', size)) : ours[0].find((row) => row.size === sizeName(size))!);
  for (const size of POOLED_SIZES) {
    const cupy = roundsOf(theirs, 'CuPy', size);
    if (cupy.length > 0) rows.push(medianRound(cupy));
  }
  rows.push(...(theirs.at(-1) ?? []).filter((row) => String(row.allocator).startsWith('Numba')));
  const targets: Target[] = [];
  const worst = Math.max(...rows.filter((row) => String(row.allocator).startsWith('vmmd')).map((row) => row.p50_us as number));
  targets.push({ target: 'pooled memalloc + free p50 under 2 µs', measured: `${worst} µs (worst size)`, limit: '2 µs', met: worst < 2 });
  for (const size of POOLED_SIZES) {
    const mine = rows.find((row) => row.size === sizeName(size) && String(row.allocator).startsWith('vmmd'));
    const cupy = rows.find((row) => row.size === sizeName(size) && String(row.allocator).startsWith('CuPy'));
    if (mine && cupy) {
      targets.push({
        target: `pooled ${sizeName(size)}: p50 at or below CuPy MemoryPool's`,
        measured: `${mine.p50_us} µs vs ${cupy.p50_us} µs (median rounds of ${mine.round_p50s_us} vs ${cupy.round_p50s_us})`,
        limit: `${cupy.p50_us} µs`,
        met: (mine.p50_us as number) <= (cupy.p50_us as number),
      });
    }
  }
  if (cuda) {
    notes.push(
      `vmmd and CuPy alternate, ${rounds} rounds (vmmd's loop, then CuPy's in a new python3; a round whose CuPy failed has no CuPy row), ${cpu === undefined ? 'unpinned (taskset missing or refused)' : `both pinned to CPU ${cpu} (taskset; vmmd's process with all its threads, V8's GC helpers too)`}; each row is its median round (of two, the lower), round_p50s_us every round's p50.`,
    );
  }
  return { id: 'pooled', title: 'Pooled memalloc + free through the NBEP 7 manager', rows, targets, notes };
}

/** Rounds of the cold comparison: vmmd's loop, then the one process's, each round. */
export const COLD_ROUNDS = 3;

export const COLD_SIZES: Array<[bigint, number]> = [
  [2n * MiB, 1],
  [64n * MiB, 0.5],
  [1n * GiB, 0.15],
];

/** Runs one named step of the in-process path: the whole is timed by the caller, or each step alone. */
type Step = <T>(name: string, body: () => T | Promise<T>) => Promise<T>;

const untimed: Step = async (_name, body) => body();

/**
 * The daemon's steps in this process: create, export, import, reserve, map,
 * set access; returns the teardown (unmap, free, release), through `step` too.
 */
async function inProcessSteps(backend: string, size: bigint, step: Step = untimed): Promise<() => Promise<void>> {
  if (backend === 'cuda') {
    const handle = await step('cuMemCreate', () => addon.cudaCreate(0, CU_LOCATION.DEVICE, 0, size, 1, true));
    const fd = await step('cuMemExportToShareableHandle (on a driver thread)', () => addon.cudaExportFd(0, handle));
    const imported = await step('cuMemImportFromShareableHandle', () => addon.cudaImportFd(fd, true));
    const address = await step('cuMemAddressReserve', () => addon.cudaReserve(size, 0n, 0n));
    await step('cuMemMap', () => addon.cudaMap(address, size, 0n, imported, true));
    await step('cuMemSetAccess', () => addon.cudaSetAccess(address, size, [{ type: CU_LOCATION.DEVICE, id: 0, flags: 3 }], true));
    return async () => {
      await step('cuMemUnmap (on a driver thread)', () => addon.cudaUnmap(0, address, size));
      await step('cuMemAddressFree', () => addon.cudaFreeAddress(address, size));
      await step('cuMemRelease (on a driver thread)', () => addon.cudaRelease(0, imported));
      await addon.cudaRelease(0, handle);
      addon.close(fd);
    };
  }
  const fd = await step('memfd_create + ftruncate', () => addon.hostMemfdCreate('bench', size));
  const exported = await step('dup (export)', () => addon.dup(fd));
  const address = await step('mmap PROT_NONE (reserve)', () => addon.hostReserve(size, 2n * MiB, 0n));
  await step('mmap MAP_FIXED (map)', () => addon.hostMap(address, size, exported, 0n));
  await step('mprotect (set access)', () => addon.hostProtect(address, size, HOST_ACCESS.READWRITE));
  return async () => {
    await step('munmap + free', () => {
      addon.hostUnmap(address, size);
      addon.hostFreeAddress(address, size);
    });
    addon.close(exported);
    addon.close(fd);
  };
}

/** Each driver call of the in-process steps, timed alone (cuda), or each system call (host). */
async function stepBreakdown(backend: string, size: bigint, count: number): Promise<Row[]> {
  const steps: Record<string, number[]> = {};
  const timed: Step = async (name, body) => {
    const start = performance.now();
    const value = await body();
    (steps[name] ??= []).push((performance.now() - start) * 1000);
    return value;
  };
  for (let i = 0; i < count; i++) await (await inProcessSteps(backend, size, timed))();
  return Object.entries(steps).map(([name, samples]) => ({ path: `  step: ${name}`, size: sizeName(size), ...summarize(samples), p50_vs_in_process: null }));
}

/** The cold targets (cuda): 2 MiB across processes ≤ the same steps in one process and ≤ 250 µs; 64 MiB ≤ 1.2× them. */
function coldRatioTargets(size: bigint, across: number, local: number): Target[] {
  const times = ratio(across, local);
  if (size === 2n * MiB) {
    return [
      {
        target: 'cold 2 MiB across processes p50 ≤ the same steps in one process',
        measured: `${across} vs ${local} µs (×${times})`,
        limit: '×1',
        met: across <= local,
      },
      { target: 'cold 2 MiB across processes p50 ≤ 250 µs', measured: `${across} µs`, limit: '250 µs', met: across <= 250 },
    ];
  }
  if (size === 64n * MiB) {
    return [
      {
        target: 'cold 64 MiB across processes p50 ≤ 1.2 × the same steps in one process',
        measured: `${across} vs ${local} µs (×${times})`,
        limit: '×1.2',
        met: across <= 1.2 * local,
      },
    ];
  }
  return [];
}

export async function cold(client: VmmdClient, iterations: number): Promise<Section> {
  const emm = await manager(client, true);
  // The same loop with no allocation received ahead: each memalloc waits for its round trip (as without allocations ahead).
  const waiting = await manager(client, true, true);
  const rows: Row[] = [];
  const targets: Target[] = [];
  const roundRatios: string[] = [];
  for (const [size, share] of COLD_SIZES) {
    const count = Math.max(10, Math.round(iterations * share));
    // Alternated rounds, vmmd's then the one process's, so that the machine's drift (on the GPU VMs the same loop
    // moves by up to 2× between minutes) hits both alike; each p50 is over all of its rounds' samples.
    const across: number[] = [];
    const acrossWaiting: number[] = [];
    const inOne: number[] = [];
    const perRound = Math.max(5, Math.ceil(count / COLD_ROUNDS));
    const ratios: number[] = [];
    const waitingRatios: number[] = [];
    // The frees' driver work (this process's unmaps, the daemon's releases and its stock's refill, which wait
    // for a quiet moment) ends before the next loop starts.
    const settle = async (manager: VmmdMemoryManager) => {
      await manager.flush();
      await new Promise((resolve) => setTimeout(resolve, 20));
    };
    for (let round = 0; round < COLD_ROUNDS; round++) {
      const warmup = round === 0 ? 50 : 10;
      const mine = await sample(perRound, () => emm.memalloc(size), { warmup, after: (pointer) => pointer.free() });
      await settle(emm);
      const mineWaiting = await sample(perRound, () => waiting.memalloc(size), { warmup, after: (pointer) => pointer.free() });
      await settle(waiting);
      const theirs = await sample(perRound, () => inProcessSteps(client.backend, size), { warmup, after: (teardown) => teardown() });
      across.push(...mine);
      acrossWaiting.push(...mineWaiting);
      inOne.push(...theirs);
      ratios.push(ratio(summarize(mine).p50_us, summarize(theirs).p50_us));
      waitingRatios.push(ratio(summarize(mineWaiting).p50_us, summarize(theirs).p50_us));
    }
    roundRatios.push(`${sizeName(size)}: ×${ratios.join(', ×')} (nothing ahead: ×${waitingRatios.join(', ×')})`);
    const daemon = summarize(across);
    const daemonWaiting = summarize(acrossWaiting);
    const local = summarize(inOne);
    rows.push({ path: 'vmmd memalloc across processes', size: sizeName(size), ...daemon, p50_vs_in_process: ratio(daemon.p50_us, local.p50_us) });
    rows.push({
      path: 'vmmd memalloc across processes, nothing ahead',
      size: sizeName(size),
      ...daemonWaiting,
      p50_vs_in_process: ratio(daemonWaiting.p50_us, local.p50_us),
    });
    rows.push({ path: 'same steps in one process', size: sizeName(size), ...local, p50_vs_in_process: 1 });
    if (client.backend === 'cuda') {
      targets.push(...coldRatioTargets(size, daemon.p50_us, local.p50_us));
      const memAlloc = summarize(
        sampleSync(
          count,
          () => addon.cudaMemAlloc(0, size),
          (pointer) => addon.cudaMemFree(0, pointer),
          5,
        ),
      );
      rows.push({ path: 'cuMemAlloc in one process', size: sizeName(size), ...memAlloc, p50_vs_in_process: ratio(memAlloc.p50_us, local.p50_us) });
    }
    if (size === 2n * MiB) {
      // The same, 2 ms apart: what the previous allocation's free and the stock's refill (driver threads, both
      // processes) cost the next one when they overlap it.
      const pause = () => new Promise((resolve) => setTimeout(resolve, 2));
      const spaced = summarize(
        await sample(count, () => emm.memalloc(size), {
          warmup: 5,
          after: async (pointer) => {
            await pointer.free();
            await pause();
          },
        }),
      );
      rows.push({ path: 'vmmd memalloc across processes, 2 ms apart', size: sizeName(size), ...spaced, p50_vs_in_process: ratio(spaced.p50_us, local.p50_us) });
      rows.push(...(await stepBreakdown(client.backend, size, count)));
      targets.push({
        target: 'cold 2 MiB memalloc across processes, p50 < 400 µs (GPU host)',
        measured: `${daemon.p50_us} µs (${client.backend})`,
        limit: '400 µs',
        met: daemon.p50_us < 400,
      });
    }
    // What this size held ahead goes back now, not (idle) during the next size's loops.
    await emm.clearCaches();
  }
  await emm.reset();
  await waiting.reset();
  return {
    id: 'cold',
    title: 'Cold memalloc: a new allocation from the daemon, mapped here',
    rows,
    targets,
    notes: [
      'vmmd: an allocate request on the session socket (create + export, served from the stock where it has the size; the descriptor comes with the answer), then import, reserve, map and set access in this process.',
      'The manager as users get it holds one allocation ahead for a size it has asked for twice (client/emm/ahead.ts): a memalloc maps the one received and asks for the next as it does; "nothing ahead" is the same loop with that off (each memalloc waits for its round trip). Each memalloc maps a new allocation of the daemon\'s either way.',
      'Published reference: legacy cuIpcOpenMemHandle about 1.3 ms.',
      `vmmd's loop and the one process's alternate in ${COLD_ROUNDS} rounds; each p50 is over every round. The ratio of p50s in each round: ${roundRatios.join('; ')}.`,
    ],
  };
}

export async function handoff(client: VmmdClient, iterations: number): Promise<Section> {
  const size = 2n * MiB;
  const allocation = await client.vmm.create({ size });
  const samples = await sample(iterations, () => client.vmm.import(allocation.id), { warmup: 20, after: (memory) => memory.close() });
  // Where the time goes: the same steps, each timed alone.
  const parts = { export: [] as number[], descriptor: [] as number[], map: [] as number[] };
  for (let i = 0; i < iterations; i++) {
    const t0 = performance.now();
    const exported = await client.vmm.export({ allocationId: allocation.id, handleType: 'HANDLE_TYPE_POSIX_FD' });
    const t1 = performance.now();
    const fd = await client.session.takeTransfer(exported.transferId);
    const t2 = performance.now();
    const memory =
      client.backend === 'cuda'
        ? await CudaImportedMemory.map(BigInt(allocation.id), { fd }, size, BigInt(exported.granularity), 0, false)
        : HostImportedMemory.map(BigInt(allocation.id), fd, size, BigInt(exported.granularity), false);
    const t3 = performance.now();
    await memory.close();
    parts.export.push((t1 - t0) * 1000);
    parts.descriptor.push((t2 - t1) * 1000);
    parts.map.push((t3 - t2) * 1000);
  }
  await client.vmm.release({ allocationId: allocation.id });
  return {
    id: 'handoff',
    title: 'Descriptor handoff: export → received → imported and mapped (2 MiB)',
    rows: [
      { step: 'whole: Export RPC, descriptor on the session socket, import, map, access', size: sizeName(size), ...summarize(samples) },
      { step: 'part: Export RPC (the daemon exports on a driver thread)', size: sizeName(size), ...summarize(parts.export) },
      { step: 'part: descriptor claimed from the session socket', size: sizeName(size), ...summarize(parts.descriptor) },
      { step: 'part: import, reserve, map, set access in this process', size: sizeName(size), ...summarize(parts.map) },
    ],
  };
}
