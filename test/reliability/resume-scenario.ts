/**
 * The resume scenario, on either backend (test/reliability/resume.test.ts on
 * host, test/gpu/resume-cuda.test.ts on cuda): under vmmd's keeper, 16
 * clients (12 TypeScript, 4 Python processes) allocate, write, release and
 * read one of 8 open stores (4 MiB each, or the size given: 512 MiB for the
 * 4 GiB of the full run) while the serving daemon is SIGKILLed, while it is
 * restarted on purpose (SIGHUP to the keeper: the planned upgrade), and while
 * a second daemon process takes over from it (`--take-over`, no keeper).
 * Every client resumes its session by itself: no error reaches its code,
 * what the daemon says each session owns is exactly what the client holds,
 * its quota charge is their bytes, and their bytes and the stores' are intact:
 * every store read whole after, and the stores' records and quota charges
 * equal to what they were before the clients came.
 */
import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { connect } from '../../client';
import { call, eventually, MiB, packageRoot, sleep, TestDaemon } from '../e2e/harness';
import { figure } from './figures';
import { runReportingClient } from './report-client';
import { servingPid, settledState } from './restart-scenario';

const TS_CLIENTS = 12;
const PY_CLIENTS = 4;
const STORES = 8;
const RUN_MS = 10_000;
const WORKER = path.join(packageRoot(), 'dist', 'test', 'reliability', 'fixtures', 'resume-worker.js');
const PY_WORKER = path.join(packageRoot(), 'test', 'reliability', 'fixtures', 'resume_worker.py');
/** The Python client's interpreter: the venv's where there is one (npm test), else $PYTHON or python3 with the package's sources (the GPU bundle). */
const VENV_PYTHON = path.join(packageRoot(), process.env.VMMD_PYTHON_VENV ?? '.venv', 'bin', 'python');
const PYTHON = fs.existsSync(VENV_PYTHON) ? VENV_PYTHON : (process.env.PYTHON ?? 'python3');
const PYTHON_PATH = path.join(packageRoot(), 'python', 'src');

interface Report {
  ops: number;
  errors: Record<string, number>;
  first?: string;
  events: string[];
  session: string;
  ownedMatches: boolean;
  owned: string[];
  mine: string[];
  chargeMatches: boolean;
  /** The session's quota charge at the end, in bytes. */
  charged: string;
  intact: number;
  held: number;
}

function runPython(args: string[], socketDir: string, env: NodeJS.ProcessEnv): Promise<Report> {
  return new Promise((resolve, reject) => {
    const pythonPath = [PYTHON_PATH, process.env.PYTHONPATH].filter(Boolean).join(':');
    const child = spawn(PYTHON, [PY_WORKER, ...args], {
      stdio: ['ignore', 'pipe', 'pipe'],
      env: { ...process.env, VMMD_SOCKET_DIR: socketDir, PYTHONPATH: pythonPath, ...env },
    });
    let out = '';
    let err = '';
    child.stdout!.on('data', (chunk) => (out += chunk));
    child.stderr!.on('data', (chunk) => (err += chunk));
    child.once('exit', (code) => (code === 0 ? resolve(JSON.parse(out) as Report) : reject(new Error(`python worker exited with ${code}: ${err}`))));
  });
}

/** How much of a store each client reads while it works (all of a smaller one): a large store is checked whole after, by `storeSums`. */
const CHECKED_BYTES = 4n * MiB;
/** The piece a store is written and hashed in: a large store is never one buffer. */
const PIECE_BYTES = 16n * MiB;

/** Store `i`'s bytes from `offset` (a multiple of PIECE_BYTES): each piece its own, so a piece misplaced is seen. */
const storePiece = (i: number, offset: bigint, length: bigint) => Buffer.alloc(Number(length), `store ${i} piece ${offset / PIECE_BYTES} `);

/** 8 stores of `storeBytes` each with bytes of their own, handed to the daemon; each one's checksum, whole and of its first CHECKED_BYTES. */
async function makeStores(dir: string, storeBytes: bigint): Promise<Array<{ whole: string; checked: string }>> {
  const maker = await connect({ socketDir: dir });
  const sums: Array<{ whole: string; checked: string }> = [];
  try {
    for (let i = 0; i < STORES; i++) {
      // Written through the maker's own mapping of the memory, then handed over: a store's load as a loader does it.
      const memory = await maker.vmm.allocate({ size: storeBytes });
      const whole = createHash('sha256');
      const checked = createHash('sha256');
      for (let offset = 0n; offset < storeBytes; offset += PIECE_BYTES) {
        const piece = storePiece(i, offset, storeBytes - offset < PIECE_BYTES ? storeBytes - offset : PIECE_BYTES);
        await memory.write(offset, piece);
        whole.update(piece);
        if (offset < CHECKED_BYTES) checked.update(piece.subarray(0, Number(CHECKED_BYTES - offset)));
      }
      await maker.stores.createStore({ allocationId: memory.allocationId, name: `weights-${i}`, handOver: true });
      await memory.close();
      sums.push({ whole: whole.digest('hex'), checked: checked.digest('hex') });
    }
  } finally {
    maker.close();
  }
  return sums;
}

/** Each store opened and read whole, piece by piece: its sha256 by name. */
async function storeSums(dir: string): Promise<Record<string, string>> {
  const reader = await connect({ socketDir: dir });
  const sums: Record<string, string> = {};
  try {
    for (const listed of await reader.stores.list()) {
      const opened = await reader.stores.open({ name: listed.name });
      const hash = createHash('sha256');
      const size = BigInt(listed.size);
      for (let offset = 0n; offset < size; offset += PIECE_BYTES)
        hash.update(await opened.memory.read(offset, size - offset < PIECE_BYTES ? size - offset : PIECE_BYTES));
      await opened.close();
      sums[listed.name] = hash.digest('hex');
    }
  } finally {
    reader.close();
  }
  return sums;
}

/** SIGKILL of the serving daemon; resolves once the next one serves. */
async function killServing(daemon: TestDaemon): Promise<void> {
  const before = servingPid(daemon.pid)!;
  process.kill(before, 'SIGKILL');
  await eventually(
    async () =>
      servingPid(daemon.pid) !== before &&
      (await daemon.stats().then(
        () => true,
        () => undefined,
      ))
        ? true
        : undefined,
    30_000,
    'the daemon to serve again',
  );
}

/** SIGHUP to the keeper (a planned upgrade); resolves once the next daemon serves. */
async function upgrade(daemon: TestDaemon): Promise<void> {
  const before = servingPid(daemon.pid)!;
  process.kill(daemon.pid, 'SIGHUP');
  await eventually(
    async () =>
      servingPid(daemon.pid) !== undefined &&
      servingPid(daemon.pid) !== before &&
      (await daemon.stats().then(
        () => true,
        () => undefined,
      ))
        ? true
        : undefined,
    30_000,
    'the new daemon to serve',
  );
}

const NAMES = { kill: 'kill -9', upgrade: 'planned upgrade', 'take-over': 'take-over by a new daemon' } as const;

/**
 * 16 clients at work while the daemon is SIGKILLed ('kill'), restarted on
 * purpose under the keeper ('upgrade'), or taken over by a second daemon
 * process started with --take-over ('take-over', no keeper), with 8 stores of
 * `storeBytes` each open (4 MiB unless given); checks and reports.
 * @param options.extraArgs more daemon arguments (a stock on host: the cuda backend's allocation path)
 */
export async function resumeScenario(
  backend: 'host' | 'cuda',
  how: 'kill' | 'upgrade' | 'take-over',
  options: { storeBytes?: bigint; extraArgs?: string[] } = {},
): Promise<void> {
  const storeBytes = options.storeBytes ?? 4n * MiB;
  const extraArgs = options.extraArgs ?? [];
  const name = `${NAMES[how]} under load, 8 stores of ${storeBytes / MiB} MiB (${backend}${extraArgs.length > 0 ? ` ${extraArgs.join(' ')}` : ''})`;
  // Room for the stores and for every client's allocations beside them.
  const capacity = `${BigInt(STORES) * storeBytes + 512n * MiB}`;
  const settings = ['--parked-grace-ms', '60000', ...(backend === 'host' ? ['--host-capacity', capacity] : []), ...extraArgs];
  let daemon = await TestDaemon.start([...(how === 'take-over' ? ['--park', 'held'] : ['--keeper', 'on']), ...settings], backend);
  // The hand-over proper, as the new daemon measures it: from its request to serving.
  let handOverMs: number | undefined;
  const restart = async () => {
    if (how === 'kill') return killServing(daemon);
    if (how === 'upgrade') return upgrade(daemon);
    daemon = await TestDaemon.takeOver(daemon, settings, backend);
    const line = daemon.logs.find((text) => text.includes('took over: serving'));
    handOverMs = line === undefined ? undefined : Math.round(JSON.parse(line).ms);
  };
  try {
    const sums = await makeStores(daemon.dir, storeBytes);
    const store = (i: number) => [`weights-${i % STORES}`, sums[i % STORES].checked, String(CHECKED_BYTES < storeBytes ? CHECKED_BYTES : storeBytes)];
    // What the stores are before the clients come and the daemon goes: their records, their allocations, the quota charges.
    const before = await settledState(daemon);
    // The clients work until this file is there (written once the daemon is back), so that every one is at work across
    // the restart however long 16 of them take to start: one that stopped before would close its session in the middle
    // of the daemon's going, and that session would wait out its grace in the next daemon.
    const stopFile = path.join(daemon.dir, 'clients-stop');
    const env = { VMMD_TEST_STOP_FILE: stopFile };
    const running = [
      ...Array.from({ length: TS_CLIENTS }, (_, i) => runReportingClient<Report>(WORKER, [String(i + 1), String(RUN_MS), ...store(i)], daemon.dir, env)),
      ...Array.from({ length: PY_CLIENTS }, (_, i) => runPython([String(TS_CLIENTS + i + 1), String(RUN_MS), ...store(TS_CLIENTS + i)], daemon.dir, env)),
    ];
    // Once every client is at work (each has a session), the daemon goes.
    // A limit on waiting, not a speed check: 16 processes starting on a loaded 2-core machine have taken over 30 s.
    await eventually(async () => ((await daemon.stats()).sessions >= TS_CLIENTS + PY_CLIENTS ? true : undefined), 60_000, 'the clients to connect');
    await sleep(2_000);
    const started = Date.now();
    await restart();
    const restartMs = Date.now() - started;
    await sleep(RUN_MS / 2);
    fs.writeFileSync(stopFile, '');
    const reports = await Promise.all(running);
    // Every store listed, opened and read whole: the bytes of each are what was written.
    const sumsAfter = await storeSums(daemon.dir);
    const errors = reports.reduce((total, report) => total + Object.values(report.errors).reduce((a, b) => a + b, 0), 0);
    const firstErrors = reports.map((report) => report.first).filter((first) => first !== undefined && first !== null);
    figure(`resume: ${name}`, {
      clients: reports.length,
      stores_open: STORES,
      store_bytes_total: String(BigInt(STORES) * storeBytes),
      stores_byte_identical: Object.entries(sumsAfter).filter(([storeName, sum]) => sums[Number(storeName.split('-')[1])]?.whole === sum).length,
      ops: reports.reduce((total, report) => total + report.ops, 0),
      client_errors: errors,
      sessions_owning_exactly_what_they_hold: reports.filter((report) => report.ownedMatches).length,
      quota_charges_equal: reports.filter((report) => report.chargeMatches).length,
      allocations_intact: reports.reduce((total, report) => total + report.intact, 0),
      allocations_held: reports.reduce((total, report) => total + report.held, 0),
      restart_ms: restartMs,
      ...(handOverMs === undefined ? {} : { hand_over_ms: handOverMs }),
    });
    expect(firstErrors).toEqual([]);
    expect(reports.filter((report) => !report.ownedMatches).map((report) => ({ session: report.session, owned: report.owned, mine: report.mine }))).toEqual([]);
    const unsound = reports.filter((report) => !report.chargeMatches || report.intact !== report.held || report.ops === 0);
    expect(unsound.map((report) => ({ session: report.session, charged: report.charged, held: report.held, intact: report.intact, ops: report.ops }))).toEqual(
      [],
    );
    // Every session is gone with its client; nothing is left over.
    await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 20_000, 'the sessions to close');
    // A closed session's objects are reclaimed just after it leaves the count: only the stores' allocations stay; a leftover is named (id, owner).
    await eventually(
      async () => ((await daemon.stats()).allocations === String(STORES) ? true : undefined),
      20_000,
      "the sessions' allocations to be reclaimed",
    ).catch(() => undefined);
    const stores = new Set((await call(daemon.raw.stores, 'List', {})).stores.map((store: { allocationId: string }) => String(store.allocationId)));
    const left = (await call(daemon.raw.admin, 'ListObjects', {})).objects.filter(
      (o: { kind: string; id: string }) => o.kind === 'allocation' && !stores.has(String(o.id)),
    );
    expect(left).toEqual([]);
    expect((await daemon.stats()).allocations).toBe(String(STORES));
    expect(sumsAfter).toEqual(Object.fromEntries(sums.map((sum, i) => [`weights-${i}`, sum.whole])));
    // The stores, their allocations and every quota charge are what they were before the clients came: 0 bytes lost, none left over.
    expect(await settledState(daemon)).toEqual(before);
  } finally {
    await daemon.stop();
  }
}
