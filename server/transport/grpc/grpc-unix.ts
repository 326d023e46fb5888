/**
 * The gRPC Unix socket, accepted by the daemon itself so that every
 * connection is attributed to its peer: SO_PEERCRED is read on each accepted
 * socket and written into the socket's remote address, which grpc-js reports
 * as each call's peer (server/transport/grpc/access.ts reads it back). grpc-js serves the
 * connections through a connection injector (Server.createConnectionInjector).
 */
import * as grpc from '@grpc/grpc-js';
import * as net from 'node:net';
import type { Logger } from 'pino';
import { addon } from '../../../native';
import { LogLimiter } from '../../observability/log-limiter';
import { unixPeerAddress } from './access';
import type { Budget, Holder } from '../../registry/budgets';
import { DAEMON_HOLDER, TransportBudgets } from '../budgets';

/** How often a failing accept (EMFILE, ENFILE) is logged at most. */
const ACCEPT_ERROR_LOG_MS = 10_000;

export class GrpcUnixListener {
  private constructor(
    private readonly server: net.Server,
    private readonly injector: grpc.ConnectionInjector,
  ) {}

  /**
   * Listens on `path` and hands every attributed connection to `grpcServer`;
   * a connection past its uid's budget, or past every uid's share of the
   * daemon's descriptors, is closed at once; `connected` is told of each
   * connection it keeps, and what it returns is called once it closes.
   */
  static async listen(grpcServer: grpc.Server, path: string, log: Logger, budgets?: TransportBudgets, connected?: () => () => void): Promise<GrpcUnixListener> {
    const injector = grpcServer.createConnectionInjector(grpc.ServerCredentials.createInsecure());
    let lastErrorLog = 0;
    let suppressed = 0;
    // What a peer can make the daemon log is bounded: one line per uid and cause per 10 s.
    const refusals = new LogLimiter();
    const server = net.createServer({ allowHalfOpen: false, pauseOnConnect: false }, (socket) => {
      const fd = (socket as unknown as { _handle?: { fd?: number } })._handle?.fd;
      let address: string;
      let uid: number;
      try {
        if (fd === undefined || fd < 0) throw new Error('the accepted socket has no descriptor');
        const peer = addon.peerCredentials(fd);
        uid = peer.uid;
        address = unixPeerAddress(peer);
      } catch (error) {
        const allowed = refusals.allow('no credentials');
        if (allowed !== undefined) log.warn({ err: error, heldBack: allowed.suppressed }, 'a gRPC connection without readable peer credentials was closed');
        socket.destroy();
        return;
      }
      if (budgets !== undefined) {
        const counted: Array<[Budget, Holder]> = [
          [budgets.connections, uid],
          [budgets.allConnections, DAEMON_HOLDER],
        ];
        const full = counted.find(([budget, holder]) => !budget.fits(holder));
        if (full !== undefined) {
          const [budget, holder] = full;
          const allowed = refusals.allow(`connections:${uid}:${budget.name}`);
          if (allowed !== undefined)
            log.warn({ peerUid: uid, heldBack: allowed.suppressed }, `a gRPC connection was closed: ${budget.refusal(holder).message}`);
          socket.destroy();
          return;
        }
        budgets.connections.take(uid);
        budgets.allConnections.take(DAEMON_HOLDER);
        socket.once('close', () => {
          budgets.connections.give(uid);
          budgets.allConnections.give(DAEMON_HOLDER);
        });
      }
      // grpc-js reads the call's peer from the socket's remoteAddress (a Unix socket has none of its own).
      Object.defineProperty(socket, 'remoteAddress', { value: address, configurable: true });
      const left = connected?.();
      if (left !== undefined) socket.once('close', left);
      injector.injectConnection(socket);
    });
    // libuv already keeps a spare descriptor for EMFILE and closes waiting connections with it; this only keeps the log short.
    server.on('error', (error: NodeJS.ErrnoException) => {
      const now = Date.now();
      if (now - lastErrorLog < ACCEPT_ERROR_LOG_MS) {
        suppressed++;
        return;
      }
      log.warn({ err: error, suppressedSinceLast: suppressed }, 'cannot accept a gRPC connection (logged at most every 10 s)');
      lastErrorLog = now;
      suppressed = 0;
    });
    await new Promise<void>((resolve, reject) => {
      const failed = (error: Error) => reject(error);
      server.once('error', failed);
      server.listen(path, () => {
        server.off('error', failed);
        resolve();
      });
    });
    return new GrpcUnixListener(server, injector);
  }

  close(): void {
    this.server.close();
    this.injector.destroy();
  }
}
