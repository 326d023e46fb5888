/**
 * The benchmarks, side by side with their references, in one run:
 *   node dist/bench/run.js [--backend host|cuda] [--quick] [--only id,id] [--json FILE]
 *                          [--daemon-args 'ARGS'] [--daemon-node-args 'ARGS' (e.g. --trace-gc)] [--profile DIR (the daemon's CPU profile)]
 *                          [--daemon-cpus LIST (the daemon pinned: taskset -c LIST)]
 * `npm run bench` runs it on the host backend; scripts/gpu-bench.sh runs it
 * with --backend cuda on a GPU host, next to CuPy and Numba (bench/reference/).
 * Prints each section's table and the targets; --json writes everything with
 * the machine, date, commit and command (bench/report.js turns results into BENCHMARKS.md).
 */
import { execFileSync, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import BUILD from '../generated/build-info.json';
import { attachDaemon, BenchDaemon, startDaemon } from './lib/daemon';
import { markdownTable, Section } from './lib/stats';
import { cold, handoff, pooled } from './sections/allocations';
import { concurrency } from './sections/concurrency';
import { newWorker } from './sections/new-worker';
import { rpcCosts } from './sections/rpc-costs';
import { rpcFloor } from './sections/rpc-floor';
import { scale } from './sections/scale';
import { sessionOps } from './sections/session-ops';
import { storeLoad } from './sections/store-load';
import { streaming } from './sections/streaming';

function option(name: string): string | undefined {
  const at = process.argv.indexOf(`--${name}`);
  return at > 0 ? process.argv[at + 1] : undefined;
}

export function machine(): string {
  const cpus = os.cpus();
  return `${cpus[0]?.model.trim() ?? 'unknown cpu'}, ${cpus.length} cores, ${Math.round(os.totalmem() / 2 ** 30)} GiB, Linux ${os.release()}`;
}

/**
 * Live-object levels of the scale section. The host backend's reservations are
 * mmaps: past vm.max_map_count (65530 by default) the kernel refuses more, so
 * there the top level is what the machine allows (the cuda backend reaches 100,000).
 */
function scaleLevels(backend: string, quick: boolean): number[] {
  if (quick) return [100, 10_000];
  if (backend !== 'host') return [100, 10_000, 100_000];
  let maps = 65_530;
  try {
    maps = Number(fs.readFileSync('/proc/sys/vm/max_map_count', 'utf8'));
  } catch {
    // not Linux: keep the default
  }
  return [100, 10_000, Math.min(100_000, Math.floor((maps * 0.6) / 1000) * 1000)];
}

/** The GPU as nvidia-smi names it, with the driver (cuda runs). */
function gpuName(): string | undefined {
  try {
    return execFileSync('nvidia-smi', ['--query-gpu=name,driver_version', '--format=csv,noheader'], { encoding: 'utf8' }).trim().split('\n').join('; ');
  } catch {
    return undefined;
  }
}

interface SectionArgs {
  backend: string;
  quick: boolean;
}

/** Every section, in the order they run. */
const SECTIONS: Record<string, (daemon: BenchDaemon, args: SectionArgs) => Promise<Section>> = {
  'rpc-floor': (daemon, args) => rpcFloor(daemon, count(args, 1000, 2000, 3000)),
  pooled: (daemon, args) => pooled(daemon.client, count(args, 20_000, 100_000, 100_000)),
  cold: (daemon, args) => cold(daemon.client, count(args, 100, 200, 300)),
  'rpc-costs': (daemon, args) => rpcCosts(daemon.client, count(args, 200, 300, 500)),
  'session-ops': (daemon, args) => sessionOps(daemon.client, count(args, 200, 1000, 2000)),
  handoff: (daemon, args) => handoff(daemon.client, count(args, 200, 500, 1000)),
  streaming: (daemon, args) => streaming(daemon.client, 256, count(args, 3, 5, 5)),
  // 8 GiB from the page cache on a GPU host (the target), 256 MiB on the host backend and with --quick.
  'store-load': (daemon, args) =>
    storeLoad(daemon, args.backend, args.backend === 'cuda' && !args.quick ? 8 * 1024 ** 3 : 256 * 1024 ** 2, count(args, 1, 3, 3)),
  // A 4 GiB store on a GPU host (the target), 256 MiB on the host backend and with --quick.
  'new-worker': (daemon, args) => newWorker(daemon, args.backend, args.backend === 'cuda' && !args.quick ? 4n << 30n : 256n << 20n, count(args, 2, 5, 5)),
  scale: (daemon, args) => scale(daemon, scaleLevels(args.backend, args.quick), count(args, 200, 200, 300)),
  concurrency: (daemon, args) => concurrency(daemon, [1, 4, 16], count(args, 1000, 2000, 3000)),
  'rpc-floor-again': async (daemon, args) => {
    const section = await rpcFloor(daemon, count(args, 1000, 2000, 3000));
    return { ...section, id: 'rpc-floor-again', title: 'RPC floor again, after every other section (drift of the machine over the run)', targets: [] };
  },
};

/** Iterations: --quick, the host backend (npm run bench stays within 3 minutes on 2 cores), the GPU host. */
function count(args: SectionArgs, quick: number, host: number, gpu: number): number {
  return args.quick ? quick : args.backend === 'host' ? host : gpu;
}

async function main() {
  const backend = option('backend') ?? 'host';
  const quick = process.argv.includes('--quick');
  const only = option('only')?.split(',');
  const jsonFile = option('json');
  const wanted = (id: string) => only === undefined || only.includes(id);
  const started = Date.now();
  const sectionArgs = { backend, quick };
  // A section runs in a client process of its own (as an application would be), against this one daemon:
  // what one section leaves in a process (heap, driver state) must not slow the next one down.
  const child = option('section');
  if (child !== undefined) {
    const attached = await attachDaemon(option('socket-dir')!, Number(option('daemon-pid')));
    try {
      const section = await SECTIONS[child](attached, sectionArgs);
      fs.writeFileSync(option('out')!, JSON.stringify(section));
    } finally {
      await attached.stop();
    }
    process.exit(0);
  }
  const words = (name: string) => option(name)?.split(' ').filter(Boolean) ?? [];
  const daemon = await startDaemon(backend, words('daemon-args'), option('profile'), words('daemon-node-args'), option('daemon-cpus'));
  const sections: Section[] = [];
  try {
    for (const id of Object.keys(SECTIONS)) {
      if (!wanted(id)) continue;
      const sectionStart = Date.now();
      const out = path.join(daemon.dir, `${id}.json`);
      const code = await new Promise<number | null>((resolve) => {
        const args = [__filename, '--section', id, '--socket-dir', daemon.dir, '--daemon-pid', String(daemon.pid), '--out', out, '--backend', backend];
        spawn(process.execPath, quick ? [...args, '--quick'] : args, { stdio: 'inherit' }).once('exit', resolve);
      });
      if (code !== 0) throw new Error(`bench: section ${id} failed (exit ${code})`);
      const section = JSON.parse(fs.readFileSync(out, 'utf8')) as Section;
      sections.push(section);
      console.log(`\n## ${section.title} (${((Date.now() - sectionStart) / 1000).toFixed(1)} s)\n`);
      console.log(markdownTable(section.rows));
      for (const target of section.targets ?? [])
        console.log(`target ${target.met ? 'MET' : 'MISSED'}: ${target.target}: ${target.measured} (limit ${target.limit})`);
    }
  } finally {
    await daemon.stop();
  }
  const report = {
    backend,
    machine: machine(),
    gpu: backend === 'cuda' ? gpuName() : undefined,
    node: process.version,
    date: new Date().toISOString(),
    commit: BUILD.commit,
    command: `node dist/bench/run.js ${process.argv.slice(2).join(' ')}`.trim(),
    seconds: Math.round((Date.now() - started) / 1000),
    sections,
  };
  console.log(`\nbench: ${report.seconds} s, ${sections.flatMap((s) => s.targets ?? []).filter((t) => !t.met).length} target(s) missed`);
  if (jsonFile !== undefined) fs.writeFileSync(jsonFile, `${JSON.stringify(report, null, 2)}\n`);
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
