/**
 * The transport's budgets: what one uid may make the daemon hold in its
 * connections and streams, and in descriptors sent but not yet read. Each is a
 * Budget (server/registry/budgets.ts) counted per uid (descriptors in flight
 * also per session, and daemon-wide against the kernel's own limit), shared
 * by the gRPC listener, the gRPC handlers and the session transport.
 */
import { DAEMON_SETTINGS } from '../../common/daemon-settings';
import { Budget, Holder } from '../registry/budgets';

export interface TransportLimits {
  /** Server streams (Read, Watch) one uid may have open at once. */
  serverStreamsPerUid: number;
  /** Client streams (Write) one uid may have open at once. */
  clientStreamsPerUid: number;
  /** Bytes a server stream hands grpc-js before its reader has taken them. */
  streamBytesInFlight: number;
  /** gRPC connections one uid may hold open at once on the Unix socket. */
  connectionsPerUid: number;
  /** Answers carrying a descriptor a session has not read yet. */
  unreadDescriptorsPerSession: number;
  /** The same for all of one uid's sessions. */
  unreadDescriptorsPerUid: number;
  /** Bytes of staging buffers one uid's sessions may have the daemon map at once (0: no limit). */
  stagingBytesPerUid: number;
}

export const DEFAULT_TRANSPORT_LIMITS: TransportLimits = {
  serverStreamsPerUid: DAEMON_SETTINGS.maxServerStreamsPerUid.default,
  clientStreamsPerUid: DAEMON_SETTINGS.maxClientStreamsPerUid.default,
  streamBytesInFlight: Number(DAEMON_SETTINGS.streamBytesInFlight.default),
  connectionsPerUid: DAEMON_SETTINGS.maxConnectionsPerUid.default,
  unreadDescriptorsPerSession: DAEMON_SETTINGS.maxUnreadDescriptorsPerSession.default,
  unreadDescriptorsPerUid: DAEMON_SETTINGS.maxUnreadDescriptorsPerUid.default,
  stagingBytesPerUid: Number(DAEMON_SETTINGS.maxStagingBytesPerUid.default),
};

/** The holder a gRPC call without a uid counts under (TCP: mutual TLS names no uid). */
export const TCP_HOLDER = 'tcp peers';

/** The part of RLIMIT_NOFILE the daemon keeps for itself: no client can make its own opens and accepts fail. */
export const DESCRIPTOR_RESERVE_SHARE = 0.25;

export class TransportBudgets {
  readonly serverStreams: Budget;
  readonly clientStreams: Budget;
  readonly connections: Budget;
  /** Every uid's gRPC connections together, under DAEMON_HOLDER: a share of RLIMIT_NOFILE. */
  readonly allConnections: Budget;
  readonly unreadDescriptorsOfSession: Budget;
  readonly unreadDescriptorsOfUid: Budget;
  /** Every session's unread descriptors together, under DAEMON_HOLDER: the kernel refuses every send past RLIMIT_NOFILE. */
  readonly allUnreadDescriptors: Budget;
  /** Staging buffers' bytes per uid: pages the daemon's staged copies fault are the daemon's memory. */
  readonly stagingBytes: Budget;

  constructor(
    readonly limits: TransportLimits = DEFAULT_TRANSPORT_LIMITS,
    descriptorLimit = Number.POSITIVE_INFINITY,
  ) {
    this.serverStreams = new Budget('server streams per uid', limits.serverStreamsPerUid);
    this.clientStreams = new Budget('client streams per uid', limits.clientStreamsPerUid);
    this.connections = new Budget('gRPC connections per uid', limits.connectionsPerUid);
    this.unreadDescriptorsOfSession = new Budget('unread descriptors per session', limits.unreadDescriptorsPerSession);
    this.unreadDescriptorsOfUid = new Budget('unread descriptors per uid', limits.unreadDescriptorsPerUid);
    this.stagingBytes = new Budget('staging bytes per uid', limits.stagingBytesPerUid, ' bytes');
    // What neither may take from the daemon: the rest of its descriptors, for its own opens and accepts.
    const share = Number.isFinite(descriptorLimit) ? Math.max(1, Math.floor(descriptorLimit * (1 - DESCRIPTOR_RESERVE_SHARE))) : 0;
    this.allConnections = new Budget('gRPC connections of all uids', share);
    this.allUnreadDescriptors = new Budget('unread descriptors of all sessions', share);
  }

  /** Every budget, for metrics. */
  all(): Budget[] {
    return [
      this.serverStreams,
      this.clientStreams,
      this.connections,
      this.allConnections,
      this.unreadDescriptorsOfSession,
      this.unreadDescriptorsOfUid,
      this.allUnreadDescriptors,
      this.stagingBytes,
    ];
  }
}

/**
 * Takes `amount` of a budget for `holder` and returns what gives it back, once.
 * @throws RESOURCE_EXHAUSTED BUDGET_EXCEEDED
 */
export function takeAmountOnce(budget: Budget, holder: Holder, amount: number): () => void {
  budget.take(holder, amount);
  let held = true;
  return () => {
    if (held) budget.give(holder, amount);
    held = false;
  };
}

/** The one holder of the daemon-wide budgets. */
export const DAEMON_HOLDER: Holder = 'the daemon';

/**
 * Takes one of a budget for `holder` and returns what gives it back, once
 * however often it is called (a stream ends by its end or by a cancel, maybe both).
 * @throws RESOURCE_EXHAUSTED BUDGET_EXCEEDED
 */
export function takeOnce(budget: Budget, holder: Holder): () => void {
  budget.take(holder);
  let held = true;
  return () => {
    if (held) budget.give(holder);
    held = false;
  };
}
