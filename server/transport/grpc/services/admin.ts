/** The Admin service: what the daemon holds and runs, for operators, vmmctl and tests. */
import * as grpc from '@grpc/grpc-js';
import { IntervalHistogram, monitorEventLoopDelay } from 'node:perf_hooks';
import type { ClearCachesResponse } from '../../../../generated/vmmd/v1/ClearCachesResponse';
import { StockedBackend } from '../../../backends/stock';
import type { GetStatsRequest__Output } from '../../../../generated/vmmd/v1/GetStatsRequest';
import type { ListObjectsRequest__Output } from '../../../../generated/vmmd/v1/ListObjectsRequest';
import type { ListObjectsResponse } from '../../../../generated/vmmd/v1/ListObjectsResponse';
import type { ListSessionsResponse } from '../../../../generated/vmmd/v1/ListSessionsResponse';
import type { ObjectInfo } from '../../../../generated/vmmd/v1/ObjectInfo';
import type { Report } from '../../../../generated/vmmd/v1/Report';
import type { Stats } from '../../../../generated/vmmd/v1/Stats';
import type { VersionInfo } from '../../../../generated/vmmd/v1/VersionInfo';
import type { VmmdProto } from '../../../../common/proto';
import type { Metrics } from '../../../observability/metrics';
import type { Quotas } from '../../../registry/quotas';
import type { Budget } from '../../../registry/budgets';
import type { Registry } from '../../../registry';
import type { SessionManager } from '../../session/sessions';
import type { StoreRegistry } from '../../../stores/stores';
import type { Session } from '../../session/sessions';
import type { GcPauses } from '../../../observability/gc-pauses';
import type { TurnMeter } from '../../../observability/turns';
import { CallContext, HandlerDeps, unary } from './handler';
import { u64 } from '../../wire';

// Written by scripts/gen-types.js at build time; tsc copies it beside the compiled code.
import BUILD from '../../../../generated/build-info.json';

export interface AdminDeps {
  registry: Registry;
  sessions: SessionManager;
  stores: StoreRegistry;
  quotas: Quotas;
  metrics: Metrics;
  version: string;
  /** The daemon's own turns (server/observability/turns.ts), reported and reset with the event-loop delay. */
  turns?: TurnMeter;
  /** The collector's pauses (server/observability/gc-pauses.ts), the same way; stopped with this service. */
  gcPauses?: GcPauses;
  /** Every budget the daemon keeps (server/registry/budgets.ts): the report shows each holder's use. */
  budgets?: () => Iterable<Budget>;
}

export class AdminService {
  // Samples the event loop every millisecond while a client is connected (sampleLoopDelay): a stall shows as delay here.
  // Its timer wakes the loop a thousand times a second, which an idle daemon has no reason to pay.
  private readonly loopDelay: IntervalHistogram = monitorEventLoopDelay({ resolution: 1 });

  constructor(private readonly deps: AdminDeps) {}

  /** Starts (true) or stops (false) sampling the event loop's delay; the histogram keeps what it has. */
  sampleLoopDelay(on: boolean): void {
    if (on) this.loopDelay.enable();
    else this.loopDelay.disable();
  }

  getStats(request?: GetStatsRequest__Output): Stats {
    const { registry, sessions } = this.deps;
    const stats = registry.stats();
    const result: Stats = {
      sessions: sessions.count,
      reservations: String(stats.reservations),
      allocations: String(stats.allocations),
      mappings: String(stats.mappings),
      reservedBytes: String(stats.reservedBytes),
      allocatedBytes: String(stats.allocatedBytes),
      importedBytes: String(stats.importedBytes),
      mappedBytes: String(stats.mappedBytes),
      pendingTransfers: sessions.pendingTransfers(),
      backend: registry.backend.name,
      version: this.deps.version,
      eventLoopDelayMaxUs: String(Math.round(this.loopDelay.max / 1000)),
      eventLoopDelayP99Us: String(Math.round(this.loopDelay.percentile(99) / 1000)),
      rssBytes: String(process.memoryUsage.rss()),
      heapUsedBytes: String(process.memoryUsage().heapUsed),
    };
    const turns = this.deps.turns?.snapshot();
    if (turns !== undefined) {
      result.eventLoopTurnMaxUs = String(turns.maxUs);
      result.eventLoopTurnP99Us = String(turns.p99Us);
      result.eventLoopTurns = String(turns.count);
      result.eventLoopTurnCpuMaxUs = String(turns.cpuMaxUs);
      result.eventLoopTurnCpuP99Us = String(turns.cpuP99Us);
      result.eventLoopTurnCpuMaxKind = turns.cpuMaxKind ?? '';
      result.eventLoopTurnCpuMaxWhat = turns.cpuMaxWhat ?? '';
      result.eventLoopTurnMaxGcUs = String(turns.maxGcUs);
      result.eventLoopTurnCpuMaxGcUs = String(turns.cpuMaxGcUs);
    }
    const pauses = this.deps.gcPauses?.snapshot();
    if (pauses !== undefined) {
      result.gcPauses = String(pauses.count);
      result.gcPauseMaxUs = String(Math.round(pauses.maxMs * 1000));
    }
    if (request?.resetEventLoopDelay) {
      this.loopDelay.reset();
      this.deps.turns?.reset();
      this.deps.gcPauses?.reset();
    }
    return result;
  }

  /** The sessions a caller may see: every one for an admin, else its own uid's. */
  private visibleSessions(context?: CallContext): Session[] {
    const who = context?.who;
    const all = this.deps.sessions.list();
    if (who === undefined || who.admin) return all;
    return all.filter((session) => who.peer !== undefined && session.peer.uid === who.peer.uid);
  }

  listSessions(context?: CallContext): ListSessionsResponse {
    const snapshot = this.deps.registry.snapshot();
    return {
      sessions: this.visibleSessions(context).map((session) => {
        const owned = snapshot.allocations.filter((allocation) => allocation.owner === String(session.id));
        return {
          id: String(session.id),
          pid: session.peer.pid,
          uid: session.peer.uid,
          gid: session.peer.gid,
          command: session.process.command,
          cgroup: session.process.cgroup,
          callsInFlight: session.inFlightCalls,
          pendingTransfers: session.inbox.held,
          allocations: String(owned.length),
          allocatedBytes: String(owned.reduce((total, allocation) => total + BigInt(allocation.size), 0n)),
          reservations: String(snapshot.reservations.filter((reservation) => reservation.owner === String(session.id)).length),
          closing: session.closing,
        };
      }),
    };
  }

  /** Objects by owner; a caller who is not an admin sees only those of its own uid's sessions. */
  listObjects(request: ListObjectsRequest__Output, context?: CallContext): ListObjectsResponse {
    const only = u64(request.ownerSession);
    const mine = context?.who === undefined || context.who.admin ? undefined : new Set(this.visibleSessions(context).map((session) => String(session.id)));
    const wanted = (owner: string) => (only === 0n || owner === String(only)) && (mine === undefined || mine.has(owner));
    const snapshot = this.deps.registry.snapshot();
    const objects: ObjectInfo[] = [];
    for (const reservation of snapshot.reservations) {
      if (!wanted(reservation.owner)) continue;
      objects.push({
        kind: 'reservation',
        id: reservation.id,
        ownerSession: reservation.owner,
        size: reservation.size,
        address: String(BigInt(reservation.address)),
        allocationId: '0',
        detail: '',
      });
      for (const mapping of reservation.mappings) {
        objects.push({
          kind: 'mapping',
          id: '0',
          ownerSession: reservation.owner,
          size: mapping.size,
          address: String(BigInt(mapping.address)),
          allocationId: mapping.allocation,
          detail: Object.entries(mapping.access)
            .map(([location, flags]) => `${location}=${flags === 3 ? 'rw' : 'r'}`)
            .join(' '),
        });
      }
    }
    for (const allocation of snapshot.allocations) {
      if (!wanted(allocation.owner)) continue;
      const record = this.deps.registry.allocation(BigInt(allocation.id));
      objects.push({
        kind: 'allocation',
        id: allocation.id,
        ownerSession: allocation.owner,
        size: allocation.size,
        address: '0',
        allocationId: allocation.id,
        detail: `${record.location.type}:${record.location.id} refs=${this.deps.registry.referenceCount(record)} mappings=${allocation.mappingCount}${allocation.imported ? ' imported' : ''}${allocation.shared ? ' shared' : ''}`,
      });
    }
    for (const store of this.deps.stores.list()) {
      if (!wanted(String(store.owner))) continue;
      objects.push({
        kind: 'store',
        id: String(store.id),
        ownerSession: String(store.owner),
        size: String(store.size),
        address: '0',
        allocationId: String(store.memory.allocationId),
        detail: `${store.name === '' ? '(anonymous)' : JSON.stringify(store.name)} ${store.target.toLowerCase()} ${store.state.toLowerCase()}${store.readOnly ? ' read-only' : ''}`,
      });
    }
    return { objects };
  }

  clearCaches(): ClearCachesResponse {
    return { transfersClosed: this.deps.sessions.closePendingTransfers() };
  }

  getVersion(): VersionInfo {
    return {
      version: this.deps.version,
      commit: BUILD.commit,
      node: process.version,
      napi: process.versions.napi ?? '',
      backend: this.deps.registry.backend.name,
      platform: `${process.platform}-${process.arch}`,
    };
  }

  getReport(): Report {
    const { registry } = this.deps;
    const bytesByOwner: Record<string, string> = {};
    for (const allocation of registry.snapshot().allocations) {
      const key = allocation.owner === '0' ? 'daemon' : `session ${allocation.owner}`;
      bytesByOwner[key] = String(BigInt(bytesByOwner[key] ?? 0) + BigInt(allocation.size));
    }
    const calls = Object.fromEntries([...this.deps.metrics.calls].map(([method, byStatus]) => [method, Object.fromEntries(byStatus)]));
    const report = {
      version: this.getVersion(),
      stats: this.getStats(),
      devices: registry.devices.map((device) => ({
        ...device,
        totalBytes: String(device.totalBytes),
        granularityMinimum: String(device.granularityMinimum),
        granularityRecommended: String(device.granularityRecommended),
      })),
      sessions: this.listSessions().sessions,
      objects: this.listObjects({ ownerSession: '0' }).objects,
      bytesByOwner,
      quotas: this.deps.quotas.used(),
      quotaRefusals: this.deps.quotas.refusals,
      budgets: Object.fromEntries(
        [...(this.deps.budgets?.() ?? [])].map((budget) => [
          budget.name,
          { limit: budget.limit, used: Object.fromEntries([...budget.holders()].map(([holder, used]) => [String(holder), used])) },
        ]),
      ),
      calls,
      stock: registry.backend instanceof StockedBackend ? registry.backend.stats() : null,
    };
    return { json: JSON.stringify(report, null, 2) };
  }

  close(): void {
    this.loopDelay.disable();
    this.deps.gcPauses?.stop();
  }

  addToServer(server: grpc.Server, proto: VmmdProto, deps: HandlerDeps): void {
    server.addService(proto.vmmd.v1.Admin.service, {
      GetStats: unary(deps, 'GetStats', (request: GetStatsRequest__Output) => this.getStats(request)),
      GetReport: unary(deps, 'GetReport', () => this.getReport()),
      ListSessions: unary(deps, 'ListSessions', (_request: object, context) => this.listSessions(context)),
      ListObjects: unary(deps, 'ListObjects', (request: ListObjectsRequest__Output, context) => this.listObjects(request, context)),
      ClearCaches: unary(deps, 'ClearCaches', () => this.clearCaches()),
      GetVersion: unary(deps, 'GetVersion', () => this.getVersion()),
    });
  }
}
