/** The Admin service: what the daemon holds, for operators and tests. */
import * as grpc from '@grpc/grpc-js';
import { IntervalHistogram, monitorEventLoopDelay } from 'node:perf_hooks';
import type { GetStatsRequest__Output } from '../../generated/vmmd/v1/GetStatsRequest';
import type { Stats } from '../../generated/vmmd/v1/Stats';
import type { VmmdProto } from '../../common/proto';
import type { Registry } from '../registry';
import type { SessionManager } from '../sessions';
import { HandlerDeps, unary } from './handler';

export class AdminService {
  // Samples the event loop every millisecond: a stall shows as delay here.
  private readonly loopDelay: IntervalHistogram = monitorEventLoopDelay({ resolution: 1 });

  constructor(
    private readonly registry: Registry,
    private readonly sessions: SessionManager,
    private readonly version: string,
  ) {
    this.loopDelay.enable();
  }

  getStats(request?: GetStatsRequest__Output): Stats {
    const stats = this.registry.stats();
    const result: Stats = {
      sessions: this.sessions.count,
      reservations: String(stats.reservations),
      allocations: String(stats.allocations),
      mappings: String(stats.mappings),
      reservedBytes: String(stats.reservedBytes),
      allocatedBytes: String(stats.allocatedBytes),
      importedBytes: String(stats.importedBytes),
      mappedBytes: String(stats.mappedBytes),
      pendingTransfers: this.sessions.pendingTransfers(),
      backend: this.registry.backend.name,
      version: this.version,
      eventLoopDelayMaxUs: String(Math.round(this.loopDelay.max / 1000)),
      eventLoopDelayP99Us: String(Math.round(this.loopDelay.percentile(99) / 1000)),
    };
    if (request?.resetEventLoopDelay) this.loopDelay.reset();
    return result;
  }

  close(): void {
    this.loopDelay.disable();
  }

  addToServer(server: grpc.Server, proto: VmmdProto, deps: HandlerDeps): void {
    server.addService(proto.vmmd.v1.Admin.service, {
      GetStats: unary(deps, 'GetStats', (request: GetStatsRequest__Output) => this.getStats(request)),
    });
  }
}
