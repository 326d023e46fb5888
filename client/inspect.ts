/**
 * inspect(): the daemon's inspection calls without a session (what vmmctl's
 * listings use): devices, memory, stats, sessions, objects, stores, the
 * version and, for admins, the report. Nothing is opened in the daemon, so
 * nothing of it is logged there: a health check that runs every 30 s writes
 * no line. Calls that make, change or move memory need connect().
 */
import * as grpc from '@grpc/grpc-js';
import * as net from 'node:net';
import * as path from 'node:path';
import { defaultSocketDir, socketPaths, whereElse } from '../common/paths';
import type { ListStoresRequest } from '../generated/vmmd/v1/ListStoresRequest';
import type { ListStoresResponse__Output } from '../generated/vmmd/v1/ListStoresResponse';
import type { Store__Output } from '../generated/vmmd/v1/Store';
import { AdminApi, DevicesApi } from './connection';
import { VmmdError } from './errors';
import { LazyServices } from './lazy-services';
import { CallSettings, unaryCall } from './rpc';

export interface InspectOptions {
  /** The daemon's socket directory; default VMMD_SOCKET_DIR, then the daemon's own default. */
  socketDir?: string;
  /** Deadline of each call, ms (default 30 s). */
  deadlineMs?: number;
}

/** The daemon seen without a session. */
export class VmmdInspector {
  constructor(
    readonly devices: DevicesApi,
    readonly admin: AdminApi,
    readonly stores: { list(): Promise<Store__Output[]> },
    private readonly services: LazyServices,
  ) {}

  close(): void {
    this.services.close();
  }
}

/**
 * The daemon's inspection calls, without a session.
 * @throws VmmdError UNAVAILABLE DAEMON_UNREACHABLE when no daemon serves the socket directory
 */
export async function inspect(options: InspectOptions = {}): Promise<VmmdInspector> {
  const grpcPath = socketPaths(options.socketDir ?? defaultSocketDir()).grpc;
  await reachable(grpcPath);
  const services = new LazyServices(`unix://${grpcPath}`);
  const settings: CallSettings = { metadata: () => new grpc.Metadata(), deadlineMs: options.deadlineMs ?? 30_000 };
  const stores = services.client('stores');
  const list = async () => (await unaryCall<ListStoresRequest, ListStoresResponse__Output>(stores, stores.List, {}, settings)).stores;
  return new VmmdInspector(new DevicesApi(services.client('devices'), settings), new AdminApi(services.client('admin'), settings), { list }, services);
}

/**
 * Resolves once something accepts a connection on the socket: a missing
 * daemon is said as connect() says it, not as gRPC's retrying channel would.
 */
function reachable(socket: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const probe = net.connect(socket);
    probe.once('connect', () => {
      probe.destroy();
      resolve();
    });
    probe.once('error', (error) => {
      probe.destroy();
      reject(
        new VmmdError('DAEMON_UNREACHABLE', grpc.status.UNAVAILABLE, `cannot reach vmmd at ${socket}: ${error.message}; ${whereElse(path.dirname(socket))}`),
      );
    });
  });
}
