/**
 * Allocations: physical memory's lifecycle in the registry. Creation and
 * adoption (through the allocation source and its adaptors), handle
 * references by holder, export, share keys, and the free that happens once
 * nothing references or maps the memory any more.
 */
import type { Backend, BackendHandle, HandleKind, ImportSource, MemLocation } from '../backends/backend';
import { failedPrecondition, invalidArgument, notFound, unavailable } from '../errors';
import type { DeviceTable } from './devices';
import {
  AllocationRecord,
  checkAligned,
  CreateArgs,
  DAEMON_OWNER,
  ExportArgs,
  Exported,
  hex,
  IdSequence,
  keptOnlyForDaemon,
  Ownership,
  ownerName,
  AllocationObserver,
  Released,
  ReleaseResult,
} from './records';
import { admitExport, newShareKey } from './export-rights';
import { PendingCreates } from './pending-creates';
import { RetainedReferences } from './retained-references';
import type { AllocationSource } from './source';

export class Allocations {
  // Invariant: every allocation not yet freed by the backend, by id.
  private readonly records = new Map<bigint, AllocationRecord>();
  private readonly pending = new PendingCreates();
  // Invariant: one promise per free in flight (settled either way), removed once it settles.
  private readonly freeing = new Set<Promise<void>>();
  private readonly retained: RetainedReferences;
  /** Hears of every allocation's changes (the parked state, server/lifecycle/); none: nobody records them. */
  observer?: AllocationObserver;

  constructor(
    private readonly backend: Backend,
    private readonly source: AllocationSource,
    private readonly devices: DeviceTable,
    private readonly ids: IdSequence,
    private readonly ownership: Ownership = new Ownership(),
  ) {
    this.retained = new RetainedReferences(backend);
  }

  /** Takes in an allocation whole (parked by an earlier daemon process, restored): its id is its own. */
  insert(record: AllocationRecord): void {
    this.records.set(record.id, record);
  }

  /** Every allocation not freed nor being freed. */
  *all(): IterableIterator<AllocationRecord> {
    for (const record of this.records.values()) if (!record.freed) yield record;
  }

  /**
   * Creates physical memory owned by the caller, with one handle reference.
   * The arguments are checked before anything is awaited; the memory is made
   * off the event loop where the backend can. Memory made for an owner whose
   * reclaim began meanwhile is released again, not recorded.
   * @throws INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED; OUT_OF_RANGE UNKNOWN_DEVICE;
   *   FAILED_PRECONDITION UNSUPPORTED_HANDLE_TYPE; RESOURCE_EXHAUSTED OUT_OF_MEMORY, QUOTA_EXCEEDED;
   *   UNAVAILABLE SESSION_CLOSED (the owner was reclaimed while its memory was being made)
   */
  async create(caller: bigint, args: CreateArgs): Promise<AllocationRecord> {
    const device = this.devices.deviceOf(args.location);
    const info = this.devices.list[device];
    if (args.size === 0n) throw invalidArgument('ZERO_SIZE', 'allocation size must be greater than 0');
    if (!info.handleTypes.includes(args.handleType)) {
      throw failedPrecondition(
        'UNSUPPORTED_HANDLE_TYPE',
        `device ${device} cannot export ${args.handleType} handles (supported: ${info.handleTypes.join(', ')})`,
      );
    }
    const granularity = this.backend.granularity(args.location).minimum;
    checkAligned('allocation size', args.size, granularity);
    // Descriptors always work; fabric comes on top where asked for.
    const handleTypes: HandleKind[] = args.handleType === 'FABRIC' ? ['POSIX_FD', 'FABRIC'] : ['POSIX_FD'];
    // The quota adaptor reserves its bytes before it awaits the backend: concurrent creates cannot overshoot.
    const pending = this.pending.begin(caller);
    try {
      const handle = await this.createAfterFrees(caller, device, args.location, args.size, handleTypes);
      if (!pending.abandoned) return this.add(caller, handle, args.size, device, args.location, handleTypes, false, granularity, args.request);
      // Nobody is left to release it: given back through the adaptors (refunded, uncounted) before the refusal.
      let fate = 'the memory was released';
      try {
        await this.source.release({ owner: caller, handle, size: args.size, device, imported: false }, true);
      } catch (error) {
        // Kept in sight rather than lost: the daemon's, with no reference, freed by the next reclaim or Release.
        const orphan = this.add(DAEMON_OWNER, handle, args.size, device, args.location, handleTypes, false, granularity);
        orphan.references.clear();
        fate = `releasing the memory failed (${(error as Error).message}): allocation ${orphan.id} is the daemon's until a reclaim or Release frees it`;
      }
      throw unavailable('SESSION_CLOSED', `${ownerName(caller)} was reclaimed while its ${args.size}-byte allocation was being created; ${fate}`);
    } finally {
      pending.settle();
    }
  }

  /**
   * Abandons the owner's creates in flight (their memory is released as it
   * arrives) and waits for them to settle: what a reclaim does first, so
   * that no memory made for the owner lands after it.
   */
  abandonCreates(owner: bigint): Promise<void> {
    return this.pending.abandon(owner);
  }

  /**
   * Create, then export a descriptor of it for the caller (Allocate, the
   * session socket's allocate); the allocation is released again if the export fails.
   * @throws as create and exportHandle
   */
  async createExported(caller: bigint, args: CreateArgs, onRollbackFailure: (error: unknown) => void): Promise<Exported> {
    const record = await this.create(caller, args);
    try {
      return await this.exportHandle(caller, { allocationId: record.id, handleType: 'POSIX_FD', shareKey: '' });
    } catch (error) {
      await this.release(caller, record.id).catch(onRollbackFailure);
      throw error;
    }
  }

  /**
   * Adopts memory a peer handed over (Import, Attach); the caller holds its one handle reference.
   * @throws OUT_OF_RANGE UNKNOWN_DEVICE; the backend's BAD_DESCRIPTOR
   */
  async importHandle(caller: bigint, source: ImportSource, size: bigint): Promise<AllocationRecord> {
    const imported = await this.source.adopt(caller, source, size);
    const granularity = this.backend.granularity(imported.location).minimum;
    return this.add(caller, imported.handle, imported.size, imported.device, imported.location, ['POSIX_FD'], true, granularity);
  }

  /**
   * Drops one handle reference: the caller's own, else (when the caller may act
   * for the owner) the owner's. Memory is freed once no reference and no
   * mapping is left; this resolves once that free is done (the Release RPC).
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; FAILED_PRECONDITION ALREADY_RELEASED, NO_REFERENCE;
   *   PERMISSION_DENIED NOT_OWNER; the free's error
   */
  async release(caller: bigint, allocationId: bigint): Promise<ReleaseResult> {
    // Waited for: the source starts the free now rather than at a quiet moment.
    const { result, freeing } = await this.retained.run(this.get(allocationId), () => this.releaseStep(caller, allocationId, true));
    await freeing;
    return result;
  }

  /**
   * Release, resolved as soon as the references are dropped and the free (if
   * due) has started: `freed` then means nothing references or maps the
   * memory and its free has begun. `freeing` settles when the backend has
   * freed it, and rejects if it could not: the allocation is then recorded
   * and charged again, and the next Release or reclaim tries the free again.
   * The quota charge stays until the free is done.
   * @throws as release, but never the free's error (that is `freeing`'s)
   */
  async releaseAnswering(caller: bigint, allocationId: bigint): Promise<Released> {
    return this.retained.run(this.get(allocationId), () => this.releaseStep(caller, allocationId, false));
  }

  /**
   * releaseAnswering once no drop of the allocation is in flight: synchronous unless a driver reference is dropped.
   * @param awaited whether the caller waits for the free (AllocationSource.release)
   */
  private releaseStep(caller: bigint, allocationId: bigint, awaited: boolean): Released | Promise<Released> {
    const allocation = this.get(allocationId);
    const total = this.referenceCount(allocation);
    if (total === 0 && allocation.mappingCount === 0 && allocation.busy === 0) {
      // Every reference was dropped but freeing failed (a driver error): this Release tries again.
      this.ownership.check(caller, allocation.owner, `allocation ${allocationId}`);
      const freeing = this.startFree(allocation, awaited);
      return { result: { freed: freeing !== undefined, handleReferences: 0, mappingCount: 0 }, freeing: freeing ?? Promise.resolve() };
    }
    if (total === 0) {
      throw failedPrecondition(
        'ALREADY_RELEASED',
        `allocation ${allocationId} was already released; its memory lives until its ${allocation.mappingCount} mapping(s) are unmapped`,
      );
    }
    let holder: bigint;
    if (allocation.references.has(caller)) {
      holder = caller;
    } else {
      this.ownership.check(caller, allocation.owner, `allocation ${allocationId}`);
      if (!allocation.references.has(allocation.owner)) {
        throw failedPrecondition('NO_REFERENCE', `${ownerName(caller)} holds no handle reference to allocation ${allocationId}`);
      }
      holder = allocation.owner;
    }
    const answer = (): Released => {
      // Let go of by its owner while a store handed over keeps it: the daemon's from now on, as at the owner's end.
      if (keptOnlyForDaemon(allocation)) this.passToDaemon(allocation);
      const freeing = this.startFree(allocation, awaited);
      return {
        result: { freed: freeing !== undefined, handleReferences: this.referenceCount(allocation), mappingCount: allocation.mappingCount },
        freeing: freeing ?? Promise.resolve(),
      };
    };
    const drop = this.retained.drop(allocation, holder, 1);
    return drop === undefined ? answer() : drop.then(answer);
  }

  /**
   * Tries again the free of an allocation whose free failed, if nothing
   * references or maps it (the daemon's retry of a free that failed after a
   * session-socket release was answered).
   * @returns false when there is nothing to free (freed meanwhile, or in use again)
   * @throws the free's error (the allocation stays, counted)
   */
  async retryFree(allocationId: bigint): Promise<boolean> {
    const allocation = this.records.get(allocationId);
    if (allocation === undefined || allocation.freed) return false;
    return this.freeIfUnused(allocation);
  }

  /**
   * The source's create; when the device is out of memory while frees are
   * in flight (releases answered before their free), it waits for them and
   * asks once more: a client that frees and allocates at once must not fail
   * on memory on its way out. (Quotas wait for their own holder's frees:
   * Quotas.holdAfterFrees.)
   */
  private async createAfterFrees(caller: bigint, device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    // A Release waiting on the driver has not started its free yet: the quota check comes after it has.
    const releasing = this.retained.settled();
    if (releasing !== undefined) await releasing;
    try {
      return await this.source.create(caller, device, location, size, handleTypes);
    } catch (error) {
      const code = (error as { code?: unknown }).code;
      // The backends' words for it: the registry's capacity, the driver's, the kernel's.
      if ((code !== 'OUT_OF_MEMORY' && code !== 'CUDA_ERROR_OUT_OF_MEMORY' && code !== 'ENOMEM') || this.freeing.size === 0) throw error;
      await this.settleFrees();
      return this.source.create(caller, device, location, size, handleTypes);
    }
  }

  /**
   * Resolves once every free in flight now has settled, done or failed.
   * Frees started meanwhile are not waited for: under steady load one is
   * always in flight, and a reclaim or a retried create waiting for all of
   * them would never go on.
   */
  async settleFrees(): Promise<void> {
    await Promise.allSettled([this.source.settle(), ...this.freeing]);
  }

  /**
   * The allocation with this id, whoever owns it.
   * @throws NOT_FOUND UNKNOWN_ALLOCATION
   */
  get(allocationId: bigint): AllocationRecord {
    const allocation = this.records.get(allocationId);
    // (One being freed is already gone for callers.)
    if (allocation === undefined || allocation.freed) {
      throw notFound('UNKNOWN_ALLOCATION', `allocation ${allocationId} does not exist (never created, or freed)`);
    }
    return allocation;
  }

  /**
   * The allocation with this id, for a caller that owns it, may act for its
   * owner, or holds a reference to it (GetProperties); a call without a
   * session (an operator's) may look at any.
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; PERMISSION_DENIED NOT_OWNER
   */
  inspect(caller: bigint, allocationId: bigint): AllocationRecord {
    const allocation = this.get(allocationId);
    if (caller !== DAEMON_OWNER) this.checkMayUse(caller, allocation);
    return allocation;
  }

  /**
   * A live allocation (one with a handle reference left).
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; FAILED_PRECONDITION ALREADY_RELEASED
   */
  live(allocationId: bigint): AllocationRecord {
    const allocation = this.get(allocationId);
    if (this.referenceCount(allocation) === 0) {
      throw failedPrecondition('ALREADY_RELEASED', `allocation ${allocationId} was released; it can no longer be mapped or exported`);
    }
    return allocation;
  }

  /** @throws PERMISSION_DENIED NOT_OWNER unless the caller may act for the owner or holds a reference */
  checkMayUse(caller: bigint, allocation: AllocationRecord): void {
    if (!allocation.references.has(caller)) this.ownership.check(caller, allocation.owner, `allocation ${allocation.id}`);
  }

  /**
   * A handle reference held by `holder` (a store) on an allocation the caller
   * may touch; with `forDaemon` (a store handed over) the holder keeps it for
   * the daemon, whose it becomes once its owner lets go of it.
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; FAILED_PRECONDITION ALREADY_RELEASED; PERMISSION_DENIED NOT_OWNER
   */
  hold(caller: bigint, allocationId: bigint, holder: bigint, forDaemon = false): AllocationRecord {
    const allocation = this.live(allocationId);
    this.checkMayUse(caller, allocation);
    allocation.references.set(holder, (allocation.references.get(holder) ?? 0) + 1);
    if (forDaemon) (allocation.keptForDaemon ??= new Set()).add(holder);
    return allocation;
  }

  /** The daemon owns the allocation from now on: its quota charge stays with its uid alone (no session holds it). */
  private passToDaemon(allocation: AllocationRecord): void {
    allocation.owner = DAEMON_OWNER;
    this.source.passedToDaemon?.(allocation);
  }

  /**
   * Drops every reference `holder` (a store) has on an allocation, and frees it
   * if nobody else references or maps it. Safe to repeat after a failure: a
   * repeat drops what is left and tries the free again.
   */
  async dropHolder(holder: bigint, allocationId: bigint): Promise<void> {
    const allocation = this.records.get(allocationId);
    if (allocation === undefined || allocation.freed) return;
    await this.dropAll(allocation, holder);
  }

  /** Drops every reference `holder` has (after the drops in flight), runs `dropped`, frees the allocation if now unused. */
  private async dropAll(allocation: AllocationRecord, holder: bigint, dropped = () => {}): Promise<void> {
    const { freeing } = await this.retained.run(allocation, () => {
      const held = allocation.references.get(holder);
      // In an object: a promise returned from then() would be waited for, and the step is over once the free has started.
      const free = () => {
        dropped();
        return { freeing: this.startFree(allocation, true) };
      };
      const drop = held === undefined ? undefined : this.retained.drop(allocation, holder, held);
      return drop === undefined ? free() : drop.then(free);
    });
    if (freeing === undefined) return;
    await freeing;
  }

  /**
   * Makes an allocation read-only for good, for the read-only store `store`:
   * the backend seals it where it can (host memfds), and the registry refuses
   * write access and writes to it from then on, to every caller.
   */
  sealReadOnly(allocation: AllocationRecord, store: bigint): void {
    this.backend.sealReadOnly(allocation.handle);
    allocation.readOnlyStore ??= store;
  }

  referenceCount(allocation: AllocationRecord): number {
    let total = 0;
    for (const count of allocation.references.values()) total += count;
    return total;
  }

  /**
   * A key that lets any session export the allocation (Share).
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; PERMISSION_DENIED NOT_OWNER; FAILED_PRECONDITION ALREADY_RELEASED
   */
  share(caller: bigint, allocationId: bigint): string {
    const allocation = this.live(allocationId);
    this.ownership.check(caller, allocation.owner, `allocation ${allocationId}`);
    allocation.shareKey ??= newShareKey();
    this.observer?.changed(allocation);
    return allocation.shareKey;
  }

  /**
   * Checks that the caller may export the allocation and pins it while the
   * backend makes the descriptor (owned by the caller) or the fabric bytes.
   * @throws NOT_FOUND UNKNOWN_ALLOCATION; FAILED_PRECONDITION ALREADY_RELEASED, UNSUPPORTED_HANDLE_TYPE;
   *   PERMISSION_DENIED NOT_OWNER, BAD_SHARE_KEY
   */
  async exportHandle(caller: bigint, args: ExportArgs): Promise<Exported> {
    const allocation = this.live(args.allocationId);
    admitExport(this.ownership, this.backend, caller, allocation, args);
    allocation.busy++;
    try {
      if (args.handleType === 'FABRIC') return { allocation, fabric: await this.backend.exportFabric(allocation.handle, allocation.device) };
      return { allocation, fd: await this.backend.exportHandle(allocation.handle, allocation.device) };
    } finally {
      allocation.busy--;
      // An export changes nothing recorded (the observer is not told again): only memory released meanwhile is freed now.
      if (this.unused(allocation)) await this.freeIfUnused(allocation);
    }
  }

  /**
   * One more reference, held by the caller, taken from the driver by the
   * address `allocation` is mapped at (RetainHandle).
   * @throws Error when the driver names another handle at that address (nothing is kept)
   */
  async retainAt(caller: bigint, allocation: AllocationRecord, address: bigint): Promise<AllocationRecord> {
    const handle: BackendHandle = this.backend.retainHandle(address, allocation.handle);
    if (handle !== allocation.handle) {
      // The driver and the registry disagree about what is mapped here: refuse rather than guess.
      await this.backend.releaseReference(handle, allocation.device);
      throw new Error(`the backend maps handle ${handle} at ${hex(address)}, the registry ${allocation.handle}`);
    }
    allocation.backendRetains++;
    allocation.references.set(caller, (allocation.references.get(caller) ?? 0) + 1);
    return allocation;
  }

  /**
   * Drops what an owner holds: its references, and its ownership (passed to
   * the daemon while others still reference or map the memory, charged to
   * the owner's uid alone from then on).
   */
  async reclaimFrom(owner: bigint, allocation: AllocationRecord): Promise<void> {
    await this.dropAll(allocation, owner, () => {
      if (allocation.owner === owner) this.passToDaemon(allocation);
    });
  }

  /**
   * Frees an allocation nobody references or maps. Recorded as freed only once
   * the source has freed it: when that fails the allocation stays, accounted
   * and charged, and the next Release or reclaim tries again.
   */
  async freeIfUnused(allocation: AllocationRecord): Promise<boolean> {
    const freeing = this.startFree(allocation, true);
    if (freeing === undefined) return false;
    await freeing;
    return true;
  }

  /**
   * Starts freeing an allocation nobody references or maps (undefined when
   * it is in use or already being freed). From this moment it is gone for
   * callers; the returned promise settles with the source's release.
   * @param awaited whether the caller waits for the free (AllocationSource.release)
   */
  private startFree(allocation: AllocationRecord, awaited: boolean): Promise<void> | undefined {
    // Every drop of references and change of owner ends here: what is left is recorded, or the end.
    if (!this.unused(allocation)) {
      if (!allocation.freed) this.observer?.changed(allocation);
      return undefined;
    }
    allocation.freed = true;
    this.observer?.gone(allocation);
    const freeing = (async () => {
      try {
        await this.source.release(allocation, awaited);
      } catch (error) {
        allocation.freed = false;
        this.observer?.changed(allocation);
        throw error;
      }
      this.records.delete(allocation.id);
    })();
    const settled = freeing.then(
      () => undefined,
      () => undefined,
    );
    this.freeing.add(settled);
    void settled.then(() => this.freeing.delete(settled));
    return freeing;
  }

  /** Not freed nor being freed, and nothing pins, maps or references it: its free may start. */
  private unused(allocation: AllocationRecord): boolean {
    return !allocation.freed && allocation.busy === 0 && allocation.mappingCount === 0 && this.referenceCount(allocation) === 0;
  }

  private add(
    owner: bigint,
    handle: BackendHandle,
    size: bigint,
    device: number,
    location: MemLocation,
    handleTypes: HandleKind[],
    imported: boolean,
    granularity: bigint,
    request?: string,
  ): AllocationRecord {
    const record: AllocationRecord = {
      id: this.ids.take(),
      owner,
      device,
      location,
      size,
      handle,
      handleTypes,
      imported,
      granularity,
      references: new Map([[owner, 1]]),
      backendRetains: 0,
      mappingCount: 0,
      busy: 0,
      freed: false,
      request,
    };
    this.records.set(record.id, record);
    this.observer?.changed(record);
    return record;
  }
}
