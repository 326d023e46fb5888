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
import { type ClientFrame, type DaemonCase, decodeDaemonFrame, encodeClientFrame } from '../common/protocol';
import type { Capability__Output } from '../generated/vmmd/v1/Capability';
import type { Location } from '../generated/vmmd/v1/Location';
import type { ExportResponse__Output } from '../generated/vmmd/v1/ExportResponse';
import type { HelloResponse__Output } from '../generated/vmmd/v1/HelloResponse';
import type { OpenResponse__Output } from '../generated/vmmd/v1/OpenResponse';
import type { ReleaseResponse__Output } from '../generated/vmmd/v1/ReleaseResponse';
import type { SessionError__Output } from '../generated/vmmd/v1/SessionError';
import type { StoreRef } from '../generated/vmmd/v1/StoreRef';
import { whereElse } from '../common/paths';
import { TransferInbox } from '../common/transfer-inbox';
import { DEFAULT_TRANSFER_WAIT_MS } from '../common/daemon-settings';
import { traceClock, traceSince, tracing } from '../common/trace';
import { native } from '../native/client';
import { SeqpacketConnection, SeqpacketMessage } from '../native/seqpacket';
import { type DeclaredCode, VmmdError } from './errors';
import { busyPollWhile, DEFAULT_BUSY_POLL_MICROS } from '../native/busy-poll';
import { flushUnmapsIfIdle } from '../native/mapping';
import { greeting, HELLO_TRIES, releasedBefore, resumeConnection } from './resume';

/** The answers that carry a descriptor. */
const WITH_DESCRIPTOR = new Set<DaemonCase>(['allocated', 'exported', 'opened']);

/** What each answer's body is. */
interface Answers {
  allocated: ExportResponse__Output;
  exported: ExportResponse__Output;
  opened: OpenResponse__Output;
  released: ReleaseResponse__Output;
  shared: { shareKey: string };
  pong: { nonce: string };
}

/** A request frame waiting for its answer. */
interface PendingRequest {
  answer: keyof Answers;
  /** The frame, with its request id: sent again, as it was (again: true), on the resumed connection. */
  frame: ClientFrame;
  /** Sent again after a resume: the daemon may have done it before it went. */
  resent: boolean;
  resolve(answer: { message: unknown; fd: number }): void;
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
 * session ends, 'daemon-error' (SessionError) when the daemon refuses a
 * frame or tells of a failure no request waits for, and, under a daemon that parks its sessions, 'resuming' when the
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
  /** What the daemon can do, from its hello (session.proto's Capability names): ask these, not a backend's name. */
  readonly capabilities: ReadonlySet<Capability__Output>;
  // Descriptors the daemon sent, until a call claims them (a resumed session's transfer ids start again: a new inbox).
  private inbox = this.newInbox();
  private newInbox(): TransferInbox {
    return new TransferInbox({
      keepMs: UNCLAIMED_TRANSFER_MS,
      increasing: false,
      close: (fd) => native.close(fd),
      errors: {
        notReceived: (transfer, waitMs) =>
          new VmmdError('TRANSFER_NOT_RECEIVED', Status.DEADLINE_EXCEEDED, `descriptor ${transfer} did not arrive within ${waitMs} ms`),
        used: (transfer) => new VmmdError('TRANSFER_USED', Status.FAILED_PRECONDITION, `descriptor ${transfer} is already being claimed`),
        closed: () => this.lost(),
      },
    });
  }
  private nextTransfer = 1n;
  // Requests in flight (allocate, release, share, export, open, ping) by request id.
  private readonly requests = new Map<string, PendingRequest>();
  private nextRequest = 1n;

  private constructor(
    connection: SeqpacketConnection,
    hello: HelloResponse__Output,
    private readonly busyPollMicros: number,
    private readonly path: string,
    private readonly resumeWaitMs: number,
  ) {
    super();
    this.id = hello.session;
    this.token = hello.token;
    this.resumeToken = hello.resumeToken === '' ? undefined : hello.resumeToken;
    this.capabilities = new Set(hello.capabilities);
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
   * Connects, says hello (the protocol it speaks) and waits for the daemon's answer.
   * @param busyPollMicros while a request waits for its answer, the event loop spins this long before each sleep
   *   (native/busy-poll.ts): an answer that comes within it finds the process awake (0: never spin)
   * @param resumeWaitMs how long a session whose socket closes tries to resume (0: it ends at once)
   * @throws VmmdError UNAVAILABLE DAEMON_UNREACHABLE, BAD_GREETING, HELLO_LATE; DEADLINE_EXCEEDED NO_GREETING; FAILED_PRECONDITION
   *   PROTOCOL_VERSION (a daemon of another session protocol); the daemon's refusal of the session (PERMISSION_DENIED…)
   */
  static async open(path: string, timeoutMs: number, busyPollMicros = DEFAULT_BUSY_POLL_MICROS, resumeWaitMs = 0): Promise<ClientSession> {
    const deadline = Date.now() + timeoutMs;
    for (let tries = 1; ; tries++) {
      let connection: SeqpacketConnection;
      try {
        connection = SeqpacketConnection.connect(path);
      } catch (error) {
        throw new VmmdError('DAEMON_UNREACHABLE', Status.UNAVAILABLE, `cannot reach vmmd at ${path}: ${(error as Error).message}; ${whereElse(dirname(path))}`);
      }
      try {
        return new ClientSession(connection, await greeting(connection, path, Math.max(1, deadline - Date.now())), busyPollMicros, path, resumeWaitMs);
      } catch (error) {
        connection.close();
        // A hello that came late on a loaded machine: a new connection says it again, at once.
        if (!(error instanceof VmmdError && error.code === 'HELLO_LATE')) throw error;
        if (tries === HELLO_TRIES || Date.now() >= deadline) throw new VmmdError('HELLO_LATE', Status.UNAVAILABLE, `${error.message} (${tries} tries)`);
      }
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
    const late = Number.isFinite(deadline)
      ? new Promise<void>((resolve) => (timer = setTimeout(resolve, Math.max(0, deadline - Date.now()))))
      : new Promise<void>(() => undefined);
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
    this.send({ transfer: { id: transfer } }, fd);
    return transfer;
  }

  /**
   * Allocate on the session socket: a new allocation of this session and its
   * descriptor (the caller owns it), in one round trip.
   * @param location as CreateRequest's (default: device 0)
   * @param awaited false for an allocation asked for ahead of need: nobody waits on it yet, so this process's
   *   gathered unmaps do not go to the driver with it (they would run beside the caller's map)
   * @returns the Allocate RPC's ExportResponse (transfer_id 0: the descriptor came with it)
   * @throws VmmdError as the Allocate RPC (OUT_OF_MEMORY, NOT_ALIGNED…), DEADLINE_EXCEEDED NO_ANSWER, UNAVAILABLE SESSION_LOST
   */
  allocate(size: bigint, location?: Location | null, timeoutMs = 30_000, awaited = true): Promise<{ message: ExportResponse__Output; fd: number }> {
    return this.request('allocated', { allocate: { size: String(size), location } }, timeoutMs, awaited);
  }

  /**
   * Release on the session socket, one round trip: the same answer as the Release RPC.
   * @throws VmmdError as the Release RPC (UNKNOWN_ALLOCATION, NOT_OWNER…), NO_ANSWER, SESSION_LOST
   */
  async release(allocation: bigint | string, timeoutMs = 30_000): Promise<ReleaseResponse__Output> {
    return (await this.request('released', { release: { allocationId: String(allocation) } }, timeoutMs)).message;
  }

  /**
   * Share on the session socket: the key another session exports the allocation with.
   * @throws VmmdError as the Share RPC (UNKNOWN_ALLOCATION, NOT_OWNER…), NO_ANSWER, SESSION_LOST
   */
  async share(allocation: bigint | string, timeoutMs = 30_000): Promise<string> {
    return (await this.request('shared', { share: { allocationId: String(allocation) } }, timeoutMs)).message.shareKey;
  }

  /**
   * Export on the session socket: a descriptor of an existing allocation (the caller owns it), attached to the answer.
   * @throws VmmdError as the Export RPC (NOT_OWNER, BAD_SHARE_KEY, ALREADY_RELEASED…), NO_ANSWER, SESSION_LOST
   */
  export(allocation: bigint | string, shareKey = '', timeoutMs = 30_000): Promise<{ message: ExportResponse__Output; fd: number }> {
    return this.request('exported', { export: { allocationId: String(allocation), shareKey } }, timeoutMs);
  }

  /**
   * Open a store on the session socket: the store and its descriptor (the caller owns it), one round trip.
   * @throws VmmdError as Stores.Open (UNKNOWN_STORE, STORE_DETACHED, STORE_READ_ONLY…), NO_ANSWER, SESSION_LOST
   */
  open(store: StoreRef, writable: boolean, timeoutMs = 30_000): Promise<{ message: OpenResponse__Output; fd: number }> {
    return this.request('opened', { open: { store, writable } }, timeoutMs);
  }

  /** Sends a request frame under a new id and waits for its answer `answer` (with a descriptor: fd, else -1). */
  private request<T extends keyof Answers>(answer: T, body: ClientFrame, timeoutMs: number, awaited = true): Promise<{ message: Answers[T]; fd: number }> {
    const request = String(this.nextRequest++);
    const what = Object.keys(body)[0];
    const sent = tracing ? traceClock() : 0n;
    return new Promise((resolve, reject) => {
      const spun = busyPollWhile(this.busyPollMicros);
      const timer = setTimeout(() => {
        this.requests.delete(request);
        spun();
        reject(new VmmdError('NO_ANSWER', Status.DEADLINE_EXCEEDED, `the daemon did not answer ${what} request ${request} within ${timeoutMs} ms`));
      }, timeoutMs);
      const frame: ClientFrame = { ...body, request };
      this.requests.set(request, {
        answer,
        frame,
        resent: false,
        resolve: (tracing
          ? (value) => {
              traceSince(`session:${what}`, sent);
              resolve(value as never);
            }
          : resolve) as PendingRequest['resolve'],
        reject,
        timer,
        spun,
      });
      // While the session resumes, the request waits and goes on the new connection.
      if (this.resuming !== undefined) return;
      try {
        this.send(frame);
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
      if (awaited && (body.allocate !== undefined || body.open !== undefined)) flushUnmapsIfIdle();
    });
  }

  /**
   * One round trip on the session socket (the daemon answers ping with pong).
   * @throws VmmdError UNAVAILABLE SESSION_LOST (also when the session closes before the pong), DEADLINE_EXCEEDED NO_ANSWER
   */
  async ping(timeoutMs = 30_000): Promise<void> {
    await this.request('pong', { ping: {} }, timeoutMs);
  }

  close(): void {
    this.closedByUs = true;
    this.connection.close();
    // A session that was resuming ends here: the socket it had is closed already.
    if (this.resuming !== undefined) this.end();
  }

  private send(frame: ClientFrame, fd = -1): void {
    if (this.closed) throw this.lost();
    if (this.resuming !== undefined) {
      throw new VmmdError(
        'SESSION_RESUMING',
        Status.UNAVAILABLE,
        `session ${this.id} is resuming after the daemon restarted; call again once it has (await session.ready())`,
      );
    }
    let sent: boolean;
    try {
      sent = this.connection.send(encodeClientFrame(frame), fd);
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
    const frame = decodeDaemonFrame(raw.data);
    if (typeof frame === 'string') {
      if (raw.fd >= 0) native.close(raw.fd);
      return;
    }
    if (frame.body === 'transfer' && raw.fd >= 0) {
      this.inbox.deliver(frame.transfer!.id, raw.fd);
      return;
    }
    const pending = frame.request === '0' ? undefined : this.requests.get(frame.request);
    if (pending !== undefined) {
      clearTimeout(pending.timer);
      pending.spun();
      this.requests.delete(frame.request);
      if (frame.body === pending.answer && raw.fd >= 0 === WITH_DESCRIPTOR.has(frame.body)) {
        pending.resolve({ message: frame[frame.body], fd: raw.fd });
        return;
      }
      const refused = frame.error;
      const before = pending.resent && pending.answer === 'released' ? releasedBefore(refused?.code) : undefined;
      if (before !== undefined) {
        pending.resolve({ message: before, fd: -1 });
        return;
      }
      pending.reject(
        refused != null
          ? new VmmdError(refused.code as DeclaredCode, refused.status as Status, refused.message)
          : new VmmdError(
              'BAD_ANSWER',
              Status.INTERNAL,
              `the daemon answered request ${frame.request} with ${frame.body ?? 'an empty frame'}${raw.fd >= 0 ? ' and a descriptor' : ''}, not ${pending.answer}${WITH_DESCRIPTOR.has(pending.answer) ? ' with a descriptor' : ''}`,
            ),
      );
      // A refusal of a request is its caller's error, not the session's.
      if (raw.fd >= 0) native.close(raw.fd);
      return;
    }
    if (raw.fd >= 0) native.close(raw.fd);
    if (frame.error != null) {
      // Nobody listening: a warning, so that what the daemon says (a free that failed after its answer) is not lost.
      if (!this.emit('daemon-error', frame.error satisfies SessionError__Output))
        process.emitWarning(`vmmd: the daemon says ${frame.error.code}: ${frame.error.message}`);
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
      pending.frame = { ...pending.frame, again: true };
      this.trySendAgain(pending.frame, (error) => {
        clearTimeout(pending.timer);
        this.requests.delete(request);
        pending.spun();
        pending.reject(error);
      });
    }
    this.emit('resumed');
  }

  private trySendAgain(frame: ClientFrame, failed: (error: Error) => void): void {
    try {
      this.send(frame);
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
    for (const pending of this.requests.values()) {
      clearTimeout(pending.timer);
      pending.spun();
      pending.reject(this.lost());
    }
    this.requests.clear();
    this.emit('close', this.endedBy);
  }
}
