/**
 * Prometheus metrics (prom-client), named by Prometheus conventions, served
 * on 127.0.0.1 only when --metrics-port is set. The same counters feed
 * Admin.GetReport.
 */
import * as http from 'node:http';
import type { Logger } from 'pino';
import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry as MetricsRegistry } from 'prom-client';
import type { Registry } from './registry';
import type { SessionManager } from './sessions';
import type { StoreRegistry } from './stores';

export class Metrics {
  readonly registry = new MetricsRegistry();
  private readonly rpcDuration: Histogram<'method' | 'status'>;
  private readonly exports: Counter;
  private readonly quotaRefusals: Counter;
  // Invariant: calls by method and status since start, for the report.
  readonly calls = new Map<string, Map<string, number>>();
  private server?: http.Server;

  constructor(registry: Registry, sessions: () => SessionManager, stores: StoreRegistry) {
    collectDefaultMetrics({ register: this.registry, prefix: 'vmmd_process_' });
    this.rpcDuration = new Histogram({
      name: 'vmmd_rpc_duration_seconds',
      help: 'Duration of gRPC calls, by method and status.',
      labelNames: ['method', 'status'],
      buckets: [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5],
      registers: [this.registry],
    });
    this.exports = new Counter({ name: 'vmmd_exports_total', help: 'Descriptors handed to sessions (Export and Open).', registers: [this.registry] });
    this.quotaRefusals = new Counter({ name: 'vmmd_quota_refusals_total', help: 'Requests refused for a quota.', registers: [this.registry] });
    new Gauge({
      name: 'vmmd_sessions',
      help: 'Open sessions.',
      registers: [this.registry],
      collect() {
        this.set(sessions().count);
      },
    });
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
            { device: String(record.device), owner_kind: allocation.owner === '0' ? 'daemon' : 'session', origin: allocation.imported ? 'imported' : 'created' },
            Number(allocation.size),
          );
        }
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
        const ownerKind = (owner: string) => (owner === '0' ? 'daemon' : 'session');
        for (const reservation of snapshot.reservations) {
          this.inc({ kind: 'reservation', owner_kind: ownerKind(reservation.owner) });
          this.inc({ kind: 'mapping', owner_kind: ownerKind(reservation.owner) }, reservation.mappings.length);
        }
        for (const allocation of snapshot.allocations) this.inc({ kind: 'allocation', owner_kind: ownerKind(allocation.owner) });
        for (const store of stores.list()) this.inc({ kind: 'store', owner_kind: store.owner === 0n ? 'daemon' : 'session' });
      },
    });
  }

  /** Called by the handler wiring for every call. */
  observe(method: string, status: string, code: string | undefined, seconds: number): void {
    this.rpcDuration.observe({ method, status }, seconds);
    const byStatus = this.calls.get(method) ?? new Map<string, number>();
    byStatus.set(status, (byStatus.get(status) ?? 0) + 1);
    this.calls.set(method, byStatus);
    if (status === 'OK' && (method === 'Export' || method === 'Open')) this.exports.inc();
    if (code === 'QUOTA_EXCEEDED') this.quotaRefusals.inc();
  }

  /** Serves /metrics on 127.0.0.1:port. */
  serve(port: number, log: Logger): Promise<void> {
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
      this.server!.listen(port, '127.0.0.1', () => {
        log.info({ port }, 'metrics on http://127.0.0.1:%d/metrics', port);
        resolve();
      });
    });
  }

  close(): void {
    this.server?.close();
  }
}
