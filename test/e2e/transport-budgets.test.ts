/**
 * The gRPC transport's budgets per uid: server streams (Watch, Read) and
 * client streams (Write) one uid may hold open, the largest message the
 * daemon receives, and the connections one uid may hold. Past a budget the
 * uid is refused (RESOURCE_EXHAUSTED BUDGET_EXCEEDED naming the budget, what
 * it holds and the limit) or its connection closed at accept, and another
 * uid is served as before. The other uid's calls need root (CI runs as root).
 */
import * as grpc from '@grpc/grpc-js';
import { spawn } from 'node:child_process';
import * as net from 'node:net';
import * as path from 'node:path';
import { socketPaths } from '../../common/paths';
import { ERROR_CODE_KEY } from '../../common/protocol';
import { call, eventually, MiB, packageRoot, TestDaemon } from './harness';

const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;
const CALLER = path.join(packageRoot(), 'dist', 'test', 'e2e', 'fixtures', 'raw-caller.js');

jest.setTimeout(60_000);

type Outcome = { ok: true; response: any } | { ok: false; status: grpc.status; code: string; details: string };

/** Calls made from a process of uid nobody. */
function asNobody(dir: string, calls: Array<{ service: string; method: string; request: object }>): Promise<Outcome[]> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [CALLER], {
      stdio: ['pipe', 'pipe', 'pipe'],
      env: { ...process.env, VMMD_SOCKET_DIR: dir },
      uid: NOBODY,
      gid: NOBODY,
    });
    let out = '';
    let err = '';
    child.stdout.on('data', (chunk) => (out += chunk));
    child.stderr.on('data', (chunk) => (err += chunk));
    child.on('exit', (code) => (code === 0 ? resolve(JSON.parse(out)) : reject(new Error(`raw-caller exited ${code}: ${err}`))));
    child.stdin.end(JSON.stringify(calls));
  });
}

/** How a call ended: OK, or its status and error code. */
function outcomeOf(error: grpc.ServiceError | null): string {
  return error === null ? 'OK' : `${grpc.status[error.code]} ${String(error.metadata?.get(ERROR_CODE_KEY)[0] ?? '')}`;
}

/** The first message of a server stream, or how it ended before one. */
function firstOf(stream: grpc.ClientReadableStream<unknown>): Promise<string> {
  return new Promise((resolve) => {
    stream.once('data', () => resolve('data'));
    stream.once('error', (error: grpc.ServiceError) => resolve(`${outcomeOf(error)}: ${error.details}`));
  });
}

describe('gRPC transport budgets per uid', () => {
  let daemon: TestDaemon | undefined;
  afterEach(async () => {
    await daemon?.stop();
    daemon = undefined;
  });

  it('refuses a uid its server streams past --max-server-streams-per-uid, gives one back when cancelled, and serves another uid', async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--max-server-streams-per-uid', '4']);
    const allocation = await call(daemon.raw.vmm, 'Create', { size: String(2n * MiB) });
    await call(daemon.raw.stores, 'CreateStore', { allocationId: allocation.id, name: 'watched', handOver: true });
    const watches = Array.from({ length: 4 }, () => daemon!.raw.stores.Watch({ since: '0' }) as grpc.ClientReadableStream<unknown>);
    for (const watch of watches) watch.on('error', () => undefined);
    expect(await Promise.all(watches.map(firstOf))).toEqual(['data', 'data', 'data', 'data']);
    const fifth = daemon.raw.stores.Watch({ since: '0' }) as grpc.ClientReadableStream<unknown>;
    expect(await firstOf(fifth)).toMatch(/^RESOURCE_EXHAUSTED BUDGET_EXCEEDED: server streams per uid: uid 0 holds 4 of at most 4/);
    watches[0].cancel();
    await eventually(
      async () => {
        const again = daemon!.raw.stores.Watch({ since: '0' }) as grpc.ClientReadableStream<unknown>;
        again.on('error', () => undefined);
        const first = await firstOf(again);
        if (first !== 'data') return undefined;
        watches.push(again);
        return first;
      },
      10_000,
      'a cancelled stream given back',
    );
    if (isRoot) {
      const [other] = await asNobody(daemon.dir, [{ service: 'Stores', method: 'Watch', request: { since: '0' } }]);
      expect(other.ok).toBe(true);
    }
    for (const watch of watches) watch.cancel();
  });

  it('refuses a uid its client streams past --max-client-streams-per-uid', async () => {
    daemon = await TestDaemon.start(['--max-client-streams-per-uid', '2']);
    const outcomes: string[] = [];
    const writes = Array.from(
      { length: 3 },
      () => daemon!.raw.stores.Write((error: grpc.ServiceError | null) => outcomes.push(outcomeOf(error))) as grpc.ClientWritableStream<unknown>,
    );
    await eventually(() => (outcomes.length >= 1 ? true : undefined), 10_000, 'the third Write refused');
    expect(outcomes).toEqual(['RESOURCE_EXHAUSTED BUDGET_EXCEEDED']);
    for (const write of writes) write.end();
    await eventually(() => (outcomes.length === 3 ? true : undefined), 10_000, 'the other Writes answered');
  });

  it('refuses a message larger than --max-message-bytes: a Write chunk of 3 MiB', async () => {
    daemon = await TestDaemon.start([]);
    const allocation = await call(daemon.raw.vmm, 'Create', { size: String(4n * MiB) });
    const store = await call(daemon.raw.stores, 'CreateStore', { allocationId: allocation.id, name: 'written', handOver: true });
    const outcome = await new Promise<string>((resolve) => {
      const write = daemon!.raw.stores.Write((error: grpc.ServiceError | null) => resolve(error === null ? 'OK' : grpc.status[error.code]));
      write.write({ span: { storeId: store.id, offset: '0' }, data: Buffer.alloc(3 << 20, 7) });
      write.end();
    });
    expect(outcome).toBe('RESOURCE_EXHAUSTED');
  });

  it("closes a uid's connections past --max-connections-per-uid at accept; another uid's calls go on", async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY), '--max-connections-per-uid', '8']);
    const ATTACKS = 20;
    let closed = 0;
    const sockets = Array.from({ length: ATTACKS }, () => {
      const socket = net.connect(socketPaths(daemon!.dir).grpc);
      socket.on('connect', () => socket.write('PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n'));
      socket.on('error', () => undefined);
      socket.on('close', () => closed++);
      return socket;
    });
    // The raw clients' own connection counts too: one of the 8 is theirs.
    await eventually(() => (closed >= ATTACKS - 7 ? true : undefined), 10_000, 'the connections past the budget closed');
    await new Promise((resolve) => setTimeout(resolve, 500));
    expect(closed).toBe(ATTACKS - 7);
    if (isRoot) {
      const outcomes = await asNobody(daemon.dir, [
        { service: 'Devices', method: 'ListDevices', request: {} },
        { service: 'Admin', method: 'GetStats', request: {} },
      ]);
      expect(outcomes.map((outcome) => outcome.ok)).toEqual([true, true]);
    }
    for (const socket of sockets) socket.destroy();
  });
});
