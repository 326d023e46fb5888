/**
 * The RPC floor's reference: a bare grpc-js server that echoes its request,
 * on a Unix socket, with the same proto-loader options as vmmd. Started by
 * bench/sections/rpc-floor.ts as its own process, as the daemon is.
 *   node dist/bench/echo-server.js SOCKET_PATH   (prints "ready")
 */
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import * as path from 'node:path';
import { LOADER_OPTIONS } from '../common/proto';
import { packageRoot } from './lib/daemon';

export function loadEcho(): grpc.ServiceClientConstructor {
  const definition = protoLoader.loadSync(path.join(packageRoot, 'bench', 'echo.proto'), { ...LOADER_OPTIONS, includeDirs: [] });
  const loaded = grpc.loadPackageDefinition(definition) as unknown as { bench: { Echo: grpc.ServiceClientConstructor } };
  return loaded.bench.Echo;
}

if (require.main === module) {
  const socket = process.argv[2];
  const server = new grpc.Server();
  server.addService(loadEcho().service, {
    Echo: (call: grpc.ServerUnaryCall<unknown, unknown>, callback: grpc.sendUnaryData<unknown>) => callback(null, call.request),
  });
  server.bindAsync(`unix:${socket}`, grpc.ServerCredentials.createInsecure(), (error) => {
    if (error) throw error;
    process.stdout.write('ready\n');
  });
  process.on('SIGTERM', () => server.forceShutdown());
}
