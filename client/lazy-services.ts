/**
 * The gRPC side of a connection, made on its first use: a worker that only
 * allocates, releases and opens stores (all on the session socket) never
 * parses the protos or opens an HTTP/2 connection, which were most of a new
 * process's connect(): loading the protos and a first RPC take tens of
 * milliseconds where the session takes a few. The
 * service APIs hold stand-ins that make the clients on first touch.
 */
import * as grpc from '@grpc/grpc-js';
import { loadProtos } from '../common/proto';
import { VmmdError } from './errors';
import type { AdminClient } from '../generated/vmmd/v1/Admin';
import type { DevicesClient } from '../generated/vmmd/v1/Devices';
import type { StoresClient } from '../generated/vmmd/v1/Stores';
import type { VirtualMemoryClient } from '../generated/vmmd/v1/VirtualMemory';

/** The four service clients, on one channel. */
export interface ServiceClients {
  devices: DevicesClient;
  vmm: VirtualMemoryClient;
  admin: AdminClient;
  stores: StoresClient;
}

/** The channel's reconnection backoff (grpc-js's defaults: 1 s first, up to 120 s). */
const RECONNECT_BACKOFF = { 'grpc.initial_reconnect_backoff_ms': 50, 'grpc.max_reconnect_backoff_ms': 1_000 };

export class LazyServices {
  private made?: ServiceClients;
  private closed = false;

  /** @param target the daemon's gRPC address (unix://…) */
  constructor(private readonly target: string) {}

  /** Whether the clients exist yet (a test's and the benchmark's question). */
  get connected(): boolean {
    return this.made !== undefined;
  }

  /**
   * The clients, made now if they were not.
   * @throws VmmdError FAILED_PRECONDITION CLIENT_CLOSED after close()
   */
  clients(): ServiceClients {
    if (this.closed) throw this.closedError('a gRPC call');
    if (this.made === undefined) {
      const { proto } = loadProtos();
      const credentials = grpc.credentials.createInsecure();
      const v1 = proto.vmmd.v1;
      // A restarted daemon is reached again within a fraction of a second, not after grpc-js's default backoff of seconds.
      const devices = new v1.Devices(this.target, credentials, RECONNECT_BACKOFF) as unknown as DevicesClient;
      // One channel for all services: grpc-js shares the subchannel when target and options match.
      const channelOverride = devices.getChannel();
      this.made = {
        devices,
        vmm: new v1.VirtualMemory(this.target, credentials, { channelOverride }) as unknown as VirtualMemoryClient,
        admin: new v1.Admin(this.target, credentials, { channelOverride }) as unknown as AdminClient,
        stores: new v1.Stores(this.target, credentials, { channelOverride }) as unknown as StoresClient,
      };
    }
    return this.made;
  }

  /**
   * A stand-in for one service's client: each property is the real client's
   * (methods bound to it), made on first touch. What awaiting, printing or
   * serialising the stand-in asks (then, symbols, toJSON, Object's own
   * methods) makes nothing; after close() its methods refuse with
   * CLIENT_CLOSED, channel made or not (never loading the protos to fail).
   */
  client<K extends keyof ServiceClients>(service: K): ServiceClients[K] {
    return new Proxy({} as ServiceClients[K], {
      get: (target, property) => {
        if (property === 'then') return undefined;
        const incidental = typeof property === 'symbol' || property === 'toJSON' || property in Object.prototype;
        if (incidental && (this.made === undefined || this.closed)) return Reflect.get(target, property);
        if (this.closed) {
          return () => {
            throw this.closedError(String(property));
          };
        }
        const real = this.clients()[service] as unknown as Record<PropertyKey, unknown>;
        const value = real[property];
        // The bound method keeps its path: a resumed call knows which method it is (client/rpc.ts).
        return typeof value === 'function'
          ? Object.assign((value as (...args: unknown[]) => unknown).bind(real), { path: (value as { path?: string }).path })
          : value;
      },
    });
  }

  /** Closes the channel if it was made; later calls refuse with CLIENT_CLOSED. */
  close(): void {
    this.closed = true;
    this.made?.devices.close();
  }

  private closedError(what: string): VmmdError {
    return new VmmdError('CLIENT_CLOSED', grpc.status.FAILED_PRECONDITION, `${what} on a closed vmmd client: connect() again`);
  }
}
