/**
 * The transport attacked per uid, at default settings: many Read streams
 * that are never read, concurrent Write streams of large messages, and
 * thousands of gRPC connections that send only the HTTP/2 preface. The
 * daemon's RSS and descriptors before, during and after each attack are
 * figures for RELIABILITY.md ("Transport budgets"); what the attacker got and
 * what another uid saw are checked. The other uid needs root (CI runs as root).
 */
import * as grpc from '@grpc/grpc-js';
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as http2 from 'node:http2';
import * as net from 'node:net';
import * as path from 'node:path';
import { loadProtos } from '../../common/proto';
import { addon } from '../../native';
import { socketPaths } from '../../common/paths';
import { call, MiB, packageRoot, sleep, TestDaemon } from '../e2e/harness';
import { figure } from './figures';

const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;
const CALLER = path.join(packageRoot(), 'dist', 'test', 'e2e', 'fixtures', 'raw-caller.js');
const READERS = 240;
const WRITERS = 32;
const CONNECTIONS = 2_000;
jest.setTimeout(300_000);

/** The daemon's resident memory in MB, and its open descriptors. */
function usage(daemon: TestDaemon): { rssMB: number; fds: number } {
  const status = fs.readFileSync(`/proc/${daemon.pid}/status`, 'utf8');
  return { rssMB: Math.round(Number(/VmRSS:\s+(\d+)/.exec(status)![1]) / 1024), fds: daemon.openFds() };
}

/** ListDevices and GetStats from a process of uid nobody: how each ended, and how long both took. */
async function victim(dir: string): Promise<string> {
  if (!isRoot) return 'not run (not root)';
  const started = Date.now();
  const outcomes: Array<{ ok: boolean; code?: string }> = await new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [CALLER], {
      stdio: ['pipe', 'pipe', 'pipe'],
      env: { ...process.env, VMMD_SOCKET_DIR: dir },
      uid: NOBODY,
      gid: NOBODY,
    });
    let out = '';
    child.stdout.on('data', (chunk) => (out += chunk));
    child.on('exit', (code) => (code === 0 ? resolve(JSON.parse(out)) : reject(new Error(`raw-caller exited ${code}`))));
    child.stdin.end(
      JSON.stringify([
        { service: 'Devices', method: 'ListDevices', request: {} },
        { service: 'Admin', method: 'GetStats', request: {} },
      ]),
    );
  });
  return `${outcomes.map((outcome) => (outcome.ok ? 'OK' : outcome.code)).join('+')} in ${Date.now() - started} ms`;
}

/** A Read stream on its own HTTP/2 connection whose reader takes nothing. */
function stalledRead(dir: string, request: object): { status: Promise<number>; close(): void } {
  const definition = (loadProtos().proto.vmmd.v1 as any).Stores.service.Read;
  const session = http2.connect('http://localhost', { createConnection: () => net.connect(socketPaths(dir).grpc) });
  session.on('error', () => undefined);
  const stream = session.request({ ':method': 'POST', ':path': definition.path, 'content-type': 'application/grpc', te: 'trailers' });
  stream.on('error', () => undefined);
  stream.pause();
  const body = definition.requestSerialize(request) as Buffer;
  const frame = Buffer.alloc(5 + body.length);
  frame.writeUInt32BE(body.length, 1);
  body.copy(frame, 5);
  stream.end(frame);
  const status = new Promise<number>((resolve) => {
    const read = (headers: http2.IncomingHttpHeaders) => headers['grpc-status'] !== undefined && resolve(Number(headers['grpc-status']));
    stream.on('response', read);
    stream.on('trailers', read);
    stream.on('close', () => resolve(-1));
  });
  return { status, close: () => session.destroy() };
}

describe('transport attacks at default settings (host)', () => {
  let daemon: TestDaemon | undefined;
  afterEach(async () => {
    await daemon?.stop();
    daemon = undefined;
  });

  it('holds unread Read streams to the uid budget, each to its bytes in flight', async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY)]);
    const allocation = await call(daemon.raw.vmm, 'Create', { size: String(64n * MiB) });
    const store = await call(daemon.raw.stores, 'CreateStore', { allocationId: allocation.id, name: 'read', handOver: true });
    await call(daemon.raw.stores, 'Fill', { span: { storeId: store.id }, length: String(64n * MiB), value: 1 });
    const before = usage(daemon);
    const readers = Array.from({ length: READERS }, () => stalledRead(daemon!.dir, { span: { storeId: store.id }, length: String(64n * MiB) }));
    await sleep(5_000);
    const during = usage(daemon);
    const seen = await victim(daemon.dir);
    // Past the connection budget a reader's connection is closed (-1); past the stream budget its stream is refused; the rest stay open (-2).
    const statuses = await Promise.all(readers.map((reader) => Promise.race([reader.status, sleep(100).then(() => -2)])));
    const count = (wanted: number) => statuses.filter((status) => status === wanted).length;
    const [refused, cut, open] = [count(grpc.status.RESOURCE_EXHAUSTED), count(-1), count(-2)];
    for (const reader of readers) reader.close();
    await sleep(2_000);
    const after = usage(daemon);
    figure('transport-read-streams', {
      streams: READERS,
      open,
      refused,
      connectionsClosed: cut,
      rssBeforeMB: before.rssMB,
      rssDuringMB: during.rssMB,
      rssAfterMB: after.rssMB,
      fdsBefore: before.fds,
      fdsDuring: during.fds,
      fdsAfter: after.fds,
      victim: seen,
    });
    expect(open).toBe(16);
    expect(during.rssMB - before.rssMB).toBeLessThan(100);
  });

  it('holds concurrent Write streams of large messages to the uid budget and the message limit', async () => {
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY)]);
    const allocation = await call(daemon.raw.vmm, 'Create', { size: String(64n * MiB) });
    const store = await call(daemon.raw.stores, 'CreateStore', { allocationId: allocation.id, name: 'written', handOver: true });
    const before = usage(daemon);
    // Under the 16 MiB a daemon accepted before --max-message-bytes.
    const chunk = Buffer.alloc(15 << 20, 3);
    const outcomes: string[] = [];
    let peak = before;
    const sampler = setInterval(() => {
      const now = usage(daemon!);
      if (now.rssMB > peak.rssMB) peak = now;
    }, 50);
    // Each on its own connection, as separate clients would.
    const clients = Array.from(
      { length: WRITERS },
      () =>
        new (loadProtos().proto.vmmd.v1 as any).Stores(`unix://${socketPaths(daemon!.dir).grpc}`, grpc.credentials.createInsecure(), {
          'grpc.max_send_message_length': 64 << 20,
          'grpc.use_local_subchannel_pool': 1,
        }),
    );
    await Promise.all(
      clients.map(
        (client) =>
          new Promise<void>((resolve) => {
            const write = client.Write((error: grpc.ServiceError | null) => {
              outcomes.push(error === null ? 'OK' : grpc.status[error.code]);
              resolve();
            });
            for (let i = 0; i < 4; i++) write.write({ span: { storeId: store.id, offset: String(i * (15 << 20)) }, data: chunk });
            write.end();
          }),
      ),
    );
    clearInterval(sampler);
    const seen = await victim(daemon.dir);
    // Stores has a Close RPC of its own: the channel is closed through grpc.Client's close.
    for (const client of clients) grpc.Client.prototype.close.call(client);
    await sleep(2_000);
    const after = usage(daemon);
    const counts = outcomes.reduce<Record<string, number>>((all, outcome) => ({ ...all, [outcome]: (all[outcome] ?? 0) + 1 }), {});
    figure('transport-write-streams', {
      streams: WRITERS,
      outcomes: JSON.stringify(counts),
      rssBeforeMB: before.rssMB,
      rssPeakMB: peak.rssMB,
      rssAfterMB: after.rssMB,
      fdsBefore: before.fds,
      fdsPeak: peak.fds,
      fdsAfter: after.fds,
      victim: seen,
    });
    expect(peak.rssMB - before.rssMB).toBeLessThan(200);

    // Within the message limit: the same 32 streams, each 64 MiB in messages just under 2 MiB.
    const fitting = Buffer.alloc((2 << 20) - 1024, 5);
    const base = usage(daemon);
    let fittingPeak = base;
    const fittingSampler = setInterval(() => {
      const now = usage(daemon!);
      if (now.rssMB > fittingPeak.rssMB) fittingPeak = now;
    }, 50);
    const fittingOutcomes: string[] = [];
    const more = Array.from(
      { length: WRITERS },
      () =>
        new (loadProtos().proto.vmmd.v1 as any).Stores(`unix://${socketPaths(daemon!.dir).grpc}`, grpc.credentials.createInsecure(), {
          'grpc.use_local_subchannel_pool': 1,
        }),
    );
    await Promise.all(
      more.map(
        (client) =>
          new Promise<void>((resolve) => {
            const write = client.Write((error: grpc.ServiceError | null) => {
              fittingOutcomes.push(error === null ? 'OK' : `${grpc.status[error.code]} ${String(error.metadata?.get('vmmd-error-code')[0] ?? '')}`);
              resolve();
            });
            for (let i = 0; i < 32; i++) write.write({ span: { storeId: store.id, offset: String(i * fitting.length) }, data: fitting });
            write.end();
          }),
      ),
    );
    clearInterval(fittingSampler);
    for (const client of more) grpc.Client.prototype.close.call(client);
    const fittingCounts = fittingOutcomes.reduce<Record<string, number>>((all, outcome) => ({ ...all, [outcome]: (all[outcome] ?? 0) + 1 }), {});
    figure('transport-write-streams-within-limit', {
      streams: WRITERS,
      outcomes: JSON.stringify(fittingCounts),
      rssBeforeMB: base.rssMB,
      rssPeakMB: fittingPeak.rssMB,
    });
  });

  it("closes idle connections past a uid's budget at accept; another uid is served", async () => {
    // The attacker's own descriptors must not be what runs out.
    addon.descriptorLimit(addon.descriptorLimit().hard);
    daemon = await TestDaemon.start(['--socket-group', String(NOBODY)], 'host', {}, { descriptorLimit: 4096 });
    const before = usage(daemon);
    let closed = 0;
    let refusedAtConnect = 0;
    const sockets: net.Socket[] = [];
    // In batches: a burst past the listen backlog is refused by the kernel, not by the daemon.
    for (let batch = 0; batch < CONNECTIONS / 100; batch++) {
      for (let i = 0; i < 100; i++) {
        const socket = net.connect(socketPaths(daemon.dir).grpc);
        let connected = false;
        socket.on('connect', () => {
          connected = true;
          socket.write('PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n');
        });
        socket.on('error', () => undefined);
        socket.on('close', () => (connected ? closed++ : refusedAtConnect++));
        sockets.push(socket);
      }
      await sleep(100);
    }
    await sleep(5_000);
    const during = usage(daemon);
    const closedByDaemon = closed;
    const stillRefused = refusedAtConnect;
    const seen = await victim(daemon.dir);
    for (const socket of sockets) socket.destroy();
    await sleep(2_000);
    const after = usage(daemon);
    figure('transport-connections', {
      connections: CONNECTIONS,
      closedByDaemon,
      refusedAtConnect: stillRefused,
      rssBeforeMB: before.rssMB,
      rssDuringMB: during.rssMB,
      rssAfterMB: after.rssMB,
      fdsBefore: before.fds,
      fdsDuring: during.fds,
      fdsAfter: after.fds,
      victim: seen,
    });
    expect(closedByDaemon).toBeGreaterThan(CONNECTIONS - 64);
    if (isRoot) expect(seen).toMatch(/^OK\+OK/);
  });
});
