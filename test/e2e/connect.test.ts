/**
 * connect() for a new worker, kept cheap for short-lived processes: the daemon names its backend in the
 * session's hello, so connect() needs no RPC, and the gRPC channel is made
 * only when a call needs it (the session socket serves allocate, release,
 * share, export and open). A daemon whose hello does not name its backend
 * (one before this) is asked with ListDevices, and a backend the client does
 * not know is still refused.
 */
import * as grpc from '@grpc/grpc-js';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { inspect } from 'node:util';
import { connect } from '../../client';
import { socketPaths } from '../../common/paths';
import { loadProtos } from '../../common/proto';
import { encodeMessage, PROTOCOL_VERSION } from '../../common/protocol';
import { SeqpacketConnection, SeqpacketListener } from '../../native/seqpacket';
import { MiB, RawSession, TestDaemon } from './harness';

/** Whether a client's gRPC channel exists (its services are made on first use). */
const grpcMade = (client: unknown) => (client as { channels: Array<{ connected: boolean }> }).channels[0].connected;

describe('connect() of a new worker', () => {
  let daemon: TestDaemon;

  beforeAll(async () => {
    daemon = await TestDaemon.start();
  });

  afterAll(async () => {
    expect(await daemon.stop()).toBe(0);
  });

  it('learns the backend from the hello, which names it', async () => {
    const raw = new RawSession(daemon.dir);
    try {
      expect(await raw.next()).toMatchObject({ type: 'hello', backend: 'host' });
    } finally {
      raw.close();
    }
    const client = await connect({ socketDir: daemon.dir });
    expect(client.backend).toBe('host');
    client.close();
  });

  it('opens no gRPC channel until a call needs one: the session socket serves the hot requests', async () => {
    const client = await connect({ socketDir: daemon.dir });
    try {
      const memory = await client.vmm.allocate({ size: 2n * MiB });
      await client.vmm.share({ allocationId: memory.allocationId });
      await memory.close();
      await client.vmm.release({ allocationId: memory.allocationId });
      expect(grpcMade(client)).toBe(false);
      // A call only gRPC serves makes the channel, once.
      expect((await client.admin.getStats()).sessions).toBeGreaterThan(0);
      expect(grpcMade(client)).toBe(true);
      expect((await client.devices.listDevices()).backend).toBe('host');
    } finally {
      client.close();
    }
  });

  it('closes a client whose channel was never made, and a closed client refuses calls without making it', async () => {
    const client = await connect({ socketDir: daemon.dir });
    client.close();
    expect(grpcMade(client)).toBe(false);
    await expect(client.admin.getStats()).rejects.toMatchObject({ code: 'CLIENT_CLOSED', status: grpc.status.FAILED_PRECONDITION });
    await expect(client.vmm.reserve({ size: 2n * MiB })).rejects.toMatchObject({ code: 'CLIENT_CLOSED', message: expect.stringMatching(/Reserve.*closed/) });
    expect(grpcMade(client)).toBe(false);
  });

  it('a closed client whose channel was made refuses calls the same way, streams too', async () => {
    const client = await connect({ socketDir: daemon.dir });
    await client.admin.getStats();
    client.close();
    await expect(client.admin.getStats()).rejects.toMatchObject({ code: 'CLIENT_CLOSED', status: grpc.status.FAILED_PRECONDITION });
    const watching = client.stores.watch();
    await expect(watching.events[Symbol.asyncIterator]().next()).rejects.toMatchObject({ code: 'CLIENT_CLOSED' });
    watching.cancel();
  });

  it('printing or serialising a stand-in of a closed client whose channel was made does not throw', async () => {
    const client = await connect({ socketDir: daemon.dir });
    await client.admin.getStats();
    client.close();
    const standIn = (client.admin as unknown as { client: object }).client;
    expect(await Promise.resolve(standIn)).toBe(standIn);
    expect(() => inspect(standIn)).not.toThrow();
    expect(() => JSON.stringify(standIn)).not.toThrow();
    expect(() => String(standIn)).not.toThrow();
    expect(() => JSON.stringify(client.admin)).not.toThrow();
  });
  it('awaiting, printing or serialising a service stand-in makes no channel', async () => {
    const client = await connect({ socketDir: daemon.dir });
    try {
      const standIn = (client.admin as unknown as { client: object }).client;
      expect(await Promise.resolve(standIn)).toBe(standIn);
      inspect(standIn);
      JSON.stringify(standIn);
      String(standIn);
      expect(Object.prototype.hasOwnProperty.call(standIn, 'GetStats')).toBe(false);
      expect(grpcMade(client)).toBe(false);
    } finally {
      client.close();
    }
  });
});

describe('a daemon whose gRPC socket is absent', () => {
  let dir: string;
  let listener: SeqpacketListener;

  beforeAll(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-no-grpc-'));
    listener = new SeqpacketListener(socketPaths(dir).session);
    listener.on('connection', (connection: SeqpacketConnection) => {
      connection.send(encodeMessage({ type: 'hello', protocol: PROTOCOL_VERSION, session: '1', token: 'f'.repeat(64), pid: process.pid, uid: 0, gid: 0, backend: 'host' }));
    });
  });

  afterAll(() => {
    listener.close();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  it('connects (the session is enough), and the first gRPC call fails at once with UNAVAILABLE, not at its deadline', async () => {
    // A deadline past the test's timeout: a call waiting for the socket to appear would fail the test.
    const client = await connect({ socketDir: dir, deadlineMs: 120_000 });
    try {
      await expect(client.admin.getStats()).rejects.toMatchObject({ status: grpc.status.UNAVAILABLE });
    } finally {
      client.close();
    }
  });
});

describe('connect() to a daemon whose hello does not name its backend', () => {
  let dir: string;
  let listener: SeqpacketListener;
  let server: grpc.Server;
  let served = 'host';
  let listed = 0;
  let helloBackend: string | undefined;

  beforeAll(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-old-daemon-'));
    const paths = socketPaths(dir);
    // The session socket of a daemon before the hello named its backend.
    listener = new SeqpacketListener(paths.session);
    listener.on('connection', (connection: SeqpacketConnection) => {
      const hello = { type: 'hello' as const, protocol: PROTOCOL_VERSION, session: '1', token: 'f'.repeat(64), pid: process.pid, uid: 0, gid: 0 };
      connection.send(encodeMessage(helloBackend === undefined ? hello : { ...hello, backend: helloBackend }));
    });
    // Its Devices service, which says the backend.
    const { proto } = loadProtos();
    server = new grpc.Server();
    server.addService(proto.vmmd.v1.Devices.service, {
      ListDevices: (_call: unknown, done: (error: null, value: object) => void) => {
        listed++;
        done(null, { backend: served, devices: [] });
      },
    });
    await new Promise<void>((resolve, reject) =>
      server.bindAsync(`unix://${paths.grpc}`, grpc.ServerCredentials.createInsecure(), (error) => (error ? reject(error) : resolve())),
    );
  });

  afterAll(() => {
    listener.close();
    server.forceShutdown();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  it('asks ListDevices for the backend', async () => {
    served = 'cuda';
    const before = listed;
    const client = await connect({ socketDir: dir });
    expect(client.backend).toBe('cuda');
    expect(listed).toBe(before + 1);
    client.close();
  });

  it('takes an empty backend in the hello as not named, and asks', async () => {
    served = 'host';
    helloBackend = '';
    const before = listed;
    try {
      const client = await connect({ socketDir: dir });
      expect(client.backend).toBe('host');
      expect(listed).toBe(before + 1);
      client.close();
    } finally {
      helloBackend = undefined;
    }
  });

  it('refuses a backend the client does not know, and closes what it opened', async () => {
    served = 'tpu';
    await expect(connect({ socketDir: dir })).rejects.toMatchObject({ code: 'UNKNOWN_BACKEND', status: grpc.status.UNIMPLEMENTED });
  });
});
