/**
 * /metrics as Prometheus scrapes it: every name checked against Prometheus'
 * naming conventions (one prefix, base units in the name, counters ending in
 * _total), the per-device, per-uid and per-session series, streams counted,
 * bytes moved, the peak, build info; the bind address; and a start that fails
 * on the metrics port leaves no socket files behind.
 */
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as http from 'node:http';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import pino from 'pino';
import { connect, VmmdClient } from '../../client';
import { socketPaths } from '../../common/paths';
import { eventually, freePort, MiB, packageRoot, TestDaemon } from './harness';

const RW = [{ location: { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' as const }];

/** A port nobody listens on now. */
function scrape(host: string, port: number): Promise<string> {
  return new Promise((resolve, reject) =>
    http
      .get({ host, port, path: '/metrics' }, (response) => {
        let body = '';
        response.on('data', (chunk) => (body += chunk));
        response.on('end', () => (response.statusCode === 200 ? resolve(body) : reject(new Error(`HTTP ${response.statusCode}`))));
      })
      .on('error', reject),
  );
}

interface Family {
  name: string;
  type: string;
  help: string;
  samples: Array<{ name: string; labels: Record<string, string>; value: number }>;
}

/** The text exposition format, parsed strictly enough to check names. */
function parse(text: string): Map<string, Family> {
  const families = new Map<string, Family>();
  let current: Family | undefined;
  for (const line of text.split('\n')) {
    if (line === '') continue;
    const help = /^# HELP (\S+) (.*)$/.exec(line);
    const type = /^# TYPE (\S+) (counter|gauge|histogram|summary|untyped)$/.exec(line);
    if (help) {
      current = { name: help[1], type: '', help: help[2], samples: [] };
      families.set(help[1], current);
    } else if (type) {
      families.get(type[1])!.type = type[2];
    } else {
      const sample = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
      if (!sample || current === undefined) throw new Error(`not exposition format: ${line}`);
      const labels = Object.fromEntries([...(sample[2] ?? '').matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)].map(([, k, v]) => [k, v]));
      current.samples.push({ name: sample[1], labels, value: Number(sample[3]) });
    }
  }
  return families;
}

function value(families: Map<string, Family>, name: string, labels: Record<string, string> = {}): number | undefined {
  const family = families.get(name.replace(/_(bucket|count|sum)$/, '')) ?? families.get(name);
  return family?.samples.find((sample) => sample.name === name && Object.entries(labels).every(([k, v]) => sample.labels[k] === v))?.value;
}

describe('metrics', () => {
  let daemon: TestDaemon;
  let port: number;
  let client: VmmdClient;

  beforeAll(async () => {
    port = await freePort();
    daemon = await TestDaemon.start(['--metrics-port', String(port), '--metrics-address', '0.0.0.0']);
    client = await connect({ socketDir: daemon.dir });
  });

  afterAll(async () => {
    client?.close();
    expect(await daemon.stop()).toBe(0);
  });

  test('every name follows Prometheus conventions: one prefix, base units, _total on counters only', async () => {
    const families = parse(await scrape('127.0.0.1', port));
    const problems: string[] = [];
    for (const family of families.values()) {
      const { name, type } = family;
      if (!/^vmmd_[a-z0-9_]+$/.test(name)) problems.push(`${name}: not vmmd_ and snake_case`);
      if ((name.match(/vmmd_/g) ?? []).length !== 1 || /^vmmd_process_process_|^vmmd_[a-z]+_nodejs_/.test(name)) problems.push(`${name}: prefix twice`);
      if (type === '') problems.push(`${name}: no TYPE`);
      if (family.help.trim() === '') problems.push(`${name}: no HELP`);
      if (type === 'counter' && !name.endsWith('_total')) problems.push(`${name}: a counter not ending in _total`);
      if (type !== 'counter' && name.endsWith('_total') && !/_total_bytes$/.test(name)) problems.push(`${name}: _total on a ${type}`);
      if (/(^|_)(ms|us|milliseconds|microseconds|kb|mb|mib|gib|kib|percent)(_|$)/.test(name)) problems.push(`${name}: not a base unit`);
      // A quantity of bytes or seconds says so at the end (before _total for counters; _info and counts have no unit).
      if (/bytes|seconds/.test(name) && !/_(bytes|seconds)(_total)?$/.test(name)) problems.push(`${name}: unit not last`);
      for (const sample of family.samples) {
        for (const label of Object.keys(sample.labels)) if (!/^[a-z][a-z0-9_]*$/.test(label)) problems.push(`${name}: label ${label}`);
      }
    }
    expect(problems).toEqual([]);
    // Node's and the process's own series under the same single prefix.
    expect(families.has('vmmd_process_cpu_seconds_total')).toBe(true);
    expect([...families.keys()].some((name) => name.startsWith('vmmd_nodejs_'))).toBe(true);
  });

  test('build info, per-device total/used/free with the UUID', async () => {
    const families = parse(await scrape('127.0.0.1', port));
    const version = JSON.parse(fs.readFileSync(path.join(packageRoot(), 'package.json'), 'utf8')).version;
    expect(value(families, 'vmmd_build_info', { version, backend: 'host', node: process.version })).toBe(1);
    const devices = (await client.devices.listDevices()).devices;
    expect(devices.length).toBeGreaterThan(0);
    for (const device of devices) {
      const labels = { device: String(device.index), uuid: device.uuid, name: device.name };
      const total = value(families, 'vmmd_device_memory_total_bytes', labels)!;
      const free = value(families, 'vmmd_device_memory_free_bytes', labels)!;
      const used = value(families, 'vmmd_device_memory_used_bytes', labels)!;
      expect(total).toBe(Number(device.totalBytes));
      expect(used).toBe(total - free);
    }
  });

  test('per-uid and per-session usage, stores, streams, bytes moved and the peak', async () => {
    const size = 4n * MiB;
    const allocation = await client.vmm.create({ size });
    const reservation = await client.vmm.reserve({ size });
    await client.vmm.map({ address: reservation.address, size, allocationId: allocation.id });
    await client.vmm.setAccess({ address: reservation.address, size, descriptors: RW });
    // Staged (>= 256 KiB) and streamed (smaller) writes and reads through the daemon.
    await client.vmm.write(reservation.address, Buffer.alloc(1 << 20, 7));
    await client.vmm.write(BigInt(reservation.address) + 2n * MiB, Buffer.alloc(4096, 9));
    await client.vmm.read(reservation.address, 1 << 20);
    await client.vmm.read(BigInt(reservation.address) + 2n * MiB, 4096);
    const storeAllocation = await client.vmm.create({ size: 2n * MiB });
    const store = await client.stores.createStore({ allocationId: storeAllocation.id, name: 'metered' });
    await client.stores.write({ storeId: store.id }, Buffer.alloc(8192, 1));
    await client.stores.read({ storeId: store.id }, 8192);
    // A stream left open: Watch.
    const watch = client.stores.watch();
    const watching = (async () => {
      for await (const event of watch.events) void event;
    })();
    const extra = await client.vmm.create({ size: 8n * MiB });
    await client.vmm.release({ allocationId: extra.id });
    try {
      const families = await eventually(async () => {
        const scraped = parse(await scrape('127.0.0.1', port));
        return value(scraped, 'vmmd_rpc_streams_active', { service: 'vmmd.v1.Stores', method: 'Watch' }) === 1 ? scraped : undefined;
      });
      const session = String(client.session.id);
      const uid = String(process.getuid!());
      // 4 MiB mapped + 2 MiB under the store.
      expect(value(families, 'vmmd_session_allocated_bytes', { session, uid, pid: String(process.pid) })).toBe(6 * 2 ** 20);
      expect(value(families, 'vmmd_uid_allocated_bytes', { uid })).toBeGreaterThanOrEqual(6 * 2 ** 20);
      expect(value(families, 'vmmd_allocated_peak_bytes')).toBeGreaterThanOrEqual(14 * 2 ** 20);
      expect(value(families, 'vmmd_stores', { target: 'sysmem', owner_kind: 'session' })).toBe(1);
      expect(value(families, 'vmmd_store_bytes', { target: 'sysmem' })).toBe(2 * 2 ** 20);
      expect(value(families, 'vmmd_rpc_streams_total', { service: 'vmmd.v1.Stores', method: 'Watch' })).toBe(1);
      // The open Watch counts in its uid's budget of server streams, beside the budget's limit.
      expect(value(families, 'vmmd_budget_used', { budget: 'server streams per uid', uid: String(uid) })).toBe(1);
      expect(value(families, 'vmmd_budget_limit', { budget: 'server streams per uid' })).toBe(16);
      expect(value(families, 'vmmd_budget_used', { budget: 'gRPC connections per uid', uid: String(uid) })).toBeGreaterThanOrEqual(1);
      expect(value(families, 'vmmd_rpc_streams_total', { service: 'vmmd.v1.Stores', method: 'Read' })).toBe(1);
      expect(value(families, 'vmmd_rpc_streams_total', { service: 'vmmd.v1.VirtualMemory', method: 'Read' })).toBe(1);
      expect(value(families, 'vmmd_rpc_streams_total', { service: 'vmmd.v1.VirtualMemory', method: 'Write' })).toBe(1);
      expect(value(families, 'vmmd_rpc_streams_active', { service: 'vmmd.v1.VirtualMemory', method: 'Read' })).toBe(0);
      // The same method name in two services: told apart by the service label.
      expect(value(families, 'vmmd_rpc_duration_seconds_count', { service: 'vmmd.v1.Stores', method: 'Read', status: 'OK' })).toBe(1);
      expect(value(families, 'vmmd_rpc_duration_seconds_count', { service: 'vmmd.v1.VirtualMemory', method: 'Read', status: 'OK' })).toBe(1);
      expect(value(families, 'vmmd_moved_bytes_total', { service: 'vmmd.v1.VirtualMemory', method: 'WriteStaged', direction: 'write' })).toBe(1 << 20);
      expect(value(families, 'vmmd_moved_bytes_total', { service: 'vmmd.v1.VirtualMemory', method: 'ReadStaged', direction: 'read' })).toBe(1 << 20);
      expect(value(families, 'vmmd_moved_bytes_total', { service: 'vmmd.v1.VirtualMemory', method: 'Write', direction: 'write' })).toBe(4096);
      expect(value(families, 'vmmd_moved_bytes_total', { service: 'vmmd.v1.VirtualMemory', method: 'Read', direction: 'read' })).toBe(4096);
      expect(value(families, 'vmmd_moved_bytes_total', { service: 'vmmd.v1.Stores', method: 'Write', direction: 'write' })).toBe(8192);
      expect(value(families, 'vmmd_moved_bytes_total', { service: 'vmmd.v1.Stores', method: 'Read', direction: 'read' })).toBe(8192);
    } finally {
      watch.cancel();
      await watching;
    }
    await eventually(async () =>
      value(parse(await scrape('127.0.0.1', port)), 'vmmd_rpc_streams_active', { service: 'vmmd.v1.Stores', method: 'Watch' }) === 0 ? true : undefined,
    );
  });

  test("--metrics-address 0.0.0.0 answers on the host's other addresses too", async () => {
    const external = Object.values(os.networkInterfaces())
      .flat()
      .find((address) => address !== undefined && address.family === 'IPv4' && !address.internal);
    if (external === undefined) {
      console.warn('no non-loopback IPv4 address on this machine: only 127.0.0.1 was scraped');
      return;
    }
    expect(await scrape(external.address, port)).toContain('vmmd_build_info');
  });
});

// Required at run time (a static import of dist/ would make its declarations the compiler's inputs).
const fromDist = <T>(module: string): T => require(path.join(packageRoot(), 'dist', module)) as T;

describe('a start that fails on the metrics port', () => {
  let busy: net.Server;
  let port: number;
  let dir: string;
  beforeEach(async () => {
    busy = net.createServer();
    await new Promise<void>((resolve) => busy.listen(0, '127.0.0.1', resolve));
    port = (busy.address() as net.AddressInfo).port;
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-busy-'));
  });
  afterEach(() => {
    busy.close();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  test('exits 1 naming the port, and removes the socket files it made', async () => {
    const child = spawn(
      process.execPath,
      [path.join(packageRoot(), 'bin', 'vmmd.js'), '--backend', 'host', '--socket-dir', dir, '--metrics-port', String(port)],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    );
    let output = '';
    child.stdout!.on('data', (chunk) => (output += chunk));
    child.stderr!.on('data', (chunk) => (output += chunk));
    const code = await new Promise<number | null>((resolve) => child.once('exit', resolve));
    expect(code).toBe(1);
    expect(output).toMatch(new RegExp(`vmmd cannot start: .*EADDRINUSE.*${port}`));
    const paths = socketPaths(dir);
    expect([fs.existsSync(paths.grpc), fs.existsSync(paths.session)]).toEqual([false, false]);
  });

  test('stops the GC observer its admin service started (in process, from dist/: the daemon finds its package.json there)', async () => {
    const { addon } = fromDist<typeof import('../../native')>('native');
    const { parseCommandLine } = fromDist<typeof import('../../server/app/config')>('server/app/config');
    const { Daemon } = fromDist<typeof import('../../server/app/daemon')>('server/app/daemon');
    const { GcPauses } = fromDist<typeof import('../../server/observability/gc-pauses')>('server/observability/gc-pauses');
    const started = jest.spyOn(GcPauses.prototype, 'start');
    const stopped = jest.spyOn(GcPauses.prototype, 'stop');
    try {
      const command = parseCommandLine(['--backend', 'host', '--socket-dir', dir, '--metrics-port', String(port)], {}, addon.pageSize());
      if (command.kind !== 'run') throw new Error('not a run');
      await expect(Daemon.start(command.config, pino({ level: 'silent' }))).rejects.toThrow(/EADDRINUSE/);
      expect(started).toHaveBeenCalledTimes(1);
      expect(stopped).toHaveBeenCalledTimes(1);
    } finally {
      started.mockRestore();
      stopped.mockRestore();
    }
  });
});
