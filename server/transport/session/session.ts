/**
 * One session: the peer it belongs to, its socket, the descriptors its client
 * sent and not yet claimed, and its calls in flight (a closed session's
 * reclaim waits for them). Its answers that carry a descriptor are counted
 * until the client has read them (server/transport/session/unread-descriptors.ts).
 */
import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import { status as Status } from '@grpc/grpc-js';
import { type DaemonFrame, encodeDaemonFrame } from '../../../common/protocol';
import type { Capability__Output } from '../../../generated/vmmd/v1/Capability';
import { TransferInbox } from '../../../common/transfer-inbox';
import { addon, Credentials } from '../../../native';
import type { SeqpacketConnection } from '../../../native/seqpacket';
import type { LogLimiter } from '../../observability/log-limiter';
import { type CodeWithStatus, deadlineExceeded, failedPrecondition, RpcError, unavailable } from '../../errors';
import { DAEMON_SETTINGS } from '../../../common/daemon-settings';
import { describeProcess, PeerProcess } from './peer-process';
import { newResumeToken } from './resume';
import type { TransportBudgets } from '../budgets';

/** How sessions are opened and what each may hold (wired from the config in daemon.ts). */
export interface SessionOptions {
  /** Why a peer may not open a session, or undefined when it may. */
  authorize?: (peer: Credentials) => string | undefined;
  /** How long Import waits for a descriptor the client has not sent yet. */
  transferWaitMs: number;
  /** How long a received, unclaimed descriptor is kept before it is closed. */
  transferKeepMs: number;
  /** Unclaimed descriptors a session may hold at once; more are closed and refused. */
  maxPendingTransfers: number;
  /** Sessions one uid may hold open at once. */
  maxSessionsPerUid: number;
  /** Unclaimed descriptors one uid's sessions may hold at once. */
  maxTransfersPerUid: number;
  /** What the daemon can do, told to each client in its hello (session.proto's Capability names). */
  capabilities?: Capability__Output[];
  /**
   * The daemon parks its sessions' objects (systemd's file-descriptor store, the keeper, a hand-over): each
   * hello carries a resume token. Without, there is nothing to resume after a restart and none is given.
   */
  resumable?: boolean;
  /** Unread descriptors per session, per uid and daemon-wide (server/transport/budgets.ts); absent: not bounded. */
  budgets?: TransportBudgets;
}

export const DEFAULT_SESSION_OPTIONS: SessionOptions = {
  transferWaitMs: DAEMON_SETTINGS.transferWaitMs.default,
  transferKeepMs: 30_000,
  maxPendingTransfers: 64,
  maxSessionsPerUid: DAEMON_SETTINGS.maxSessionsPerUid.default,
  maxTransfersPerUid: DAEMON_SETTINGS.maxTransfersPerUid.default,
};

/** What counts a session's answers that carry a descriptor until its client has read them. */
export interface DescriptorsInFlight {
  /** @throws RESOURCE_EXHAUSTED BUDGET_EXCEEDED when the session may be sent no more now */
  check(session: Session, count?: number): void;
  /** One more was sent. */
  sent(session: Session): void;
}

/** An error that refuses a message as malformed (answered without a request's status). */
export function refuseMessage(code: CodeWithStatus<'INVALID_ARGUMENT'>, message: string): RpcError {
  return Object.assign(new RpcError(Status.INVALID_ARGUMENT, code, message), { messageRefused: true });
}

export class Session {
  /** The gRPC token (metadata vmmd-session-token). */
  readonly token: string;
  /** The secret its client presents to resume it after a restart (server/transport/session/resume.ts). */
  readonly resumeToken: string;
  readonly log: Logger;
  closing = false;
  /** The client's hello was answered: from then on its frames are requests and transfers. */
  greeted = false;
  // Aborted once the socket closes: a call that waits for something (AllocateAll's memory) stops waiting then.
  private readonly closed = new AbortController();
  /** The session sent a request or a descriptor, or a call named its token: a connection that has cannot become another session by resuming. */
  used = false;
  /** Adopted by a resume hello: a parked session's again. */
  resumed = false;
  /** Closed by the daemon to be parked (a hand-over): its objects live on, nothing is reclaimed. */
  parked = false;
  // Invariant: inFlight counts calls of this session that started and have not settled.
  private inFlight = 0;
  private drainWaiters: Array<() => void> = [];
  private nextOutgoing = 1n;
  /** Descriptors the client sent, until a call claims them. */
  readonly inbox: TransferInbox;
  /** The peer's command name and cgroup, read when the session opened. */
  readonly process: PeerProcess;
  private readonly descriptors?: DescriptorsInFlight;

  constructor(
    readonly id: bigint,
    readonly peer: Credentials,
    readonly connection: SeqpacketConnection,
    log: Logger,
    options: SessionOptions,
    limits: { logLimiter: LogLimiter; mayHold: () => string | undefined; descriptors?: DescriptorsInFlight },
    identity: { token: string; resumeToken: string } = { token: randomBytes(32).toString('hex'), resumeToken: newResumeToken() },
  ) {
    this.token = identity.token;
    this.resumeToken = identity.resumeToken;
    this.descriptors = limits.descriptors;
    this.process = describeProcess(peer.pid);
    this.log = log.child({ session: String(id), peerPid: peer.pid, peerUid: peer.uid, command: this.process.command });
    this.inbox = new TransferInbox({
      keepMs: options.transferKeepMs,
      maxHeld: options.maxPendingTransfers,
      mayHold: limits.mayHold,
      increasing: true,
      close: (fd) => addon.close(fd),
      expired: (transfer) => {
        const allowed = limits.logLimiter.allow(`expired:${peer.uid}`);
        if (allowed !== undefined) this.log.warn({ transfer, heldBack: allowed.suppressed }, 'an unclaimed descriptor expired');
      },
      errors: {
        notReceived: (transfer, waitMs) =>
          deadlineExceeded('TRANSFER_NOT_RECEIVED', `no descriptor arrived as transfer ${transfer} on session ${id}'s socket within ${waitMs} ms`),
        used: (transfer, when) =>
          failedPrecondition(
            'TRANSFER_USED',
            when === 'claiming' ? `transfer ${transfer} is already being claimed` : `transfer ${transfer} was already claimed, refused or expired`,
          ),
        closed: (transfer) =>
          unavailable('SESSION_CLOSED', transfer === undefined ? `session ${id} is closed` : `session ${id} closed before transfer ${transfer} arrived`),
      },
    });
  }

  /** Aborted when the session's socket closes, before its reclaim: calls waiting on the session's behalf give up. */
  get endSignal(): AbortSignal {
    return this.closed.signal;
  }

  /** Marks the session closing and tells its waiting calls (once). */
  end(): void {
    this.closing = true;
    if (!this.closed.signal.aborted) this.closed.abort();
  }

  get inFlightCalls(): number {
    return this.inFlight;
  }

  /** Runs a call as part of this session; the session's reclaim waits for it. */
  async track<T>(call: () => Promise<T>): Promise<T> {
    this.inFlight++;
    try {
      return await call();
    } finally {
      this.inFlight--;
      if (this.inFlight === 0) for (const wake of this.drainWaiters.splice(0)) wake();
    }
  }

  drained(): Promise<void> {
    if (this.inFlight === 0) return Promise.resolve();
    return new Promise((resolve) => this.drainWaiters.push(resolve));
  }

  /**
   * Refuses a request whose answer would carry a descriptor when the client has
   * too many unread already: checked before the request does anything.
   * @param count the descriptors the answer carries (AllocateAll: one per allocation)
   * @throws RESOURCE_EXHAUSTED BUDGET_EXCEEDED
   */
  checkDescriptorRoom(count = 1): void {
    this.descriptors?.check(this, count);
  }

  /** @throws UNAVAILABLE SESSION_SOCKET_FULL; RESOURCE_EXHAUSTED BUDGET_EXCEEDED (a descriptor, with too many unread) */
  send(frame: DaemonFrame, fd = -1): void {
    if (fd >= 0) this.descriptors?.check(this);
    if (!this.connection.send(encodeDaemonFrame(frame), fd)) {
      throw unavailable('SESSION_SOCKET_FULL', `session ${this.id}'s socket is full; the client is not reading it`);
    }
    if (fd >= 0) this.descriptors?.sent(this);
  }

  /**
   * Sends a descriptor to the client; the caller keeps (and closes) its own fd.
   * @returns the transfer id the client pairs it with
   * @throws UNAVAILABLE SESSION_SOCKET_FULL; the socket's error
   */
  sendTransfer(fd: number, about: { allocation: bigint; size: bigint }): string {
    const transfer = String(this.nextOutgoing++);
    this.send({ transfer: { id: transfer, allocationId: String(about.allocation), size: String(about.size) } }, fd);
    return transfer;
  }

  /** Sends a message the client may not be reading; a failure only costs the client its answer. */
  trySend(frame: DaemonFrame, fd = -1): void {
    try {
      this.send(frame, fd);
    } catch {
      // Not reading its socket: its request times out on its side.
    }
  }
}
