/**
 * Take-overs (`vmmd --take-over` from a daemon started with `--park held`),
 * the parts test/reliability/take-over.test.ts (host) and
 * test/gpu/park-cuda.test.ts (cuda) share: a daemon populated with stores,
 * bytes and a session's shared allocation, the checks that everything came
 * through, and a successor killed after it took everything, from which the
 * old daemon serves again.
 */
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { call, eventually, MiB, packageRoot, Peer, TestDaemon } from '../e2e/harness';
import { observed } from './restart-scenario';

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
 * A daemon with stores holding bytes, one read-only, one whose maker let go of
 * its allocation (the daemon's, charged to the maker's uid alone), and a
 * session's own allocation shared with a key.
 */
export async function populate(daemon: TestDaemon, peers: Peer[]) {
  const maker = await Peer.start(daemon.dir);
  peers.push(maker);
  for (const [index, text] of ['weights of model a', 'weights of model b'].entries()) {
    const allocation = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
    const store = await maker.do({
      op: 'call',
      api: 'stores',
      method: 'createStore',
      args: { allocationId: allocation.id, name: `model-${index}`, handOver: true },
    });
    await maker.do({ op: 'storeWrite', id: store.id, text });
    if (index === 1) await maker.do({ op: 'call', api: 'vmm', method: 'release', args: { allocationId: allocation.id } });
  }
  const frozen = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
  await maker.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: frozen.id, name: 'frozen', readOnly: true, handOver: true } });
  const own = await maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(4n * MiB) } });
  const { shareKey } = await maker.do({ op: 'call', api: 'vmm', method: 'share', args: { allocationId: own.id } });
  const writer = await Peer.start(daemon.dir);
  const mapped = await writer.do({ op: 'import', allocationId: own.id, shareKey });
  await writer.do({ op: 'fill', handle: mapped.handle, offset: 4096, text: 'bytes of the session' });
  await writer.stop();
  return { maker, own, shareKey };
}

/** The stores' checksums, through a fresh client. */
export async function checksums(dir: string): Promise<Record<string, string>> {
  const checker = await Peer.start(dir);
  try {
    const sums: Record<string, string> = {};
    for (const name of ['model-0', 'model-1', 'frozen']) {
      const opened = await checker.do({ op: 'storeOpen', name });
      sums[name] = (await checker.do({ op: 'storeChecksum', handle: opened.handle })).sha256;
      await checker.do({ op: 'storeClose', handle: opened.handle });
    }
    return sums;
  } finally {
    await checker.stop();
  }
}

/** Everything is as before on `daemon`: stores, bytes, allocations, owners, quota charges, the share key's bytes; the maker's session carries on. */
export async function expectIntact(
  daemon: TestDaemon,
  before: Awaited<ReturnType<typeof observed>>,
  sums: Record<string, string>,
  made: Awaited<ReturnType<typeof populate>>,
) {
  expect(await observed(daemon)).toEqual(before);
  expect(await checksums(daemon.dir)).toEqual(sums);
  const reader = await Peer.start(daemon.dir);
  try {
    const reopened = await reader.do({ op: 'import', allocationId: made.own.id, shareKey: made.shareKey });
    expect((await reader.do({ op: 'peek', handle: reopened.handle, offset: 4096, length: 20 })).text).toBe('bytes of the session');
    await expect(reader.do({ op: 'storeOpen', name: 'frozen', writable: true })).rejects.toMatchObject({ code: 'STORE_READ_ONLY' });
  } finally {
    await reader.stop();
  }
  // The maker's client resumed its session by itself: it makes more, with ids never given before.
  const fresh = await made.maker.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
  expect(BigInt(fresh.id)).toBeGreaterThan(BigInt(made.own.id));
  await made.maker.do({ op: 'call', api: 'vmm', method: 'release', args: { allocationId: fresh.id } });
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
  // A successor process that takes every descriptor and is killed before it answers "done".
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
  // The old one stopped serving for the hand-over.
  expect(fs.existsSync(path.join(old.dir, 'vmmd.sock'))).toBe(false);
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
  const servedAfterMs = Date.now() - killed;
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
