/**
 * The daemon: one backend, one registry, the session socket and the gRPC
 * server, started and stopped together.
 */
import * as grpc from '@grpc/grpc-js';
import { ReflectionService } from '@grpc/reflection';
import { HealthImplementation } from 'grpc-health-check';
import * as fs from 'node:fs';
import type { Logger } from 'pino';
import { socketPaths } from '../../common/paths';
import { loadProtos, reflectedDefinition } from '../../common/proto';
import { addon } from '../../native';
import type { Backend } from '../backends/backend';
import { selectBackend } from '../backends/select';
import type { DaemonConfig } from './config';
import { AccessPolicy } from '../transport/grpc/access';
import { TransportBudgets } from '../transport/budgets';
import { Metrics } from '../observability/metrics';
import { Quotas } from '../registry/quotas';
import { AllocationStatistics } from '../registry/statistics';
import { AllocationBudget } from '../registry/allocation-budget';
import { BackendSource } from '../registry/source';
import { derivedLimits, SystemLimits, UidBudgetLimits, UidBudgets } from '../registry/uid-budgets';
import { Registry } from '../registry';
import { AdminService } from '../transport/grpc/services/admin';
import { DevicesService } from '../transport/grpc/services/devices';
import { HandlerDeps } from '../transport/grpc/services/handler';
import { FairCalls } from '../transport/grpc/services/fair-calls';
import { VirtualMemoryService } from '../transport/grpc/services/virtual-memory';
import { StoresService } from '../transport/grpc/services/stores';
import { SessionDispatcher } from '../transport/session/session-dispatcher';
import { toWireCapabilities } from '../transport/wire';
import { GcPauses } from '../observability/gc-pauses';
import { LogLimiter } from '../observability/log-limiter';
import { measureCompletions, TurnMeter } from '../observability/turns';
import { busyPollAlways } from '../../native/busy-poll';
import { ClientActivity } from './activity';
import { makeSocketDir } from './socket-dir';
import { DEFAULT_SESSION_OPTIONS, SessionManager, SessionOptions } from '../transport/session/sessions';
import { deferred, ParkedSession } from '../transport/session/resume';
import { StagingBuffers } from '../stores/staging';
import { CUDA_STAGING_PINNING } from '../backends/cuda';
import { isStoreHolder, StoreRegistry } from '../stores/stores';
import { Lifecycle } from '../lifecycle/lifecycle';
import { HandOverListener, HandOverSide, takeOver } from '../lifecycle/hand-over';
import { clearStaleSockets, GrpcListeners, openGrpc } from './serving';

export { DaemonStartError } from './serving';

// eslint-disable-next-line @typescript-eslint/no-require-imports -- package.json lies outside the compiled tree
export const VERSION: string = require('../../../package.json').version;

/** The health service answers for the whole server ('') and for each vmmd service. */
const HEALTH_SERVICES = ['', 'vmmd.v1.Devices', 'vmmd.v1.VirtualMemory', 'vmmd.v1.Stores', 'vmmd.v1.Admin'];

/**
 * Makes the socket directory owner-only (0700), or for a group (0750) when one
 * is configured, whether it existed or not: an existing 0755 directory would
 * let every user reach the sockets. Returns the mode it had, when it changed.
 */
function prepareSocketDir(config: DaemonConfig): number | undefined {
  const mode = config.socketGroup === undefined ? 0o700 : 0o750;
  makeSocketDir(config.socketDir, mode);
  if (config.socketGroup !== undefined) fs.chownSync(config.socketDir, process.getuid!(), config.socketGroup);
  const before = fs.statSync(config.socketDir).mode & 0o7777;
  fs.chmodSync(config.socketDir, mode);
  return before === mode ? undefined : before;
}

export class Daemon {
  private constructor(
    readonly config: DaemonConfig,
    readonly backend: Backend,
    readonly registry: Registry,
    readonly sessions: SessionManager,
    // Invariant: the gRPC servers open while serving; closed by the quiesce, opened anew to serve again.
    private listeners: GrpcListeners,
    private readonly addServices: (server: grpc.Server) => void,
    private readonly log: Logger,
    readonly paths: { grpc: string; session: string },
    private readonly admin: AdminService,
    private readonly health: HealthImplementation,
    private readonly metrics: Metrics,
    private readonly transportBudgets: TransportBudgets,
    private readonly activity: ClientActivity,
    private readonly lifecycle: Lifecycle,
  ) {}

  private handOverListener?: HandOverListener;
  private readonly handOver = deferred<void>();
  // The stop's first part, once begun (a hand-over's, or SIGTERM's): done once, unless the daemon serves again.
  private stopped?: Promise<void>;
  // The sessions parked for a successor: theirs once it serves, waiting here again if it goes away first.
  private parkedSessions: ParkedSession[] = [];

  /** @throws DaemonStartError, BackendUnavailableError, or the socket's error */
  static async start(config: DaemonConfig, log: Logger, sessionOptions: SessionOptions = DEFAULT_SESSION_OPTIONS): Promise<Daemon> {
    const descriptors = raiseDescriptorLimit(log);
    // The descriptors a file-descriptor store handed back are read first: they sit from fd 3 on.
    const lifecycle = Lifecycle.fromEnvironment(config.park, process.env, log);
    // The daemon's own turns: each native completion's continuation is one (server/observability/turns.ts),
    // measured by wall clock, and (unless --turn-cpu off) by this thread's CPU time too.
    // With the collector's pauses, which GetStats sets beside its longest turns (started with the admin service).
    const gcPauses = new GcPauses();
    const turns = new TurnMeter(config.turnCpu ? () => addon.threadCpuNanos() : undefined, (fromMs, toMs) => gcPauses.within(fromMs, toMs));
    const backend = await selectBackend(config, log, (chosen) => measureCompletions(chosen, turns));
    armFaults(process.env.VMMD_FAULTS, log);
    const access = new AccessPolicy(config);
    const transportBudgets = new TransportBudgets(
      {
        serverStreamsPerUid: config.maxServerStreamsPerUid,
        clientStreamsPerUid: config.maxClientStreamsPerUid,
        streamBytesInFlight: Number(config.streamBytesInFlight),
        connectionsPerUid: config.maxConnectionsPerUid,
        unreadDescriptorsPerSession: config.maxUnreadDescriptorsPerSession,
        unreadDescriptorsPerUid: config.maxUnreadDescriptorsPerUid,
        stagingBytesPerUid: Number(config.maxStagingBytesPerUid),
      },
      descriptors,
    );
    const sessions = new SessionManager(log, {
      budgets: transportBudgets,
      ...sessionOptions,
      capabilities: toWireCapabilities(backend.capabilities),
      transferWaitMs: config.transferWaitMs,
      maxSessionsPerUid: config.maxSessionsPerUid,
      maxTransfersPerUid: config.maxTransfersPerUid,
      authorize: (peer) => access.refusal(peer),
      resumable: lifecycle.parks,
    });
    const quotas = new Quotas({ perUid: config.quotaPerUid, perSession: config.quotaPerSession }, (session) => sessions.uidOf(session));
    // The daemon's objects (made without a session, or left by an ended one) are acted on by admins' sessions only,
    // besides the daemon itself and store holders on their stores' memory.
    const actsForDaemon = (caller: bigint) => {
      if (isStoreHolder(caller)) return true;
      const peer = sessions.peerOf(caller);
      return peer !== undefined && access.isAdmin(peer);
    };
    const budgets = uidBudgets(config, systemLimits(log), (session) => sessions.uidOf(session), log);
    // The allocation source, RMM's way: each policy one adaptor around its upstream. Statistics count what the backend
    // makes and adopts, quotas charge it (SYSMEM stores' memfds too), the lifecycle parks what is made, the per-uid budget counts allocations.
    const statistics = new AllocationStatistics(new BackendSource(backend));
    const charged = lifecycle.adapt(quotas.around(statistics, (handle, device) => backend.memoryIdentity(handle, device)));
    const registry = new Registry(backend, { source: new AllocationBudget(budgets, charged), statistics }, actsForDaemon, budgets);
    // Metrics and GetReport show the registry's budgets and the transport's alike.
    const everyBudget = () => [...budgets.list(), registry.referee.waitingPerUid, ...transportBudgets.all()];
    const paths = socketPaths(config.socketDir);
    const previousMode = prepareSocketDir(config);
    if (previousMode !== undefined) {
      log.warn(
        { socketDir: config.socketDir, was: previousMode.toString(8), now: config.socketGroup === undefined ? '700' : '750' },
        'socket directory mode corrected',
      );
    }
    // The protos and their reflection are read before a take-over, not in the gap while no daemon serves.
    const { proto } = loadProtos();
    const reflection = new ReflectionService(reflectedDefinition());
    // Taking over: the running daemon stops serving and hands everything over; its sockets are gone once it has.
    const takeOverStarted = process.hrtime.bigint();
    const taken = config.takeOver ? await takeOver(config.socketDir, VERSION, config.shutdownGraceMs + TAKE_OVER_SLACK_MS, log) : undefined;
    try {
      if (taken !== undefined) lifecycle.takeOver(taken.descriptors);
      clearStaleSockets(paths);
    } catch (error) {
      taken?.abandon();
      throw error;
    }

    const stores = new StoreRegistry(registry, log);
    // On cuda the staging buffers are page-locked: staged Read and Write are DMAs of the copy engine, not CPU copies.
    // A client can open staging buffers at will: their warnings are bounded (one per interval, the next saying how many were held back).
    const stagingWarnings = new LogLimiter();
    const staging = new StagingBuffers(backend.capabilities.gpuMemory ? CUDA_STAGING_PINNING : undefined, (message) => {
      const allowed = stagingWarnings.allow('staging');
      if (allowed !== undefined) log.warn({ heldBack: allowed.suppressed }, message);
    });
    // A start that fails once the sockets exist (a metrics port in use, say) closes what it opened and removes them.
    let started: Daemon | undefined;
    const undo: Array<() => void> = [];
    try {
      // The session socket's requests go straight to the registry; a closed session's stores and staging go before its objects.
      // What an earlier process of the daemon parked comes back before anyone can ask for it.
      await lifecycle.restore({ registry, stores, backend, sessions }, config.parkedGraceMs);
      const metrics = new Metrics(registry, () => sessions, stores, { version: VERSION, backend: backend.name }, turns, everyBudget);
      undo.push(() => metrics.close());
      // Busy polling and the delay sampler run only while a client is connected: an idle daemon sleeps.
      // Made once the gRPC services are (below); the activity callback may run before that.
      // eslint-disable-next-line prefer-const
      let admin: AdminService | undefined;
      let serving = false;
      const activity = new ClientActivity((active) => {
        if (serving) busyPollAlways(active ? config.busyPollMicros : 0);
        admin?.sampleLoopDelay(active);
      });
      const vmm = new VirtualMemoryService(registry, sessions, staging, transportBudgets);
      const storesService = new StoresService(registry, stores, sessions);
      sessions.listen(
        paths.session,
        new SessionDispatcher({
          registry,
          // The RPCs' own methods: the socket's requests differ only in how their answer travels.
          methods: {
            allocate: (request, context) => vmm.allocate(request, context),
            release: (request, context) => vmm.release(request, context),
            share: (request, context) => vmm.share(request, context),
            export: (request, context) => vmm.export(request, context),
            open: (request, context) => storesService.open(request, context),
          },
          reclaimers: [(session) => stores.reclaim(session), (session) => staging.close(session)],
          check: (session, method) => access.checkSession(method, session),
          who: (session) => access.sessionCaller(session),
        }),
        {
          observe: (method, status, code, seconds) => metrics.observe('vmmd.session', method, status, code, seconds),
          turns,
          connected: () => activity.enter(),
        },
      );

      // grpc-js's own log goes through pino, at the daemon's level.
      grpc.setLogger({
        error: (...args: unknown[]) => log.child({ component: 'grpc-js' }).warn(args.map(String).join(' ')),
      });
      grpc.setLogVerbosity(log.isLevelEnabled('debug') ? grpc.logVerbosity.DEBUG : grpc.logVerbosity.ERROR);
      const health = new HealthImplementation(Object.fromEntries(HEALTH_SERVICES.map((name) => [name, 'NOT_SERVING'])));
      // One uid's pipelined calls start in turns with every other uid's, across the services.
      const fair = new FairCalls();
      // Each service's calls are counted under its full name: Read and List exist in two services.
      const depsOf = (service: string): HandlerDeps => ({
        sessions,
        access,
        streamStallMs: config.streamStallMs,
        budgets: transportBudgets,
        fair,
        log,
        observe: (method, status, code, seconds) => metrics.observe(service, method, status, code, seconds),
        streams: (method, delta) => metrics.stream(service, method, delta),
        moved: (method, direction, bytes) => metrics.bytesMoved(service, method, direction, bytes),
        turns,
      });
      const devices = new DevicesService(registry);
      admin = new AdminService({ registry, sessions, stores, quotas, metrics, version: VERSION, turns, gcPauses: gcPauses.start(), budgets: everyBudget });
      admin.sampleLoopDelay(activity.active);
      // A start that fails from here on stops its delay sampler and GC observer too.
      undo.push(() => admin?.close());
      const adminService = admin;
      const addServices = (server: grpc.Server) => {
        // grpcurl's view: reflection (v1 and v1alpha) over the vmmd protos and health.
        reflection.addToServer(server);
        health.addToServer(server);
        devices.addToServer(server, proto, depsOf('vmmd.v1.Devices'));
        vmm.addToServer(server, proto, depsOf('vmmd.v1.VirtualMemory'));
        storesService.addToServer(server, proto, depsOf('vmmd.v1.Stores'));
        adminService.addToServer(server, proto, depsOf('vmmd.v1.Admin'));
      };
      const listeners = await openGrpc({ config, log, paths, budgets: transportBudgets, activity, health, metrics, addServices, undo });
      for (const name of HEALTH_SERVICES) health.setStatus(name, 'SERVING');
      // From now on, while a client is connected, the loop spins a little before it sleeps: its next message finds it awake.
      serving = true;
      undo.push(() => activity.stop());
      if (activity.active) busyPollAlways(config.busyPollMicros);
      // And a turn past 2 ms, which holds up every session's next message, is said (at most a line per 10 s);
      // not before: the start's own turns (the first driver calls make the CUDA context, tens of milliseconds) keep no one waiting.
      const longTurns = new LogLimiter();
      turns.onLong = (turn) => {
        const allowed = longTurns.allow('long turn');
        if (allowed !== undefined)
          log.warn(
            { turn, heldBack: allowed.suppressed },
            `a turn of the event loop ran ${(turn.cpuMs ?? turn.wallMs).toFixed(2)} ms${turn.cpuMs === undefined ? '' : ' of CPU'}: ${turn.kind} ${turn.what ?? ''}`.trimEnd(),
          );
      };
      log.info({ backend: backend.name, socketDir: config.socketDir, devices: registry.devices.length, version: VERSION }, 'vmmd serving');
      started = new Daemon(
        config,
        backend,
        registry,
        sessions,
        listeners,
        addServices,
        log,
        paths,
        admin,
        health,
        metrics,
        transportBudgets,
        activity,
        lifecycle,
      );
    } finally {
      if (started === undefined) {
        // The daemon taken over keeps everything: it is told by the closed connection.
        taken?.abandon();
        for (const step of undo) step();
        await sessions.close().catch(() => undefined);
        for (const path of [paths.grpc, paths.session]) fs.rmSync(path, { force: true });
        await backend.close();
      }
    }
    if (taken !== undefined) {
      await taken.done();
      log.info({ from: taken.from, ms: Number(process.hrtime.bigint() - takeOverStarted) / 1e6 }, 'took over: serving in place of the daemon before');
    }
    // Under a service manager's store (systemd, vmmd's keeper) the memory is the store's: the keeper answers take-overs, systemd restarts.
    if (!lifecycle.outlivesProcess) started.listenForHandOver();
    return started;
  }

  /** Resolves once this daemon has handed everything to a successor (`vmmd --take-over`): it has stopped and should exit. */
  get handedOver(): Promise<void> {
    return this.handOver.promise;
  }

  private listenForHandOver(): void {
    const side: HandOverSide = {
      refusal: () => this.lifecycle.handOverRefusal(),
      quiesce: () => (this.stopped ??= this.quiesce(true)),
      held: () => this.lifecycle.held(),
      handedOver: () => void this.finish().then(() => this.handOver.resolve()),
      resumeServing: () =>
        this.serveAgain().catch((error: Error) => {
          this.log.error({ err: error }, 'serving again failed: this daemon holds every descriptor and record for the next take-over');
          throw error;
        }),
    };
    this.handOverListener = HandOverListener.listen(this.config.socketDir, side, this.log, this.config.shutdownGraceMs);
  }

  /** Stops serving: refuses new calls, lets in-flight ones finish, reclaims every session (parks them where memory outlives the process). */
  async stop(graceMs = this.config.shutdownGraceMs): Promise<void> {
    this.log.info('vmmd stopping');
    this.handOverListener?.close();
    this.stopped ??= this.quiesce(this.lifecycle.outlivesProcess, graceMs);
    await this.stopped;
    await this.finish();
  }

  /**
   * Stops accepting and lets the calls in flight finish (gRPC within
   * `graceMs`); then either parks every session (their calls answered, their
   * records parked, each waiting for its client in the next daemon) or closes
   * and reclaims them; then freezes the parked state: what this process does
   * from here on changes nothing parked. Parking comes before the freeze, so
   * that what a call in flight made is parked with it.
   */
  private async quiesce(park: boolean, graceMs = this.config.shutdownGraceMs): Promise<void> {
    this.activity.stop();
    busyPollAlways(0);
    for (const name of HEALTH_SERVICES) this.health.setStatus(name, 'NOT_SERVING');
    const { server, unix, healthServer } = this.listeners;
    const drained = new Promise<void>((resolve) => server.tryShutdown(() => resolve()));
    const timeout = new Promise<void>((resolve) => setTimeout(resolve, graceMs).unref());
    await Promise.race([drained, timeout]);
    server.forceShutdown();
    unix.close();
    healthServer.forceShutdown();
    this.metrics.close();
    // Where memory is parked, the sessions are too: their calls in flight finish, are recorded and answered, and
    // each waits for its client in the next daemon or the successor; else they end and are reclaimed. Recording
    // stops only after that drain: an allocation answered after the freeze would be one its client holds and the
    // next daemon does not know.
    if (park) this.parkedSessions = await this.sessions.park();
    // The parked memory stays for the next start or the successor: a reclaim from here on frees only this process's hold of it.
    this.lifecycle.freeze();
    if (!park) await this.sessions.close();
    for (const path of [this.paths.grpc, this.paths.session]) fs.rmSync(path, { force: true });
  }

  /**
   * Serves again after the quiesce for a successor that went away before it
   * served (killed, or failed to start): this process still holds everything,
   * unchanged since the freeze. Recording goes on, the parked sessions wait
   * for their clients here as after a restart, and the sockets open anew. A
   * failure quiesces again: everything stays held for the next take-over.
   * @throws DaemonStartError when a daemon answers on the socket directory (the successor serves after all), or the bind's error
   */
  private async serveAgain(): Promise<void> {
    clearStaleSockets(this.paths);
    const undo: Array<() => void> = [];
    try {
      this.lifecycle.thaw();
      this.sessions.reopen(this.paths.session, this.parkedSessions.splice(0), this.config.parkedGraceMs);
      const log = this.log;
      const deps = { config: this.config, log, paths: this.paths, budgets: this.transportBudgets, activity: this.activity };
      this.listeners = await openGrpc({ ...deps, health: this.health, metrics: this.metrics, addServices: this.addServices, undo });
    } catch (error) {
      for (const step of undo) step();
      this.parkedSessions = await this.sessions.park();
      this.lifecycle.freeze();
      for (const path of [this.paths.grpc, this.paths.session]) fs.rmSync(path, { force: true });
      throw error;
    }
    for (const name of HEALTH_SERVICES) this.health.setStatus(name, 'SERVING');
    this.activity.start();
    if (this.activity.active) busyPollAlways(this.config.busyPollMicros);
    this.stopped = undefined;
    this.log.info({ waiting: this.sessions.waitingCount }, 'vmmd serving again: its successor went away before it served');
  }

  /** What is left once stopped: the backend, the admin's samplers, the descriptors held in this process. */
  private async finish(): Promise<void> {
    await this.backend.close();
    this.admin.close();
    this.lifecycle.releaseHeld();
    this.log.info('vmmd stopped');
  }
}

/** Beyond the shutdown grace, how long a take-over waits for the running daemon to send everything. */
const TAKE_OVER_SLACK_MS = 30_000;

/** What the kernel allows the daemon's process: read once at start (the budgets' defaults derive from it). */
function systemLimits(log: Logger): SystemLimits {
  let maxMapCount = DEFAULT_MAX_MAP_COUNT;
  try {
    maxMapCount = Number(fs.readFileSync('/proc/sys/vm/max_map_count', 'utf8').trim()) || DEFAULT_MAX_MAP_COUNT;
  } catch (error) {
    log.warn({ err: error, assumed: maxMapCount }, 'cannot read vm.max_map_count; assuming the kernel default');
  }
  return { maxMapCount, descriptors: addon.descriptorLimit().soft };
}

/** The kernel's default vm.max_map_count. */
const DEFAULT_MAX_MAP_COUNT = 65_530;

/** The per-uid budgets: each as configured, else derived from the system's limits; logged once. */
function uidBudgets(config: DaemonConfig, system: SystemLimits, uidOf: (session: bigint) => number | undefined, log: Logger): UidBudgets {
  const derived = derivedLimits(system);
  const limits: UidBudgetLimits = {
    mappingsPerUid: config.maxMappingsPerUid ?? derived.perUid.mappingsPerUid,
    reservationsPerUid: config.maxReservationsPerUid ?? derived.perUid.reservationsPerUid,
    addressSpacePerUid: config.maxAddressSpacePerUid === undefined ? derived.perUid.addressSpacePerUid : Number(config.maxAddressSpacePerUid),
    storesPerUid: config.maxStoresPerUid ?? derived.perUid.storesPerUid,
    allocationsPerUid: config.maxAllocationsPerUid ?? derived.perUid.allocationsPerUid,
  };
  log.info({ perUid: limits, clientsTogether: derived.totals, system }, 'budgets');
  return new UidBudgets(limits, derived.totals, uidOf);
}

/**
 * Raises the soft RLIMIT_NOFILE to the hard one: the daemon holds a
 * descriptor per session and per unclaimed transfer, and the usual soft
 * default (1024) is far below what the hard limit allows. Returns the limit
 * now (infinite when unknown): the transport's daemon-wide budgets are a share of it.
 */
function raiseDescriptorLimit(log: Logger): number {
  let soft = Number.POSITIVE_INFINITY;
  try {
    const limit = addon.descriptorLimit();
    soft = limit.soft;
    if (limit.soft < limit.hard) soft = addon.descriptorLimit(limit.hard).soft;
    log.info({ descriptors: soft, was: limit.soft }, 'descriptor limit');
  } catch (error) {
    log.warn({ err: error }, 'cannot raise the descriptor limit; keeping it');
  }
  return soft;
}

/**
 * Fault injection (tests only; native/src/faults.h): the plan was checked when
 * the addon loaded, and counts restart here, once the backend is open, so that
 * "the N-th call" means the N-th call made for requests, whatever the device
 * and fabric probes at start called.
 */
function armFaults(plan: string | undefined, log: Logger): void {
  if (plan === undefined || plan === '') return;
  addon.faultsSet(plan);
  log.warn({ faults: plan }, 'fault injection armed (VMMD_FAULTS): these calls will fail on purpose');
}
