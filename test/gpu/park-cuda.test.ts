/**
 * Restarts without loss on the cuda backend. First the premise the feature
 * stands on: a descriptor of a cuMemCreate allocation (POSIX descriptor
 * handle) held by a process that is not a CUDA process keeps the memory and
 * its bytes after the process that made it exits; a new process imports it
 * and reads the bytes back; the memory is freed when the holder exits. Then
 * the daemon itself: SIGKILL under the keeper, and every store, byte,
 * allocation, owner, share key and quota charge comes back; and a `--park
 * held` daemon whose successor is killed before serving serves it all again.
 */
import { ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { addon } from '../../native';
import { eventually, packageRoot, Peer, TestDaemon } from '../e2e/harness';
import { restartScenario } from '../reliability/restart-scenario';
import { successorKilledScenario } from '../reliability/take-over-scenario';
import { describeGpu } from './gpu';

const FIXTURE = path.join(packageRoot(), 'dist', 'test', 'gpu', 'fixtures', 'park-premise.js');
const SIZE = 64n << 20n;

/** Runs a role of the fixture; resolves with its output lines once it exits (or, with `until`, once a line matches). */
function role(args: string[], until?: RegExp): { child: ChildProcess; lines: Promise<string[]> } {
  const child = spawn(process.execPath, [FIXTURE, ...args], { stdio: ['ignore', 'pipe', 'inherit'] });
  const seen: string[] = [];
  const lines = new Promise<string[]>((resolve, reject) => {
    readline.createInterface({ input: child.stdout! }).on('line', (line) => {
      seen.push(line);
      if (until?.test(line)) resolve(seen);
    });
    child.once('exit', (code) => (code === 0 || until !== undefined ? resolve(seen) : reject(new Error(`${args[0]} exited with ${code}`))));
  });
  return { child, lines };
}

describeGpu('parked descriptors on the cuda backend', () => {
  it('keep a cuMemCreate allocation and its bytes in a process that is not a CUDA process, and free it when that process exits', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-premise-'));
    const socket = path.join(dir, 'holder');
    const holder = role(['holder', socket], /^ready$/);
    try {
      await holder.lines;
      const free = () => addon.cudaMemGetInfo(0).free;
      const before = free();
      await role(['creator', socket, String(SIZE)]).lines;
      // The creator has exited: the memory lives on in the holder's descriptor.
      expect(before - free()).toBeGreaterThanOrEqual(SIZE);
      // The holder never loaded the driver.
      expect(fs.readFileSync(`/proc/${holder.child.pid}/maps`, 'utf8')).not.toMatch(/libcuda/);
      const read = await role(['reader', socket, String(SIZE)]).lines;
      expect(JSON.parse(read[read.length - 1])).toEqual({ matching: 1024, of: 1024 });
      const held = free();
      holder.child.kill('SIGKILL');
      await eventually(() => (free() - held >= SIZE ? true : undefined), 10_000, 'the memory to be freed with its holder');
    } finally {
      holder.child.kill('SIGKILL');
      fs.rmSync(dir, { recursive: true, force: true });
    }
  }, 120_000);

  it('restarts a SIGKILLed daemon with every store, byte, allocation, owner, share key and quota charge as before', () => restartScenario('cuda'), 300_000);

  it('serves again from what it holds when its successor is SIGKILLed before serving (--park held), and is taken over later', async () => {
    const daemons: TestDaemon[] = [];
    const peers: Peer[] = [];
    try {
      const served = await successorKilledScenario('cuda', ['--park', 'held', '--quota-per-uid', '64MiB', '--parked-grace-ms', '600000'], daemons, peers);
      process.stdout.write(`cuda: successor SIGKILLed → the old daemon serving again: ${served} ms\n`);
    } finally {
      for (const peer of peers) await peer.kill().catch(() => undefined);
      for (const daemon of daemons.reverse()) {
        if (daemon.process.exitCode === null && daemon.process.signalCode === null) await daemon.stop();
      }
    }
  }, 300_000);
});
