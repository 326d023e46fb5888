/**
 * `vmmctl health`: the daemon's gRPC health service (grpc.health.v1, service
 * "") asked over its Unix socket, without a session. What a container's
 * health check runs every 30 s: no session opened, so nothing logged.
 */
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import { protoPath as HEALTH_PROTO } from 'grpc-health-check';
import { socketPaths } from '../../common/paths';

/** How long the check waits for an answer. */
const HEALTH_DEADLINE_MS = 5_000;

/** The status the daemon's health service gives ("SERVING", "NOT_SERVING"), or the call's error message. */
export function checkHealth(socketDir: string): Promise<{ serving: boolean; status: string }> {
  const definition = protoLoader.loadSync(HEALTH_PROTO, { keepCase: true, enums: String });
  const Health = (grpc.loadPackageDefinition(definition) as unknown as { grpc: { health: { v1: { Health: grpc.ServiceClientConstructor } } } }).grpc.health.v1
    .Health;
  const client = new Health(`unix://${socketPaths(socketDir).grpc}`, grpc.credentials.createInsecure());
  return new Promise((resolve) =>
    client.Check({ service: '' }, { deadline: Date.now() + HEALTH_DEADLINE_MS }, (error: grpc.ServiceError | null, response?: { status: string }) => {
      client.close();
      resolve(error ? { serving: false, status: error.details || error.message } : { serving: response!.status === 'SERVING', status: response!.status });
    }),
  );
}
