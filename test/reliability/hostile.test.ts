/**
 * Hostile input: property-based requests (fast-check) to every unary and
 * streaming RPC of every vmmd service, built from the protos' own field
 * lists: random and boundary values (0, 1, the granularity, 2^64-1, random
 * uint64s, odd strings, unknown enum numbers, nested messages), unknown ids,
 * with the caller's session, another session's token, a bogus token or none.
 * Then the session socket: random bytes, truncated and mistyped protobuf frames, a
 * JSON frame, oversized frames, frames of every body with hostile values, and
 * descriptors of the wrong kind.
 * No request may crash the daemon or get INTERNAL or UNKNOWN, and nothing is
 * left behind once the sessions close. Reports its figures.
 * 10,000 RPCs with VMMD_RELIABILITY=full (npm run reliability), 2,000 in CI.
 */
import * as grpc from '@grpc/grpc-js';
import fc from 'fast-check';
import { connect } from '../../client';
import { loadProtos } from '../../common/proto';
import { socketPaths } from '../../common/paths';
import { encodeClientFrame, PROTOCOL_VERSION, SESSION_METADATA_KEY } from '../../common/protocol';
import { addon } from '../../native';
import { SeqpacketConnection, SeqpacketMessage } from '../../native/seqpacket';
import { eventually, flatFrame, TestDaemon } from '../e2e/harness';
import { figure } from './figures';

const FULL = process.env.VMMD_RELIABILITY === 'full';
const RPCS = FULL ? 10_000 : 2_000;
const SOCKET_MESSAGES = FULL ? 3_000 : 600;

type Field = { name: string; type: string; typeName: string; label: string };
type Namespace = Record<string, { type?: { field?: Field[]; value?: Array<{ name: string }> }; service?: Record<string, MethodInfo> }>;
type MethodInfo = { path: string; requestStream: boolean; responseStream: boolean; requestType: { type: { field: Field[] } } };

const U64_MAX = '18446744073709551615';
const u64 = fc.oneof(
  fc.constantFrom('0', '1', '4096', '2097152', '4194304', String(1n << 30n), String(1n << 47n), U64_MAX, '9223372036854775808'),
  fc.bigInt({ min: 0n, max: (1n << 64n) - 1n }).map(String),
  fc.nat({ max: 64 }).map((n) => String(BigInt(n) * 2097152n)),
);
const u32 = fc.oneof(fc.constantFrom(0, 1, 7, 255, 4294967295), fc.nat());
const text = fc.oneof(
  fc.string({ maxLength: 80 }),
  fc.constantFrom('', 'GPU-00000000-0000-0000-0000-000000000000', '../../etc/passwd', '\u0000', 'x'.repeat(5000)),
);

/** A random request for a message type, from its field list; nested messages to depth 2. */
function message(ns: Namespace, fields: Field[], depth: number): fc.Arbitrary<Record<string, unknown>> {
  const entries: Record<string, fc.Arbitrary<unknown>> = {};
  for (const field of fields) {
    let value: fc.Arbitrary<unknown>;
    switch (field.type) {
      case 'TYPE_UINT64':
      case 'TYPE_INT64':
        value = u64;
        break;
      case 'TYPE_UINT32':
      case 'TYPE_INT32':
        value = u32;
        break;
      case 'TYPE_BOOL':
        value = fc.boolean();
        break;
      case 'TYPE_STRING':
        value = text;
        break;
      case 'TYPE_BYTES':
        value = fc.uint8Array({ maxLength: 96 }).map((bytes) => Buffer.from(bytes));
        break;
      case 'TYPE_ENUM': {
        const names = (ns[field.typeName]?.type?.value ?? []).map((entry) => entry.name);
        value = fc.oneof(fc.constantFrom(...(names.length > 0 ? names : ['X'])), fc.integer({ min: -3, max: 1000 }));
        break;
      }
      case 'TYPE_MESSAGE': {
        const nested = ns[field.typeName]?.type?.field;
        value = depth > 0 && nested ? message(ns, nested, depth - 1) : fc.constant(undefined);
        break;
      }
      default:
        value = fc.constant(undefined);
    }
    entries[field.name] = field.label === 'LABEL_REPEATED' ? fc.array(value, { maxLength: 4 }) : value;
  }
  return fc.record(entries, { requiredKeys: [] });
}

/** Calls a method with a request; resolves with the gRPC status code (0 for OK), or 'unsent' when the client cannot encode it. */
function invoke(
  client: grpc.Client & Record<string, any>,
  name: string,
  info: MethodInfo,
  request: unknown,
  metadata: grpc.Metadata,
): Promise<number | 'unsent'> {
  return new Promise((resolve) => {
    const options = { deadline: Date.now() + 10_000 };
    try {
      if (info.requestStream) {
        const call = client[name](metadata, options, (error: grpc.ServiceError | null) => resolve(error ? error.code : 0));
        call.write(request);
        call.end();
      } else if (info.responseStream) {
        const call = client[name](request, metadata, options);
        call.on('data', () => undefined);
        call.on('status', (status: grpc.StatusObject) => resolve(status.code));
        call.on('error', () => undefined);
        // A stream that never ends by itself (Watch): its first moments are the test.
        setTimeout(() => call.cancel(), 200);
      } else {
        client[name](request, metadata, options, (error: grpc.ServiceError | null) => resolve(error ? error.code : 0));
      }
    } catch {
      resolve('unsent');
    }
  });
}

it(`answers ${RPCS} hostile RPCs and ${SOCKET_MESSAGES} hostile session messages without a crash, INTERNAL, UNKNOWN or leak`, async () => {
  // A short transfer wait: Import and Attach with made-up transfer ids would otherwise wait 5 s each.
  const daemon = await TestDaemon.start(['--quota-per-session', '64MiB', '--transfer-wait-ms', '20']);
  const [own, other] = [await connect({ socketDir: daemon.dir }), await connect({ socketDir: daemon.dir })];
  try {
    const baselineFds = daemon.openFds();
    const { proto } = loadProtos();
    const ns = proto.vmmd.v1 as unknown as Namespace;
    const target = `unix://${socketPaths(daemon.dir).grpc}`;
    const credentials = grpc.credentials.createInsecure();
    const clients: Record<string, grpc.Client & Record<string, any>> = {};
    const methods: Array<{ service: string; name: string; info: MethodInfo }> = [];
    for (const service of ['Devices', 'VirtualMemory', 'Stores', 'Admin']) {
      const Client = (proto.vmmd.v1 as any)[service] as grpc.ServiceClientConstructor;
      clients[service] = new Client(target, credentials) as grpc.Client & Record<string, any>;
      for (const [name, info] of Object.entries(Client.service as unknown as Record<string, MethodInfo>)) methods.push({ service, name, info });
    }
    const tokens = [own.session.token, other.session.token, 'f'.repeat(64), undefined];
    const statuses = new Map<number, number>();
    const bad: string[] = [];
    let sent = 0;
    let unsent = 0;
    const arbitrary = fc
      .tuple(fc.constantFrom(...methods), fc.constantFrom(...tokens), fc.integer({ min: 0, max: 2 ** 31 - 1 }))
      .chain(([method, token, seed]) => message(ns, method.info.requestType.type.field, 2).map((request) => ({ method, token, request, seed })));
    const samples = fc.sample(arbitrary, { numRuns: RPCS, seed: 20261122 });
    // Eight in flight at a time: concurrency is part of hostility.
    for (let index = 0; index < samples.length; index += 8) {
      await Promise.all(
        samples.slice(index, index + 8).map(async ({ method, token, request }) => {
          const metadata = new grpc.Metadata();
          if (token !== undefined) metadata.set(SESSION_METADATA_KEY, token);
          const code = await invoke(clients[method.service], method.name, method.info, request, metadata);
          if (code === 'unsent') {
            unsent++;
            return;
          }
          sent++;
          statuses.set(code, (statuses.get(code) ?? 0) + 1);
          if (code === grpc.status.INTERNAL || code === grpc.status.UNKNOWN) {
            bad.push(
              `${method.service}.${method.name} ${JSON.stringify(request, (_k, v) => (typeof v === 'bigint' ? String(v) : v)).slice(0, 300)} → ${grpc.status[code]}`,
            );
          }
        }),
      );
    }
    expect(bad).toEqual([]);
    expect(daemon.process.exitCode).toBeNull();

    // The session socket: its own hostile peer.
    const socketPath = socketPaths(daemon.dir).session;
    const peer = SeqpacketConnection.connect(socketPath);
    peer.send(encodeClientFrame({ hello: { protocol: PROTOCOL_VERSION } }));
    const answers: SeqpacketMessage[] = [];
    let peerClosed = false;
    peer.on('message', (received: SeqpacketMessage) => {
      if (received.fd >= 0) addon.close(received.fd);
      answers.push(received);
    });
    peer.on('close', () => (peerClosed = true));
    const frames = fc.sample(
      fc.oneof(
        fc.uint8Array({ maxLength: 200 }).map((bytes) => Buffer.from(bytes)),
        // Truncated and mistyped frames, a JSON frame of protocol 1, a second hello, a daemon's error and an unknown body.
        fc
          .constantFrom(
            [0x12, 0x05, 0x01],
            [0x08, 0xff],
            [0x2a],
            [0x7b, 0x22],
            [0x12, 0x02, 0x08, 0x02],
            [0x7a, 0x00],
            [0x62, 0x00],
            [0x0a, 0x03, 0x01, 0x02, 0x03],
          )
          .map((bytes) => Buffer.from(bytes)),
        // Well-formed frames with hostile values: every request, ids of 0 and 2^64-1, unknown enum values, long strings.
        fc
          .record({
            request: fc.oneof(u64, fc.constant('0')),
            body: fc.constantFrom('transfer', 'allocate', 'release', 'share', 'export', 'open', 'ping'),
            id: u64,
            kind: fc.integer({ min: 0, max: 9 }),
            name: text,
          })
          .map(({ request, body, id, kind, name }) =>
            encodeClientFrame({
              request,
              transfer: body === 'transfer' ? { id } : undefined,
              allocate:
                body === 'allocate' ? { size: id, location: { type: kind as never, id: kind, deviceUuid: name }, handleType: kind as never } : undefined,
              release: body === 'release' ? { allocationId: id } : undefined,
              share: body === 'share' ? { allocationId: id } : undefined,
              export: body === 'export' ? { allocationId: id, shareKey: name, handleType: kind as never } : undefined,
              open: body === 'open' ? { store: { id, name }, writable: kind % 2 === 0 } : undefined,
              ping: body === 'ping' ? { nonce: name } : undefined,
            }),
          ),
        fc.constant(Buffer.alloc(9000, 0x08)),
      ),
      { numRuns: SOCKET_MESSAGES, seed: 7 },
    );
    let withDescriptors = 0;
    for (const [index, frame] of frames.entries()) {
      // Every fifth frame carries a descriptor: of the wrong kind (stdin, stderr) or a real memfd.
      let fd = -1;
      if (index % 5 === 0) {
        fd = index % 3 === 0 ? addon.hostMemfdCreate('hostile', 4096n) : addon.dup(index % 2 === 0 ? 0 : 2);
        withDescriptors++;
      }
      try {
        peer.send(frame, fd);
      } catch {
        // the socket is full: the daemon answers in its own time
      } finally {
        if (fd >= 0) addon.close(fd);
      }
      if (index % 50 === 0) await new Promise((resolve) => setTimeout(resolve, 5));
    }
    // Frames are handled in order: the pong to a last ping means every frame before it was. The ping is sent
    // again while the socket is full (frames the daemon could not take yet are the flood's, not lost answers).
    const ponged = () => answers.some((answer) => flatFrame(answer.data).nonce === 'last');
    await eventually(
      async () => {
        if (peerClosed || ponged()) return true;
        peer.send(encodeClientFrame({ request: '1', ping: { nonce: 'last' } }), -1);
        await new Promise((resolve) => setTimeout(resolve, 200));
        return ponged() ? true : undefined;
      },
      20_000,
      'the pong after the hostile frames',
    );
    expect(daemon.process.exitCode).toBeNull();
    // The hostile session survives its own garbage (an empty frame once passed for a hang-up and ended it).
    expect(peerClosed).toBe(false);
    const stillOpen = !peerClosed;
    peer.close();
    // The sessions still work, then everything goes with them.
    await own.devices.getGranularity();
    await other.devices.getGranularity();
    own.close();
    other.close();
    await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 20_000, 'the sessions to close');
    // What remains was made without a session (the daemon's, as grpcurl's would be) and is all accounted for.
    const stats = await daemon.stats();
    const daemonOwned = (
      await new Promise<any>((resolve, reject) =>
        daemon.raw.admin.ListObjects({ ownerSession: '0' }, (error: Error | null, value: unknown) => (error ? reject(error) : resolve(value))),
      )
    ).objects as Array<{ kind: string }>;
    const remaining = Number(stats.reservations) + Number(stats.allocations) + Number(stats.mappings);
    expect(daemonOwned.length).toBeGreaterThanOrEqual(remaining);
    // Descriptors: the daemon's own allocations keep theirs (host backend: one memfd each); nothing else stays open.
    await eventually(() => (daemon.openFds() <= baselineFds - 2 + Number(stats.allocations) + 2 ? true : undefined), 10_000, 'descriptors back');
    figure('hostile input', {
      rpcs_sent: sent,
      rpcs_unencodable_by_the_client: unsent,
      statuses: [...statuses.entries()]
        .sort((a, b) => a[0] - b[0])
        .map(([code, count]) => `${grpc.status[code]} ${count}`)
        .join(', '),
      internal_or_unknown: bad.length,
      session_frames: SOCKET_MESSAGES,
      session_frames_with_descriptors: withDescriptors,
      session_answers: answers.length,
      session_socket_still_open: stillOpen,
      daemon_crashes: 0,
      objects_left_by_closed_sessions: remaining - daemonOwned.length > 0 ? remaining - daemonOwned.length : 0,
    });
    // (Stores has an RPC named Close: the channel's own close.)
    for (const client of Object.values(clients)) grpc.Client.prototype.close.call(client);
  } finally {
    own.close();
    other.close();
    expect(await daemon.stop()).toBe(0);
  }
}, 600_000);
