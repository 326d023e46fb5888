/**
 * Stores: memory many processes open, with legate::ExternalAllocation's
 * semantics. Detach stops new opens and waits for every daemon operation on
 * the store; a store is freed once it is detached (or its owner's session
 * is gone) and nobody has it open, and exactly then a RELEASED event tells
 * the owner to run its deleter. Once detached, a store still open is no
 * longer its maker's to pay for: what it costs (a store, the daemon's
 * mapping and its address space) counts against each uid that keeps it
 * open, until it closes, so that no other uid can keep a maker's detached
 * store on the maker's budgets.
 * Read-only stores are never written by the daemon and are handed out read-only.
 */
import { EventEmitter } from 'node:events';
import type { Logger } from 'pino';
import { addon } from '../../native';
import { failedPrecondition, invalidArgument, notFound, outOfRange, permissionDenied } from '../errors';
import type { Charge } from '../registry/uid-budgets';
import { AllocationRecord, DAEMON_OWNER, Registry } from '../registry';
import { StoreEventKind, StoreEventLog } from './store-events';
import { closeOpens, moveCharge, storeCosts } from './store-charges';
import { AllocationMemory, StoreMemory } from './store-memory';
import { checkNotMappedWritable } from './store-admission';
import { attachClientMemfd } from './sysmem-attachment';
import { StoreNames } from './store-names';
import { STORE_HOLDER_BASE, StoreEvent, StoreRecord, StoreTarget } from './store-record';

export { isStoreHolder } from './store-record';
export type { StoreEvent, StoreEventKind, StoreRecord, StoreState, StoreTarget } from './store-record';

export class StoreRegistry extends EventEmitter {
  private nextId = 1n;
  // Invariant: every store not yet released; names of stores not detached are unique, and `names` indexes them.
  private readonly stores = new Map<bigint, StoreRecord>();
  private readonly names = new StoreNames<StoreRecord>();
  private readonly events: StoreEventLog<StoreRecord>;

  constructor(
    private readonly registry: Registry,
    private readonly log?: Logger,
  ) {
    super();
    this.setMaxListeners(0);
    this.events = new StoreEventLog(log);
  }

  list(): StoreRecord[] {
    return [...this.stores.values()];
  }

  /** The sequence number of the latest event (0: none yet). */
  get lastSequence(): bigint {
    return this.events.lastSequence;
  }

  /** Events after `since`, oldest first. */
  eventsSince(since: bigint): StoreEvent[] {
    return this.events.since(since);
  }

  /**
   * A store of an allocation the caller may touch. The store holds its own
   * reference; it counts as a store and a daemon mapping of the caller's uid.
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; ALREADY_EXISTS NAME_TAKEN; PERMISSION_DENIED NOT_OWNER;
   *   RESOURCE_EXHAUSTED BUDGET_EXCEEDED
   */
  async create(
    caller: bigint,
    args: { allocationId: bigint; name: string; readOnly: boolean; handOver: boolean; size: bigint; creatorUid?: number },
  ): Promise<StoreRecord> {
    const unclaim = this.names.claim(args.name);
    try {
      return await this.createClaimed(caller, args);
    } finally {
      unclaim();
    }
  }

  private async createClaimed(
    caller: bigint,
    args: { allocationId: bigint; name: string; readOnly: boolean; handOver: boolean; size: bigint; creatorUid?: number },
  ): Promise<StoreRecord> {
    const allocationSize = this.registry.allocation(args.allocationId).size;
    if (args.size > allocationSize) {
      throw outOfRange('BEYOND_ALLOCATION', `store size ${args.size} exceeds allocation ${args.allocationId} of ${allocationSize} bytes`);
    }
    const id = this.nextId++;
    const holder = STORE_HOLDER_BASE + id;
    const charge = this.registry.budgets?.take(caller, storeCosts(allocationSize));
    let allocation: AllocationRecord;
    let memory: StoreMemory;
    try {
      allocation = this.registry.holdAllocation(caller, args.allocationId, holder, args.handOver);
      memory = await this.mapHeld(allocation, holder, id, args.readOnly);
    } catch (error) {
      charge?.give();
      throw error;
    }
    const target: StoreTarget =
      allocation.location.type === 'DEVICE' && this.registry.backend.capabilities.gpuMemory
        ? 'FBMEM'
        : allocation.location.type === 'DEVICE'
          ? 'SYSMEM'
          : 'ZCMEM';
    return this.add(caller, {
      charge,
      chargedBytes: allocationSize,
      id,
      name: args.name,
      owner: args.handOver ? DAEMON_OWNER : caller,
      target,
      device: allocation.device,
      size: args.size === 0n ? allocation.size : args.size,
      readOnly: args.readOnly,
      attached: false,
      hasDeleter: false,
      memory,
      creatorUid: args.creatorUid,
    });
  }

  /**
   * A store of external memory the caller sent: a memfd (SYSMEM) or CUDA
   * memory (ZCMEM, FBMEM). Takes ownership of fd. Counts as a store and a
   * daemon mapping of the caller's uid (an import, as an allocation too).
   * @throws FAILED_PRECONDITION NO_CUDA_BACKEND; OUT_OF_RANGE UNKNOWN_DEVICE; INVALID_ARGUMENT BAD_DESCRIPTOR, ZERO_SIZE;
   *   RESOURCE_EXHAUSTED BUDGET_EXCEEDED
   */
  async attach(
    caller: bigint,
    fd: number,
    args: { target: StoreTarget; device: number; size: bigint; readOnly: boolean; name: string; hasDeleter: boolean; creatorUid?: number },
  ): Promise<StoreRecord> {
    let unclaim: () => void;
    try {
      unclaim = this.names.claim(args.name);
    } catch (error) {
      addon.close(fd);
      throw error;
    }
    try {
      return await this.attachClaimed(caller, fd, args);
    } finally {
      unclaim();
    }
  }

  private async attachClaimed(
    caller: bigint,
    fd: number,
    args: { target: StoreTarget; device: number; size: bigint; readOnly: boolean; name: string; hasDeleter: boolean; creatorUid?: number },
  ): Promise<StoreRecord> {
    let charge: Charge | undefined;
    try {
      if (args.target !== 'SYSMEM' && !this.registry.backend.capabilities.gpuMemory) {
        throw failedPrecondition('NO_CUDA_BACKEND', `${args.target} stores need the cuda backend; this daemon runs the ${this.registry.backend.name} backend`);
      }
      if (args.device >= this.registry.devices.length) {
        throw outOfRange('UNKNOWN_DEVICE', `device ${args.device} does not exist (the daemon has ${this.registry.devices.length} device(s))`);
      }
      if (args.size === 0n) throw invalidArgument('ZERO_SIZE', 'an attached allocation must have a size above 0');
      charge = this.registry.budgets?.take(caller, storeCosts(args.size));
    } catch (error) {
      addon.close(fd);
      throw error;
    }
    try {
      return await this.attachCharged(caller, fd, args, charge);
    } catch (error) {
      charge?.give();
      throw error;
    }
  }

  /** attach once its arguments are checked, its name claimed and the store counted. */
  private async attachCharged(
    caller: bigint,
    fd: number,
    args: { target: StoreTarget; device: number; size: bigint; readOnly: boolean; name: string; hasDeleter: boolean; creatorUid?: number },
    charge: Charge | undefined,
  ): Promise<StoreRecord> {
    const id = this.nextId++;
    let memory: StoreMemory;
    if (args.target === 'SYSMEM') {
      memory = await attachClientMemfd(this.registry, caller, fd, args.size, args.readOnly);
    } else {
      const allocation = await this.registry.importHandle(caller, { fd }, args.size);
      const holder = STORE_HOLDER_BASE + id;
      this.registry.holdAllocation(caller, allocation.id, holder);
      await this.registry.release(caller, allocation.id);
      // The import goes with the store that could not be made (found by fault injection: it stayed).
      memory = await this.mapHeld(allocation, holder, id, args.readOnly);
    }
    return this.add(caller, {
      charge,
      chargedBytes: args.size,
      id,
      name: args.name,
      owner: caller,
      target: args.target,
      device: args.device,
      size: args.size,
      readOnly: args.readOnly,
      attached: true,
      hasDeleter: args.hasDeleter,
      memory,
      creatorUid: args.creatorUid,
    });
  }

  /**
   * A store an earlier daemon process parked, taken back on its allocation
   * (restored, server/lifecycle/): held and mapped again under its own id.
   * @throws as mapHeld (the store is not made)
   */
  async restore(
    fields: Pick<StoreRecord, 'id' | 'name' | 'owner' | 'target' | 'device' | 'size' | 'readOnly' | 'attached' | 'creatorUid' | 'charge'>,
    allocation: AllocationRecord,
  ): Promise<StoreRecord> {
    const holder = STORE_HOLDER_BASE + fields.id;
    allocation.references.set(holder, (allocation.references.get(holder) ?? 0) + 1);
    // A store handed over keeps its memory for the daemon, as when it was made (its maker may still let go of it).
    if (fields.owner === DAEMON_OWNER) (allocation.keptForDaemon ??= new Set()).add(holder);
    const memory = await this.mapHeld(allocation, holder, fields.id, fields.readOnly);
    if (fields.id >= this.nextId) this.nextId = fields.id + 1n;
    return this.add(fields.owner, { ...fields, chargedBytes: allocation.size, hasDeleter: false, memory });
  }

  /**
   * The store by id, or by name among stores not detached.
   * @throws NOT_FOUND UNKNOWN_STORE
   */
  find(ref: { id: bigint; name: string }): StoreRecord {
    const store = ref.id !== 0n ? this.stores.get(ref.id) : this.names.get(ref.name);
    if (store === undefined) {
      throw notFound('UNKNOWN_STORE', ref.id !== 0n ? `store ${ref.id} does not exist` : `no store is named ${JSON.stringify(ref.name)}`);
    }
    return store;
  }

  /**
   * The store a StoreRef names (by id, else by name); null names none.
   * @throws INVALID_ARGUMENT NO_STORE; NOT_FOUND UNKNOWN_STORE
   */
  findRef(ref: { id?: string | number | bigint; name?: string } | null | undefined): StoreRecord {
    if (ref === null || ref === undefined) throw invalidArgument('NO_STORE', 'name the store by id or name');
    return this.find({ id: BigInt(ref.id ?? 0), name: ref.name ?? '' });
  }

  /**
   * A descriptor of the store for the session, counted as one open; with
   * `readOnlyDescriptor`, one that cannot write where the memory allows it.
   * @throws FAILED_PRECONDITION STORE_DETACHED, STORE_READ_ONLY
   */
  async open(session: bigint, store: StoreRecord, writable: boolean, readOnlyDescriptor = false): Promise<number> {
    this.checkLive(store, 'open');
    if (writable && store.readOnly) {
      throw failedPrecondition('STORE_READ_ONLY', `store ${store.id} is read-only; open it without writable`);
    }
    const fd = await this.use(store, () => store.memory.exportFd(readOnlyDescriptor));
    store.opens.set(session, (store.opens.get(session) ?? 0) + 1);
    this.record('OPENED', store, session);
    return fd;
  }

  /**
   * Drops one open of the session; frees a detached store nobody uses any more.
   * @throws FAILED_PRECONDITION NOT_OPEN
   */
  async close(session: bigint, store: StoreRecord): Promise<number> {
    const count = store.opens.get(session) ?? 0;
    if (count === 0) throw failedPrecondition('NOT_OPEN', `session ${session} has no open of store ${store.id}`);
    if (count === 1) closeOpens(store, session);
    else store.opens.set(session, count - 1);
    this.record('CLOSED', store, session);
    await this.releaseOrLog(store);
    return this.openCount(store);
  }

  /**
   * Detach as Legate defines it: no new opens, then waits for every daemon
   * operation on the store; the memory goes once nobody has it open. When
   * freeing fails the store stays detached, its memory accounted, and the
   * error says so; Detach again tries the free again (so do the last close
   * and the end of any session).
   * @throws PERMISSION_DENIED NOT_OWNER; FAILED_PRECONDITION STORE_DETACHED; the free's error
   */
  async detach(caller: bigint, store: StoreRecord): Promise<StoreRecord> {
    if (store.owner !== caller && store.owner !== DAEMON_OWNER) {
      throw permissionDenied('NOT_OWNER', `store ${store.id} belongs to session ${store.owner}; only its owner detaches it`);
    }
    if (store.state === 'DETACHED' && store.releaseFailure !== undefined) {
      await this.release(store);
      return store;
    }
    if (store.state !== 'LIVE') throw failedPrecondition('STORE_DETACHED', `store ${store.id} is already ${store.state.toLowerCase()}`);
    await this.detachNow(store, caller);
    return store;
  }

  /**
   * A session is gone: its opens close, and its own stores detach (they go
   * when others close them too).
   */
  async reclaim(session: bigint): Promise<void> {
    const failures: unknown[] = [];
    for (const store of [...this.stores.values()]) {
      if (store.opens.has(session)) {
        closeOpens(store, session);
        this.record('CLOSED', store, session);
      }
      try {
        if (store.owner === session && store.state === 'LIVE') await this.detachNow(store, session);
        else await this.release(store);
      } catch (error) {
        failures.push(error);
      }
    }
    if (failures.length > 0) {
      throw new AggregateError(
        failures,
        `reclaiming the stores of session ${session}: ${failures.length} could not be freed (first: ${(failures[0] as Error).message})`,
      );
    }
  }

  /**
   * Runs a daemon operation on a live store, counted for Detach to wait on.
   * @throws FAILED_PRECONDITION STORE_DETACHED
   */
  async use<T>(store: StoreRecord, operation: () => Promise<T>): Promise<T> {
    const end = this.begin(store);
    try {
      return await operation();
    } finally {
      end();
    }
  }

  /**
   * Counts one daemon operation on a live store (a whole Read, Write, Fill or
   * Copy, however many chunks), until the returned function runs.
   * @throws FAILED_PRECONDITION STORE_DETACHED
   */
  begin(store: StoreRecord): () => void {
    this.checkLive(store, 'operations');
    store.inFlight++;
    let ended = false;
    return () => {
      if (ended) return;
      ended = true;
      store.inFlight--;
      if (store.inFlight === 0) for (const wake of store.drainWaiters.splice(0)) wake();
      if (store.state === 'DETACHED') void this.releaseOrLog(store);
    };
  }

  /** @throws OUT_OF_RANGE BEYOND_STORE; FAILED_PRECONDITION STORE_READ_ONLY (for writes) */
  checkRange(store: StoreRecord, offset: bigint, length: bigint, write: boolean): void {
    if (write && store.readOnly) throw failedPrecondition('STORE_READ_ONLY', `store ${store.id} is read-only: the daemon never writes it`);
    if (length === 0n) throw invalidArgument('ZERO_SIZE', 'length must be greater than 0');
    if (offset + length > store.size) {
      throw outOfRange('BEYOND_STORE', `[${offset}, ${offset + length}) runs past the end of store ${store.id} (${store.size} bytes)`);
    }
  }

  /** Reads a store range chunk by chunk; the caller has begun the operation. */
  async readChunk(store: StoreRecord, offset: bigint, length: bigint): Promise<Buffer> {
    this.checkRange(store, offset, length, false);
    return store.memory.read(offset, Number(length));
  }

  /** Writes through to the store's memory: resolved once the bytes are there. The caller has begun the operation. */
  async writeChunk(store: StoreRecord, offset: bigint, data: Buffer): Promise<void> {
    this.checkRange(store, offset, BigInt(data.length), true);
    await store.memory.write(offset, data);
  }

  /**
   * Seals (for a read-only store) and maps memory held for store `id`; when
   * either fails, the store's hold is dropped, and the memory with it if
   * nothing else holds it.
   */
  private async mapHeld(allocation: AllocationRecord, holder: bigint, id: bigint, readOnly: boolean): Promise<StoreMemory> {
    try {
      if (readOnly) {
        checkNotMappedWritable(this.registry, allocation);
        this.registry.sealReadOnly(allocation, id);
      }
      return await AllocationMemory.map(this.registry, allocation, holder, readOnly);
    } catch (error) {
      await this.registry.dropHolder(holder, allocation.id);
      throw error;
    }
  }

  private add(
    caller: bigint,
    fields: Omit<StoreRecord, 'state' | 'opens' | 'inFlight' | 'drainWaiters' | 'releasing' | 'releaseFailure' | 'chargeMoved' | 'openerCharges'>,
  ): StoreRecord {
    const store: StoreRecord = {
      ...fields,
      state: 'LIVE',
      opens: new Map(),
      inFlight: 0,
      drainWaiters: [],
      releasing: false,
      chargeMoved: false,
      openerCharges: new Map(),
    };
    this.stores.set(store.id, store);
    this.names.bind(store.name, store);
    this.record('CREATED', store, caller);
    return store;
  }

  private async detachNow(store: StoreRecord, caller: bigint): Promise<void> {
    store.state = 'DETACHING';
    if (store.inFlight > 0) await new Promise<void>((resolve) => store.drainWaiters.push(resolve));
    store.state = 'DETACHED';
    this.names.drop(store.name, store);
    this.record('DETACHED', store, caller);
    await this.release(store);
  }

  private openCount(store: StoreRecord): number {
    let total = 0;
    for (const count of store.opens.values()) total += count;
    return total;
  }

  /**
   * Frees a detached store nobody uses. A store is forgotten only once its
   * memory is freed: when a step fails it stays (detached, accounted, with
   * releaseFailure) and the error is thrown; a repeat resumes at that step.
   * One still open moves its charge to the sessions that keep it open first.
   */
  private async release(store: StoreRecord): Promise<void> {
    if (store.state !== 'DETACHED' || store.inFlight > 0) return;
    if (this.openCount(store) > 0) return moveCharge(store, this.registry.budgets);
    if (store.releasing) return;
    store.releasing = true;
    try {
      await store.memory.release();
    } catch (error) {
      store.releasing = false;
      store.releaseFailure = (error as Error).message;
      throw Object.assign(
        new Error(`store ${store.id} is detached, but its memory could not be freed yet: ${store.releaseFailure}; Detach it again to retry`),
        { code: (error as { code?: unknown }).code },
      );
    }
    store.releaseFailure = undefined;
    this.stores.delete(store.id);
    store.charge?.give();
    this.record('RELEASED', store, DAEMON_OWNER);
  }

  /** release, where nobody waits for the answer: a failure is logged, and retried at the next Detach, close or session end. */
  private async releaseOrLog(store: StoreRecord): Promise<void> {
    try {
      await this.release(store);
    } catch (error) {
      this.log?.error({ err: error, store: String(store.id) }, 'freeing a detached store failed; it is retried');
    }
  }

  private checkLive(store: StoreRecord, what: string): void {
    if (store.state !== 'LIVE') {
      throw failedPrecondition('STORE_DETACHED', `store ${store.id} is ${store.state.toLowerCase()}: no new ${what}`);
    }
  }

  private record(kind: StoreEventKind, store: StoreRecord, session: bigint): void {
    this.emit('event', this.events.add(kind, store, session, this.openCount(store)));
  }
}
