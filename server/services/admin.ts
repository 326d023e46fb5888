/** The Admin service: what the daemon holds, for operators and tests. */
import * as grpc from '@grpc/grpc-js';
import type { Stats } from '../../generated/vmmd/v1/Stats';
import type { VmmdProto } from '../../common/proto';
import type { Registry } from '../registry';
import type { SessionManager } from '../sessions';
import { HandlerDeps, unary } from './handler';

export class AdminService {
  constructor(
    private readonly registry: Registry,
    private readonly sessions: SessionManager,
    private readonly version: string,
  ) {}

  getStats(): Stats {
    const stats = this.registry.stats();
    return {
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
    };
  }

  addToServer(server: grpc.Server, proto: VmmdProto, deps: HandlerDeps): void {
    server.addService(proto.vmmd.v1.Admin.service, {
      GetStats: unary(deps, 'GetStats', () => this.getStats()),
    });
  }
}
