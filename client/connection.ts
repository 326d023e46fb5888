/**
 * connect(): the session socket and the gRPC channel of one client process,
 * with a typed promise API for every service.
 */
import * as grpc from '@grpc/grpc-js';
import { EventEmitter } from 'node:events';
import { DEFAULT_BUSY_POLL_MICROS } from '../common/busy-poll';
import { defaultSocketDir, socketPaths } from '../common/paths';
import { SESSION_METADATA_KEY } from '../common/protocol';
import type { AdminClient } from '../generated/vmmd/v1/Admin';
import type { DevicesClient } from '../generated/vmmd/v1/Devices';
import type { GetGranularityRequest } from '../generated/vmmd/v1/GetGranularityRequest';
import type { GetMemoryInfoRequest } from '../generated/vmmd/v1/GetMemoryInfoRequest';
import type { Granularity__Output } from '../generated/vmmd/v1/Granularity';
import type { ListDevicesResponse__Output } from '../generated/vmmd/v1/ListDevicesResponse';
import type { MemoryInfo__Output } from '../generated/vmmd/v1/MemoryInfo';
import type { GetStatsRequest } from '../generated/vmmd/v1/GetStatsRequest';
import type { Stats__Output } from '../generated/vmmd/v1/Stats';
import type { ClearCachesResponse__Output } from '../generated/vmmd/v1/ClearCachesResponse';
import type { ListObjectsRequest } from '../generated/vmmd/v1/ListObjectsRequest';
import type { ListObjectsResponse__Output } from '../generated/vmmd/v1/ListObjectsResponse';
import type { ListSessionsResponse__Output } from '../generated/vmmd/v1/ListSessionsResponse';
import type { Report__Output } from '../generated/vmmd/v1/Report';
import type { VersionInfo__Output } from '../generated/vmmd/v1/VersionInfo';
import { CallSettings, Input, unaryCall } from './rpc';
import { ClientSession } from './session';
import { DEFAULT_STAGING_BYTES } from './staging';
import { native } from '../native/client';
import { VmmdError } from './errors';
import { LazyServices } from './lazy-services';
import { StoresApi } from './stores';
import { VirtualMemoryApi } from './vmm';
import { MemoryTags } from './memory-tags';
import { SleepOptions, SleepReport, WakeOptions, WakeReport } from './sleep-wake';
import { resumeWaitMs } from './resume';

export interface ConnectOptions {
  /** The daemon's socket directory; default VMMD_SOCKET_DIR, then the daemon's own default. */
  socketDir?: string;
  /** Deadline of each call, ms (default 30 s). */
  deadlineMs?: number;
  /** How long to wait for the daemon's greeting, ms (default 5 s). */
  connectTimeoutMs?: number;
  /**
   * Bytes of the staging buffer that large Read/Write calls go through (the
   * bulk path; two halves, so it should be even). 0 streams everything over gRPC. Default 32 MiB, mapped on first use.
   */
  stagingBytes?: number;
  /**
   * While a session-socket request (allocate, release, export, open, share) waits for its answer, this
   * process's event loop spins up to this long before it sleeps, µs: an answer that comes within it
   * finds the process awake, without the wake-up a sleeping process pays (slow on a virtual machine).
   * Costs at most that much CPU per wait. Default VMMD_CLIENT_BUSY_POLL_US, else 200; 0: never spin.
   */
  busyPollMicros?: number;
  /**
   * Under a daemon that parks its sessions (restarts without loss), how long, ms, the client tries to
   * resume its session after the session socket closed without close(): calls wait meanwhile, up to their
   * deadlines. Default VMMD_RESUME_WAIT_MS, else 30 s; 0: never resume (the session is lost at once).
   */
  resumeWaitMs?: number;
}

export class DevicesApi {
  constructor(
    private readonly client: DevicesClient,
    private readonly settings: CallSettings,
  ) {}

  listDevices(): Promise<ListDevicesResponse__Output> {
    return unaryCall(this.client, this.client.ListDevices, {}, this.settings);
  }

  /** @throws VmmdError OUT_OF_RANGE UNKNOWN_DEVICE */
  getMemoryInfo(request: Input<GetMemoryInfoRequest> = {}): Promise<MemoryInfo__Output> {
    return unaryCall(this.client, this.client.GetMemoryInfo, request, this.settings);
  }

  /** @throws VmmdError OUT_OF_RANGE UNKNOWN_DEVICE */
  getGranularity(request: Input<GetGranularityRequest> = {}): Promise<Granularity__Output> {
    return unaryCall(this.client, this.client.GetGranularity, request, this.settings);
  }
}

export class AdminApi {
  constructor(
    private readonly client: AdminClient,
    private readonly settings: CallSettings,
  ) {}

  getStats(request: Input<GetStatsRequest> = {}): Promise<Stats__Output> {
    return unaryCall(this.client, this.client.GetStats, request, this.settings);
  }

  async getReport(): Promise<unknown> {
    return JSON.parse((await unaryCall<object, Report__Output>(this.client, this.client.GetReport, {}, this.settings)).json);
  }

  listSessions(): Promise<ListSessionsResponse__Output> {
    return unaryCall<object, ListSessionsResponse__Output>(this.client, this.client.ListSessions, {}, this.settings);
  }

  listObjects(request: Input<ListObjectsRequest> = {}): Promise<ListObjectsResponse__Output> {
    return unaryCall<ListObjectsRequest, ListObjectsResponse__Output>(this.client, this.client.ListObjects, request, this.settings);
  }

  clearCaches(): Promise<ClearCachesResponse__Output> {
    return unaryCall<object, ClearCachesResponse__Output>(this.client, this.client.ClearCaches, {}, this.settings);
  }

  getVersion(): Promise<VersionInfo__Output> {
    return unaryCall<object, VersionInfo__Output>(this.client, this.client.GetVersion, {}, this.settings);
  }
}

/** The backends a daemon serves. */
export type BackendName = 'host' | 'cuda';

/**
 * A connected client: the session (the lease on everything it creates) and
 * the three services. Emits 'session-lost' if the daemon goes away and the
 * session does not come back; under a daemon that parks its sessions,
 * 'resuming' when the session socket closed and 'resumed' once the session
 * is back with everything it owned.
 */
export class VmmdClient extends EventEmitter {
  private closing = false;

  constructor(
    readonly session: ClientSession,
    readonly socketDir: string,
    /** What the daemon's descriptors are ('host': memfds, 'cuda': CUDA handles, from its capabilities), as `VmmdMemoryManager` and the memory classes take it. */
    readonly backend: BackendName,
    readonly devices: DevicesApi,
    readonly vmm: VirtualMemoryApi,
    readonly admin: AdminApi,
    readonly stores: StoresApi,
    /** What close() closes besides the session: the gRPC channel (made on first use, or never). */
    private readonly channels: Array<{ close(): void }>,
    private readonly options: ConnectOptions = {},
  ) {
    super();
    session.on('resuming', () => this.emit('resuming'));
    session.on('resumed', () => this.emit('resumed'));
    session.on('close', (why?: VmmdError) => {
      if (this.closing) return;
      this.lost = true;
      this.emit(
        'session-lost',
        new VmmdError(
          'SESSION_LOST',
          grpc.status.UNAVAILABLE,
          `session ${session.id} with vmmd at ${socketDir} ended: the daemon went away${why === undefined ? '' : ` and the session did not come back (${why.message})`}; everything the session held in the daemon is gone (memory mapped in this process stays valid); reconnect() opens a new session`,
        ),
      );
    });
  }

  /** True once the daemon ended the session without close() (it stopped or crashed). */
  lost = false;

  /** Memory that sleeps and wakes by tag (client/sleep-wake.ts): groups of mappings, memory managers' pools. */
  readonly tags = new MemoryTags(this);

  /**
   * Puts the memory tagged `tag` to sleep (docs/CLIENT.md, Sleep and wake).
   * @throws VmmdError NOT_FOUND NOT_VMMD_MEMORY (no such tag); FAILED_PRECONDITION ASLEEP; the offload's refusals
   */
  sleep(tag: string, options: SleepOptions = {}): Promise<SleepReport> {
    return this.tags.sleep(tag, options);
  }

  /**
   * Wakes the memory tagged `tag` at the same addresses.
   * @throws VmmdError NOT_FOUND NOT_VMMD_MEMORY; RESOURCE_EXHAUSTED OUT_OF_MEMORY (still asleep and intact)
   */
  wake(tag: string, options: WakeOptions = {}): Promise<WakeReport> {
    return this.tags.wake(tag, options);
  }

  /**
   * A new client, on a new session with the daemon at the same socket
   * directory and with the same options (after a restart of the daemon, say):
   * use the client it returns. This one stays closed; memory this process
   * mapped earlier stays valid.
   * @throws VmmdError UNAVAILABLE DAEMON_UNREACHABLE while no daemon serves the directory
   */
  reconnect(): Promise<VmmdClient> {
    this.close();
    return connect({ ...this.options, socketDir: this.socketDir });
  }

  /** Ends the session: the daemon reclaims everything it owns. Local mappings stay valid. */
  close(): void {
    this.closing = true;
    this.vmm.closeStaging();
    this.session.close();
    for (const channel of this.channels) channel.close();
  }

  [Symbol.dispose](): void {
    this.close();
  }
}

/**
 * Opens a session with the daemon; the gRPC channel to it is made on the
 * first call that needs it.
 * @throws VmmdError UNAVAILABLE DAEMON_UNREACHABLE when no daemon serves the socket directory
 */
/**
 * The busy-poll budget: the option, else VMMD_CLIENT_BUSY_POLL_US, else the default.
 * @throws VmmdError INVALID_ARGUMENT BAD_OPTION naming the value and the rule
 */
export function busyPollBudget(option: number | undefined, env = process.env.VMMD_CLIENT_BUSY_POLL_US): number {
  const [value, from] =
    option !== undefined
      ? [option, 'busyPollMicros']
      : env !== undefined && env !== ''
        ? [Number(env), 'VMMD_CLIENT_BUSY_POLL_US']
        : [DEFAULT_BUSY_POLL_MICROS, ''];
  if (!Number.isInteger(value) || value < 0 || value > 10_000) {
    throw new VmmdError('BAD_OPTION', grpc.status.INVALID_ARGUMENT, `${from} must be a whole number of microseconds from 0 to 10000, got ${option ?? env}`);
  }
  return value;
}

export async function connect(options: ConnectOptions = {}): Promise<VmmdClient> {
  const stagingBytes = options.stagingBytes ?? DEFAULT_STAGING_BYTES;
  if (!Number.isSafeInteger(stagingBytes) || stagingBytes < 0 || stagingBytes % (2 * native.pageSize()) !== 0) {
    throw new VmmdError(
      'BAD_STAGING_SIZE',
      grpc.status.INVALID_ARGUMENT,
      `stagingBytes ${stagingBytes} must be 0 or a positive multiple of twice the page size (${2 * native.pageSize()})`,
    );
  }
  const socketDir = options.socketDir ?? defaultSocketDir();
  const paths = socketPaths(socketDir);
  const session = await ClientSession.open(
    paths.session,
    options.connectTimeoutMs ?? 5_000,
    busyPollBudget(options.busyPollMicros),
    resumeWaitMs(options.resumeWaitMs),
  );
  // The gRPC clients are made on first use: the session socket serves a worker's hot requests.
  const services = new LazyServices(`unix://${paths.grpc}`);
  const settings: CallSettings = {
    metadata: () => {
      const metadata = new grpc.Metadata();
      metadata.set(SESSION_METADATA_KEY, session.token);
      return metadata;
    },
    deadlineMs: options.deadlineMs ?? 30_000,
  };
  // Not enumerable: a service API printed or serialised does not take the session (and its bigints) with it.
  Object.defineProperty(settings, 'session', { value: session, enumerable: false });
  const devices = new DevicesApi(services.client('devices'), settings);
  // How to map the daemon's descriptors is a capability its hello states: memfds, or CUDA handles.
  let backend: BackendName;
  if (session.capabilities.has('CAPABILITY_CUDA_DESCRIPTORS')) backend = 'cuda';
  else if (session.capabilities.has('CAPABILITY_MEMFD_DESCRIPTORS')) backend = 'host';
  else {
    session.close();
    services.close();
    throw new VmmdError(
      'UNKNOWN_BACKEND',
      grpc.status.UNIMPLEMENTED,
      `the daemon's descriptors are of no kind this client maps (its capabilities: ${[...session.capabilities].join(', ') || 'none'}); this client maps memfds and CUDA handles`,
    );
  }
  const vmm = new VirtualMemoryApi(services.client('vmm'), settings, session, backend, stagingBytes);
  const stores = new StoresApi(services.client('stores'), settings, session, backend);
  return new VmmdClient(session, socketDir, backend, devices, vmm, new AdminApi(services.client('admin'), settings), stores, [services], options);
}
