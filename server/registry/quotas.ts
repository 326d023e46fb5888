/**
 * Quotas: an adaptor around the allocation source that limits the physical
 * memory a uid, and a session, keeps alive through the daemon. Memory is
 * counted by what it is, not by how many ids name it: each piece of physical
 * memory (Backend.memoryIdentity: a memfd's file, a CUDA allocation) counts
 * once for a session, and once for a uid, however many allocations, imports
 * and SYSMEM stores of theirs hold it; it counts for every session and uid
 * that holds it, and stops counting for one when its last hold of it goes.
 * So memory stays charged as long as anyone keeps it alive, to whoever does,
 * and no release can move a charge onto a holder above its limit: the bytes
 * a uid keeps alive never exceed its quota. Memory that comes in (Import,
 * Attach) counts by its real size (a memfd's size after sealing, sparse or
 * not) and is refused past the quota like a Create. A charge checks and adds
 * in one synchronous step before the creation is awaited (or right after
 * the adoption), so concurrent requests never overshoot. Memory being freed
 * stays charged until the backend has freed it; a request over the quota
 * while its holder has such frees in flight waits for them (telling the
 * source so: a free held back for a quiet moment starts) and asks again,
 * so that release-then-allocate at the limit is never refused. A client's
 * memfd a SYSMEM store maps comes through the same adaptor, charged like an
 * Import. Calls without a session (operators) are not limited. Memory that
 * passes to the daemon (its owner's session ended, or let go of it while a
 * store handed over keeps it) stays charged to the uid that brought it, and
 * to no session.
 */
import type { BackendHandle, HandleKind, ImportedHandle, ImportSource, MemLocation } from '../backends/backend';
import { resourceExhausted } from '../errors';
import { DAEMON_OWNER } from './records';
import { once, PassThroughSource, type AllocationSource, type HeldMemfd, type RestoredMemory, type SourcedAllocation } from './source';

export interface QuotaLimits {
  /** 0: no limit. */
  perUid: bigint;
  perSession: bigint;
}

/** One hold of physical memory by a session (an allocation, an import, a SYSMEM store). */
export interface QuotaHold {
  /** DAEMON_OWNER once the memory passed to the daemon: charged to `uid` alone. */
  session: bigint;
  readonly uid?: number;
  readonly size: bigint;
  /** Undefined until the memory exists (a Create is charged before the backend makes it). */
  identity?: string;
}

/** What names physical memory: the backend's memoryIdentity. */
export type IdentifyMemory = (handle: BackendHandle, device: number) => string;

export class Quotas {
  // Invariant: bytes charged by uid and by session, each the sum of the sizes of the distinct
  // memory (identities) it holds, plus holds not yet named; no entry holds 0.
  private readonly byUid = new Map<number, bigint>();
  private readonly bySession = new Map<bigint, bigint>();
  // Invariant: live holds by memory and session ("identity|session"), and by memory and uid ("identity|uid"); no entry holds 0.
  private readonly sessionHolds = new Map<string, number>();
  private readonly uidHolds = new Map<string, number>();
  // Invariant: the holds whose memory is being freed, each with its free (settled either way); removed when it settles.
  private readonly beingFreed = new Map<QuotaHold, Promise<void>>();
  refusals = 0;

  constructor(
    private readonly limits: QuotaLimits,
    private readonly uidOf: (session: bigint) => number | undefined,
  ) {}

  /** The adaptor that charges these quotas for memory `upstream` creates and adopts. */
  around(upstream: AllocationSource, identify: IdentifyMemory): AllocationSource {
    return new QuotaAdaptor(this, upstream, identify);
  }

  /**
   * One more hold of memory by the owner's session: charged to the session
   * and its uid unless they already hold that memory. `identity` undefined:
   * memory about to be made (counts as new). Undefined for the daemon (not limited).
   * @throws RESOURCE_EXHAUSTED QUOTA_EXCEEDED saying the size, what is in use and the limit (nothing is charged)
   */
  hold(owner: bigint, identity: string | undefined, size: bigint, what = 'requested'): QuotaHold | undefined {
    const refusal = this.refusal(owner, identity, size, what);
    if (refusal !== undefined) {
      this.refusals++;
      throw refusal.error;
    }
    return this.take(owner, identity, size);
  }

  /**
   * hold(), but a hold that would go over the quota while the session (or its
   * uid) has frees in flight waits for those frees, whose charge stays until
   * the memory is really freed, and asks again: a client at its limit that
   * releases and then allocates is never refused for memory on its way out.
   * The check and the charge are one synchronous step, as in hold().
   * @param settle tells the source someone waits for its frees (AllocationSource.settle); only the holder's own are awaited here
   * @throws RESOURCE_EXHAUSTED QUOTA_EXCEEDED when it is over with no free of its own left in flight
   */
  async holdAfterFrees(
    owner: bigint,
    identity: string | undefined,
    size: bigint,
    settle: () => Promise<void>,
    what = 'requested',
  ): Promise<QuotaHold | undefined> {
    for (;;) {
      const refusal = this.refusal(owner, identity, size, what);
      if (refusal === undefined) return this.take(owner, identity, size);
      const own = [...this.beingFreed].filter(([hold]) => hold.session === owner || (refusal.uid !== undefined && hold.uid === refusal.uid));
      if (own.length === 0) {
        this.refusals++;
        throw refusal.error;
      }
      // Not awaited: every free in flight may take longer than the holder's own (settle never rejects).
      void settle();
      await Promise.all(own.map(([, settled]) => settled));
    }
  }

  /**
   * A hold of memory an earlier daemon process charged (parked, now taken
   * back): charged again to the same session and uid, never refused.
   */
  restore(session: bigint, uid: number, identity: string, size: bigint): QuotaHold {
    if (session !== DAEMON_OWNER && !this.sessionHolds.has(`${identity}|${session}`)) this.add(this.bySession, session, size);
    if (!this.uidHolds.has(`${identity}|${uid}`)) this.add(this.byUid, uid, size);
    const hold: QuotaHold = { session, uid, size };
    this.name(hold, identity, false);
    return hold;
  }

  /** The hold's memory passed to the daemon: it stops counting for its session (whose last hold of it this was); its uid's charge stays. */
  passToDaemon(hold: QuotaHold): void {
    if (hold.session === DAEMON_OWNER) return;
    this.releaseSession(hold);
    hold.session = DAEMON_OWNER;
  }

  /** Marks a hold whose memory is being freed until `free` settles: holds refused meanwhile wait for it. */
  freeing(hold: QuotaHold, free: Promise<unknown>): void {
    const settled = free.then(
      () => undefined,
      () => undefined,
    );
    this.beingFreed.set(hold, settled);
    void settled.then(() => {
      if (this.beingFreed.get(hold) === settled) this.beingFreed.delete(hold);
    });
  }

  /** Why a hold would be refused (and the uid whose limit it is, for the uid's), or undefined when it fits. */
  private refusal(owner: bigint, identity: string | undefined, size: bigint, what: string): { error: Error; uid?: number } | undefined {
    if (owner === DAEMON_OWNER) return undefined;
    const uid = this.uidOf(owner);
    const newForSession = identity === undefined || !this.sessionHolds.has(`${identity}|${owner}`);
    const newForUid = uid !== undefined && (identity === undefined || !this.uidHolds.has(`${identity}|${uid}`));
    const session = this.bySession.get(owner) ?? 0n;
    const user = uid === undefined ? 0n : (this.byUid.get(uid) ?? 0n);
    if (newForSession && this.limits.perSession > 0n && session + size > this.limits.perSession) {
      return {
        error: resourceExhausted('QUOTA_EXCEEDED', `session ${owner} quota: ${what} ${size} bytes, ${session} of ${this.limits.perSession} bytes in use`),
      };
    }
    if (newForUid && this.limits.perUid > 0n && user + size > this.limits.perUid) {
      return { error: resourceExhausted('QUOTA_EXCEEDED', `uid ${uid} quota: ${what} ${size} bytes, ${user} of ${this.limits.perUid} bytes in use`), uid };
    }
    return undefined;
  }

  /** Charges a hold refusal() let through. */
  private take(owner: bigint, identity: string | undefined, size: bigint): QuotaHold | undefined {
    if (owner === DAEMON_OWNER) return undefined;
    const uid = this.uidOf(owner);
    if (identity === undefined || !this.sessionHolds.has(`${identity}|${owner}`)) this.add(this.bySession, owner, size);
    if (uid !== undefined && (identity === undefined || !this.uidHolds.has(`${identity}|${uid}`))) this.add(this.byUid, uid, size);
    const hold: QuotaHold = { session: owner, uid, size };
    if (identity !== undefined) this.name(hold, identity, false);
    return hold;
  }

  /**
   * Names the memory a hold taken before it existed is of (a Create's). Memory
   * the session or uid already holds (an identity the backend reuses) is not charged twice.
   */
  name(hold: QuotaHold, identity: string, charged = true): void {
    hold.identity = identity;
    const sessionKey = `${identity}|${hold.session}`;
    if (hold.session !== DAEMON_OWNER && this.count(this.sessionHolds, sessionKey, 1) > 1 && charged) this.add(this.bySession, hold.session, -hold.size);
    if (hold.uid === undefined) return;
    if (this.count(this.uidHolds, `${identity}|${hold.uid}`, 1) > 1 && charged) this.add(this.byUid, hold.uid, -hold.size);
  }

  /** Drops a hold; the memory stops counting for the session (and uid) whose last hold of it this was. */
  release(hold: QuotaHold): void {
    this.releaseSession(hold);
    if (hold.uid === undefined) return;
    if (hold.identity === undefined || this.count(this.uidHolds, `${hold.identity}|${hold.uid}`, -1) === 0) this.add(this.byUid, hold.uid, -hold.size);
  }

  /** Drops the session's part of a hold (none once it passed to the daemon). */
  private releaseSession(hold: QuotaHold): void {
    if (hold.session === DAEMON_OWNER) return;
    if (hold.identity === undefined || this.count(this.sessionHolds, `${hold.identity}|${hold.session}`, -1) === 0)
      this.add(this.bySession, hold.session, -hold.size);
  }

  used(): { byUid: Record<string, string>; bySession: Record<string, string> } {
    const text = <K>(map: Map<K, bigint>) => Object.fromEntries([...map].map(([key, value]) => [String(key), String(value)]));
    return { byUid: text(this.byUid), bySession: text(this.bySession) };
  }

  /** Bytes charged to a uid now (0: none). */
  usedByUid(uid: number): bigint {
    return this.byUid.get(uid) ?? 0n;
  }

  private add<K>(map: Map<K, bigint>, key: K, bytes: bigint): void {
    const total = (map.get(key) ?? 0n) + bytes;
    if (total === 0n) map.delete(key);
    else map.set(key, total);
  }

  private count(map: Map<string, number>, key: string, delta: 1 | -1): number {
    const total = (map.get(key) ?? 0) + delta;
    if (total === 0) map.delete(key);
    else map.set(key, total);
    return total;
  }
}

class QuotaAdaptor extends PassThroughSource {
  // Invariant: the hold of every live handle created or adopted through this adaptor for a session.
  private readonly holds = new Map<BackendHandle, QuotaHold>();

  constructor(
    private readonly quotas: Quotas,
    upstream: AllocationSource,
    private readonly identify: IdentifyMemory,
  ) {
    super(upstream);
  }

  override async create(owner: bigint, device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    // Charged before the create's await: creates in flight at once are all counted, so none escapes the quota.
    // Over the quota, it waits first for the owner's frees in flight (still charged) and asks again.
    const hold = await this.quotas.holdAfterFrees(owner, undefined, size, this.settleUpstream);
    let handle: BackendHandle;
    try {
      handle = await this.upstream.create(owner, device, location, size, handleTypes);
    } catch (error) {
      if (hold !== undefined) this.quotas.release(hold);
      throw error;
    }
    if (hold !== undefined) {
      this.quotas.name(hold, this.identify(handle, device));
      this.holds.set(handle, hold);
    }
    return handle;
  }

  override async adopt(owner: bigint, source: ImportSource, size: bigint): Promise<ImportedHandle> {
    // Charged by the size the backend found (a memfd's after sealing), once it is known; refused, it goes again.
    const imported = await this.upstream.adopt(owner, source, size);
    let hold: QuotaHold | undefined;
    try {
      hold = await this.quotas.holdAfterFrees(owner, this.identify(imported.handle, imported.device), imported.size, this.settleUpstream, 'importing');
    } catch (error) {
      await this.upstream.release({ owner, handle: imported.handle, size: imported.size, device: imported.device, imported: true }, true);
      throw error;
    }
    if (hold !== undefined) this.holds.set(imported.handle, hold);
    return imported;
  }

  override async restore(memory: RestoredMemory): Promise<ImportedHandle> {
    const restored = await this.upstream.restore(memory);
    if (memory.charged !== undefined) {
      this.holds.set(
        restored.handle,
        this.quotas.restore(memory.charged.session, memory.charged.uid, this.identify(restored.handle, restored.device), restored.size),
      );
    }
    return restored;
  }

  /** Charged by the memfd's size once the backend holds it, as an adoption is; refused, the backend's hold goes again. */
  override async holdClientMemfd(owner: bigint, fd: number, size: bigint): Promise<HeldMemfd> {
    const held = await this.upstream.holdClientMemfd(owner, fd, size);
    let hold: QuotaHold | undefined;
    try {
      hold = await this.quotas.holdAfterFrees(owner, held.identity, size, this.settleUpstream, 'attaching');
    } catch (error) {
      held.release();
      throw error;
    }
    return {
      identity: held.identity,
      release: once(() => {
        if (hold !== undefined) this.quotas.release(hold);
        held.release();
      }),
    };
  }

  private readonly settleUpstream = () => this.upstream.settle();

  override passedToDaemon(allocation: SourcedAllocation): void {
    const hold = this.holds.get(allocation.handle);
    if (hold !== undefined) this.quotas.passToDaemon(hold);
    super.passedToDaemon(allocation);
  }

  override async release(allocation: SourcedAllocation, awaited: boolean): Promise<void> {
    // Taken out before the upstream frees the handle: a handle number the
    // backend reuses at once (a memfd's) must not meet this hold.
    const hold = this.holds.get(allocation.handle);
    this.holds.delete(allocation.handle);
    const release = this.upstream.release(allocation, awaited);
    // Still charged until it is freed: a hold refused meanwhile waits for this free.
    if (hold !== undefined) this.quotas.freeing(hold, release);
    try {
      await release;
    } catch (error) {
      if (hold !== undefined && !this.holds.has(allocation.handle)) this.holds.set(allocation.handle, hold);
      throw error;
    }
    if (hold !== undefined) this.quotas.release(hold);
  }
}
