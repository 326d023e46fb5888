/**
 * The registry's records and the rules every part of it shares: who may act
 * on whose objects, alignment, the owner names in messages. Records are
 * plain data; the parts (allocations, address space, I/O, reclaim) own the
 * operations on them.
 */
import type { Access, BackendHandle, HandleKind, MemLocation } from '../backends/backend';
import { failedPrecondition, invalidArgument, permissionDenied } from '../errors';
import type { SerialQueue } from '../serial-queue';
import type { Charge } from './uid-budgets';

/** The owner id of objects that belong to the daemon rather than a session. */
export const DAEMON_OWNER = 0n;

/** Largest reservation: 2^46 bytes (64 TiB), well inside a 47-bit user address space. */
export const MAX_RESERVATION_BYTES = 1n << 46n;

/** Largest Read or Write chunk the registry hands the backend at once. */
export const IO_CHUNK_BYTES = 1 << 20;

export interface ReservationRecord {
  readonly id: bigint;
  readonly owner: bigint;
  readonly address: bigint;
  readonly size: bigint;
  readonly alignment: bigint;
  // Invariant: sorted by address; every mapping lies inside the reservation and no two overlap.
  readonly mappings: MappingRecord[];
  readonly queue: SerialQueue;
  /** What it counts against its owner's uid's budgets until it is freed. */
  readonly charge?: Charge;
  freed: boolean;
}

export interface AllocationRecord {
  readonly id: bigint;
  owner: bigint;
  readonly device: number;
  readonly location: MemLocation;
  readonly size: bigint;
  readonly handle: BackendHandle;
  readonly handleTypes: HandleKind[];
  readonly imported: boolean;
  /** Minimum granularity of the allocation's location: its mappings align to it. */
  readonly granularity: bigint;
  // Invariant: handle references by holder (owner id); no entry holds 0.
  readonly references: Map<bigint, number>;
  /**
   * Holders that keep it for the daemon (stores handed over): once its owner
   * holds no handle reference while one of them still does, it is the daemon's.
   */
  keptForDaemon?: Set<bigint>;
  // Invariant: the backend holds 1 + backendRetains references to `handle` while
  // any registry reference is left; releases drop a retained one first.
  backendRetains: number;
  mappingCount: number;
  // Operations in flight that use the handle (export); freeing waits for them.
  busy: number;
  shareKey?: string;
  /** The session request that made it (CreateArgs.request), parked with it. */
  request?: string;
  /** The read-only store made of it, if any: from then on nothing writes it through the daemon (for good, as the host's seal). */
  readOnlyStore?: bigint;
  freed: boolean;
}

/** Whether its owner (a session) holds no handle reference any more while a holder keeps it for the daemon (a store handed over). */
export function keptOnlyForDaemon(allocation: AllocationRecord): boolean {
  if (allocation.owner === DAEMON_OWNER || allocation.references.has(allocation.owner)) return false;
  for (const holder of allocation.keptForDaemon ?? []) if (allocation.references.has(holder)) return true;
  return false;
}

export interface MappingRecord {
  readonly address: bigint;
  readonly size: bigint;
  readonly allocation: AllocationRecord;
  // Invariant: holds only READ or READWRITE; a location absent has no access.
  readonly access: Map<string, Access>;
  /** What it counts against the uid of the session that mapped it, until it is unmapped. */
  readonly charge?: Charge;
  unmapping: boolean;
}

export interface ReserveArgs {
  size: bigint;
  alignment: bigint;
  address: bigint;
}

export interface CreateArgs {
  size: bigint;
  location: MemLocation;
  handleType: HandleKind;
  /** The session request that asks for it (an allocate message's id): the same request sent again after a restart finds it. */
  request?: string;
}

export interface MapArgs {
  address: bigint;
  size: bigint;
  offset: bigint;
  allocationId: bigint;
}

export interface ExportArgs {
  allocationId: bigint;
  handleType: HandleKind;
  shareKey: string;
}

export interface ReleaseResult {
  freed: boolean;
  handleReferences: number;
  mappingCount: number;
}

/** A Release's answer, and its free (settles when the backend has freed the memory). */
export interface Released {
  result: ReleaseResult;
  freeing: Promise<void>;
}

/** An export's result: the allocation and its descriptor (owned by the caller) or fabric bytes. */
export interface Exported {
  allocation: AllocationRecord;
  fd?: number;
  fabric?: Buffer;
}

/** Ids of reservations, allocations and stores' holders: one sequence, never reused. */
export class IdSequence {
  private next = 1n;
  take(): bigint {
    return this.next++;
  }
  /** The id the next take() returns. */
  peek(): bigint {
    return this.next;
  }
  /** Skips ids an earlier daemon process gave out (the parked state's next id). */
  advanceTo(next: bigint): void {
    if (next > this.next) this.next = next;
  }
}

/**
 * Hears of every allocation's changes, synchronously, before the answer that
 * reports them (the parked state: server/lifecycle/). A change is a new
 * allocation, a reference dropped, a new owner, a share key.
 */
export interface AllocationObserver {
  changed(allocation: AllocationRecord): void;
  /** Its free has begun: it is gone for callers. */
  gone(allocation: AllocationRecord): void;
}

export const hex = (value: bigint) => `0x${value.toString(16)}`;
export const range = (address: bigint, size: bigint) => `[${hex(address)}, ${hex(address + size)})`;
export const ownerName = (owner: bigint) => (owner === DAEMON_OWNER ? 'the daemon' : `session ${owner}`);
export const isPowerOfTwo = (value: bigint) => value > 0n && (value & (value - 1n)) === 0n;

/** Binary search in a list sorted by address: the index of the first entry starting after `address`. */
export function indexAfter(list: ReadonlyArray<{ address: bigint }>, address: bigint): number {
  let low = 0;
  let high = list.length;
  while (low < high) {
    const middle = (low + high) >>> 1;
    if (list[middle].address <= address) low = middle + 1;
    else high = middle;
  }
  return low;
}

/**
 * Who may act on an object: its owner, and on the daemon's objects (made
 * without a session, or left behind by a session that ended while others
 * still used them) the daemon itself and the callers `actsForDaemon` admits.
 * A bare registry admits every caller; the daemon admits admins' sessions and
 * store holders only (server/app/daemon.ts).
 */
export class Ownership {
  constructor(private readonly actsForDaemon: (caller: bigint) => boolean = () => true) {}

  mayAct(caller: bigint, owner: bigint): boolean {
    return owner === caller || (owner === DAEMON_OWNER && this.actsForDaemon(caller));
  }

  /** @throws PERMISSION_DENIED NOT_OWNER */
  check(caller: bigint, owner: bigint, what: string): void {
    if (this.mayAct(caller, owner)) return;
    throw permissionDenied(
      'NOT_OWNER',
      owner === DAEMON_OWNER
        ? `${what} belongs to the daemon; only an admin (--admin-uids, --admin-gids) acts on the daemon's objects, and ${ownerName(caller)}'s uid is not one`
        : `${what} belongs to ${ownerName(owner)}; ${ownerName(caller)} may touch only its own objects`,
    );
  }
}

/** @throws INVALID_ARGUMENT NOT_ALIGNED */
export function checkAligned(what: string, value: bigint, granularity: bigint): void {
  if (value % granularity !== 0n) {
    throw invalidArgument('NOT_ALIGNED', `${what} ${value >= 1n << 20n ? hex(value) : value} is not a multiple of the granularity ${granularity}`);
  }
}

export const readOnlyMemory = (allocation: AllocationRecord, what: string) =>
  failedPrecondition(
    'READ_ONLY_MEMORY',
    `cannot ${what}: allocation ${allocation.id} backs read-only store ${allocation.readOnlyStore}, and nothing writes it through the daemon`,
  );

/** Objects a long loop (a session's reclaim) handles before it lets the event loop serve others. */
const YIELD_EVERY = 64;

/** Every YIELD_EVERY-th call waits one turn of the event loop: awaits that resolve at once never yield. */
export function breathe(count: number): Promise<void> | undefined {
  return count % YIELD_EVERY === 0 ? new Promise((resolve) => setImmediate(resolve)) : undefined;
}
