/**
 * The hot operations on the session socket: allocate (from the stock
 * where the daemon has one), release, share, export and open, each one
 * SEQPACKET round trip, against the session socket's ping in the same run
 * (interleaved rounds, so that drift of the machine hits every row alike), and
 * the same operations as RPCs beside them. Target: each p50 ≤ 2 × ping's p50.
 */
import * as grpc from '@grpc/grpc-js';
import type { VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import { addon } from '../../native';
import { ratio, Row, sample, Section, summarize, Target } from '../lib/stats';

const MiB = 1n << 20n;

type Callback = (error: grpc.ServiceError | null, value?: unknown) => void;

/** The raw RPC of a client's service (the client library's own methods take the socket now). */
function rpc<T>(service: unknown, method: string, request: object, token: string): Promise<T> {
  const metadata = new grpc.Metadata();
  metadata.set(SESSION_METADATA_KEY, token);
  const client = (service as { client: Record<string, (request: object, metadata: grpc.Metadata, callback: Callback) => void> }).client;
  return new Promise((resolve, reject) => client[method].call(client, request, metadata, (error, value) => (error ? reject(error) : resolve(value as T))));
}

type Stock = { stock?: null | { hits: number; misses: number; levels: Array<{ size: string; held: number }> } };

export async function sessionOps(client: VmmdClient, iterations: number): Promise<Section> {
  const session = client.session;
  const size = 2n * MiB;
  const token = session.token;
  // What share, export and open act on: one allocation and a store of it, made once.
  const kept = await session.allocate(size);
  addon.close(kept.fd);
  const allocation = kept.message.allocationId;
  const storeName = `bench-session-ops-${process.pid}`;
  await client.stores.createStore({ allocationId: allocation, name: storeName, size: String(size) });
  // Allocations made untimed for the release rows to free, one per timed call.
  const toRelease: string[] = [];
  const prepareRelease = async () => {
    const made = await session.allocate(size);
    addon.close(made.fd);
    toRelease.push(made.message.allocationId);
  };
  const names = ['ping', 'allocate', 'release', 'share', 'export', 'open', 'Allocate RPC', 'Release RPC', 'Share RPC', 'Export RPC', 'Open RPC'] as const;
  type Name = (typeof names)[number];
  const bodies: Record<Name, { run: () => Promise<unknown>; before?: () => Promise<unknown>; after?: (value: unknown) => Promise<unknown> | unknown }> = {
    ping: { run: () => session.ping() },
    allocate: {
      run: () => session.allocate(size),
      after: async (value) => {
        const { message, fd } = value as Awaited<ReturnType<typeof session.allocate>>;
        addon.close(fd);
        await session.release(message.allocationId);
      },
    },
    release: { before: prepareRelease, run: () => session.release(toRelease.pop()!) },
    share: { run: () => session.share(allocation) },
    export: { run: () => session.export(allocation), after: (value) => addon.close((value as { fd: number }).fd) },
    // Opens are not closed one by one: a Close RPC between two opens would leave its gRPC work to the next
    // timed call; the session's end drops them all (as the lease does).
    open: { run: () => session.open({ name: storeName }, false), after: (value) => addon.close((value as { fd: number }).fd) },
    'Allocate RPC': {
      run: async () => {
        const response = await client.vmm.allocateRaw({ size });
        return { response, fd: await session.takeTransfer(response.transferId) };
      },
      after: async (value) => {
        const { response, fd } = value as { response: { allocationId: string }; fd: number };
        addon.close(fd);
        await session.release(response.allocationId);
      },
    },
    'Release RPC': { before: prepareRelease, run: () => rpc(client.vmm, 'Release', { allocationId: toRelease.pop()! }, token) },
    'Share RPC': { run: () => rpc(client.vmm, 'Share', { allocationId: allocation }, token) },
    'Export RPC': {
      run: async () => {
        const response = await rpc<{ transferId: string }>(client.vmm, 'Export', { allocationId: allocation, handleType: 'HANDLE_TYPE_POSIX_FD' }, token);
        return session.takeTransfer(response.transferId);
      },
      after: (fd) => addon.close(fd as number),
    },
    'Open RPC': {
      run: async () => {
        const response = await rpc<{ transferId: string }>(client.stores, 'Open', { store: { name: storeName } }, token);
        return session.takeTransfer(response.transferId);
      },
      after: (fd) => addon.close(fd as number),
    },
  };
  const samples = Object.fromEntries(names.map((name) => [name, [] as number[]])) as Record<Name, number[]>;
  const stockBefore = ((await client.admin.getReport()) as Stock).stock;
  const rounds = 5;
  const perRound = Math.ceil(iterations / rounds);
  try {
    for (let round = 0; round < rounds; round++) {
      for (const name of names) {
        const { run, before, after } = bodies[name];
        const warmup = round === 0 ? 50 : 10;
        // Release needs one allocation per call, made before the timing starts.
        if (before !== undefined) for (let i = 0; i < warmup + perRound; i++) await before();
        samples[name].push(...(await sample(perRound, run, { warmup, after })));
      }
    }
  } finally {
    for (const id of toRelease.splice(0)) await session.release(id).catch(() => undefined);
    await client.stores.detach(storeName).catch(() => undefined);
    await session.release(allocation).catch(() => undefined);
  }
  const stockAfter = ((await client.admin.getReport()) as Stock).stock;
  const ping = summarize(samples.ping);
  const describe: Record<Name, string> = {
    ping: 'session socket ping/pong (reference)',
    allocate: 'allocate 2 MiB (create + export, descriptor attached)',
    release: 'release 2 MiB (freed)',
    share: 'share (the key)',
    export: 'export 2 MiB (descriptor attached)',
    open: 'open a 2 MiB store (descriptor attached)',
    'Allocate RPC': 'Allocate RPC + its transfer',
    'Release RPC': 'Release RPC',
    'Share RPC': 'Share RPC',
    'Export RPC': 'Export RPC + its transfer',
    'Open RPC': 'Stores.Open RPC + its transfer',
  };
  const rows: Row[] = names.map((name) => {
    const summary = summarize(samples[name]);
    return {
      operation: describe[name],
      transport: name.endsWith('RPC') ? 'gRPC' : 'session socket',
      ...summary,
      p50_vs_ping: ratio(summary.p50_us, ping.p50_us),
    };
  });
  const targets: Target[] = (['allocate', 'release', 'share', 'open', 'export'] as const).map((name) => {
    const p50 = summarize(samples[name]).p50_us;
    return {
      target: `${name} on the session socket p50 ≤ 2 × session-socket ping p50`,
      measured: `${p50} µs vs ping ${ping.p50_us} µs (×${ratio(p50, ping.p50_us)})`,
      limit: '×2',
      met: p50 <= 2 * ping.p50_us,
    };
  });
  const notes: string[] = [];
  if (stockBefore && stockAfter && stockBefore.levels.length > 0) {
    const hits = stockAfter.hits - stockBefore.hits;
    const misses = stockAfter.misses - stockBefore.misses;
    notes.push(
      `The stock served ${hits} of the ${hits + misses} allocations of this section (allocate rows, the RPC's and those made for the release rows); the rest were created on the spot.`,
    );
  } else {
    notes.push('This daemon keeps no stock (the host backend by default): allocate creates each allocation on the spot (a memfd on host).');
  }
  return { id: 'session-ops', title: 'Hot operations on the session socket, one round trip each, vs its ping and the RPCs', rows, targets, notes };
}
