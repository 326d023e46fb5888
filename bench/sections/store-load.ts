/**
 * 10. Filling a store from a file and dumping it: `vmmctl store
 * load` of a file in the page cache (8 GiB on a GPU host) and `vmmctl store
 * dump` of it, against the same bytes copied in one process in the same run:
 * from page-locked memory (the copy engine's rate) and, where PyTorch is
 * installed, torch.from_file(...).cuda(). Read/Write of 256 MiB through the
 * daemon is section 5 (streaming).
 */
import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { addon } from '../../native';
import { BenchDaemon, packageRoot } from '../lib/daemon';
import { Row, Section, Target } from '../lib/stats';

const MiB = 1 << 20;
const GB = 1e9;
/** The rate the issue asks of store load and dump on a GPU host. */
const TARGET_GB_S = 10;

/** Writes `bytes` of incompressible data to a new file and reads it once: it is in the page cache. */
function makeFile(file: string, bytes: number): void {
  const block = randomBytes(64 * MiB);
  const fd = fs.openSync(file, 'w');
  try {
    for (let done = 0; done < bytes;) {
      const length = Math.min(block.length, bytes - done);
      block[0] = (done / block.length) & 0xff; // no two blocks alike
      done += fs.writeSync(fd, block, 0, length, done);
    }
  } finally {
    fs.closeSync(fd);
  }
  const read = fs.openSync(file, 'r');
  try {
    for (let done = 0; done < bytes;) done += fs.readSync(read, block, 0, Math.min(block.length, bytes - done), done);
  } finally {
    fs.closeSync(read);
  }
}

/** Runs vmmctl against the bench's daemon; returns its --json answer and the command's own wall time. */
function vmmctl(daemon: BenchDaemon, args: string[]): { json: { seconds?: number }; wallSeconds: number } {
  const start = performance.now();
  const output = execFileSync(process.execPath, [path.join(packageRoot, 'bin', 'vmmctl.js'), '--socket-dir', daemon.dir, '--json', ...args], {
    encoding: 'utf8',
    // Its progress lines on standard error are not the bench's.
    stdio: ['ignore', 'pipe', 'pipe'],
    timeout: 600_000,
    maxBuffer: 1 << 20,
  });
  return { json: JSON.parse(output), wallSeconds: (performance.now() - start) / 1000 };
}

/** Host → device and device → host copies of `bytes` from page-locked memory in this process, 256 MiB at a time. */
async function pinnedReference(bytes: number): Promise<{ htod: number; dtoh: number }> {
  const size = 256 * MiB;
  const buffer = Buffer.allocUnsafeSlow(size).fill(7);
  const host = addon.addressOf(buffer);
  const device = addon.cudaMemAlloc(0, BigInt(size));
  addon.cudaHostRegister(0, host, BigInt(size), false);
  try {
    const rounds = Math.max(1, Math.round(bytes / size));
    // One round first: the first copy of a registered range pays for its translations.
    await addon.cudaCopyToDevice(0, device, buffer);
    let start = performance.now();
    for (let i = 0; i < rounds; i++) await addon.cudaCopyToDevice(0, device, buffer);
    const htod = (rounds * size) / ((performance.now() - start) / 1000) / GB;
    start = performance.now();
    for (let i = 0; i < rounds; i++) await addon.cudaCopyFromDevice(0, device, BigInt(size), buffer);
    const dtoh = (rounds * size) / ((performance.now() - start) / 1000) / GB;
    return { htod, dtoh };
  } finally {
    addon.cudaHostUnregister(0, host);
    addon.cudaMemFree(0, device);
  }
}

/** torch.from_file(file).cuda() in a Python process of its own, by bench/reference/torch_load.py. */
function torchReference(file: string, bytes: number): { seconds?: number; cudaSeconds?: number; error?: string } {
  const script = path.join(packageRoot, 'bench', 'reference', 'torch_load.py');
  try {
    const output = execFileSync('python3', [script, file, String(bytes)], { encoding: 'utf8', timeout: 600_000, stdio: ['ignore', 'pipe', 'pipe'] });
    return JSON.parse(output.trim().split('\n').pop()!);
  } catch (error) {
    const stderr = String((error as { stderr?: unknown }).stderr ?? '')
      .trim()
      .split('\n')
      .pop();
    return { error: `python3 ${script}: ${stderr || (error as Error).message.split('\n')[0]}` };
  }
}

const rate = (bytes: number, seconds: number) => +(bytes / seconds / GB).toFixed(2);
const median = (values: number[]) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];

export async function storeLoad(daemon: BenchDaemon, backend: string, bytes: number, runs: number): Promise<Section> {
  const file = path.join(os.tmpdir(), `vmmd-bench-load-${process.pid}.bin`);
  const rows: Row[] = [];
  const notes: string[] = [];
  const targets: Target[] = [];
  const size = bytes >= 1024 * MiB ? `${bytes / (1024 * MiB)} GiB` : `${bytes / MiB} MiB`;
  makeFile(file, bytes);
  try {
    const loads: number[] = [];
    const dumps: number[] = [];
    const walls: number[] = [];
    for (let run = 0; run < runs; run++) {
      const name = `bench-load-${run}`;
      const loaded = vmmctl(daemon, ['store', 'load', name, file]);
      loads.push(loaded.json.seconds!);
      walls.push(loaded.wallSeconds);
      dumps.push(vmmctl(daemon, ['store', 'dump', name, '/dev/null']).json.seconds!);
      vmmctl(daemon, ['store', 'rm', name]);
    }
    rows.push({
      operation: `vmmctl store load (${size}, page cache)`,
      GB_s: rate(bytes, median(loads)),
      best_GB_s: rate(bytes, Math.min(...loads)),
      seconds: +median(loads).toFixed(3),
    });
    rows.push({
      operation: '  the same, whole command (node start, connect, CUDA context)',
      GB_s: rate(bytes, median(walls)),
      best_GB_s: rate(bytes, Math.min(...walls)),
      seconds: +median(walls).toFixed(3),
    });
    rows.push({
      operation: `vmmctl store dump (${size}, to /dev/null)`,
      GB_s: rate(bytes, median(dumps)),
      best_GB_s: rate(bytes, Math.min(...dumps)),
      seconds: +median(dumps).toFixed(3),
    });
    if (backend === 'cuda') {
      const pinned = await pinnedReference(bytes);
      rows.push({
        operation: 'pinned cuMemcpyHtoDAsync in one process (256 MiB at a time)',
        GB_s: +pinned.htod.toFixed(2),
        best_GB_s: null,
        seconds: +(bytes / pinned.htod / GB).toFixed(3),
      });
      rows.push({
        operation: 'pinned cuMemcpyDtoHAsync in one process (256 MiB at a time)',
        GB_s: +pinned.dtoh.toFixed(2),
        best_GB_s: null,
        seconds: +(bytes / pinned.dtoh / GB).toFixed(3),
      });
      const torch = torchReference(file, bytes);
      if (torch.error !== undefined) notes.push(torch.error);
      else {
        rows.push({
          operation: `torch.from_file(...).cuda() in one process (${size})`,
          GB_s: rate(bytes, torch.seconds!),
          best_GB_s: null,
          seconds: +torch.seconds!.toFixed(3),
        });
        rows.push({
          operation: '  of which .cuda() (pageable → device)',
          GB_s: rate(bytes, torch.cudaSeconds!),
          best_GB_s: null,
          seconds: +torch.cudaSeconds!.toFixed(3),
        });
      }
      const load = rate(bytes, median(loads));
      const dump = rate(bytes, median(dumps));
      targets.push({
        target: `vmmctl store load of ${size} from the page cache ≥ ${TARGET_GB_S} GB/s`,
        measured: `${load} GB/s (pinned copy alone ${pinned.htod.toFixed(2)} GB/s${torch.seconds ? `, torch.from_file().cuda() ${rate(bytes, torch.seconds)} GB/s` : ''})`,
        limit: `${TARGET_GB_S} GB/s`,
        met: load >= TARGET_GB_S,
      });
      targets.push({
        target: `vmmctl store dump of ${size} ≥ ${TARGET_GB_S} GB/s`,
        measured: `${dump} GB/s (pinned copy alone ${pinned.dtoh.toFixed(2)} GB/s)`,
        limit: `${TARGET_GB_S} GB/s`,
        met: dump >= TARGET_GB_S,
      });
    }
    notes.push(
      `${runs} runs; GB/s of the median run. vmmctl's own seconds time the copy (create and import before, the store's creation after are not in them); the whole command is on its own row.`,
      'On cuda vmmctl reads the file into 4 page-locked buffers of 32 MiB on the thread pool while the copy engine empties the others (client/pinned-copy.ts).',
    );
  } finally {
    fs.rmSync(file, { force: true });
  }
  return { id: 'store-load', title: 'Store load and dump through vmmctl (a file in the page cache onto the GPU and back)', rows, targets, notes };
}
