/**
 * The client's side of the session socket: the greeting with the session
 * token, descriptors received from the daemon by transfer id, and descriptors
 * sent to it.
 */
import { EventEmitter } from 'node:events';
import { dirname } from 'node:path';
import { status as Status } from '@grpc/grpc-js';
import { type ClientFrame, type DaemonCase, decodeDaemonFrame, encodeClientFrame, isProtocol1, PROTOCOL_VERSION } from '../common/protocol';
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
 * Emits 'close' when the connection ends and 'daemon-error' (SessionError)
 * when the daemon refuses a frame or tells of a failure no request waits for.
 */
export class ClientSession extends EventEmitter {
  readonly id: string;
  readonly token: string;
  /** What the daemon can do, from its hello (session.proto's Capability names): ask these, not a backend's name. */
  readonly capabilities: ReadonlySet<Capability__Output>;
  // Descriptors the daemon sent, until a call claims them.
  private readonly inbox = new TransferInbox({
    keepMs: UNCLAIMED_TRANSFER_MS,
    increasing: false,
    close: (fd) => native.close(fd),
    errors: {
      notReceived: (transfer, waitMs) => new VmmdError('TRANSFER_NOT_RECEIVED', Status.DEADLINE_EXCEEDED, `descriptor ${transfer} did not arrive within ${waitMs} ms`),
      used: (transfer) => new VmmdError('TRANSFER_USED', Status.FAILED_PRECONDITION, `descriptor ${transfer} is already being claimed`),
      closed: () => this.lost(),
    },
  });
  private nextTransfer = 1n;
  // Requests in flight (allocate, release, share, export, open, ping) by request id.
  private readonly requests = new Map<string, PendingRequest>();
  private nextRequest = 1n;

  private constructor(
    private readonly connection: SeqpacketConnection,
    hello: HelloResponse__Output,
    private readonly busyPollMicros: number,
  ) {
    super();
    this.id = hello.session;
    this.token = hello.token;
    this.capabilities = new Set(hello.capabilities);
    connection.on('message', (message: SeqpacketMessage) => this.onMessage(message));
    connection.on('close', () => this.onClose());
    // The session must not keep a finished program alive; pending calls do.
    connection.unref();
  }

  /**
   * Connects, says hello (the protocol it speaks) and waits for the daemon's answer.
   * @param busyPollMicros while a request waits for its answer, the event loop spins this long before each sleep
   *   (native/busy-poll.ts): an answer that comes within it finds the process awake (0: never spin)
   * @throws VmmdError UNAVAILABLE DAEMON_UNREACHABLE, BAD_GREETING; DEADLINE_EXCEEDED NO_GREETING; FAILED_PRECONDITION
   *   PROTOCOL_VERSION (a daemon of another session protocol); the daemon's refusal of the session (PERMISSION_DENIED…)
   */
  static open(path: string, timeoutMs: number, busyPollMicros = DEFAULT_BUSY_POLL_MICROS): Promise<ClientSession> {
    let connection: SeqpacketConnection;
    try {
      connection = SeqpacketConnection.connect(path);
    } catch (error) {
      return Promise.reject(
        new VmmdError('DAEMON_UNREACHABLE', Status.UNAVAILABLE, `cannot reach vmmd at ${path}: ${(error as Error).message}; ${whereElse(dirname(path))}`),
      );
    }
    return new Promise((resolve, reject) => {
      let settled = false;
      const fail = (error: VmmdError) => {
        // Settle first: closing emits 'close', whose handler would settle with a vaguer error.
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        reject(error);
        connection.close();
      };
      const timer = setTimeout(
        () => fail(new VmmdError('NO_GREETING', Status.DEADLINE_EXCEEDED, `vmmd at ${path} sent no greeting within ${timeoutMs} ms`)),
        timeoutMs,
      );
      connection.once('close', () => fail(new VmmdError('DAEMON_UNREACHABLE', Status.UNAVAILABLE, `vmmd at ${path} closed the session socket`)));
      connection.once('message', (message: SeqpacketMessage) => {
        if (message.fd >= 0) native.close(message.fd);
        // A daemon of protocol 1 speaks first, in JSON.
        if (isProtocol1(message.data)) {
          fail(new VmmdError('PROTOCOL_VERSION', Status.FAILED_PRECONDITION, `vmmd at ${path} speaks session protocol 1; this client speaks ${PROTOCOL_VERSION}: upgrade the daemon`));
          return;
        }
        const frame = decodeDaemonFrame(message.data);
        if (typeof frame !== 'string' && frame.error != null) {
          const refused = frame.error;
          fail(new VmmdError(refused.code as DeclaredCode, refused.status === 0 ? Status.PERMISSION_DENIED : (refused.status as Status), `vmmd refused the session: ${refused.message}`));
          return;
        }
        if (typeof frame === 'string' || frame.hello == null || frame.hello.protocol !== PROTOCOL_VERSION) {
          fail(new VmmdError('BAD_GREETING', Status.UNAVAILABLE, `vmmd at ${path} greeted with an unexpected frame`));
          return;
        }
        settled = true;
        clearTimeout(timer);
        connection.removeAllListeners();
        resolve(new ClientSession(connection, frame.hello, busyPollMicros));
      });
      try {
        connection.send(encodeClientFrame({ hello: { protocol: PROTOCOL_VERSION } }));
      } catch {
        // The daemon refused the session at connect and closed (EPIPE): its refusal, already queued, is read above.
      }
    });
  }

  get closed(): boolean {
    return this.connection.isClosed;
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
  private request<T extends keyof Answers>(answer: T, frame: ClientFrame, timeoutMs: number, awaited = true): Promise<{ message: Answers[T]; fd: number }> {
    const request = String(this.nextRequest++);
    const what = Object.keys(frame)[0];
    const sent = tracing ? traceClock() : 0n;
    return new Promise((resolve, reject) => {
      const spun = busyPollWhile(this.busyPollMicros);
      const timer = setTimeout(() => {
        this.requests.delete(request);
        spun();
        reject(new VmmdError('NO_ANSWER', Status.DEADLINE_EXCEEDED, `the daemon did not answer ${what} request ${request} within ${timeoutMs} ms`));
      }, timeoutMs);
      this.requests.set(request, {
        answer,
        resolve: (tracing ? (value) => {
          traceSince(`session:${what}`, sent);
          resolve(value as never);
        } : resolve) as PendingRequest['resolve'],
        reject,
        timer,
        spun,
      });
      try {
        this.send({ ...frame, request });
      } catch (error) {
        clearTimeout(timer);
        this.requests.delete(request);
        spun();
        reject(error);
        return;
      }
      // While the answer is on its way this process makes no driver call: its waiting unmaps go now,
      // rather than beside the import and map the answer leads to (the driver serializes them). Never throws.
      // Not for a request nobody waits on yet (an allocation ahead, sent as its caller starts mapping).
      if (awaited && (frame.allocate !== undefined || frame.open !== undefined)) flushUnmapsIfIdle();
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
    this.connection.close();
  }

  private send(frame: ClientFrame, fd = -1): void {
    if (this.closed) throw this.lost();
    let sent: boolean;
    try {
      sent = this.connection.send(encodeClientFrame(frame), fd);
    } catch (error) {
      throw new VmmdError('SESSION_LOST', Status.UNAVAILABLE, `the session socket failed: ${(error as Error).message}`);
    }
    if (!sent) throw new VmmdError('SESSION_SOCKET_FULL', Status.UNAVAILABLE, 'the session socket is full; the daemon is not reading');
  }

  private lost(): VmmdError {
    return new VmmdError('SESSION_LOST', Status.UNAVAILABLE, `session ${this.id} with vmmd is closed`);
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
      if (frame.body === pending.answer && (raw.fd >= 0) === WITH_DESCRIPTOR.has(frame.body)) {
        pending.resolve({ message: frame[frame.body], fd: raw.fd });
        return;
      }
      const refused = frame.error;
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
      if (!this.emit('daemon-error', frame.error satisfies SessionError__Output)) process.emitWarning(`vmmd: the daemon says ${frame.error.code}: ${frame.error.message}`);
    }
  }

  private onClose(): void {
    this.inbox.close();
    for (const pending of this.requests.values()) {
      clearTimeout(pending.timer);
      pending.spun();
      pending.reject(this.lost());
    }
    this.requests.clear();
    this.emit('close');
  }
}
