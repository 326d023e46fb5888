/**
 * Prometheus metrics (prom-client), named by Prometheus conventions: one
 * prefix (vmmd_), base units in the name (_bytes, _seconds), counters ending in
 * _total, an info metric for the build. Served on --metrics-address
 * (127.0.0.1 by default) when --metrics-port is set. The same call counts feed
 * Admin.GetReport.
 */
import * as http from 'node:http';
import type { Logger } from 'pino';
import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry as MetricsRegistry } from 'prom-client';
import type { Registry } from '../registry';
import type { SessionManager } from '../transport/session/sessions';
import type { StoreRegistry } from '../stores/stores';
import type { TurnMeter } from './turns';
import type { Budget } from '../registry/budgets';
import { busyPollStats } from '../../native/busy-poll';

/** How often the event loop's delay is sampled for the Prometheus lag gauges, in milliseconds. */
const EVENT_LOOP_LAG_SAMPLE_MS = 100;

export interface MetricsInfo {
  version: string;
  backend: string;
}

/** "daemon" for objects the daemon owns, else the session id. */
const ownerLabel = (owner: string) => (owner === '0' ? 'daemon' : owner);

export class Metrics {
  readonly registry = new MetricsRegistry();
  private readonly rpcDuration: Histogram<'service' | 'method' | 'status'>;
  private readonly streamsActive: Gauge<'service' | 'method'>;
  private readonly streamsTotal: Counter<'service' | 'method'>;
  private readonly moved: Counter<'service' | 'method' | 'direction'>;
  private readonly exports: Counter;
  private readonly quotaRefusals: Counter;
  // Invariant: calls by method and status since start, for the report.
  readonly calls = new Map<string, Map<string, number>>();
  private server?: http.Server;

  /** @param budgets every budget the daemon keeps (server/registry/budgets.ts), each holder's use shown */
  constructor(
    registry: Registry,
    sessions: () => SessionManager,
    stores: StoreRegistry,
    info: MetricsInfo,
    turns?: TurnMeter,
    budgets: () => Iterable<Budget> = () => [],
  ) {
    // prom-client samples the loop's delay on a timer of its own for vmmd_nodejs_eventloop_lag_*: at its default
    // (every 10 ms) that timer alone wakes an idle daemon 100 times a second. GetStats has the fine-grained delay.
    collectDefaultMetrics({ register: this.registry, prefix: 'vmmd_', eventLoopMonitoringPrecision: EVENT_LOOP_LAG_SAMPLE_MS });
    // NOTE: prom-client names two gauges *_total (nodejs_active_{handles,requests,resources}_total), which
    // Prometheus reserves for counters; the same numbers are the sums of vmmd_nodejs_active_{handles,requests,resources}.
    for (const name of ['vmmd_nodejs_active_handles_total', 'vmmd_nodejs_active_requests_total', 'vmmd_nodejs_active_resources_total'])
      this.registry.removeSingleMetric(name);
    new Gauge({
      name: 'vmmd_build_info',
      help: 'Always 1; the labels say which vmmd runs: version, Node.js version and backend.',
      labelNames: ['version', 'node', 'backend'],
      registers: [this.registry],
    }).set({ version: info.version, node: process.version, backend: info.backend }, 1);
    // Busy polling (native/busy-poll.ts): what spinning before sleeping costs, and how often it met the next message awake.
    const spinning = (name: string, help: string, value: (stats: ReturnType<typeof busyPollStats>) => number) =>
      new Counter({
        name,
        help,
        registers: [this.registry],
        collect() {
          this.reset();
          this.inc(value(busyPollStats()));
        },
      });
    spinning(
      'vmmd_busy_poll_seconds_total',
      'CPU time the event loop spent spinning for the next message before sleeping (--busy-poll-us).',
      (stats) => stats.spunMicroseconds / 1e6,
    );
    spinning('vmmd_busy_poll_spins_total', 'Times the event loop spun before sleeping.', (stats) => stats.spins);
    spinning('vmmd_busy_poll_caught_total', 'Spins that met a message or a completion ready, the sleep and wake-up skipped.', (stats) => stats.caught);
    const labelNames = ['service', 'method'] as const;
    this.rpcDuration = new Histogram({
      name: 'vmmd_rpc_duration_seconds',
      help: 'Duration of calls (streams included, open to end), by service, method and status; session-socket requests count as service vmmd.session under the name of their RPC.',
      labelNames: [...labelNames, 'status'],
      buckets: [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5],
      registers: [this.registry],
    });
    if (turns !== undefined) {
      const turnSeconds = new Histogram({
        name: 'vmmd_event_loop_turn_seconds',
        help: "The daemon's own turns: how long its event loop ran without a break for one piece of its work, by where it entered (session: a session-socket message; grpc: a gRPC handler; completion: a native call's continuation), each with the microtasks it ran.",
        labelNames: ['kind'],
        buckets: [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1],
        registers: [this.registry],
      });
      const turnCpuSeconds = new Histogram({
        name: 'vmmd_event_loop_turn_cpu_seconds',
        help: "The same turns by the event-loop thread's own CPU time: without the time the OS had the thread off its CPU in the middle of a turn (a host whose cores are all busy).",
        labelNames: ['kind'],
        buckets: [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1],
        registers: [this.registry],
      });
      turns.observe = (kind, seconds, cpuSeconds) => {
        turnSeconds.observe({ kind }, seconds);
        if (cpuSeconds !== undefined) turnCpuSeconds.observe({ kind }, cpuSeconds);
      };
      new Gauge({
        name: 'vmmd_event_loop_turn_max_seconds',
        help: "The daemon's longest turn since start (vmmd_event_loop_turn_seconds' largest).",
        registers: [this.registry],
        collect() {
          this.set(turns.snapshot().longestUs / 1e6);
        },
      });
    }
    new Gauge({
      name: 'vmmd_budget_used',
      help: 'What each holder uses of each budget now (docs/OPERATIONS.md, Budgets): uid is the uid, or a holder of the budget\'s own ("all uids" for the daemon\'s totals); a holder that uses nothing is absent.',
      labelNames: ['budget', 'uid'],
      registers: [this.registry],
      collect() {
        this.reset();
        for (const budget of budgets()) for (const [holder, used] of budget.holders()) this.set({ budget: budget.name, uid: String(holder) }, used);
      },
    });
    new Gauge({
      name: 'vmmd_budget_limit',
      help: 'The most one holder may use of each budget (0: no limit).',
      labelNames: ['budget'],
      registers: [this.registry],
      collect() {
        this.reset();
        for (const budget of budgets()) this.set({ budget: budget.name }, budget.limit);
      },
    });
    this.streamsActive = new Gauge({ name: 'vmmd_rpc_streams_active', help: 'Streaming calls open now.', labelNames, registers: [this.registry] });
    this.streamsTotal = new Counter({ name: 'vmmd_rpc_streams_total', help: 'Streaming calls opened since start.', labelNames, registers: [this.registry] });
    this.moved = new Counter({
      name: 'vmmd_moved_bytes_total',
      help: 'Bytes moved through the daemon by Read and Write streams, staged copies, Fill and Copy; direction read is to the client.',
      labelNames: [...labelNames, 'direction'],
      registers: [this.registry],
    });
    this.exports = new Counter({ name: 'vmmd_exports_total', help: 'Descriptors handed to sessions (Export and Open).', registers: [this.registry] });
    this.quotaRefusals = new Counter({ name: 'vmmd_quota_refusals_total', help: 'Requests refused for a quota.', registers: [this.registry] });
    new Gauge({
      name: 'vmmd_allocated_peak_bytes',
      help: 'The most bytes of live allocations (created and imported) held at once since start.',
      registers: [this.registry],
      collect() {
        this.set(Number(registry.statistics.peakBytes()));
      },
    });
    new Gauge({
      name: 'vmmd_sessions',
      help: 'Open sessions.',
      registers: [this.registry],
      collect() {
        this.set(sessions().count);
      },
    });
    const deviceLabels = ['device', 'uuid', 'name'] as const;
    const deviceGauge = (name: string, help: string, value: (memory: { totalBytes: bigint; freeBytes: bigint }) => bigint) =>
      new Gauge({
        name,
        help,
        labelNames: deviceLabels,
        registers: [this.registry],
        collect() {
          this.reset();
          for (const device of registry.devices) {
            const memory = registry.backend.memoryInfo(device.index);
            this.set(
              { device: String(device.index), uuid: device.uuid, name: device.name },
              Number(value({ totalBytes: BigInt(memory.totalBytes), freeBytes: BigInt(memory.freeBytes) })),
            );
          }
        },
      });
    deviceGauge('vmmd_device_memory_total_bytes', 'Memory of each device (host backend: its capacity), by index, UUID and name.', (m) => m.totalBytes);
    deviceGauge('vmmd_device_memory_free_bytes', 'Free memory of each device, as the driver (or the host backend) reports it.', (m) => m.freeBytes);
    deviceGauge(
      'vmmd_device_memory_used_bytes',
      'Used memory of each device: total minus free, by every process of the host.',
      (m) => m.totalBytes - m.freeBytes,
    );
    new Gauge({
      name: 'vmmd_memory_bytes',
      help: 'Bytes of live allocations, by device, owner kind and whether the daemon created or imported them.',
      labelNames: ['device', 'owner_kind', 'origin'],
      registers: [this.registry],
      collect() {
        this.reset();
        for (const allocation of registry.snapshot().allocations) {
          const record = registry.allocation(BigInt(allocation.id));
          this.inc(
            {
              device: String(record.device),
              owner_kind: allocation.owner === '0' ? 'daemon' : 'session',
              origin: allocation.imported ? 'imported' : 'created',
            },
            Number(allocation.size),
          );
        }
      },
    });
    /** Bytes of live allocations by owner: session id or "daemon". */
    const byOwner = () => {
      const bytes = new Map<string, number>();
      for (const allocation of registry.snapshot().allocations) bytes.set(allocation.owner, (bytes.get(allocation.owner) ?? 0) + Number(allocation.size));
      return bytes;
    };
    new Gauge({
      name: 'vmmd_session_allocated_bytes',
      help: 'Bytes of live allocations each open session holds (session "daemon": handed over or made without a session), with the peer uid and pid.',
      labelNames: ['session', 'uid', 'pid'],
      registers: [this.registry],
      collect() {
        this.reset();
        const bytes = byOwner();
        for (const session of sessions().list()) {
          this.set({ session: String(session.id), uid: String(session.peer.uid), pid: String(session.peer.pid) }, bytes.get(String(session.id)) ?? 0);
        }
        this.set({ session: 'daemon', uid: '', pid: '' }, bytes.get('0') ?? 0);
      },
    });
    new Gauge({
      name: 'vmmd_uid_allocated_bytes',
      help: 'Bytes of live allocations held by the sessions of each uid (what --quota-per-uid limits).',
      labelNames: ['uid'],
      registers: [this.registry],
      collect() {
        this.reset();
        const bytes = byOwner();
        for (const session of sessions().list()) this.inc({ uid: String(session.peer.uid) }, bytes.get(String(session.id)) ?? 0);
      },
    });
    new Gauge({
      name: 'vmmd_uid_location_bytes',
      help: 'Bytes of live allocations held by the sessions of each uid, by where the memory lives (DEVICE:n, HOST_NUMA:n): what a sleeping process offloaded to host memory shows here.',
      labelNames: ['uid', 'location'],
      registers: [this.registry],
      collect() {
        this.reset();
        const uids = new Map(
          sessions()
            .list()
            .map((session) => [session.id, session.peer.uid]),
        );
        for (const allocation of registry.allocations.all()) {
          const uid = uids.get(allocation.owner);
          if (uid !== undefined) this.inc({ uid: String(uid), location: `${allocation.location.type}:${allocation.location.id}` }, Number(allocation.size));
        }
      },
    });
    new Gauge({
      name: 'vmmd_allocate_all_waiting',
      help: 'AllocateAll requests (wakes) waiting for their turn or their memory, or being served, by queue (a device, or host memory).',
      labelNames: ['queue'],
      registers: [this.registry],
      collect() {
        this.reset();
        for (const [queue, count] of registry.referee.stats().waiting) this.set({ queue }, count);
      },
    });
    new Counter({
      name: 'vmmd_allocate_all_total',
      help: 'AllocateAll requests answered since start, by outcome (served; out_of_memory at the deadline; abandoned: its session closed or its call was cancelled while it waited; refused for another rule).',
      labelNames: ['outcome'],
      registers: [this.registry],
      collect() {
        this.reset();
        for (const [outcome, count] of registry.referee.stats().outcomes) this.inc({ outcome }, count);
      },
    });
    new Gauge({
      name: 'vmmd_stores',
      help: 'Stores, by target, state and owner kind.',
      labelNames: ['target', 'state', 'owner_kind'],
      registers: [this.registry],
      collect() {
        this.reset();
        for (const store of stores.list())
          this.inc({
            target: String(store.target).toLowerCase(),
            state: String(store.state).toLowerCase(),
            owner_kind: store.owner === 0n ? 'daemon' : 'session',
          });
      },
    });
    new Gauge({
      name: 'vmmd_store_bytes',
      help: 'Bytes of stores not yet freed, by target and state.',
      labelNames: ['target', 'state'],
      registers: [this.registry],
      collect() {
        this.reset();
        for (const store of stores.list())
          this.inc({ target: String(store.target).toLowerCase(), state: String(store.state).toLowerCase() }, Number(store.size));
      },
    });
    new Gauge({
      name: 'vmmd_objects',
      help: 'Live objects, by kind and owner kind.',
      labelNames: ['kind', 'owner_kind'],
      registers: [this.registry],
      collect() {
        this.reset();
        const snapshot = registry.snapshot();
        const ownerKind = (owner: string) => (ownerLabel(owner) === 'daemon' ? 'daemon' : 'session');
        for (const reservation of snapshot.reservations) {
          this.inc({ kind: 'reservation', owner_kind: ownerKind(reservation.owner) });
          this.inc({ kind: 'mapping', owner_kind: ownerKind(reservation.owner) }, reservation.mappings.length);
        }
        for (const allocation of snapshot.allocations) this.inc({ kind: 'allocation', owner_kind: ownerKind(allocation.owner) });
        for (const store of stores.list()) this.inc({ kind: 'store', owner_kind: store.owner === 0n ? 'daemon' : 'session' });
      },
    });
  }

  /** Called by the handler wiring for every call, streams included. */
  observe(service: string, method: string, status: string, code: string | undefined, seconds: number): void {
    this.rpcDuration.observe({ service, method, status }, seconds);
    const byStatus = this.calls.get(method) ?? new Map<string, number>();
    byStatus.set(status, (byStatus.get(status) ?? 0) + 1);
    this.calls.set(method, byStatus);
    if (status === 'OK' && (method === 'Export' || method === 'Open')) this.exports.inc();
    if (code === 'QUOTA_EXCEEDED') this.quotaRefusals.inc();
  }

  /** A stream opened (+1) or ended (-1). */
  stream(service: string, method: string, delta: 1 | -1): void {
    this.streamsActive.inc({ service, method }, delta);
    if (delta === 1) this.streamsTotal.inc({ service, method });
  }

  /** Bytes a call moved, to the client (read) or into memory (write). */
  bytesMoved(service: string, method: string, direction: 'read' | 'write', bytes: number): void {
    if (bytes > 0) this.moved.inc({ service, method, direction }, bytes);
  }

  /** Serves /metrics on address:port. */
  serve(port: number, address: string, log: Logger): Promise<void> {
    this.server = http.createServer((request, response) => {
      if (request.url !== '/metrics') {
        response.writeHead(404).end('see /metrics\n');
        return;
      }
      this.registry.metrics().then(
        (text) => response.writeHead(200, { 'content-type': this.registry.contentType }).end(text),
        (error) => response.writeHead(500).end(String(error)),
      );
    });
    return new Promise((resolve, reject) => {
      this.server!.once('error', reject);
      this.server!.listen(port, address, () => {
        const url = `http://${address.includes(':') ? `[${address}]` : address}:${port}/metrics`;
        log.info({ port, address }, 'metrics on %s', url);
        resolve();
      });
    });
  }

  close(): void {
    this.server?.close();
  }
}
