/**
 * The daemon's listening side: the gRPC server with every service on the
 * Unix socket (each connection accepted here and attributed to its uid), on
 * TCP with TLS where configured, the plaintext health port and the metrics
 * port. Opened at start, and opened again by a daemon whose successor went
 * away before it served (server/app/daemon.ts); and the socket files' rules:
 * their modes, and stale files cleared where nobody answers.
 */
import * as grpc from '@grpc/grpc-js';
import type { HealthImplementation } from 'grpc-health-check';
import * as fs from 'node:fs';
import type { Logger } from 'pino';
import { addon, isNativeError } from '../../native';
import type { Metrics } from '../observability/metrics';
import { GrpcUnixListener } from '../transport/grpc/grpc-unix';
import type { TransportBudgets } from '../transport/budgets';
import type { ClientActivity } from './activity';
import type { DaemonConfig } from './config';

export class DaemonStartError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'DaemonStartError';
  }
}

/** The gRPC servers as they listen: closed by the daemon's stop, each opened anew to serve again. */
export interface GrpcListeners {
  readonly server: grpc.Server;
  /** Only the health service, plaintext: what Kubernetes' gRPC probes speak (they have no Unix sockets). */
  readonly healthServer: grpc.Server;
  readonly unix: GrpcUnixListener;
}

/**
 * A new gRPC server with every service (`addServices`), listening on the Unix
 * socket, TCP and the health and metrics ports as configured. What it opened
 * goes on `undo` as it is opened (a failed start closes it).
 * @throws the bind's error (a port in use)
 */
export async function openGrpc(deps: {
  config: DaemonConfig;
  log: Logger;
  paths: { grpc: string; session: string };
  budgets: TransportBudgets;
  activity: ClientActivity;
  health: HealthImplementation;
  metrics: Metrics;
  addServices: (server: grpc.Server) => void;
  undo: Array<() => void>;
}): Promise<GrpcListeners> {
  const { config, log, paths, undo } = deps;
  const server = new grpc.Server({ 'grpc.max_receive_message_length': Number(config.maxMessageBytes) });
  const healthServer = new grpc.Server();
  undo.push(
    () => server.forceShutdown(),
    () => healthServer.forceShutdown(),
  );
  deps.addServices(server);
  deps.health.addToServer(healthServer);
  // Accepted here, not by grpc-js: each connection is attributed to its peer's uid (server/transport/grpc/access.ts).
  const unix = await GrpcUnixListener.listen(server, paths.grpc, log, deps.budgets, () => deps.activity.enter());
  undo.push(() => unix.close());
  restrictSockets(config, paths);
  if (config.tcpListen !== '' && config.tls !== undefined) {
    const tls = config.tls;
    const credentials = grpc.ServerCredentials.createSsl(
      tls.ca === undefined ? null : fs.readFileSync(tls.ca),
      [{ cert_chain: fs.readFileSync(tls.cert), private_key: fs.readFileSync(tls.key) }],
      tls.ca !== undefined,
    );
    await new Promise<void>((resolve, reject) => server.bindAsync(config.tcpListen, credentials, (error) => (error ? reject(error) : resolve())));
    log.info({ address: config.tcpListen, mutualTls: tls.ca !== undefined }, 'serving gRPC over TCP with TLS (no sessions, no descriptors)');
  }
  if (config.metricsPort > 0) {
    await deps.metrics.serve(config.metricsPort, config.metricsAddress, log);
    undo.push(() => deps.metrics.close());
  }
  if (config.healthPort > 0) {
    const address = `${config.metricsAddress.includes(':') ? `[${config.metricsAddress}]` : config.metricsAddress}:${config.healthPort}`;
    await new Promise<void>((resolve, reject) =>
      healthServer.bindAsync(address, grpc.ServerCredentials.createInsecure(), (error) => (error ? reject(error) : resolve())),
    );
    log.info({ address }, 'health service (grpc.health.v1 only, plaintext) on %s', address);
  }
  return { server, healthServer, unix };
}
/** Sockets owner-only (0600), or read-write for the configured group (0660). */
export function restrictSockets(config: DaemonConfig, paths: { grpc: string; session: string }): void {
  for (const path of [paths.grpc, paths.session]) {
    if (config.socketGroup !== undefined) fs.chownSync(path, process.getuid!(), config.socketGroup);
    fs.chmodSync(path, config.socketGroup === undefined ? 0o600 : 0o660);
  }
}

/**
 * Removes socket files no daemon answers on; refuses to start over a live one.
 * @throws DaemonStartError when another daemon serves the directory
 */
export function clearStaleSockets(paths: { grpc: string; session: string }): void {
  if (fs.existsSync(paths.session)) {
    let fd = -1;
    try {
      fd = addon.seqpacketConnect(paths.session);
    } catch (error) {
      if (!isNativeError(error, 'ECONNREFUSED') && !isNativeError(error, 'ENOTSOCK') && !isNativeError(error, 'EPROTOTYPE')) {
        throw error;
      }
    }
    if (fd >= 0) {
      addon.close(fd);
      throw new DaemonStartError(`another vmmd is serving ${paths.session}; stop it or choose another --socket-dir`);
    }
  }
  for (const path of [paths.grpc, paths.session]) fs.rmSync(path, { force: true });
}
