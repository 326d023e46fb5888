/**
 * Sleep and wake of a tagged pool, against what it stands in for, in one run:
 *   node dist/bench/sleep-wake.js [--backend host|cuda] [--gib N] [--discard-gib N] [--store-gib N] [--json FILE]
 * - offload sleep and wake of N GiB (16 on cuda) against a pinned copy of the
 *   same bytes in this process (each direction; the target: at least 80% of
 *   it) and against vLLM-style sleep: one pinned copy per allocation, one at
 *   a time, to a buffer of its own and back; three cycles: the first with the
 *   host memory made at sleep, the first with it made ahead (prepareOffload,
 *   the target's case), and a next one with it kept;
 * - discard sleep of up to 64 GiB (what the device can hold; ≤ 50 ms);
 * - wake of a store-backed model of N GiB (16 on cuda; nothing copied, ≤ 50 ms).
 * On the host backend the sizes default small and the references are memcpy:
 * it checks the bench runs, not the targets.
 */
import * as fs from 'node:fs';
import { addon } from '../native';
import type { ImportedMemory, VmmdClient } from '../client';
import { startDaemon } from './lib/daemon';
import { markdownTable, Row, Target } from './lib/stats';

const MiB = 1n << 20n;
const GB = 1e9;
/** A model's allocations: what a PyTorch caching allocator's segments look like (large, a few hundred MiB to 2 GiB). */
const PIECE_BYTES = 512n * MiB;

function option(name: string): string | undefined {
  const at = process.argv.indexOf(`--${name}`);
  return at > 0 ? process.argv[at + 1] : undefined;
}

const seconds = (start: number) => (performance.now() - start) / 1000;

/** Bytes in pieces of PIECE_BYTES (the last one smaller), each a multiple of `granularity`. */
function pieces(total: bigint, granularity: bigint, piece = PIECE_BYTES): bigint[] {
  const sizes: bigint[] = [];
  for (let left = total; left > 0n; left -= piece < left ? piece : left) {
    const size = piece < left ? piece : left;
    sizes.push(((size + granularity - 1n) / granularity) * granularity);
  }
  return sizes;
}

/** Device memory as one AllocateAll, each piece mapped here and given a byte at each end. */
async function model(client: VmmdClient, total: bigint, granularity: bigint): Promise<ImportedMemory[]> {
  const { memory } = await client.vmm.allocateAll({ sizes: pieces(total, granularity), deadlineMs: 10_000 });
  for (const [index, mapped] of memory.entries()) {
    // Host backend: every page made now, as a GPU's memory is, so that no copy below pays for making it.
    if (client.backend !== 'cuda') await addon.hostPopulate(mapped.address, mapped.size);
    await mapped.write(0, Buffer.from([index & 0xff]));
    await mapped.write(mapped.size - 1n, Buffer.from([(index + 1) & 0xff]));
  }
  return memory;
}

async function freeAll(client: VmmdClient, memory: ImportedMemory[]): Promise<void> {
  for (const mapped of memory) {
    await mapped.close();
    await client.vmm.release({ allocationId: mapped.allocationId });
  }
}

/** A pinned (cuda) or plain (host) buffer of `bytes`; free() unpins it. */
function hostBuffer(cuda: boolean, bytes: number): { buffer: Buffer; free(): void } {
  const buffer = Buffer.allocUnsafeSlow(bytes);
  if (!cuda) return { buffer, free: () => undefined };
  const address = addon.addressOf(buffer);
  addon.cudaHostRegister(0, address, BigInt(bytes), false);
  return { buffer, free: () => addon.cudaHostUnregister(0, address) };
}

/** The same bytes copied device → host and back from this process's own pinned memory, in pieces as large as the model's, several in flight. */
async function pinnedReference(memory: ImportedMemory[], cuda: boolean): Promise<{ dtoh: number; htod: number }> {
  const bytes = memory.reduce((sum, mapped) => sum + mapped.size, 0n);
  const buffers = memory.map((mapped) => hostBuffer(cuda, Number(mapped.size)));
  try {
    let start = performance.now();
    await Promise.all(memory.map((mapped, index) => mapped.readInto(0, buffers[index].buffer)));
    const dtoh = Number(bytes) / seconds(start) / GB;
    start = performance.now();
    await Promise.all(memory.map((mapped, index) => mapped.write(0, buffers[index].buffer)));
    const htod = Number(bytes) / seconds(start) / GB;
    return { dtoh, htod };
  } finally {
    for (const buffer of buffers) buffer.free();
  }
}

/** vLLM's CuMemAllocator sleep: each allocation copied to a pinned buffer of its own, one at a time, then back. */
async function vllmStyle(memory: ImportedMemory[], cuda: boolean): Promise<{ sleep: number; wake: number }> {
  const buffers: Array<{ buffer: Buffer; free(): void }> = [];
  try {
    let start = performance.now();
    for (const mapped of memory) {
      const buffer = hostBuffer(cuda, Number(mapped.size));
      buffers.push(buffer);
      await mapped.readInto(0, buffer.buffer);
    }
    const sleep = seconds(start);
    start = performance.now();
    for (const [index, mapped] of memory.entries()) await mapped.write(0, buffers[index].buffer);
    return { sleep, wake: seconds(start) };
  } finally {
    for (const buffer of buffers) buffer.free();
  }
}

async function main(): Promise<void> {
  const backend = option('backend') ?? 'host';
  const cuda = backend === 'cuda';
  const gib = (name: string, gpu: number, host: number) => BigInt(Math.round(Number(option(name) ?? (cuda ? gpu : host)) * 1024)) * MiB;
  const modelBytes = gib('gib', 16, 0.25);
  const storeBytes = gib('store-gib', 16, 0.25);
  const daemon = await startDaemon(backend, cuda ? [] : ['--host-capacity', '2GiB']);
  const client = daemon.client;
  const rows: Row[] = [];
  const targets: Target[] = [];
  const notes: string[] = [];
  try {
    const device = (await client.devices.listDevices()).devices[0];
    const granularity = BigInt(device.granularityMinimum);
    const total = BigInt((await client.devices.getMemoryInfo({ device: 0 })).totalBytes);

    // Offload: sleep and wake of the model against the pinned copy and vLLM's way, measured on the same memory.
    const memory = await model(client, modelBytes, granularity);
    const reference = await pinnedReference(memory, cuda);
    const vllm = await vllmStyle(memory, cuda);
    const gbps = (time: number) => Number(modelBytes) / time / GB;
    const check = async () => {
      for (const [index, mapped] of memory.entries()) {
        const [first, last] = [await mapped.read(0, 1), await mapped.read(mapped.size - 1n, 1)];
        if (first[0] !== (index & 0xff) || last[0] !== ((index + 1) & 0xff)) throw new Error(`allocation ${index} came back with other bytes`);
      }
    };
    const cycle = async (tag: string) => {
      let start = performance.now();
      await client.sleep(tag, { mode: 'offload', deadlineMs: 120_000 });
      const sleep = seconds(start);
      start = performance.now();
      const woken = await client.wake(tag, { deadlineMs: 120_000 });
      const wake = seconds(start);
      await check();
      return { sleep, wake, waitedMs: woken.waitedMs };
    };
    const offloadRows = (what: string, timing: { sleep: number; wake: number; waitedMs: number }, vllmColumn: boolean): Row[] => [
      {
        what: `${what}: sleep`,
        seconds: round(timing.sleep),
        'GB/s': round(gbps(timing.sleep)),
        'pinned copy GB/s': round(reference.dtoh),
        ratio: round(gbps(timing.sleep) / reference.dtoh),
        ...(vllmColumn ? { 'vLLM-style s': round(vllm.sleep) } : {}),
      },
      {
        what: `${what}: wake`,
        seconds: round(timing.wake),
        'GB/s': round(gbps(timing.wake)),
        'pinned copy GB/s': round(reference.htod),
        ratio: round(gbps(timing.wake) / reference.htod),
        ...(vllmColumn ? { 'vLLM-style s': round(vllm.wake) } : {}),
        'waited ms': timing.waitedMs,
      },
    ];
    // First cycle, host memory made by the sleep (the daemon creates it, the driver pins it, then the copy).
    const plain = client.tags.group('weights');
    memory.forEach((mapped) => plain.add(mapped));
    const made = await cycle('weights');
    for (const mapped of memory) await plain.forget(mapped);
    // The same memory with its host copies made ahead while awake (prepareOffload): first cycle, then a second.
    const prepared = client.tags.group('weights-prepared', { prepareOffload: true });
    let start = performance.now();
    memory.forEach((mapped) => prepared.add(mapped));
    while (prepared.prepared.pending > 0) await new Promise((resolve) => setTimeout(resolve, 5));
    const preparedSeconds = seconds(start);
    if (prepared.prepared.lastError !== undefined) throw prepared.prepared.lastError;
    const first = await cycle('weights-prepared');
    const second = await cycle('weights-prepared');
    rows.push(
      ...offloadRows(`offload, first cycle, host memory made at sleep, ${modelBytes / MiB} MiB in ${memory.length}`, made, true),
      { what: 'host copies made ahead while awake (prepareOffload, in the background)', seconds: round(preparedSeconds) },
      ...offloadRows('offload, first cycle, copies made ahead', first, false),
      ...offloadRows('offload, next cycle, copies kept', second, false),
    );
    targets.push(
      {
        target: 'first offload sleep (copies made ahead) ≥ 80% of the pinned copy (device → host)',
        measured: `${round(gbps(first.sleep))} GB/s`,
        limit: `${round(0.8 * reference.dtoh)} GB/s`,
        met: gbps(first.sleep) >= 0.8 * reference.dtoh,
      },
      {
        target: 'first wake ≥ 80% of the pinned copy (host → device)',
        measured: `${round(gbps(first.wake))} GB/s`,
        limit: `${round(0.8 * reference.htod)} GB/s`,
        met: gbps(first.wake) >= 0.8 * reference.htod,
      },
    );
    for (const mapped of memory) await prepared.forget(mapped);
    await freeAll(client, memory);

    // Discard: as much as the device holds, up to 64 GiB.
    const free = BigInt((await client.devices.getMemoryInfo({ device: 0 })).freeBytes);
    const wanted = gib('discard-gib', 64, 1);
    const discardBytes = (() => {
      const fits = ((free * 9n) / 10n / granularity) * granularity;
      return wanted < fits ? wanted : fits;
    })();
    if (discardBytes < wanted)
      notes.push(`discard sleep of ${discardBytes / MiB} MiB: what fits on this device (${total / MiB} MiB) of the ${wanted / MiB} MiB asked`);
    const cache = await model(client, discardBytes, granularity);
    cache.forEach((mapped) => client.tags.group('kv').add(mapped));
    start = performance.now();
    await client.sleep('kv', { mode: 'discard' });
    const discardMs = seconds(start) * 1000;
    start = performance.now();
    await client.wake('kv', { deadlineMs: 60_000 });
    const discardWakeMs = seconds(start) * 1000;
    rows.push(
      { what: `discard sleep, ${discardBytes / MiB} MiB in ${cache.length}`, seconds: round(discardMs / 1000, 4) },
      { what: 'wake after discard', seconds: round(discardWakeMs / 1000, 4) },
    );
    targets.push({ target: `discard sleep of ${discardBytes / MiB} MiB ≤ 50 ms`, measured: `${round(discardMs)} ms`, limit: '50 ms', met: discardMs <= 50 });
    await freeAll(client, cache);

    // A store-backed model: unmapped and mapped again, nothing copied.
    const backing = await client.vmm.allocate({ size: ((storeBytes + granularity - 1n) / granularity) * granularity });
    const store = await client.stores.createStore({ allocationId: backing.allocationId, readOnly: true, name: 'bench-model' });
    const opened = await client.stores.open('bench-model');
    client.tags.group('model').addStore(opened);
    await client.sleep('model');
    start = performance.now();
    await client.wake('model');
    const storeWakeMs = seconds(start) * 1000;
    rows.push({ what: `wake of a ${storeBytes / MiB} MiB store-backed model`, seconds: round(storeWakeMs / 1000, 4) });
    targets.push({
      target: `store-backed wake of ${storeBytes / MiB} MiB ≤ 50 ms`,
      measured: `${round(storeWakeMs)} ms`,
      limit: '50 ms',
      met: storeWakeMs <= 50,
    });
    await opened.close();
    await client.stores.detach({ id: store.id });
    await freeAll(client, [backing]);
  } finally {
    await daemon.stop();
  }
  console.log(`## Sleep and wake (${backend})\n\n${markdownTable(rows)}\n\n${markdownTable(targets.map((target) => ({ ...target })))}`);
  for (const note of notes) console.log(`\n${note}`);
  const json = option('json');
  if (json !== undefined) fs.writeFileSync(json, JSON.stringify({ id: 'sleep-wake', backend, rows, targets, notes, date: new Date().toISOString() }, null, 2));
}

function round(value: number, digits = 2): number {
  const scale = 10 ** digits;
  return Math.round(value * scale) / scale;
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 1;
});
