/**
 * The transfer inbox: descriptors that arrived on a session socket, each
 * named by its transfer id, until the call that names the id claims them.
 * One inbox serves both ends (server/transport/session/sessions.ts, client/session.ts): a
 * descriptor may arrive before or after its claim, and one nobody claims is
 * closed after a while. Errors are the caller's own kind (RpcError or VmmdError).
 */

export interface InboxErrors {
  /** No descriptor arrived as `transfer` within `waitMs`. */
  notReceived(transfer: string, waitMs: number): Error;
  /** `transfer` is being claimed (`claiming`) or was claimed, refused or expired (`past`). */
  used(transfer: string, when: 'claiming' | 'past'): Error;
  /** The session closed (before `transfer` arrived, when one was awaited). */
  closed(transfer?: string): Error;
}

export interface InboxOptions {
  /** How long a received, unclaimed descriptor is kept before it is closed. */
  keepMs: number;
  /** Unclaimed descriptors held at once; a descriptor beyond is refused (default: no bound). */
  maxHeld?: number;
  /** Ids must increase (the daemon's rule for what clients send): an id at or below the highest seen is used. */
  increasing: boolean;
  close(fd: number): void;
  /** Told when an unclaimed descriptor expires. */
  expired?(transfer: string): void;
  errors: InboxErrors;
  /** Why no more descriptors may be held (a bound beyond this inbox's own, e.g. per uid), or undefined. */
  mayHold?: () => string | undefined;
}

/** What became of a delivered descriptor: claimed at once, held, or refused (the inbox closed it). */
export type Delivery = { kind: 'claimed' | 'held' } | { kind: 'refused'; code: 'TRANSFER_USED' | 'TOO_MANY_TRANSFERS'; message: string };

interface Held {
  fd: number;
  timer: NodeJS.Timeout;
}

interface Waiter {
  resolve(fd: number): void;
  reject(error: Error): void;
  timer: NodeJS.Timeout;
}

export class TransferInbox {
  // Invariant: a transfer id is in at most one of held and waiters; with `increasing`,
  // every id in held is at most highest, and an id at or below it not in held was used.
  private readonly heldFds = new Map<string, Held>();
  private readonly waiters = new Map<string, Waiter>();
  private highest = 0n;
  private closed = false;

  constructor(private readonly options: InboxOptions) {}

  /** Descriptors received and not claimed yet. */
  get held(): number {
    return this.heldFds.size;
  }

  /** Takes a descriptor that arrived as `transfer`: hands it to its waiting claim, or holds it. */
  deliver(transfer: string, fd: number): Delivery {
    if (this.options.increasing) {
      const id = BigInt(transfer);
      if (id <= this.highest) {
        this.options.close(fd);
        return {
          kind: 'refused',
          code: 'TRANSFER_USED',
          message: `transfer ids must increase: ${transfer} is not above ${this.highest}, already used in this session`,
        };
      }
      this.highest = id;
    }
    const waiter = this.waiters.get(transfer);
    if (waiter !== undefined) {
      clearTimeout(waiter.timer);
      this.waiters.delete(transfer);
      waiter.resolve(fd);
      return { kind: 'claimed' };
    }
    if (this.heldFds.size >= (this.options.maxHeld ?? Infinity)) {
      this.options.close(fd);
      return { kind: 'refused', code: 'TOO_MANY_TRANSFERS', message: `already holding ${this.heldFds.size} unclaimed descriptors` };
    }
    const beyond = this.options.mayHold?.();
    if (beyond !== undefined) {
      this.options.close(fd);
      return { kind: 'refused', code: 'TOO_MANY_TRANSFERS', message: beyond };
    }
    const timer = setTimeout(() => {
      this.heldFds.delete(transfer);
      this.options.close(fd);
      this.options.expired?.(transfer);
    }, this.options.keepMs);
    timer.unref();
    const previous = this.heldFds.get(transfer);
    if (previous !== undefined) {
      // Only without `increasing` (the daemon never reuses an id it sends): the newer descriptor wins.
      clearTimeout(previous.timer);
      this.options.close(previous.fd);
    }
    this.heldFds.set(transfer, { fd, timer });
    return { kind: 'held' };
  }

  /**
   * The descriptor that arrived (or arrives within `waitMs`) as `transfer`; the caller owns it.
   * @throws (rejects) the errors' notReceived, used, closed
   */
  take(transfer: string, waitMs: number): Promise<number> {
    const held = this.heldFds.get(transfer);
    if (held !== undefined) {
      clearTimeout(held.timer);
      this.heldFds.delete(transfer);
      return Promise.resolve(held.fd);
    }
    const { errors } = this.options;
    if (this.options.increasing) {
      if (this.waiters.has(transfer)) return Promise.reject(errors.used(transfer, 'claiming'));
      if (BigInt(transfer) <= this.highest) return Promise.reject(errors.used(transfer, 'past'));
    }
    if (this.closed) return Promise.reject(errors.closed());
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiters.delete(transfer);
        reject(errors.notReceived(transfer, waitMs));
      }, waitMs);
      const previous = this.waiters.get(transfer);
      if (previous !== undefined) {
        // Only without `increasing`: one claim per id, the newer one waits.
        clearTimeout(previous.timer);
        previous.reject(errors.used(transfer, 'claiming'));
      }
      this.waiters.set(transfer, { resolve, reject, timer });
    });
  }

  /** Closes every held descriptor; returns how many. */
  closeHeld(): number {
    const count = this.heldFds.size;
    for (const held of this.heldFds.values()) {
      clearTimeout(held.timer);
      this.options.close(held.fd);
    }
    this.heldFds.clear();
    return count;
  }

  /** The session is gone: every waiting claim fails, every held descriptor is closed, later claims fail. */
  close(): void {
    this.closed = true;
    for (const [transfer, waiter] of this.waiters) {
      clearTimeout(waiter.timer);
      waiter.reject(this.options.errors.closed(transfer));
    }
    this.waiters.clear();
    this.closeHeld();
  }
}
