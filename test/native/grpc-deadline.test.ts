/**
 * A gRPC call whose deadline passes while it waits for its turn is not run:
 * its caller has been told DEADLINE_EXCEEDED already (grpc-js answers at the
 * deadline), so work done for it would be work nobody learns of: memory made
 * for an answer that never arrives. The real listener and handler wrapper,
 * two calls read in one turn: the first holds the event loop past the
 * second's deadline, as a burst of other work would.
 */
import * as grpc from '@grpc/grpc-js';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import pino from 'pino';
import { loadProtos } from '../../common/proto';
import { AccessPolicy } from '../../server/transport/grpc/access';
import { GrpcUnixListener } from '../../server/transport/grpc/grpc-unix';
import { FairCalls } from '../../server/transport/grpc/services/fair-calls';
import { HandlerDeps, unary } from '../../server/transport/grpc/services/handler';
import { SessionManager } from '../../server/transport/session/sessions';
import { VirtualMemoryService } from '../../server/transport/grpc/services/virtual-memory';
import { Registry } from '../../server/registry';
import { StagingBuffers } from '../../server/stores/staging';
import { FakeBackend } from '../unit/fake-backend';
import { StoresService } from '../../server/transport/grpc/services/stores';
import { StoreRegistry } from '../../server/stores/stores';
import { DAEMON_OWNER } from '../../server/registry/records';

const HOLD_MS = 300;
const DEADLINE_MS = 100;

function busyFor(ms: number): void {
  const until = Date.now() + ms;
  while (Date.now() < until) {
    // the event loop held, as a long turn of other work holds it
  }
}

function handlerDeps(): HandlerDeps {
  const log = pino({ level: 'silent' });
  const uid = process.getuid?.() ?? 0;
  return {
    sessions: new SessionManager(log),
    access: new AccessPolicy({ allowUids: [uid], allowGids: [], adminUids: [uid], adminGids: [] }),
    streamStallMs: 1_000,
    log,
    fair: new FairCalls(),
  };
}

describe('a gRPC call whose deadline passed while it waited', () => {
  it('is not run, and its caller gets DEADLINE_EXCEEDED', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-deadline-'));
    const socket = path.join(dir, 'grpc.sock');
    const log = pino({ level: 'silent' });
    const deps = handlerDeps();
    let ran = 0;
    const server = new grpc.Server();
    server.addService(loadProtos().proto.vmmd.v1.Devices.service, {
      ListDevices: unary(deps, 'ListDevices', () => {
        busyFor(HOLD_MS);
        return { devices: [] };
      }),
      GetMemoryInfo: unary(deps, 'GetMemoryInfo', () => {
        ran++;
        return { freeBytes: '0', totalBytes: '0' };
      }),
    });
    const listener = await GrpcUnixListener.listen(server, socket, log);
    const client = new (loadProtos().proto.vmmd.v1.Devices)(`unix://${socket}`, grpc.credentials.createInsecure());
    try {
      // Connected first: both calls then go out together and are read in one turn.
      await new Promise<void>((resolve, reject) => client.waitForReady(Date.now() + 5_000, (error?: Error) => (error ? reject(error) : resolve())));
      const holding = new Promise<void>((resolve, reject) => client.ListDevices({}, (error: Error | null) => (error ? reject(error) : resolve())));
      const late = new Promise<grpc.ServiceError | null>((resolve) =>
        client.GetMemoryInfo({}, { deadline: Date.now() + DEADLINE_MS }, (error: grpc.ServiceError | null) => resolve(error)),
      );
      await holding;
      expect((await late)?.code).toBe(grpc.status.DEADLINE_EXCEEDED);
      // Its turn came after the deadline: nothing ran for it.
      await new Promise((resolve) => setTimeout(resolve, 50));
      expect(ran).toBe(0);
    } finally {
      client.close();
      listener.close();
      server.forceShutdown();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  it('while it ran: what it made is undone, once its answer can reach nobody', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-deadline-'));
    const socket = path.join(dir, 'grpc.sock');
    const deps = handlerDeps();
    const undone: unknown[] = [];
    const server = new grpc.Server();
    server.addService(loadProtos().proto.vmmd.v1.Devices.service, {
      ListDevices: unary(deps, 'ListDevices', () => ({ devices: [] })),
      // Made after a wait past the caller's deadline (a create waiting for frees, say).
      GetMemoryInfo: unary(
        deps,
        'GetMemoryInfo',
        async () => {
          await new Promise((resolve) => setTimeout(resolve, HOLD_MS));
          return { freeBytes: '1', totalBytes: '2' };
        },
        (made) => void undone.push(made),
      ),
    });
    const listener = await GrpcUnixListener.listen(server, socket, deps.log);
    const client = new (loadProtos().proto.vmmd.v1.Devices)(`unix://${socket}`, grpc.credentials.createInsecure());
    try {
      const late = await new Promise<grpc.ServiceError | null>((resolve) =>
        client.GetMemoryInfo({}, { deadline: Date.now() + DEADLINE_MS }, (error: grpc.ServiceError | null) => resolve(error)),
      );
      expect(late?.code).toBe(grpc.status.DEADLINE_EXCEEDED);
      await new Promise((resolve) => setTimeout(resolve, HOLD_MS));
      expect(undone).toEqual([{ freeBytes: '1', totalBytes: '2' }]);
      // A call in time keeps what it made.
      await new Promise<void>((resolve, reject) => client.GetMemoryInfo({}, (error: Error | null) => (error ? reject(error) : resolve())));
      expect(undone).toHaveLength(1);
    } finally {
      client.close();
      listener.close();
      server.forceShutdown();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  it('a Create whose memory came after its deadline is released again: nothing stays allocated', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-deadline-'));
    const socket = path.join(dir, 'grpc.sock');
    const deps = handlerDeps();
    // A backend whose creates take longer than the caller waits (a driver under load, a wait for frees).
    class SlowCreates extends FakeBackend {
      override async create(...args: Parameters<FakeBackend['create']>) {
        await new Promise((resolve) => setTimeout(resolve, HOLD_MS));
        return super.create(...args);
      }
    }
    const registry = new Registry(new SlowCreates());
    const { proto } = loadProtos();
    const server = new grpc.Server();
    new VirtualMemoryService(registry, deps.sessions, new StagingBuffers()).addToServer(server, proto, deps);
    const listener = await GrpcUnixListener.listen(server, socket, deps.log);
    const client = new proto.vmmd.v1.VirtualMemory(`unix://${socket}`, grpc.credentials.createInsecure());
    const create = (deadline?: number) =>
      new Promise<grpc.ServiceError | null>((resolve) =>
        client.Create(
          { size: String(2n << 20n), location: { type: 'LOCATION_TYPE_DEVICE', id: 0 } },
          deadline === undefined ? {} : { deadline },
          (error: grpc.ServiceError | null) => resolve(error),
        ),
      );
    try {
      expect((await create(Date.now() + DEADLINE_MS))?.code).toBe(grpc.status.DEADLINE_EXCEEDED);
      await new Promise((resolve) => setTimeout(resolve, 2 * HOLD_MS));
      expect(registry.stats()).toMatchObject({ allocations: 0 });
      // In time, it stays.
      expect(await create()).toBeNull();
      expect(registry.stats()).toMatchObject({ allocations: 1 });
    } finally {
      client.close();
      listener.close();
      server.forceShutdown();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  it('a CreateStore whose store came after its deadline is detached again: no store stays', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-deadline-'));
    const socket = path.join(dir, 'grpc.sock');
    const deps = handlerDeps();
    // The daemon's mapping of the store's memory takes longer than the caller waits.
    class SlowMaps extends FakeBackend {
      override async map(...args: Parameters<FakeBackend['map']>) {
        await new Promise((resolve) => setTimeout(resolve, HOLD_MS));
        return super.map(...args);
      }
    }
    const registry = new Registry(new SlowMaps());
    const stores = new StoreRegistry(registry);
    const allocation = await registry.create(DAEMON_OWNER, { size: 2n << 20n, location: { type: 'DEVICE', id: 0 }, handleType: 'POSIX_FD' });
    const { proto } = loadProtos();
    const server = new grpc.Server();
    new StoresService(registry, stores, deps.sessions).addToServer(server, proto, deps);
    const listener = await GrpcUnixListener.listen(server, socket, deps.log);
    const client = new proto.vmmd.v1.Stores(`unix://${socket}`, grpc.credentials.createInsecure());
    const createStore = (name: string, deadline?: number) =>
      new Promise<grpc.ServiceError | null>((resolve) =>
        client.CreateStore({ allocationId: String(allocation.id), name }, deadline === undefined ? {} : { deadline }, (error: grpc.ServiceError | null) =>
          resolve(error),
        ),
      );
    try {
      expect((await createStore('late', Date.now() + DEADLINE_MS))?.code).toBe(grpc.status.DEADLINE_EXCEEDED);
      await new Promise((resolve) => setTimeout(resolve, 2 * HOLD_MS));
      expect(stores.list().map((store) => store.name)).toEqual([]);
      expect(await createStore('in-time')).toBeNull();
      expect(stores.list().map((store) => store.name)).toEqual(['in-time']);
    } finally {
      // (The Stores client's own close() is the Close RPC's alias.)
      client.getChannel().close();
      listener.close();
      server.forceShutdown();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
