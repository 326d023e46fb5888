/**
 * 1. The RPC floor: the daemon's cheapest RPCs against a bare grpc-js echo
 * server on the same kind of Unix socket, both in their own process, called
 * from one client process by the same raw grpc-js client code with the same
 * metadata (the session token). A third row is the vmmd client library's call
 * (deadline, error mapping), what applications see.
 */
import * as grpc from '@grpc/grpc-js';
import { spawn } from 'node:child_process';
import * as path from 'node:path';
import { loadProtos } from '../../common/proto';
import { socketPaths } from '../../common/paths';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import { loadEcho } from '../echo-server';
import type { BenchDaemon } from '../lib/daemon';
import { ratio, sample, Section, summarize } from '../lib/stats';

type Callback = (error: grpc.ServiceError | null, value?: unknown) => void;
type RawMethod = (request: unknown, metadata: grpc.Metadata, callback: Callback) => void;

function rawCall(client: grpc.Client, method: RawMethod, request: unknown, metadata: grpc.Metadata): () => Promise<unknown> {
  return () =>
    new Promise((resolve, reject) => {
      method.call(client, request, metadata, (error, value) => (error ? reject(error) : resolve(value)));
    });
}

export async function rpcFloor(daemon: BenchDaemon, iterations: number): Promise<Section> {
  const socket = path.join(daemon.dir, 'echo.sock');
  const echoProcess = spawn(process.execPath, [path.join(__dirname, '..', 'echo-server.js'), socket], { stdio: ['ignore', 'pipe', 'inherit'] });
  await new Promise<void>((resolve, reject) => {
    echoProcess.stdout!.once('data', () => resolve());
    echoProcess.once('exit', (code) => reject(new Error(`the echo server exited with ${code}`)));
  });
  const metadata = new grpc.Metadata();
  metadata.set(SESSION_METADATA_KEY, daemon.client.session.token);
  const Echo = loadEcho();
  const echo = new Echo(`unix://${socket}`, grpc.credentials.createInsecure());
  const { proto } = loadProtos();
  const target = `unix://${socketPaths(daemon.dir).grpc}`;
  const admin = new proto.vmmd.v1.Admin(target, grpc.credentials.createInsecure());
  const devices = new proto.vmmd.v1.Devices(target, grpc.credentials.createInsecure());
  const raw = (client: grpc.Client, name: string) => (client as unknown as Record<string, RawMethod>)[name];
  try {
    // Interleaved rounds, so that drift of the machine hits every row alike.
    const names = ['echo', 'GetVersion', 'GetGranularity', 'client GetGranularity', 'session ping'] as const;
    const bodies: Record<(typeof names)[number], () => Promise<unknown>> = {
      echo: rawCall(echo, raw(echo, 'Echo'), { payload: Buffer.alloc(0) }, metadata),
      GetVersion: rawCall(admin, raw(admin, 'GetVersion'), {}, metadata),
      GetGranularity: rawCall(devices, raw(devices, 'GetGranularity'), {}, metadata),
      'client GetGranularity': () => daemon.client.devices.getGranularity(),
      'session ping': () => daemon.client.session.ping(),
    };
    const samples = Object.fromEntries(names.map((name) => [name, [] as number[]])) as Record<(typeof names)[number], number[]>;
    const rounds = 5;
    for (let round = 0; round < rounds; round++) {
      for (const name of names) samples[name].push(...(await sample(Math.ceil(iterations / rounds), bodies[name], { warmup: round === 0 ? 200 : 20 })));
    }
    const echoSummary = summarize(samples.echo);
    const rows = names.map((name) => {
      const summary = summarize(samples[name]);
      return {
        call:
          name === 'echo'
            ? 'bare grpc-js echo (reference)'
            : name === 'session ping'
              ? 'session socket ping/pong (SEQPACKET, no gRPC)'
              : name.startsWith('client')
                ? `vmmd client library: ${name.slice(7)}`
                : `daemon ${name} (raw grpc-js client)`,
        ...summary,
        p50_vs_echo: ratio(summary.p50_us, echoSummary.p50_us),
      };
    });
    const best = Math.min(...rows.slice(1, 3).map((row) => row.p50_us));
    return {
      id: 'rpc-floor',
      title: 'RPC floor: the cheapest RPCs against a bare grpc-js echo server',
      rows,
      targets: [
        {
          target: 'daemon p50 ≤ 1.2 × bare echo p50',
          measured: `${best} µs vs ${echoSummary.p50_us} µs (×${ratio(best, echoSummary.p50_us)})`,
          limit: '×1.2',
          met: best <= 1.2 * echoSummary.p50_us,
        },
      ],
    };
  } finally {
    echo.close();
    admin.close();
    devices.close();
    echoProcess.kill('SIGTERM');
  }
}
