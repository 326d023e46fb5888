/**
 * Running it for real: what grpcurl does through reflection, health
 * transitions, and SIGTERM draining a call in flight.
 */
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import * as http from 'node:http';
import * as path from 'node:path';
import * as protobuf from 'protobufjs';
const descriptor = require('protobufjs/ext/descriptor');
import { connect } from '../../client';
import { socketPaths } from '../../common/paths';
import { addon } from '../../native';
import { call, eventually, MiB, packageRoot, TestDaemon } from './harness';

const ROOT = packageRoot();

function reflectionClient(dir: string, version: 'v1' | 'v1alpha'): any {
  const file = path.join(ROOT, 'node_modules', '@grpc', 'reflection', 'build', 'proto', 'grpc', 'reflection', version, 'reflection.proto');
  const loaded = grpc.loadPackageDefinition(protoLoader.loadSync(file, { keepCase: true, longs: String, defaults: true })) as any;
  const Service = loaded.grpc.reflection[version].ServerReflection;
  return new Service(`unix://${socketPaths(dir).grpc}`, grpc.credentials.createInsecure());
}

/** One request on a fresh reflection stream, as grpcurl sends them. */
function ask(client: any, request: object): Promise<any> {
  return new Promise((resolve, reject) => {
    const stream = client.ServerReflectionInfo();
    stream.on('data', (response: any) => {
      resolve(response);
      stream.end();
    });
    stream.on('error', reject);
    stream.write(request);
  });
}

let daemon: TestDaemon;

afterEach(async () => {
  if (daemon.process.exitCode === null) await daemon.stop();
});

describe('reflection, as grpcurl uses it', () => {
  it('lists, resolves each service file and its dependencies by name, describes, and invokes from JSON', async () => {
    daemon = await TestDaemon.start();
    const reflection = reflectionClient(daemon.dir, 'v1');
    const listed = await ask(reflection, { list_services: '' });
    const services: string[] = listed.list_services_response.service.map((s: { name: string }) => s.name);
    expect(services).toEqual(expect.arrayContaining(['vmmd.v1.Devices', 'vmmd.v1.VirtualMemory', 'vmmd.v1.Stores', 'vmmd.v1.Admin', 'grpc.health.v1.Health']));

    // Resolve every vmmd service's file, then every dependency by file name, until nothing is missing.
    const files = new Map<string, any>();
    const missing: string[] = [];
    for (const service of services.filter((name) => name.startsWith('vmmd.'))) {
      const answer = await ask(reflection, { file_containing_symbol: service });
      for (const bytes of answer.file_descriptor_response.file_descriptor_proto) {
        const file = descriptor.FileDescriptorProto.decode(bytes);
        files.set(file.name, file);
        missing.push(...(file.dependency ?? []));
      }
    }
    while (missing.length > 0) {
      const name = missing.pop()!;
      if (files.has(name)) continue;
      const answer = await ask(reflection, { file_by_filename: name });
      for (const bytes of answer.file_descriptor_response.file_descriptor_proto) {
        const file = descriptor.FileDescriptorProto.decode(bytes);
        files.set(file.name, file);
        missing.push(...(file.dependency ?? []));
      }
    }
    // Every file a service needs, and every file those depend on, resolved by name.
    expect(files.size).toBeGreaterThan(0);
    for (const file of files.values()) for (const dependency of file.dependency ?? []) expect(files.has(dependency)).toBe(true);

    // Describe, as `grpcurl describe` does.
    const root = (protobuf.Root as any).fromDescriptor({ file: [...files.values()] }) as protobuf.Root;
    const vmm = root.lookupService('vmmd.v1.VirtualMemory');
    expect(Object.keys(vmm.methods)).toEqual(expect.arrayContaining(['Reserve', 'Map', 'Export', 'Read', 'Write']));
    const reserveRequest = root.lookupType('vmmd.v1.ReserveRequest');
    expect(Object.keys(reserveRequest.fields)).toEqual(['size', 'alignment', 'address']);

    // Invoke from JSON, with nothing but the reflected descriptors.
    const method = vmm.methods.Reserve;
    const requestType = root.lookupType(method.requestType);
    const responseType = root.lookupType(method.responseType);
    const generic = new grpc.Client(`unix://${socketPaths(daemon.dir).grpc}`, grpc.credentials.createInsecure());
    const response = await new Promise<any>((resolve, reject) =>
      generic.makeUnaryRequest(
        '/vmmd.v1.VirtualMemory/Reserve',
        (value: object) => Buffer.from(requestType.encode(requestType.fromObject(value)).finish()),
        (bytes: Buffer) => responseType.toObject(responseType.decode(bytes), { longs: String }),
        JSON.parse('{"size": "4194304"}'),
        (error, value) => (error ? reject(error) : resolve(value)),
      ),
    );
    expect(response).toMatchObject({ size: '4194304', ownerSession: '0' });
    generic.close();

    // The older v1alpha protocol answers too.
    const alpha = reflectionClient(daemon.dir, 'v1alpha');
    expect((await ask(alpha, { list_services: '' })).list_services_response.service.length).toBe(services.length);
    alpha.close();
    reflection.close();
  });
});

describe('health and shutdown', () => {
  it('serves, turns NOT_SERVING when SIGTERM arrives, drains a call in flight and exits 0', async () => {
    // The health watch is itself a call in flight: a short grace bounds how long it holds the exit.
    daemon = await TestDaemon.start(['--shutdown-grace-ms', '3000']);
    const healthFile = path.join(ROOT, 'node_modules', 'grpc-health-check', 'proto', 'health', 'v1', 'health.proto');
    const Health = (grpc.loadPackageDefinition(protoLoader.loadSync(healthFile, { enums: String })) as any).grpc.health.v1.Health;
    const health = new Health(`unix://${socketPaths(daemon.dir).grpc}`, grpc.credentials.createInsecure());
    expect(await call(health, 'Check', { service: '' })).toEqual({ status: 'SERVING' });
    expect(await call(health, 'Check', { service: 'vmmd.v1.VirtualMemory' })).toEqual({ status: 'SERVING' });
    const statuses: string[] = [];
    const watch = health.Watch({ service: '' });
    watch.on('data', (update: { status: string }) => statuses.push(update.status));
    watch.on('error', () => undefined);
    await eventually(() => (statuses.includes('SERVING') ? true : undefined));

    // A slow reader keeps a Read in flight across the SIGTERM.
    const client = await connect({ socketDir: daemon.dir });
    const allocation = await client.vmm.create({ size: 32n * MiB });
    const reservation = await client.vmm.reserve({ size: 32n * MiB });
    await client.vmm.map({ address: reservation.address, size: 32n * MiB, allocationId: allocation.id });
    await client.vmm.setAccess({
      address: reservation.address,
      size: 32n * MiB,
      descriptors: [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }],
    });
    let received = 0;
    const reading = client.stores.read({ address: reservation.address }, 32n * MiB, async (chunk) => {
      received += chunk.length;
      await new Promise((resolve) => setTimeout(resolve, 20));
    });
    await eventually(() => (received > 0 ? true : undefined));
    daemon.process.kill('SIGTERM');
    await eventually(() => (statuses.includes('NOT_SERVING') ? true : undefined), 20_000, 'NOT_SERVING');
    expect((await reading).length).toBe(Number(32n * MiB));
    expect(await daemon.exitStatus).toBe(0);
    watch.cancel();
    health.close();
    client.close();
  });
});

describe('Admin and metrics', () => {
  it('reports sessions, objects, bytes per owner, calls and the build; clears unclaimed descriptors', async () => {
    daemon = await TestDaemon.start();
    const client = await connect({ socketDir: daemon.dir });
    const allocation = await client.vmm.create({ size: 2n * MiB });
    const reservation = await client.vmm.reserve({ size: 4n * MiB });
    await client.vmm.map({ address: reservation.address, size: 2n * MiB, allocationId: allocation.id });
    const sessions = await call(daemon.raw.admin, 'ListSessions', {});
    expect(sessions.sessions).toEqual([
      expect.objectContaining({
        id: client.session.id,
        pid: process.pid,
        uid: process.getuid!(),
        allocations: '1',
        allocatedBytes: String(2n * MiB),
        reservations: '1',
      }),
    ]);
    const objects = (await call(daemon.raw.admin, 'ListObjects', { ownerSession: client.session.id })).objects;
    expect(objects.map((o: { kind: string }) => o.kind).sort()).toEqual(['allocation', 'mapping', 'reservation']);
    const report = JSON.parse((await call(daemon.raw.admin, 'GetReport', {})).json);
    expect(report.bytesByOwner).toEqual({ [`session ${client.session.id}`]: String(2n * MiB) });
    expect(report.calls.Create).toEqual({ OK: 1 });
    expect(report.devices[0]).toMatchObject({ kind: 'HOST', granularityMinimum: String(2n * MiB) });
    const version = await call(daemon.raw.admin, 'GetVersion', {});
    expect(version).toMatchObject({ version: require(path.join(ROOT, 'package.json')).version, backend: 'host', node: process.version });
    expect(version.commit).not.toBe('');
    const fd = addon.hostMemfdCreate('stray', 2n * MiB);
    client.session.sendDescriptor(fd);
    addon.close(fd);
    await eventually(async () => ((await daemon.stats()).pendingTransfers === 1 ? true : undefined));
    expect(await call(daemon.raw.admin, 'ClearCaches', {})).toEqual({ transfersClosed: 1 });
    expect((await daemon.stats()).pendingTransfers).toBe(0);
    client.close();
  });

  it('serves Prometheus metrics on 127.0.0.1 when asked', async () => {
    const port = 20000 + Math.floor(Math.random() * 20000);
    daemon = await TestDaemon.start(['--metrics-port', String(port), '--quota-per-session', '2MiB']);
    const client = await connect({ socketDir: daemon.dir });
    const allocation = await client.vmm.create({ size: 2n * MiB });
    await expect(client.vmm.create({ size: 2n * MiB })).rejects.toMatchObject({ code: 'QUOTA_EXCEEDED' });
    await client.vmm.import(allocation.id).then((memory) => memory.close());
    const text = await new Promise<string>((resolve, reject) =>
      http
        .get(`http://127.0.0.1:${port}/metrics`, (response) => {
          let body = '';
          response.on('data', (chunk) => (body += chunk));
          response.on('end', () => resolve(body));
        })
        .on('error', reject),
    );
    expect(text).toMatch(/vmmd_rpc_duration_seconds_count\{service="vmmd.v1.VirtualMemory",method="Create",status="OK"\} 1/);
    expect(text).toMatch(/vmmd_rpc_duration_seconds_count\{service="vmmd.v1.VirtualMemory",method="Create",status="RESOURCE_EXHAUSTED"\} 1/);
    expect(text).toMatch(/vmmd_quota_refusals_total 1/);
    expect(text).toMatch(/vmmd_exports_total 1/);
    expect(text).toMatch(/vmmd_sessions 1/);
    expect(text).toMatch(/vmmd_memory_bytes\{device="0",owner_kind="session",origin="created"\} 2097152/);
    expect(text).toMatch(/vmmd_objects\{kind="allocation",owner_kind="session"\} 1/);
    expect(text).toMatch(/vmmd_process_/);
    client.close();
  });
});
