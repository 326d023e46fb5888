/**
 * Stores' events, kept for Watch's replay (the last EVENT_LOG_SIZE, numbered
 * in order), and the operator's trail of every store's life in the log:
 * creations, detaches and releases at info, bounded per uid (a client can
 * make and drop stores as fast as it likes), opens and closes not logged.
 */
import type { Logger } from 'pino';
import { LogLimiter } from '../observability/log-limiter';
import { DAEMON_OWNER } from '../registry';

export type StoreEventKind = 'CREATED' | 'OPENED' | 'CLOSED' | 'DETACHED' | 'RELEASED';

/** What the trail says of a store. */
export interface TrailedStore {
  readonly id: bigint;
  readonly name: string;
  readonly target: string;
  readonly size: bigint;
  readonly readOnly: boolean;
  readonly creatorUid?: number;
}

export interface LoggedEvent<S> {
  sequence: bigint;
  kind: StoreEventKind;
  store: S;
  session: bigint;
}

/** Events kept for Watch's replay. */
const EVENT_LOG_SIZE = 4096;

export class StoreEventLog<S extends TrailedStore> {
  private nextSequence = 1n;
  // Invariant: the latest events, at most EVENT_LOG_SIZE, oldest first, numbered without gaps.
  private readonly events: Array<LoggedEvent<S>> = [];
  private readonly trail = new LogLimiter(10_000, 20);

  constructor(private readonly log?: Logger) {}

  /** The sequence number of the latest event (0: none yet). */
  get lastSequence(): bigint {
    return this.nextSequence - 1n;
  }

  /** Events after `since`, oldest first. */
  since(since: bigint): Array<LoggedEvent<S>> {
    return this.events.filter((event) => event.sequence > since);
  }

  /** Numbers and keeps an event, and writes the trail's line for it. @param opens the store's opens now (said at detach) */
  add(kind: StoreEventKind, store: S, session: bigint, opens: number): LoggedEvent<S> {
    if (kind === 'CREATED' || kind === 'DETACHED' || kind === 'RELEASED') {
      const allowed = this.trail.allow(`${kind}:${store.creatorUid ?? 'daemon'}`);
      const fields = {
        store: String(store.id),
        name: store.name,
        target: store.target,
        size: String(store.size),
        readOnly: store.readOnly,
        by: session === DAEMON_OWNER ? 'daemon' : `session ${session}`,
        ...(allowed !== undefined && allowed.suppressed > 0 ? { heldBack: allowed.suppressed } : {}),
      };
      const level = allowed === undefined ? 'debug' : 'info';
      if (kind === 'CREATED') this.log?.[level](fields, 'store created');
      else if (kind === 'DETACHED') this.log?.[level]({ ...fields, opens }, 'store detached');
      else this.log?.[level](fields, 'store released: its memory is freed');
    }
    const event: LoggedEvent<S> = { sequence: this.nextSequence++, kind, store, session };
    this.events.push(event);
    if (this.events.length > EVENT_LOG_SIZE) this.events.shift();
    return event;
  }
}
