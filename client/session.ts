/**
 * The client's side of the session socket: the greeting with the session
 * token, descriptors received from the daemon by transfer id, and descriptors
 * sent to it. Under a daemon that parks its sessions, a socket that closes
 * without close() is resumed (client/resume.ts): requests wait, up to their
 * deadlines, and go (again) on the new connection.
 */
import { EventEmitter } from 'node:events';
import { dirname } from 'node:path';
import { status as Status } from '@grpc/grpc-js';
import {
  AllocatedMessage,
  AllocateMessage,
  decodeMessage,
  encodeMessage,
  ExportedMessage,
  HelloMessage,
  OpenedMessage,
  OpenMessage,
  ReleasedMessage,
  RequestAnswer,
  SessionMessage,
} from '../common/protocol';
import { whereElse } from '../common/paths';
import { TransferInbox } from '../common/transfer-inbox';
import { DEFAULT_TRANSFER_WAIT_MS } from '../common/daemon-settings';
import { traceClock, traceSince, tracing } from '../common/trace';
import { native } from '../native/client';
import { SeqpacketConnection, SeqpacketMessage } from '../native/seqpacket';
import { type DeclaredCode, VmmdError } from './errors';
import { busyPollWhile, DEFAULT_BUSY_POLL_MICROS } from '../native/busy-poll';
import { flushUnmapsIfIdle } from '../native/mapping';
import { greeting, resumeConnection } from './resume';

/** Answers to request messages, and those that carry a descriptor. */
const ANSWERS = new Set<string>(['allocated', 'released', 'shared', 'exported', 'opened']);
const WITH_DESCRIPTOR = new Set<string>(['allocated', 'exported', 'opened']);

/** A request message waiting for its answer. */
interface PendingRequest {
  answer: RequestAnswer['type'];
  /** The message, with its request id: sent again, as it was, on the resumed connection. */
  message: SessionMessage;
  /** Sent again after a resume: the daemon may have done it before it went. */
  resent: boolean;
  resolve(answer: { message: RequestAnswer; fd: number }): void;
  reject(error: Error): void;
  timer: NodeJS.Timeout;
  /** Ends this request's share of busy polling (native/busy-poll.ts). */
  spun(): void;
}

/** How long a descriptor the daemon sent waits to be claimed before it is closed. */
const UNCLAIMED_TRANSFER_MS = 30_000;

/**
 * One session: the lease on everything this process creates through vmmd.
 * Emits 'close' (with the error that ended it, when the daemon did) when the
 * session ends, 'daemon-error' (ErrorMessage) when the daemon refuses a
 * message, and, under a daemon that parks its sessions, 'resuming' when the
 * socket closed and 'resumed' once the session is back.
 */
export class ClientSession extends EventEmitter {
  readonly id: string;
  readonly token: string;
  /** The secret that resumes this session after a restart of the daemon; undefined where the daemon parks nothing. */
  readonly resumeToken: string | undefined;
  private connection: SeqpacketConnection;
  // Invariant: `resuming` is set exactly while the socket is closed and the session tries to come back.
  private resuming?: Promise<void>;
  private ended = false;
  private closedByUs = false;
  /** The daemon's backend, from its hello ("host", "cuda"); undefined from daemons that do not say. */
  readonly backend: string | undefined;
  // Descriptors the daemon sent, until a call claims them (a resumed session's transfer ids start again: a new inbox).
  private inbox = this.newInbox();
  private newInbox(): TransferInbox {
    return new TransferInbox({
    keepMs: UNCLAIMED_TRANSFER_MS,
    increasing: false,
    close: (fd) => native.close(fd),
    errors: {
      notReceived: (transfer, waitMs) => new VmmdError('TRANSFER_NOT_RECEIVED', Status.DEADLINE_EXCEEDED, `descriptor ${transfer} did not arrive within ${waitMs} ms`),
      used: (transfer) => new VmmdError('TRANSFER_USED', Status.FAILED_PRECONDITION, `descriptor ${transfer} is already being claimed`),
      closed: () => this.lost(),
    },
    });
  }
  private nextTransfer = 1n;
  // Pings in flight by nonce.
  private readonly pings = new Map<string, { resolve(): void; reject(error: Error): void; spun(): void }>();
  private nextPing = 1;
  // Requests in flight (allocate, release, share, export, open) by request id.
  private readonly requests = new Map<string, PendingRequest>();
  private nextRequest = 1n;

  private constructor(
    connection: SeqpacketConnection,
    hello: HelloMessage,
    private readonly busyPollMicros: number,
    private readonly path: string,
    private readonly resumeWaitMs: number,
  ) {
    super();
    this.id = hello.session;
    this.token = hello.token;
    this.resumeToken = hello.resumeToken === '' ? undefined : hello.resumeToken;
    // An empty name is no name (proto3's default): the client asks ListDevices.
    this.backend = hello.backend === '' ? undefined : hello.backend;
    this.connection = connection;
    this.attach(connection);
  }

  private attach(connection: SeqpacketConnection): void {
    connection.on('message', (message: SeqpacketMessage) => this.onMessage(message));
    connection.on('close', () => this.onClose());
    // The session must not keep a finished program alive; pending calls do.
    connection.unref();
  }

  /**
   * Connects and waits for the daemon's greeting.
   * @param busyPollMicros while a request waits for its answer, the event loop spins this long before each sleep
   *   (native/busy-poll.ts): an answer that comes within it finds the process awake (0: never spin)
   * @throws VmmdError UNAVAILABLE DAEMON_UNREACHABLE, DEADLINE_EXCEEDED NO_GREETING
   */
  static async open(path: string, timeoutMs: number, busyPollMicros = DEFAULT_BUSY_POLL_MICROS, resumeWaitMs = 0): Promise<ClientSession> {
    let connection: SeqpacketConnection;
    try {
      connection = SeqpacketConnection.connect(path);
    } catch (error) {
      throw new VmmdError('DAEMON_UNREACHABLE', Status.UNAVAILABLE, `cannot reach vmmd at ${path}: ${(error as Error).message}; ${whereElse(dirname(path))}`);
    }
    try {
      return new ClientSession(connection, await greeting(connection, path, timeoutMs), busyPollMicros, path, resumeWaitMs);
    } catch (error) {
      connection.close();
      throw error;
    }
  }

  /** True once the session has ended for good (close(), or the daemon went and the session did not come back). */
  get closed(): boolean {
    return this.ended;
  }

  /** Whether a closed socket would be resumed rather than end the session. */
  private get mayResume(): boolean {
    return this.resumeToken !== undefined && this.resumeWaitMs > 0 && !this.closedByUs && !this.ended;
  }

  /** Whether the session is coming back after its socket closed (requests wait meanwhile). */
  get isResuming(): boolean {
    return this.resuming !== undefined;
  }

  /**
   * Resolves once the session serves: at once unless it is resuming; then when it is back, or has
   * ended (the next call says why), or at `deadline` (ms since the epoch), whichever comes first.
   */
  async ready(deadline = Infinity): Promise<void> {
    if (this.resuming === undefined) return;
    let timer: NodeJS.Timeout | undefined;
    const late = Number.isFinite(deadline) ? new Promise<void>((resolve) => (timer = setTimeout(resolve, Math.max(0, deadline - Date.now())))) : new Promise<void>(() => undefined);
    await Promise.race([this.resuming, late]);
    clearTimeout(timer);
  }

  /**
   * The descriptor the daemon sent as `transfer`; the caller owns it.
   * @throws VmmdError DEADLINE_EXCEEDED TRANSFER_NOT_RECEIVED, UNAVAILABLE SESSION_LOST
   */
  takeTransfer(transfer: string, timeoutMs = DEFAULT_TRANSFER_WAIT_MS): Promise<number> {
    if (this.closed) return Promise.reject(this.lost());
    return this.inbox.take(transfer, timeoutMs);
  }

  /**
   * Sends a descriptor (the caller keeps its own) and returns its transfer id,
   * to be named in an Import call.
   * @throws VmmdError UNAVAILABLE SESSION_LOST, SESSION_SOCKET_FULL
   */
  sendDescriptor(fd: number): string {
    const transfer = String(this.nextTransfer++);
    this.send({ type: 'transfer', transfer }, fd);
    return transfer;
  }

  /**
   * Allocate on the session socket: a new allocation of this session and its
   * descriptor (the caller owns it), in one round trip.
   * @param awaited false for an allocation asked for ahead of need: nobody waits on it yet, so this process's
   *   gathered unmaps do not go to the driver with it (they would run beside the caller's map)
   * @throws VmmdError as the Allocate RPC (OUT_OF_MEMORY, NOT_ALIGNED…), DEADLINE_EXCEEDED NO_ANSWER, UNAVAILABLE SESSION_LOST
   */
  allocate(
    size: bigint,
    location?: AllocateMessage['location'],
    timeoutMs = 30_000,
    awaited = true,
  ): Promise<{ message: AllocatedMessage; fd: number }> {
    return this.request('allocated', { type: 'allocate', size: String(size), ...(location === undefined ? {} : { location }) }, timeoutMs, awaited);
  }

  /**
   * Release on the session socket, one round trip: the same answer as the Release RPC.
   * @throws VmmdError as the Release RPC (UNKNOWN_ALLOCATION, NOT_OWNER…), NO_ANSWER, SESSION_LOST
   */
  async release(allocation: bigint | string, timeoutMs = 30_000): Promise<ReleasedMessage> {
    return (await this.request('released', { type: 'release', allocation: String(allocation) }, timeoutMs)).message;
  }

  /**
   * Share on the session socket: the key another session exports the allocation with.
   * @throws VmmdError as the Share RPC (UNKNOWN_ALLOCATION, NOT_OWNER…), NO_ANSWER, SESSION_LOST
   */
  async share(allocation: bigint | string, timeoutMs = 30_000): Promise<string> {
    return (await this.request('shared', { type: 'share', allocation: String(allocation) }, timeoutMs)).message.shareKey;
  }

  /**
   * Export on the session socket: a descriptor of an existing allocation (the caller owns it), attached to the answer.
   * @throws VmmdError as the Export RPC (NOT_OWNER, BAD_SHARE_KEY, ALREADY_RELEASED…), NO_ANSWER, SESSION_LOST
   */
  export(allocation: bigint | string, shareKey = '', timeoutMs = 30_000): Promise<{ message: ExportedMessage; fd: number }> {
    return this.request('exported', { type: 'export', allocation: String(allocation), ...(shareKey === '' ? {} : { shareKey }) }, timeoutMs);
  }

  /**
   * Open a store on the session socket: the store and its descriptor (the caller owns it), one round trip.
   * @throws VmmdError as Stores.Open (UNKNOWN_STORE, STORE_DETACHED, STORE_READ_ONLY…), NO_ANSWER, SESSION_LOST
   */
  open(store: OpenMessage['store'], writable: boolean, timeoutMs = 30_000): Promise<{ message: OpenedMessage; fd: number }> {
    return this.request('opened', { type: 'open', store, writable }, timeoutMs);
  }

  /** Sends a request message under a new id and waits for its answer of type `answer` (with a descriptor: fd, else -1). */
  private request<T extends RequestAnswer['type']>(
    answer: T,
    message: Record<string, unknown> & { type: string },
    timeoutMs: number,
    awaited = true,
  ): Promise<{ message: Extract<RequestAnswer, { type: T }>; fd: number }> {
    const request = String(this.nextRequest++);
    const sent = tracing ? traceClock() : 0n;
    return new Promise((resolve, reject) => {
      const spun = busyPollWhile(this.busyPollMicros);
      const timer = setTimeout(() => {
        this.requests.delete(request);
        spun();
        reject(new VmmdError('NO_ANSWER', Status.DEADLINE_EXCEEDED, `the daemon did not answer ${message.type} request ${request} within ${timeoutMs} ms`));
      }, timeoutMs);
      const sending = { ...message, request } as unknown as SessionMessage;
      this.requests.set(request, {
        answer,
        message: sending,
        resent: false,
        resolve: (tracing ? (value) => {
          traceSince(`session:${message.type}`, sent);
          resolve(value as never);
        } : resolve) as PendingRequest['resolve'],
        reject,
        timer,
        spun,
      });
      // While the session resumes, the request waits and goes on the new connection.
      if (this.resuming !== undefined) return;
      try {
        this.send(sending);
      } catch (error) {
        if ((error as VmmdError).code === 'SESSION_RESUMING') return;
        clearTimeout(timer);
        this.requests.delete(request);
        spun();
        reject(error);
        return;
      }
      // While the answer is on its way this process makes no driver call: its waiting unmaps go now,
      // rather than beside the import and map the answer leads to (the driver serializes them). Never throws.
      // Not for a request nobody waits on yet (an allocation ahead, sent as its caller starts mapping).
      if (awaited && (message.type === 'allocate' || message.type === 'open')) flushUnmapsIfIdle();
    });
  }

  /**
   * One round trip on the session socket (the daemon answers ping with pong).
   * @throws VmmdError UNAVAILABLE SESSION_LOST (also when the session closes before the pong), DEADLINE_EXCEEDED NO_ANSWER
   */
  ping(timeoutMs = 30_000): Promise<void> {
    const nonce = String(this.nextPing++);
    const sent = tracing ? traceClock() : 0n;
    return new Promise((resolve, reject) => {
      const spun = busyPollWhile(this.busyPollMicros);
      // The timer also keeps the process alive while the pong is due (the socket does not).
      const timer = setTimeout(() => {
        this.pings.delete(nonce);
        spun();
        reject(new VmmdError('NO_ANSWER', Status.DEADLINE_EXCEEDED, `the daemon did not answer ping ${nonce} within ${timeoutMs} ms`));
      }, timeoutMs);
      const settle = (error?: Error) => {
        clearTimeout(timer);
        spun();
        traceSince('session:ping', sent);
        if (error === undefined) resolve();
        else reject(error);
      };
      this.pings.set(nonce, { resolve: () => settle(), reject: settle, spun });
      if (this.resuming !== undefined) return;
      try {
        this.send({ type: 'ping', nonce });
      } catch (error) {
        if ((error as VmmdError).code === 'SESSION_RESUMING') return;
        this.pings.delete(nonce);
        settle(error as Error);
      }
    });
  }

  close(): void {
    this.closedByUs = true;
    this.connection.close();
    // A session that was resuming ends here: the socket it had is closed already.
    if (this.resuming !== undefined) this.end();
  }

  private send(message: SessionMessage, fd = -1): void {
    if (this.closed) throw this.lost();
    if (this.resuming !== undefined) {
      throw new VmmdError('SESSION_RESUMING', Status.UNAVAILABLE, `session ${this.id} is resuming after the daemon restarted; call again once it has (await session.ready())`);
    }
    let sent: boolean;
    try {
      sent = this.connection.send(encodeMessage(message), fd);
    } catch (error) {
      // The daemon went and the socket's close is not seen yet: a request waits for the session to come back.
      if (this.mayResume) throw new VmmdError('SESSION_RESUMING', Status.UNAVAILABLE, `session ${this.id} is resuming after the daemon went away`);
      throw new VmmdError('SESSION_LOST', Status.UNAVAILABLE, `the session socket failed: ${(error as Error).message}`);
    }
    if (!sent) throw new VmmdError('SESSION_SOCKET_FULL', Status.UNAVAILABLE, 'the session socket is full; the daemon is not reading');
  }

  // Why the session ended, when the daemon ended it (a resume refused or out of time).
  private endedBy?: VmmdError;

  private lost(): VmmdError {
    return this.endedBy ?? new VmmdError('SESSION_LOST', Status.UNAVAILABLE, `session ${this.id} with vmmd is closed`);
  }

  private onMessage(raw: SeqpacketMessage): void {
    const message = decodeMessage(raw.data);
    if (typeof message !== 'string' && message.type === 'transfer' && raw.fd >= 0) {
      this.inbox.deliver(message.transfer, raw.fd);
      return;
    }
    if (typeof message !== 'string' && (ANSWERS.has(message.type) || message.type === 'error') && (message as { request?: unknown }).request !== undefined) {
      const request = (message as { request: string }).request;
      const pending = this.requests.get(request);
      if (pending !== undefined) {
        clearTimeout(pending.timer);
        pending.spun();
        this.requests.delete(request);
        if (message.type === pending.answer && (raw.fd >= 0) === WITH_DESCRIPTOR.has(message.type)) {
          pending.resolve({ message: message as RequestAnswer, fd: raw.fd });
          return;
        }
        // A release sent again after a resume, of an allocation the daemon no longer knows: the first one freed it before the daemon went.
        if (pending.resent && pending.answer === 'released' && message.type === 'error' && message.code === 'UNKNOWN_ALLOCATION') {
          const allocation = (pending.message as { allocation: string }).allocation;
          pending.resolve({ message: { type: 'released', request, allocation, freed: true, handleReferences: 0, mappingCount: 0 }, fd: -1 });
          return;
        }
        pending.reject(
          message.type === 'error'
            ? new VmmdError(message.code as DeclaredCode, (message.status ?? Status.UNKNOWN) as Status, message.message)
            : new VmmdError(
                'BAD_ANSWER',
                Status.INTERNAL,
                `the daemon answered request ${request} with ${message.type}${raw.fd >= 0 ? ' and a descriptor' : ''}, not ${pending.answer}${WITH_DESCRIPTOR.has(pending.answer) ? ' with a descriptor' : ''}`,
              ),
        );
        // A refusal of a request is its caller's error, not the session's.
        if (raw.fd >= 0) native.close(raw.fd);
        return;
      }
    }
    if (raw.fd >= 0) native.close(raw.fd);
    if (typeof message !== 'string' && message.type === 'pong' && message.nonce !== undefined) {
      const ping = this.pings.get(message.nonce);
      this.pings.delete(message.nonce);
      ping?.resolve();
      return;
    }
    if (typeof message !== 'string' && message.type === 'error') {
      // Nobody listening: a warning, so that what the daemon says (a free that failed after its answer) is not lost.
      if (!this.emit('daemon-error', message)) process.emitWarning(`vmmd: the daemon says ${message.code}: ${message.message}`);
    }
  }

  private onClose(): void {
    if (!this.mayResume) return this.end();
    this.resuming = this.resume();
    this.emit('resuming');
  }

  /** Tries to bring the session back on a new connection; ends it when it cannot. */
  private async resume(): Promise<void> {
    let connection: SeqpacketConnection;
    try {
      connection = await resumeConnection(this.path, this.id, this.resumeToken!, Date.now() + this.resumeWaitMs);
    } catch (error) {
      const why = error as VmmdError;
      this.endedBy = new VmmdError(
        'SESSION_LOST',
        Status.UNAVAILABLE,
        `session ${this.id} with vmmd could not be resumed after its socket closed (${why.code}: ${why.message}); everything it held in the daemon is gone (memory mapped in this process stays valid)`,
      );
      this.resuming = undefined;
      return this.end();
    }
    if (this.closedByUs || this.ended) {
      connection.close();
      return;
    }
    this.connection = connection;
    // Descriptors the old connection brought and nobody claimed belong to calls that failed with it.
    this.inbox.close();
    this.inbox = this.newInbox();
    this.attach(connection);
    this.resuming = undefined;
    for (const [request, pending] of this.requests) {
      pending.resent = true;
      // An allocate the daemon may have made before it went: it answers with that allocation, not a second one.
      if (pending.answer === 'allocated') pending.message = { ...(pending.message as AllocateMessage), again: true };
      this.trySendAgain(pending.message, (error) => {
        clearTimeout(pending.timer);
        this.requests.delete(request);
        pending.spun();
        pending.reject(error);
      });
    }
    for (const [nonce, ping] of this.pings) {
      this.trySendAgain({ type: 'ping', nonce }, (error) => {
        this.pings.delete(nonce);
        ping.reject(error);
      });
    }
    this.emit('resumed');
  }

  private trySendAgain(message: SessionMessage, failed: (error: Error) => void): void {
    try {
      this.send(message);
    } catch (error) {
      failed(error as Error);
    }
  }

  /** The session is over: everything waiting on it fails with why. */
  private end(): void {
    if (this.ended) return;
    this.ended = true;
    this.resuming = undefined;
    this.inbox.close();
    for (const ping of this.pings.values()) ping.reject(this.lost());
    this.pings.clear();
    for (const pending of this.requests.values()) {
      clearTimeout(pending.timer);
      pending.spun();
      pending.reject(this.lost());
    }
    this.requests.clear();
    this.emit('close', this.endedBy);
  }
}
