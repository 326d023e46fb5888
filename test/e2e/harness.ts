/**
 * End-to-end harness: a real daemon on a temporary socket directory, raw
 * sessionless gRPC clients for inspection, and client processes driven over
 * stdin/stdout (fixtures/peer.ts).
 */
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import { protoPath as HEALTH_PROTO } from 'grpc-health-check';
import { ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as http from 'node:http';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { socketPaths } from '../../common/paths';
import { loadProtos } from '../../common/proto';
import { type ClientFrame, decodeDaemonFrame, encodeClientFrame, PROTOCOL_VERSION } from '../../common/protocol';
import type { Stats__Output } from '../../generated/vmmd/v1/Stats';
import { addon } from '../../native';
import { SeqpacketConnection, SeqpacketMessage } from '../../native/seqpacket';

/** The package root, from the sources or from dist/ when compiled. */
export function packageRoot(): string {
  let dir = __dirname;
  while (!fs.existsSync(path.join(dir, 'package.json'))) dir = path.dirname(dir);
  return dir;
}

const ROOT = packageRoot();
const DAEMON = path.join(ROOT, 'bin', 'vmmd.js');
const PEER = path.join(ROOT, 'dist', 'test', 'e2e', 'fixtures', 'peer.js');

export const MiB = 1n << 20n;

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * Closes the clients, waits for their sessions to end, asserts the daemon holds
 * no reservation, allocation, mapping or pending transfer, and stops it.
 */
export async function stopWhenClean(daemon: TestDaemon | undefined, clients: Array<{ close(): void }>): Promise<void> {
  for (const connected of clients.splice(0)) connected.close();
  if (daemon === undefined) return;
  await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'the sessions to close');
  expect(await daemon.stats()).toMatchObject({ reservations: '0', allocations: '0', mappings: '0', pendingTransfers: 0 });
  await daemon.stop();
}

/** The daemon's Prometheus metrics page, as a scraper reads it. */
export function scrapeMetrics(port: number): Promise<string> {
  return new Promise((resolve, reject) =>
    http
      .get({ host: '127.0.0.1', port, path: '/metrics' }, (response) => {
        let body = '';
        response.on('data', (chunk) => (body += chunk));
        response.on('end', () => resolve(body));
      })
      .on('error', reject),
  );
}

/** The status the daemon's plaintext health port gives `service` ('' is the whole daemon), as a kubelet's gRPC probe asks. */
export function healthCheck(port: number, service = ''): Promise<string> {
  const definition = protoLoader.loadSync(HEALTH_PROTO, { keepCase: true, enums: String });
  const Health = (grpc.loadPackageDefinition(definition) as any).grpc.health.v1.Health;
  const client = new Health(`127.0.0.1:${port}`, grpc.credentials.createInsecure());
  return new Promise((resolve, reject) =>
    client.Check({ service }, { deadline: Date.now() + 5000 }, (error: Error | null, response: { status: string }) => {
      client.close();
      return error ? reject(error) : resolve(response.status);
    }),
  );
}

/** A TCP port on 127.0.0.1 that was free a moment ago (for a daemon's metrics or health listener). */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as net.AddressInfo;
      server.close(() => resolve(port));
    });
  });
}

/** Polls until check() returns a value that is not undefined, or throws after timeoutMs with the last value. */
export async function eventually<T>(check: () => Promise<T | undefined> | T | undefined, timeoutMs = 10_000, what = 'condition'): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value !== undefined) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(25);
  }
}

export interface RawClients {
  devices: grpc.Client & Record<string, any>;
  vmm: grpc.Client & Record<string, any>;
  admin: grpc.Client & Record<string, any>;
  stores: grpc.Client & Record<string, any>;
  close(): void;
}

/** Sessionless clients, as grpcurl would be. */
export function rawClients(dir: string): RawClients {
  const { proto } = loadProtos();
  const target = `unix://${socketPaths(dir).grpc}`;
  const credentials = grpc.credentials.createInsecure();
  const devices = new proto.vmmd.v1.Devices(target, credentials) as any;
  const vmm = new proto.vmmd.v1.VirtualMemory(target, credentials, { channelOverride: devices.getChannel() }) as any;
  const admin = new proto.vmmd.v1.Admin(target, credentials, { channelOverride: devices.getChannel() }) as any;
  const stores = new proto.vmmd.v1.Stores(target, credentials, { channelOverride: devices.getChannel() }) as any;
  return { devices, vmm, admin, stores, close: () => devices.close() };
}

/** A unary call on a raw client as a promise; rejects with the grpc-js error. */
export function call<T = any>(client: any, method: string, request: object, metadata = new grpc.Metadata()): Promise<T> {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, (error: grpc.ServiceError | null, response: T) => (error ? reject(error) : resolve(response)));
  });
}

export class TestDaemon {
  readonly dir: string;
  readonly raw: RawClients;
  private exited: Promise<number | null>;
  readonly logs: string[] = [];

  private constructor(
    readonly process: ChildProcess,
    dir: string,
  ) {
    this.dir = dir;
    this.raw = rawClients(dir);
    this.exited = new Promise((resolve) => process.once('exit', (code) => resolve(code)));
  }

  /**
   * @param options.descriptorLimit RLIMIT_NOFILE (soft and hard) for the daemon, set by the shell that starts it
   * @param options.as the daemon's uid and gid, as deployed: its own, no capabilities (needs root; the socket directory becomes theirs)
   */
  static async start(
    extraArgs: string[] = [],
    backend: 'host' | 'cuda' = 'host',
    env: NodeJS.ProcessEnv = {},
    options: { descriptorLimit?: number; as?: { uid: number; gid: number }; nodeArgs?: string[] } = {},
  ): Promise<TestDaemon> {
    // A --socket-dir among the extra arguments names the directory; else a fresh temporary one.
    const named = extraArgs.indexOf('--socket-dir');
    const dir = named >= 0 ? extraArgs[named + 1] : fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-e2e-'));
    if (options.as !== undefined) fs.chownSync(dir, options.as.uid, options.as.gid);
    const limited = options.descriptorLimit === undefined ? [] : ['/bin/sh', '-c', `ulimit -n ${options.descriptorLimit} && exec "$0" "$@"`];
    const child = spawn(
      limited[0] ?? process.execPath,
      [
        ...limited.slice(1),
        ...(limited.length > 0 ? [process.execPath] : []),
        ...(options.nodeArgs ?? []),
        DAEMON,
        '--backend',
        backend,
        '--socket-dir',
        dir,
        '--host-capacity',
        '256MiB',
        '--log-level',
        'warn',
        ...extraArgs.filter((_, i) => named < 0 || (i !== named && i !== named + 1)),
      ],
      { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env }, ...(options.as ?? {}) },
    );
    const daemon = new TestDaemon(child, dir);
    for (const stream of [child.stdout!, child.stderr!]) {
      readline.createInterface({ input: stream }).on('line', (line) => daemon.logs.push(line));
    }
    await eventually(
      async () => {
        if (child.exitCode !== null) throw new Error(`vmmd exited with ${child.exitCode}: ${daemon.logs.join('\n')}`);
        try {
          await call(daemon.raw.devices, 'ListDevices', {});
          return true;
        } catch {
          return undefined;
        }
      },
      // A limit on waiting, not a speed check: on a loaded 2-core machine a start has taken over 15 s.
      60_000,
      'the daemon to serve',
    );
    return daemon;
  }

  /**
   * A second daemon on `old`'s directory, started with `--take-over on`:
   * resolves once the old one has exited and this one serves. `old` is done
   * with then (its directory is the new one's: do not stop it).
   * @throws when the new daemon exits first (its logs in the message)
   */
  static async takeOver(old: TestDaemon, extraArgs: string[] = [], backend: 'host' | 'cuda' = 'host', env: NodeJS.ProcessEnv = {}): Promise<TestDaemon> {
    const child = spawn(
      process.execPath,
      [DAEMON, '--backend', backend, '--socket-dir', old.dir, '--host-capacity', '256MiB', '--log-level', 'info', '--take-over', 'on', ...extraArgs],
      { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env } },
    );
    const daemon = new TestDaemon(child, old.dir);
    for (const stream of [child.stdout!, child.stderr!]) {
      readline.createInterface({ input: stream }).on('line', (line) => daemon.logs.push(line));
    }
    await eventually(
      async () => {
        if (child.exitCode !== null) throw new Error(`vmmd --take-over exited with ${child.exitCode}: ${daemon.logs.join('\n')}`);
        if (old.process.exitCode === null && old.process.signalCode === null) return undefined;
        return (await call(daemon.raw.devices, 'ListDevices', {}).then(
          () => true,
          () => undefined,
        ))
          ? true
          : undefined;
      },
      60_000,
      'the new daemon to take over',
    );
    old.raw.close();
    return daemon;
  }

  /** The daemon's exit status, once it has exited (listened for from its start: an exit before a caller asks is not missed). */
  get exitStatus(): Promise<number | null> {
    return this.exited;
  }

  get pid(): number {
    return this.process.pid!;
  }

  stats(): Promise<Stats__Output> {
    return call(this.raw.admin, 'GetStats', {});
  }

  /** Descriptors the daemon process has open now. */
  openFds(): number {
    return fs.readdirSync(`/proc/${this.pid}/fd`).length;
  }

  async stop(): Promise<number | null> {
    this.raw.close();
    if (this.process.exitCode === null) this.process.kill('SIGTERM');
    const code = await this.exited;
    fs.rmSync(this.dir, { recursive: true, force: true });
    return code;
  }
}

/** A client process running fixtures/peer.ts, driven one JSON command at a time. */
export class Peer {
  private readonly pending: Array<{ resolve(value: any): void; reject(error: Error): void }> = [];
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  private stderr = '';

  private constructor(readonly process: ChildProcess) {
    readline.createInterface({ input: process.stdout! }).on('line', (line) => {
      const waiter = this.pending.shift();
      if (waiter === undefined) return;
      const reply = JSON.parse(line);
      if (reply.ok) waiter.resolve(reply.result);
      else waiter.reject(Object.assign(new Error(reply.error.message), reply.error));
    });
    process.stderr!.on('data', (chunk) => (this.stderr += chunk));
    this.exited = new Promise((resolve) =>
      process.once('exit', (code, signal) => {
        for (const waiter of this.pending.splice(0)) waiter.reject(new Error(`peer exited (${code ?? signal}): ${this.stderr}`));
        resolve({ code, signal });
      }),
    );
  }

  /**
   * A client process in `dir`, running as another uid/gid when given (needs root);
   * with `groups`, as uid:gid with exactly those supplementary groups (through setpriv).
   */
  static async start(dir: string, as: { uid?: number; gid?: number; groups?: number[] } = {}): Promise<Peer> {
    const { groups, ...ids } = as;
    const env = { ...process.env, VMMD_SOCKET_DIR: dir };
    const child =
      groups === undefined
        ? spawn(process.execPath, [PEER], { stdio: ['pipe', 'pipe', 'pipe'], env, ...ids })
        : spawn('setpriv', [`--reuid=${ids.uid}`, `--regid=${ids.gid}`, `--groups=${groups.join(',')}`, '--', process.execPath, PEER], {
            stdio: ['pipe', 'pipe', 'pipe'],
            env,
          });
    const peer = new Peer(child);
    try {
      await peer.do({ op: 'connect' });
    } catch (error) {
      // A peer refused its session would wait on stdin for good, and keep jest from exiting.
      child.kill('SIGKILL');
      await peer.exited;
      throw error;
    }
    return peer;
  }

  get pid(): number {
    return this.process.pid!;
  }

  do<T = any>(command: object): Promise<T> {
    return new Promise((resolve, reject) => {
      this.pending.push({ resolve, reject });
      this.process.stdin!.write(`${JSON.stringify(command)}\n`);
    });
  }

  async kill(signal: NodeJS.Signals = 'SIGKILL'): Promise<void> {
    this.process.kill(signal);
    await this.exited;
  }

  async stop(): Promise<void> {
    if (this.process.exitCode !== null || this.process.signalCode !== null) return;
    this.process.stdin!.end();
    await this.exited;
  }
}

/** What a daemon holds, from its stats: objects, bytes and unclaimed descriptors (not sessions or timings). */
export function objectsOf(stats: Awaited<ReturnType<TestDaemon['stats']>>) {
  const { reservations, allocations, mappings, reservedBytes, allocatedBytes, importedBytes, mappedBytes, pendingTransfers } = stats;
  return { reservations, allocations, mappings, reservedBytes, allocatedBytes, importedBytes, mappedBytes, pendingTransfers };
}

/** The bytes of a client frame, for tests that send frames as they are. */
export function frame(value: ClientFrame): Buffer {
  return encodeClientFrame(value);
}

/**
 * A daemon frame as the protocol's tests match it: the body's case as `type`,
 * its fields beside the frame's `request` (a frame that does not decode: the reason, a string).
 */
export function flatFrame(data: Buffer): any {
  const decoded = decodeDaemonFrame(data);
  if (typeof decoded === 'string' || decoded.body === undefined) return decoded;
  return { type: decoded.body, request: decoded.request, ...(decoded[decoded.body] as object) };
}

/**
 * A session-socket connection without the client library, for the protocol's own tests: frames sent as they are
 * (after a hello of this protocol, unless `hello` is false), the daemon's frames read in order (a descriptor that
 * comes with one is closed).
 */
export class RawSession {
  readonly connection: SeqpacketConnection;
  private readonly inbox: SeqpacketMessage[] = [];

  constructor(dir: string, hello = true) {
    this.connection = SeqpacketConnection.connect(socketPaths(dir).session);
    this.connection.on('message', (message: SeqpacketMessage) => this.inbox.push(message));
    if (hello) this.connection.send(frame({ hello: { protocol: PROTOCOL_VERSION } }));
  }

  /** Sends a frame (and a descriptor). */
  send(value: ClientFrame, fd = -1): boolean {
    return this.connection.send(frame(value), fd);
  }

  /** The next frame from the daemon, flattened (flatFrame: the tests match it field by field). */
  async next(): Promise<any> {
    const message = await this.nextRaw();
    return flatFrame(message.data);
  }

  /** The next datagram from the daemon as it came (its descriptor closed). */
  async nextRaw(): Promise<SeqpacketMessage> {
    const message = await eventually(() => this.inbox.shift(), 20_000, 'a message from the daemon');
    if (message.fd >= 0) addon.close(message.fd);
    return message;
  }

  close(): void {
    this.connection.close();
    this.inbox.length = 0;
  }
}
