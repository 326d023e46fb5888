/**
 * A daemon of the benchmark's own: a child process on a temporary socket
 * directory, with a connected client; stop() ends both.
 */
import { ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { connect, VmmdClient } from '../../client';

/** The package root, from dist/bench/lib or bench/lib. */
export const packageRoot = (() => {
  let dir = __dirname;
  while (!fs.existsSync(path.join(dir, 'package.json'))) dir = path.dirname(dir);
  return dir;
})();

export interface BenchDaemon {
  dir: string;
  client: VmmdClient;
  /** The daemon process's id. */
  pid: number;
  /** A new client of the same daemon (its own session). */
  connect(): Promise<VmmdClient>;
  stop(): Promise<void>;
}

export async function connectWhenReady(socketDir: string, child?: ChildProcess): Promise<VmmdClient> {
  for (let attempt = 0; ; attempt++) {
    try {
      return await connect({ socketDir });
    } catch (error) {
      if (attempt > 200 || (child?.exitCode !== null && child?.exitCode !== undefined)) throw error;
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  }
}

/**
 * @param profileDir where the daemon writes a V8 CPU profile (--cpu-prof) when it stops
 * @param nodeArgs Node's own options for the daemon's process (--trace-gc: its collections, on this process's stdout)
 * @param cpus the CPUs the daemon runs on (taskset -c LIST; all its threads), else wherever the bench runs
 */
export async function startDaemon(
  backend: string,
  extraArgs: string[] = [],
  profileDir?: string,
  nodeArgs: string[] = [],
  cpus?: string,
): Promise<BenchDaemon> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-bench-'));
  const pinned = cpus === undefined ? [] : ['-c', cpus, process.execPath];
  const child = spawn(
    cpus === undefined ? process.execPath : 'taskset',
    [
      ...pinned,
      ...nodeArgs,
      ...(profileDir ? ['--cpu-prof', `--cpu-prof-dir=${profileDir}`] : []),
      path.join(packageRoot, 'bin', 'vmmd.js'),
      '--backend',
      backend,
      '--socket-dir',
      dir,
      '--log-level',
      'warn',
      ...extraArgs,
    ],
    { stdio: ['ignore', 'inherit', 'inherit'] },
  );
  const client = await connectWhenReady(dir, child);
  return {
    dir,
    client,
    pid: child.pid!,
    connect: () => connect({ socketDir: dir }),
    async stop() {
      client.close();
      if (child.exitCode === null) {
        child.kill('SIGTERM');
        await new Promise((resolve) => child.once('exit', resolve));
      }
      fs.rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** A daemon another process started (a section run in its own client process): stop() only disconnects. */
export async function attachDaemon(dir: string, pid: number): Promise<BenchDaemon> {
  const client = await connect({ socketDir: dir });
  return {
    dir,
    client,
    pid,
    connect: () => connect({ socketDir: dir }),
    async stop() {
      client.close();
    },
  };
}
