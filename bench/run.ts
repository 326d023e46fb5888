/**
 * The benchmarks, side by side with their references, in one run:
 *   node dist/bench/run.js [--backend host|cuda] [--quick] [--only id,id] [--json FILE]
 *                          [--daemon-args 'ARGS'] [--profile DIR (the daemon's CPU profile)]
 * `npm run bench` runs it on the host backend; scripts/gpu-bench.sh runs it
 * with --backend cuda on a GPU host, next to CuPy and Numba (bench/reference/).
 * Prints each section's table and the targets; --json writes everything with
 * the machine, date, commit and command (bench/report.js turns results into BENCHMARKS.md).
 */
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import BUILD from '../generated/build-info.json';
import { startDaemon } from './lib/daemon';
import { markdownTable, Section } from './lib/stats';
import { cold, handoff, pooled } from './sections/allocations';
import { concurrency } from './sections/concurrency';
import { rpcCosts } from './sections/rpc-costs';
import { rpcFloor } from './sections/rpc-floor';
import { scale } from './sections/scale';
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

async function main() {
  const backend = option('backend') ?? 'host';
  const quick = process.argv.includes('--quick');
  const only = option('only')?.split(',');
  const jsonFile = option('json');
  const wanted = (id: string) => only === undefined || only.includes(id);
  const started = Date.now();
  const daemon = await startDaemon(backend, option('daemon-args')?.split(' ').filter(Boolean) ?? [], option('profile'));
  const sections: Section[] = [];
  const run = async (id: string, body: () => Promise<Section>) => {
    if (!wanted(id)) return;
    const sectionStart = Date.now();
    const section = await body();
    sections.push(section);
    console.log(`\n## ${section.title} (${((Date.now() - sectionStart) / 1000).toFixed(1)} s)\n`);
    console.log(markdownTable(section.rows));
    for (const target of section.targets ?? []) console.log(`target ${target.met ? 'MET' : 'MISSED'}: ${target.target}: ${target.measured} (limit ${target.limit})`);
  };
  try {
    // Cold and its breakdown first: measured in a fresh client process (the later sections leave this one slower; see
    // the last row of the scale section's notes and BENCHMARKS.md).
    await run('rpc-floor', () => rpcFloor(daemon, quick ? 1000 : 3000));
    await run('cold', () => cold(daemon.client, quick ? 100 : 300));
    await run('rpc-costs', () => rpcCosts(daemon.client, quick ? 200 : 500));
    await run('handoff', () => handoff(daemon.client, quick ? 200 : 1000));
    await run('pooled', () => pooled(daemon.client, quick ? 20_000 : 100_000));
    await run('streaming', () => streaming(daemon.client, 256, quick ? 3 : 5));
    await run('scale', () => scale(daemon, scaleLevels(backend, quick), quick ? 200 : 300));
    await run('concurrency', () => concurrency(daemon, [1, 4, 16], quick ? 1000 : backend === 'host' ? 2000 : 3000));
    await run('rpc-floor-again', async () => {
      const section = await rpcFloor(daemon, quick ? 1000 : 3000);
      return { ...section, id: 'rpc-floor-again', title: 'RPC floor again, at the end of the run (the same client process)', targets: [] };
    });
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
