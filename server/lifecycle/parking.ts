/**
 * The parked state: the daemon's memory kept outside its process. Every
 * allocation's descriptor goes to the file-descriptor store (systemd's, or
 * vmmd's keeper) as the memory comes, before its record; every change of an
 * allocation or a store is a journal line, written before the answer that
 * reports it; the journal is a memfd parked beside them. A crash at any
 * moment leaves each object whole (descriptor and record) or absent: a
 * descriptor without a record is closed at the next start, a record without
 * a descriptor dropped. Restoring is server/lifecycle/restore.ts.
 */
import type { Logger } from 'pino';
import { addon } from '../../native';
import type { Backend, BackendHandle, HandleKind, ImportedHandle, ImportSource, MemLocation } from '../backends/backend';
import type { AllocationObserver, AllocationRecord, AllocationSource } from '../registry';
import { PassThroughSource, type SourcedAllocation } from '../registry/source';
import { isStoreHolder, StoreEvent, StoreRecord } from '../stores/stores';
import type { DescriptorParking } from './fd-store';
import { Journal } from './journal';
import { apply, emptyState, JournalLine, ParkedAllocation, ParkedState, ParkedStore } from './parked-records';

/** The journal's descriptor name: `j` and its generation (a compaction parks the next one before it drops this one). */
export const journalName = (generation: number) => `j${generation}`;
export const JOURNAL_NAME = /^j(\d+)$/;

/** Lines a journal may hold before it is compacted, beyond four per live object. */
const COMPACT_SLACK = 4096;
/** A journal that went on after a restart is compacted this long after the start (once the daemon serves) when it holds more than one line per live object beyond the slack. */
export const COMPACT_AFTER_START_MS = 1000;

/** Where the daemon's Parking is, once it has started. */
export interface ParkingSlot {
  parking?: Parking;
}

/** Who a session is, for its parked record. */
export interface SessionPeers {
  peerOf(session: bigint): { uid: number; gid: number } | undefined;
  /** The session's tokens, for its client to resume it after a restart. */
  tokensOf?(session: bigint): { token: string; resumeToken: string } | undefined;
}

export class Parking implements AllocationObserver {
  // Invariant: the state the journal describes, line for line (what a compaction writes).
  private readonly state: ParkedState;
  // Invariant: the fd-store name of every live handle whose descriptor is parked.
  private readonly names = new Map<BackendHandle, string>();
  // Invariant: the last line written per allocation id (an unchanged record is not written again).
  private readonly written = new Map<string, string>();
  private nextName = 1;
  private frozen = false;
  // Invariant: names of freed memory whose descriptor is still to leave the store (sent on the next turn).
  private readonly removals: string[] = [];
  // The devices' UUIDs, read once: a record names its device by UUID.
  private readonly uuids: string[];

  private constructor(
    private readonly client: DescriptorParking,
    private readonly backend: Backend,
    private readonly peers: SessionPeers,
    private readonly log: Logger,
    private journal: Journal,
    private generation: number,
    state: ParkedState,
    /** The registry's next id, for each record (ids are never reused after a restart). */
    private readonly nextId: () => bigint,
  ) {
    this.state = state;
    this.uuids = backend.devices().map((device) => device.uuid);
  }

  /**
   * Starts the parked state from `state` (restored, or empty): a new journal
   * holding its snapshot is parked, then the previous ones dropped; or, with
   * `resumed`, the parked journal that `state` was read from goes on (it is
   * in the store already), and the older ones are dropped.
   * @throws the fd store's error (nothing can be parked)
   */
  static start(
    deps: { client: DescriptorParking; backend: Backend; peers: SessionPeers; log: Logger; nextId: () => bigint },
    state: ParkedState,
    previous: number[],
    usedNames: Iterable<string>,
    resumed?: { journal: Journal; generation: number },
  ): Parking {
    const generation = resumed?.generation ?? (previous.length === 0 ? 1 : Math.max(...previous) + 1);
    const journal = resumed?.journal ?? Journal.create(state);
    if (resumed === undefined) {
      try {
        deps.client.store(journalName(generation), journal.fd);
      } catch (error) {
        journal.close();
        throw error;
      }
    }
    for (const old of previous) if (old !== generation) deps.client.remove(journalName(old));
    const parking = new Parking(deps.client, deps.backend, deps.peers, deps.log, journal, generation, state, deps.nextId);
    for (const name of usedNames) parking.nextName = Math.max(parking.nextName, parseInt(name.slice(1), 36) + 1 || 1);
    return parking;
  }

  /**
   * The adaptor that parks each piece of memory's descriptor as it comes and
   * drops it once freed, through whichever Parking `slot` holds (none yet
   * while the daemon restores, none at all when parking is off).
   */
  static adaptor(slot: ParkingSlot, upstream: AllocationSource): AllocationSource {
    return new ParkingAdaptor(slot, upstream);
  }

  /**
   * A journal that went on after a restart is written anew a moment after
   * the start, off the path to the first answer, when it is long: the next
   * restart then reads one line per object, not the lines of every change.
   */
  compactAfterStart(): void {
    const live = this.state.allocations.size + this.state.stores.size + this.state.sessions.size;
    if (this.journal.lines <= COMPACT_SLACK / 4 + live) return;
    const timer = setTimeout(() => {
      if (!this.frozen) this.compact();
    }, COMPACT_AFTER_START_MS);
    timer.unref();
  }

  /** Objects a resumed journal names that did not come back at the restore (no descriptor, another device): recorded as gone. */
  forgetDropped(allocations: Iterable<string>, stores: Iterable<string>): void {
    for (const id of allocations) this.write({ t: 'A', id });
    for (const id of stores) this.write({ t: 'S', id });
  }

  /** Memory whose descriptor is parked already, under `name`: taken back at start, or whose free failed after detach(). */
  adopted(handle: BackendHandle, name: string): void {
    this.names.set(handle, name);
  }

  /** Parks a descriptor of new memory; logged and left unparked (lost at a crash) when the store refuses it. */
  async park(handle: BackendHandle, device: number): Promise<void> {
    if (this.frozen) return;
    const name = `m${(this.nextName++).toString(36)}`;
    let fd: number | undefined;
    try {
      fd = await this.backend.exportHandle(handle, device);
      this.client.store(name, fd);
      this.names.set(handle, name);
    } catch (error) {
      this.log.error({ err: error }, 'parking a descriptor failed: this memory will not survive a restart of the daemon');
    } finally {
      if (fd !== undefined) closeQuietly(fd);
    }
  }

  /**
   * Memory about to be freed: the name its descriptor is parked under leaves
   * the handle now, while the handle still names this memory. Once the
   * backend has freed it, the same handle value can name new memory (a host
   * memfd's number, a driver's handle), parked under a name of its own before
   * this free's continuation runs: looked up then, the handle would give the
   * new memory's name.
   * @returns the name, for unpark() once freed (or adopted() again when the free fails)
   */
  detach(handle: BackendHandle): string | undefined {
    const name = this.names.get(handle);
    this.names.delete(handle);
    return name;
  }

  /**
   * Memory freed: its descriptor leaves the store, after the answer (the
   * journal already says it is gone: a crash before the removal leaves a
   * descriptor no record names, which the next start closes).
   * @param name what detach() gave for its handle
   */
  unpark(name: string): void {
    if (this.removals.push(name) === 1 && !this.frozen) setImmediate(() => this.removeParked());
  }

  /** Sends the removals due; frozen, they wait (sent if the daemon records again, else the next start closes what no record names). */
  private removeParked(): void {
    if (this.frozen) return;
    for (const name of this.removals.splice(0)) {
      try {
        this.client.remove(name);
      } catch (error) {
        this.log.warn({ err: error, name }, 'dropping a parked descriptor failed; the next start closes it');
      }
    }
  }

  changed(allocation: AllocationRecord): void {
    const fd = this.names.get(allocation.handle);
    if (fd === undefined || this.frozen) return;
    const parked = this.parkedAllocation(allocation, fd);
    const text = JSON.stringify(parked);
    const id = String(allocation.id);
    if (this.written.get(id) === text) return;
    this.noteSession(allocation.owner);
    // The line is written from the record's text as it is: one serialization per change.
    this.write({ t: 'a', a: parked, next: String(this.nextId()) }, `{"t":"a","a":${text},"next":"${this.nextId()}"}`);
    this.written.set(id, text);
  }

  gone(allocation: AllocationRecord): void {
    const id = String(allocation.id);
    this.written.delete(id);
    if (this.frozen || !this.state.allocations.has(id)) return;
    this.write({ t: 'A', id });
  }

  /** A store's life: recorded when made, dropped when detached (a detached store is not listed, and goes). */
  storeEvent(event: StoreEvent): void {
    if (this.frozen) return;
    const store = event.store;
    if (event.kind === 'CREATED') {
      const parked = this.parkedStore(store);
      if (parked === undefined) return;
      this.noteSession(store.owner);
      this.write({ t: 's', s: parked, next: String(store.id + 1n) });
    } else if ((event.kind === 'DETACHED' || event.kind === 'RELEASED') && this.state.stores.has(String(store.id))) {
      this.write({ t: 'S', id: String(store.id) });
    }
  }

  /**
   * Stops recording: from here on nothing the process does changes the
   * parked state (a stop that reclaims its sessions leaves the memory parked
   * for the next start).
   */
  freeze(): void {
    this.frozen = true;
  }

  /** Records again after a freeze (a successor that went away before it served): nothing changed meanwhile but frees, sent now. */
  thaw(): void {
    this.frozen = false;
    if (this.removals.length > 0) setImmediate(() => this.removeParked());
  }

  /** Objects recorded now (allocations, stores). */
  counts(): { allocations: number; stores: number; journalLines: number } {
    return { allocations: this.state.allocations.size, stores: this.state.stores.size, journalLines: this.journal.lines };
  }

  private parkedAllocation(allocation: AllocationRecord, fd: string): ParkedAllocation {
    const previous = this.state.allocations.get(String(allocation.id));
    const references: Array<[string, number]> = [];
    for (const [holder, count] of allocation.references) if (!isStoreHolder(holder)) references.push([String(holder), count]);
    const owner = allocation.owner;
    const peer = owner === 0n ? undefined : this.peers.peerOf(owner);
    return {
      id: String(allocation.id),
      fd,
      owner: String(owner),
      device: allocation.device,
      deviceUuid: this.uuids[allocation.device] ?? '',
      location: allocation.location,
      size: String(allocation.size),
      handleTypes: allocation.handleTypes as HandleKind[],
      imported: allocation.imported,
      references,
      // Plain properties (JSON.stringify leaves out the undefined ones): a conditional spread costs ~20 µs a change.
      shareKey: allocation.shareKey,
      request: allocation.request,
      ...chargedOf(previous?.charged, owner, peer?.uid),
    };
  }

  private parkedStore(store: StoreRecord): ParkedStore | undefined {
    const allocationId = store.memory.allocationId;
    // A SYSMEM attachment maps a client's memfd outside the registry: not parked.
    if (allocationId === 0n || !this.state.allocations.has(String(allocationId))) return undefined;
    return {
      id: String(store.id),
      name: store.name,
      owner: String(store.owner),
      target: store.target,
      device: store.device,
      size: String(store.size),
      readOnly: store.readOnly,
      attached: store.attached,
      allocationId: String(allocationId),
      ...(store.creatorUid === undefined ? {} : { creatorUid: store.creatorUid }),
    };
  }

  /** A session opened: its record is parked before its hello goes, so that its client can resume it even if it owns nothing yet. */
  sessionOpened(id: bigint): void {
    if (this.frozen) return;
    this.noteSession(id);
  }

  /** A session ended and was reclaimed: its record goes (the next compaction would drop it anyway). */
  sessionEnded(id: bigint): void {
    // Frozen, its reclaim's frees were not recorded: its record stays, so the next start reclaims what it owned after the grace.
    if (this.frozen) return;
    if (this.state.sessions.has(String(id))) this.write({ t: 'P', id: String(id) });
  }

  /** The owner's session record, written once, before the first object it owns (or at its open). */
  private noteSession(owner: bigint): void {
    if (owner === 0n || isStoreHolder(owner) || this.state.sessions.has(String(owner))) return;
    const peer = this.peers.peerOf(owner);
    if (peer === undefined) return;
    this.write({ t: 'p', p: { id: String(owner), uid: peer.uid, gid: peer.gid, ...this.peers.tokensOf?.(owner) } });
  }

  private write(line: JournalLine, text?: string): void {
    try {
      this.journal.append(line, text);
    } catch (error) {
      this.log.error({ err: error }, 'writing the parked state failed: the change will not survive a restart of the daemon');
      return;
    }
    apply(this.state, line);
    const live = this.state.allocations.size + this.state.stores.size + this.state.sessions.size;
    if (this.journal.lines > COMPACT_SLACK + 4 * live) this.compact();
  }

  /** Writes the state anew in a fresh journal, parks it, then drops the old one: a crash between leaves two, and the newer is whole. */
  private compact(): void {
    const live = new Set<string>();
    for (const a of this.state.allocations.values()) {
      live.add(a.owner);
      if (a.charged !== undefined && a.charged.session !== '0') live.add(a.charged.session);
    }
    for (const s of this.state.stores.values()) live.add(s.owner);
    // And the sessions open or waiting for their clients, objects or not: they can be resumed.
    for (const id of this.state.sessions.keys()) if (this.peers.peerOf(BigInt(id)) !== undefined) live.add(id);
    for (const id of [...this.state.sessions.keys()]) if (!live.has(id)) this.state.sessions.delete(id);
    let next: Journal;
    try {
      next = Journal.create(this.state);
      this.client.store(journalName(this.generation + 1), next.fd);
    } catch (error) {
      this.log.warn({ err: error }, 'compacting the parked state failed; the journal goes on growing');
      return;
    }
    const old = this.journal;
    this.client.remove(journalName(this.generation));
    this.generation++;
    this.journal = next;
    old.close();
  }
}

/**
 * Whom the quota charges, as parked: the owner and its uid when the memory
 * came; once it passed to the daemon, that uid alone (session 0). Memory the
 * daemon made for itself is charged to nobody.
 */
function chargedOf(previous: ParkedAllocation['charged'], owner: bigint, uid: number | undefined): Pick<ParkedAllocation, 'charged'> {
  if (previous !== undefined) return { charged: owner === 0n ? { session: '0', uid: previous.uid } : previous };
  return uid === undefined ? {} : { charged: { session: String(owner), uid } };
}

function closeQuietly(fd: number): void {
  try {
    addon.close(fd);
  } catch {
    // Already closed: nothing to give back.
  }
}

/** Parks each piece of memory's descriptor as it comes, before the registry records it; drops it once freed. */
class ParkingAdaptor extends PassThroughSource {
  constructor(
    private readonly slot: ParkingSlot,
    upstream: AllocationSource,
  ) {
    super(upstream);
  }

  override async create(owner: bigint, device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    const handle = await this.upstream.create(owner, device, location, size, handleTypes);
    await this.slot.parking?.park(handle, device);
    return handle;
  }

  override async adopt(owner: bigint, source: ImportSource, size: bigint): Promise<ImportedHandle> {
    const imported = await this.upstream.adopt(owner, source, size);
    await this.slot.parking?.park(imported.handle, imported.device);
    return imported;
  }

  override async release(allocation: SourcedAllocation, awaited: boolean): Promise<void> {
    const parking = this.slot.parking;
    // Taken before the free: after it, the handle value may already name other memory, parked meanwhile.
    const name = parking?.detach(allocation.handle);
    try {
      await this.upstream.release(allocation, awaited);
    } catch (error) {
      // Not freed: the memory lives on under its parked name.
      if (name !== undefined) parking!.adopted(allocation.handle, name);
      throw error;
    }
    if (name !== undefined) parking!.unpark(name);
  }
}

/** The parked state of a fresh start. */
export const freshState = emptyState;
