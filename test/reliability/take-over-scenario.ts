/**
 * Take-overs (`vmmd --take-over` from a daemon started with `--park held`),
 * the parts test/reliability/take-over.test.ts (host) and
 * test/gpu/park-cuda.test.ts (cuda) share: the hand-over socket, a successor
 * that takes everything and never answers, and the scenario that kills it,
 * after which the old daemon serves again with everything
 * (test/reliability/parked-objects.ts).
 */
import { ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { call, eventually, packageRoot, Peer, TestDaemon } from '../e2e/harness';
import { checksums, expectIntact, observed, populate } from './parked-objects';

export const HAND_OVER = 'vmmd.handover.sock';

/** How long a daemon whose successor died before serving may take to serve again (the machine may be loaded). */
export const SERVES_AGAIN_WITHIN_MS = 20_000;

/**
 * A successor that asks to take over, receives every descriptor and the
 * "end", prints how many came, and waits (for the SIGKILL) without answering.
 */
export const SUCCESSOR_THAT_TAKES_ALL = `const { addon } = require(${JSON.stringify(path.join(packageRoot(), 'dist', 'native'))});
  const fd = addon.seqpacketConnect(process.argv[1]);
  addon.unixDgramSendFds(fd, Buffer.from(JSON.stringify({ take: { pid: process.pid, version: 'test' } })), []);
  let received = 0;
  const poll = () => {
    for (;;) {
      const got = addon.unixDgramRecvFds(fd, 65536);
      if (got === null) return setTimeout(poll, 5);
      received += got.fds.length;
      if (JSON.parse(got.data.toString()).end !== undefined) { process.stdout.write(received + '\\n'); return setInterval(() => {}, 1000); }
    }
  };
  poll();`;

/**
 * A successor process (SUCCESSOR_THAT_TAKES_ALL) that has taken every
 * descriptor of `old` and waits without answering: resolved once it has.
 */
export async function takingAll(old: TestDaemon): Promise<ChildProcess> {
  const successor = spawn(process.execPath, ['-e', SUCCESSOR_THAT_TAKES_ALL, path.join(old.dir, HAND_OVER)], { stdio: ['ignore', 'pipe', 'inherit'] });
  const took = await new Promise<number>((resolve, reject) => {
    let out = '';
    successor.stdout!.on('data', (chunk) => {
      out += chunk;
      if (out.includes('\n')) resolve(Number(out.trim()));
    });
    successor.once('exit', (code) => reject(new Error(`the successor exited (${code}) before it took everything`)));
  });
  expect(took).toBeGreaterThan(0);
  return successor;
}

/** SIGKILLs the successor that took everything; the milliseconds until `old` serves again. */
export async function killedAndServedAgain(old: TestDaemon, successor: ChildProcess): Promise<number> {
  const killed = Date.now();
  successor.kill('SIGKILL');
  await eventually(
    async () =>
      await call(old.raw.devices, 'ListDevices', {}).then(
        () => true,
        () => undefined,
      ),
    SERVES_AGAIN_WITHIN_MS,
    'the old daemon to serve again',
  );
  return Date.now() - killed;
}

/**
 * A successor process takes every descriptor of a `--park held` daemon and is
 * SIGKILLed before it answers "done": the old daemon serves again with
 * everything, its maker's client resumes by itself, and a later take-over
 * gets it all. Returns the milliseconds from the kill to the old one serving.
 * @param held the daemons' flags (`--park held` and the rest)
 * @param daemons, peers where the daemons and clients started here go, for the caller's cleanup
 */
export async function successorKilledScenario(backend: 'host' | 'cuda', held: string[], daemons: TestDaemon[], peers: Peer[]): Promise<number> {
  const old = await TestDaemon.start(held, backend);
  daemons.push(old);
  const made = await populate(old, peers);
  const sums = await checksums(old.dir);
  const before = await observed(old);
  const successor = await takingAll(old);
  // The old one stopped serving for the hand-over.
  expect(fs.existsSync(path.join(old.dir, 'vmmd.sock'))).toBe(false);
  const servedAfterMs = await killedAndServedAgain(old, successor);
  expect(old.logs.some((line) => line.includes('went away before it served: serving again'))).toBe(true);
  expect(old.process.exitCode).toBeNull();
  // Everything as before; the maker's client resumed its session by itself.
  await expectIntact(old, before, sums, made);
  // The hand-over socket is there again: a later take-over gets it all.
  const next = await TestDaemon.takeOver(old, held, backend);
  daemons.push(next);
  expect(await old.exitStatus).toBe(0);
  await expectIntact(next, before, sums, made);
  return servedAfterMs;
}
