/**
 * connect() for a new worker, kept cheap for short-lived processes: the daemon states its capabilities in the
 * session's hello (how its descriptors are mapped among them), so connect() needs no RPC, and the gRPC channel
 * is made only when a call needs it (the session socket serves allocate, release, share, export and open). A
 * daemon whose descriptors the client cannot map is refused, and so is a daemon of session protocol 1.
 */
import * as grpc from '@grpc/grpc-js';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { inspect } from 'node:util';
import { connect } from '../../client';
import { socketPaths } from '../../common/paths';
import { encodeDaemonFrame, PROTOCOL_VERSION, protocol1Refusal } from '../../common/protocol';
import type { Capability } from '../../generated/vmmd/v1/Capability';
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

  it('learns how to map descriptors from the capabilities in the hello', async () => {
    const raw = new RawSession(daemon.dir);
    try {
      expect(await raw.next()).toMatchObject({ type: 'hello', capabilities: expect.arrayContaining(['CAPABILITY_MEMFD_DESCRIPTORS']) });
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

/** A session socket that answers each client's hello as a daemon of this protocol with `capabilities` would. */
function fakeSessionSocket(dir: string, capabilities: () => Capability[]): SeqpacketListener {
  const listener = new SeqpacketListener(socketPaths(dir).session);
  listener.on('connection', (connection: SeqpacketConnection) => {
    connection.once('message', () => {
      connection.send(
        encodeDaemonFrame({
          hello: { protocol: PROTOCOL_VERSION, session: '1', token: 'f'.repeat(64), pid: process.pid, uid: 0, gid: 0, capabilities: capabilities() },
        }),
      );
    });
  });
  return listener;
}

describe('a daemon whose gRPC socket is absent', () => {
  let dir: string;
  let listener: SeqpacketListener;

  beforeAll(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-no-grpc-'));
    listener = fakeSessionSocket(dir, () => ['CAPABILITY_MEMFD_DESCRIPTORS']);
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

describe('connect() to a daemon by what its hello says it can do', () => {
  let dir: string;
  let listener: SeqpacketListener;
  let capabilities: Capability[] = [];

  beforeAll(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-capabilities-'));
    listener = fakeSessionSocket(dir, () => capabilities);
  });

  afterAll(() => {
    listener.close();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  it('maps CUDA handles where the daemon says its descriptors are CUDA handles, without asking ListDevices', async () => {
    capabilities = ['CAPABILITY_CUDA_DESCRIPTORS', 'CAPABILITY_HOST_NUMA'];
    const client = await connect({ socketDir: dir });
    expect(client.backend).toBe('cuda');
    expect([...client.session.capabilities]).toEqual(['CAPABILITY_CUDA_DESCRIPTORS', 'CAPABILITY_HOST_NUMA']);
    expect(grpcMade(client)).toBe(false);
    client.close();
  });

  it('refuses a daemon whose descriptors it cannot map, and closes what it opened', async () => {
    capabilities = [];
    await expect(connect({ socketDir: dir })).rejects.toMatchObject({
      code: 'UNKNOWN_BACKEND',
      status: grpc.status.UNIMPLEMENTED,
      message: expect.stringContaining('capabilities: none'),
    });
  });
});

describe('connect() to a daemon of session protocol 1', () => {
  let dir: string;
  let listener: SeqpacketListener;

  beforeAll(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-protocol-1-'));
    listener = new SeqpacketListener(socketPaths(dir).session);
    // A daemon of protocol 1 spoke first: its JSON hello.
    listener.on('connection', (connection: SeqpacketConnection) => {
      connection.send(
        Buffer.from(JSON.stringify({ type: 'hello', protocol: 1, session: '1', token: 'f'.repeat(64), pid: process.pid, uid: 0, gid: 0, backend: 'host' })),
      );
    });
  });

  afterAll(() => {
    listener.close();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  it('fails PROTOCOL_VERSION, naming both protocols', async () => {
    await expect(connect({ socketDir: dir })).rejects.toMatchObject({
      code: 'PROTOCOL_VERSION',
      status: grpc.status.FAILED_PRECONDITION,
      message: expect.stringMatching(/speaks session protocol 1; this client speaks 2/),
    });
  });
});

describe('connect() to a daemon that took its hello, come late, for the silence of a client of protocol 1', () => {
  let dir: string;
  let listener: SeqpacketListener;
  let late = 0;
  let connections = 0;

  beforeAll(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-late-hello-'));
    listener = new SeqpacketListener(socketPaths(dir).session);
    // The first `late` connections are refused as a daemon refuses a silent client (in protocol 1's JSON, naming its own protocol).
    listener.on('connection', (connection: SeqpacketConnection) => {
      if (connections++ < late) {
        connection.send(protocol1Refusal('this client sent no hello within 1000 ms'));
        connection.close();
        return;
      }
      connection.once('message', () =>
        connection.send(
          encodeDaemonFrame({
            hello: {
              protocol: PROTOCOL_VERSION,
              session: '1',
              token: 'f'.repeat(64),
              pid: process.pid,
              uid: 0,
              gid: 0,
              capabilities: ['CAPABILITY_MEMFD_DESCRIPTORS'],
            },
          }),
        ),
      );
    });
  });

  afterAll(() => {
    listener.close();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  it('connects again and gets its session, not "upgrade the daemon"', async () => {
    [late, connections] = [2, 0];
    const client = await connect({ socketDir: dir });
    expect(client.session.id).toBe('1');
    expect(connections).toBe(3);
    client.close();
  });

  it("fails HELLO_LATE naming the daemon's refusal when every try comes late", async () => {
    [late, connections] = [100, 0];
    await expect(connect({ socketDir: dir })).rejects.toMatchObject({
      code: 'HELLO_LATE',
      status: grpc.status.UNAVAILABLE,
      message: expect.stringMatching(/no hello within 1000 ms.*3 tries/),
    });
  });
});
