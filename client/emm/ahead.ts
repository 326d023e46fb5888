/**
 * Allocations ahead: for each size this process has asked the daemon for more
 * than once, `depth` more allocations of it, received (their descriptors held,
 * not mapped) before they are asked for, so that the next memalloc of that size maps
 * it without waiting for a round trip (in a cold cycle the allocate round
 * trip costs about as much as the create and export the stock saves). It is an
 * ordinary allocate of the session's: the daemon accounts it to this user
 * and reclaims it with the session. Bounded in bytes; given back when unused
 * for `idleMs`, and by dropAll() (clearCaches, reset, out of memory).
 */
import { status as Status } from '@grpc/grpc-js';
import type { ExportResponse__Output } from '../../generated/vmmd/v1/ExportResponse';
import { VmmdError } from '../errors';

export interface AheadSettings {
  /** At most this many bytes held ahead, all sizes together; a size above it never is (0: none). */
  maxBytes: bigint;
  /** An allocation held ahead this long without being taken goes back to the daemon. */
  idleMs: number;
  /**
   * How many are held for each size. Two: back to back, the one a memalloc takes was asked for a memalloc
   * earlier, and its answer is here (with one, the answer asked for as the caller maps was often still on its
   * way at the next memalloc: a round trip takes longer than a cold memalloc's own work).
   */
  depth: number;
}

export const DEFAULT_AHEAD: AheadSettings = { maxBytes: 256n << 20n, idleMs: 1_000, depth: 2 };

/** The most allocations held ahead for one size. */
export const MAX_AHEAD_DEPTH = 8;

/**
 * The settings, checked.
 * @throws VmmdError INVALID_ARGUMENT BAD_CONFIG naming the value and the rule
 */
export function checkAhead(settings: AheadSettings): AheadSettings {
  const bad = (message: string) => new VmmdError('BAD_CONFIG', Status.INVALID_ARGUMENT, message);
  if (typeof settings.maxBytes !== 'bigint' || settings.maxBytes < 0n)
    throw bad(`allocations ahead: maxBytes ${String(settings.maxBytes)} must be a bigint >= 0`);
  if (!Number.isInteger(settings.idleMs) || settings.idleMs < 1 || settings.idleMs > MAX_TIMER_MS) {
    throw bad(`allocations ahead: idleMs ${settings.idleMs} must be an integer from 1 to ${MAX_TIMER_MS}`);
  }
  if (!Number.isInteger(settings.depth) || settings.depth < 1 || settings.depth > MAX_AHEAD_DEPTH) {
    throw bad(`allocations ahead: depth ${settings.depth} must be an integer from 1 to ${MAX_AHEAD_DEPTH}`);
  }
  return settings;
}

/** The longest delay setTimeout keeps (a longer one fires at once). */
const MAX_TIMER_MS = 2 ** 31 - 1;

/** An allocation received and not mapped: the answer and its descriptor. */
export interface Received {
  message: ExportResponse__Output;
  fd: number;
}

/** What the holder needs of the daemon: an allocate that does not map, and a give-back of what it received. */
export interface AheadSource<Location> {
  allocate(size: bigint, location: Location): Promise<Received>;
  giveBack(received: Received): void;
}

interface Entry {
  readonly size: bigint;
  // Settles to the allocation, or to undefined when the daemon refused it (quota, session gone).
  readonly answer: Promise<Received | undefined>;
  timer?: NodeJS.Timeout;
  // held: in the map; taken: a memalloc awaits its answer; dropped: expired or given back (an answer arriving after goes back at once).
  state: 'held' | 'taken' | 'dropped';
}

/** How many distinct sizes the holder remembers having seen (then it forgets them all). */
const REMEMBERED_SIZES = 64;

export class AllocationsAhead<Location> {
  // Invariant: at most settings.depth entries per key, oldest first, no queue empty; `bytes` is the sum of their sizes, ≤ settings.maxBytes.
  private readonly entries = new Map<string, Entry[]>();
  private bytes = 0n;
  // Keys allocated from the daemon at least once (a second time starts holding one ahead).
  private readonly seen = new Set<string>();
  // Keys whose allocation ahead the daemon refused: none again until dropAll().
  private readonly refused = new Set<string>();
  private readonly inFlight = new Set<Promise<unknown>>();
  readonly counters = { requested: 0, taken: 0, expired: 0, refused: 0, dropped: 0 };
  // dropAll() starts a new epoch: refusals of requests from an earlier one do not mark their key.
  private epoch = 0;
  // While above 0 (an out-of-memory retry runs), nothing new is asked for ahead.
  private paused = 0;

  /** No allocation is asked for ahead until the returned function is called. */
  pause(): () => void {
    this.paused++;
    let resumed = false;
    return () => {
      if (!resumed) this.paused--;
      resumed = true;
    };
  }

  constructor(
    private readonly settings: AheadSettings,
    private readonly source: AheadSource<Location>,
    private readonly keyOf: (size: bigint, location: Location) => string,
  ) {}

  /** The bytes held ahead (received or on their way). */
  get heldBytes(): bigint {
    return this.bytes;
  }

  /** The number of allocations held ahead (received or on their way). */
  get held(): number {
    let count = 0;
    for (const queue of this.entries.values()) count += queue.length;
    return count;
  }

  /** The number of allocations asked for ahead whose answer has not come yet (taken ones too). */
  get arriving(): number {
    return this.inFlight.size;
  }

  /**
   * The oldest allocation held ahead for this size and location, if any (it
   * may still be on its way; undefined once settled means the daemon refused
   * it), and a request for the next one, sent now: its round trip runs while
   * the caller maps.
   */
  take(size: bigint, location: Location): Promise<Received | undefined> | undefined {
    const key = this.keyOf(size, location);
    const entry = this.entries.get(key)?.[0];
    if (entry === undefined) return undefined;
    this.forget(key, entry, 'taken');
    this.counters.taken++;
    this.request(key, size, location);
    return entry.answer;
  }

  /** After an allocation of this size went to the daemon: the second time a size is seen, `depth` are held ahead of it. */
  noteAllocated(size: bigint, location: Location): void {
    const key = this.keyOf(size, location);
    if (this.seen.has(key)) {
      this.request(key, size, location);
      return;
    }
    if (this.seen.size >= REMEMBERED_SIZES) this.seen.clear();
    this.seen.add(key);
  }

  /** Gives back everything held ahead, and resolves once what was on its way has come and gone back too. */
  async dropAll(): Promise<void> {
    this.epoch++;
    const gone: Array<Promise<unknown>> = [...this.inFlight];
    for (const [key, entry] of [...this.entries].flatMap(([key, queue]) => queue.map((entry) => [key, entry] as const))) {
      this.forget(key, entry, 'dropped');
      this.counters.dropped++;
      gone.push(this.giveBackOnArrival(entry));
    }
    this.refused.clear();
    this.seen.clear();
    await Promise.all(gone);
  }

  /** Asks for as many as the size's queue lacks, within the bytes. */
  private request(key: string, size: bigint, location: Location): void {
    if (this.paused > 0) return;
    while ((this.entries.get(key)?.length ?? 0) < this.settings.depth && !this.refused.has(key) && this.bytes + size <= this.settings.maxBytes) {
      this.requestOne(key, size, location);
    }
  }

  private requestOne(key: string, size: bigint, location: Location): void {
    this.counters.requested++;
    const epoch = this.epoch;
    // The answer's continuations name the entry, which holds the answer: declared first, assigned once below.
    // eslint-disable-next-line prefer-const
    let entry: Entry;
    const answer = this.source.allocate(size, location).then(
      (received): Received | undefined => {
        if (entry.state === 'dropped') {
          // Dropped while on its way: nobody will take it.
          this.source.giveBack(received);
          return undefined;
        }
        if (entry.state === 'held') {
          entry.timer = setTimeout(() => this.expire(key, entry), this.settings.idleMs);
          entry.timer.unref();
        }
        return received;
      },
      () => {
        // Refused (over the quota, the session gone): the caller allocates as it would have; no more ahead of this size for now.
        this.counters.refused++;
        if (epoch === this.epoch) this.refused.add(key);
        if (entry.state === 'held') this.forget(key, entry, 'dropped');
        return undefined;
      },
    );
    entry = { size, answer, state: 'held' };
    const queue = this.entries.get(key);
    if (queue === undefined) this.entries.set(key, [entry]);
    else queue.push(entry);
    this.bytes += size;
    this.inFlight.add(answer);
    void answer.then(() => this.inFlight.delete(answer));
  }

  private expire(key: string, entry: Entry): void {
    if (entry.state !== 'held') return;
    this.forget(key, entry, 'dropped');
    this.counters.expired++;
    void this.giveBackOnArrival(entry);
  }

  /** A dropped entry's allocation goes back once its answer is here (an answer the daemon refused is nothing to give back). */
  private giveBackOnArrival(entry: Entry): Promise<void> {
    return entry.answer.then((received) => {
      if (received !== undefined) this.source.giveBack(received);
    });
  }

  private forget(key: string, entry: Entry, state: 'taken' | 'dropped'): void {
    entry.state = state;
    clearTimeout(entry.timer);
    const queue = this.entries.get(key)!;
    queue.splice(queue.indexOf(entry), 1);
    if (queue.length === 0) this.entries.delete(key);
    this.bytes -= entry.size;
  }
}
