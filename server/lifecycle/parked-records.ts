/**
 * What the daemon parks besides descriptors: one compact record per object
 * (allocation, store), written as journal lines, and the replay that turns
 * a journal back into the state it describes. A line is a whole object as it
 * is now ("put") or its end ("gone"): replaying keeps the last line of each
 * object, so an object is whole (its last line) or absent, never half.
 */
import type { HandleKind, MemLocation } from '../backends/backend';

/** An allocation as parked: what the registry needs to take it back, and whom its quota charges. */
export interface ParkedAllocation {
  id: string;
  /** The name its descriptor is parked under. */
  fd: string;
  owner: string;
  device: number;
  /** The device's UUID ('' on the host backend): a restore on another GPU is refused. */
  deviceUuid: string;
  location: MemLocation;
  size: string;
  handleTypes: HandleKind[];
  imported: boolean;
  /** Handle references by holder (sessions, store holders), as [holder, count]. */
  references: Array<[string, number]>;
  shareKey?: string;
  /** The session request that made it: an allocate sent again after the restart finds it. */
  request?: string;
  readOnlyStore?: string;
  /** Whom the quota charges: its first owner and that owner's uid when the memory came; session 0 once it passed to the daemon (the uid alone); none: the daemon's own, uncharged. */
  charged?: { session: string; uid: number };
}

/** A store as parked: made of a parked allocation (held by the store's holder). */
export interface ParkedStore {
  id: string;
  name: string;
  owner: string;
  target: 'SYSMEM' | 'ZCMEM' | 'FBMEM';
  device: number;
  size: string;
  readOnly: boolean;
  attached: boolean;
  allocationId: string;
  creatorUid?: number;
}

/** A session that owned parked objects: who it was, for its resumption. */
export interface ParkedSessionRecord {
  id: string;
  uid: number;
  gid: number;
  /** Its gRPC token and resume token (server/transport/session/resume.ts): absent, nobody can resume it. */
  token?: string;
  resumeToken?: string;
}

export type JournalLine =
  | { t: 'a'; a: ParkedAllocation; next: string }
  | { t: 'A'; id: string }
  | { t: 's'; s: ParkedStore; next: string }
  | { t: 'S'; id: string }
  | { t: 'p'; p: ParkedSessionRecord }
  | { t: 'P'; id: string };

/** The state a journal describes. */
export interface ParkedState {
  allocations: Map<string, ParkedAllocation>;
  stores: Map<string, ParkedStore>;
  sessions: Map<string, ParkedSessionRecord>;
  /** The registry's next id and the stores' next id: never reused after a restart. */
  nextId: bigint;
  nextStoreId: bigint;
}

export function emptyState(): ParkedState {
  return { allocations: new Map(), stores: new Map(), sessions: new Map(), nextId: 1n, nextStoreId: 1n };
}

const maxOf = (a: bigint, b: bigint) => (a > b ? a : b);

/** Applies one line to the state. */
export function apply(state: ParkedState, line: JournalLine): void {
  switch (line.t) {
    case 'a':
      state.allocations.set(line.a.id, line.a);
      state.nextId = maxOf(state.nextId, BigInt(line.next));
      break;
    case 'A':
      state.allocations.delete(line.id);
      break;
    case 's':
      state.stores.set(line.s.id, line.s);
      state.nextStoreId = maxOf(state.nextStoreId, BigInt(line.next));
      break;
    case 'S':
      state.stores.delete(line.id);
      break;
    case 'p':
      state.sessions.set(line.p.id, line.p);
      break;
    case 'P':
      state.sessions.delete(line.id);
      break;
  }
}

/** The lines that write the state anew (a compacted journal). */
export function* snapshotLines(state: ParkedState): IterableIterator<JournalLine> {
  for (const p of state.sessions.values()) yield { t: 'p', p };
  for (const a of state.allocations.values()) yield { t: 'a', a, next: String(state.nextId) };
  for (const s of state.stores.values()) yield { t: 's', s, next: String(state.nextStoreId) };
}

/**
 * Replays journal text: every complete line in order. A last line cut short
 * (the process died inside the write) is not an object's state and is skipped.
 */
export function replay(text: string, state: ParkedState = emptyState()): ParkedState {
  // The next ids as the decimal text the lines carry, the larger kept: one BigInt each at the end, not one a line.
  let nextId = '0';
  let nextStoreId = '0';
  for (const raw of text.split('\n')) {
    if (raw === '') continue;
    let line: JournalLine;
    try {
      line = JSON.parse(raw) as JournalLine;
    } catch {
      continue;
    }
    if (line.t === 'a') {
      state.allocations.set(line.a.id, line.a);
      nextId = largerDecimal(nextId, line.next);
    } else if (line.t === 's') {
      state.stores.set(line.s.id, line.s);
      nextStoreId = largerDecimal(nextStoreId, line.next);
    } else {
      apply(state, line);
    }
  }
  state.nextId = maxOf(state.nextId, BigInt(nextId));
  state.nextStoreId = maxOf(state.nextStoreId, BigInt(nextStoreId));
  return state;
}

/** The larger of two non-negative integers written in decimal without leading zeros (as String(bigint) writes them). */
const largerDecimal = (a: string, b: string) => (b.length > a.length || (b.length === a.length && b > a) ? b : a);
