/**
 * Quotas: an adaptor around the allocation source that limits the bytes of
 * allocations a uid, and a session, may hold at once. A charge checks and
 * adds in one synchronous step before the creation is awaited, so concurrent
 * requests never overshoot; it is rolled back when the upstream fails and refunded
 * when the memory is freed. Calls without a session (operators) are not limited.
 */
import type { BackendHandle, HandleKind, ImportedHandle, ImportSource, MemLocation } from './backends/backend';
import { resourceExhausted } from './errors';
import { DAEMON_OWNER } from './registry/records';
import type { AllocationSource, SourcedAllocation } from './registry/source';

export interface QuotaLimits {
  /** 0: no limit. */
  perUid: bigint;
  perSession: bigint;
}

interface Charge {
  session: bigint;
  uid?: number;
  bytes: bigint;
}

export class Quotas {
  // Invariant: bytes charged and not refunded, by uid and by session; no entry holds 0.
  private readonly byUid = new Map<number, bigint>();
  private readonly bySession = new Map<bigint, bigint>();
  refusals = 0;

  constructor(
    private readonly limits: QuotaLimits,
    private readonly uidOf: (session: bigint) => number | undefined,
  ) {}

  /** The adaptor that charges these quotas for memory `upstream` creates. */
  around(upstream: AllocationSource): AllocationSource {
    return new QuotaAdaptor(this, upstream);
  }

  /**
   * Charges `bytes` to the owner's session and uid; undefined for the daemon (not limited).
   * @throws RESOURCE_EXHAUSTED QUOTA_EXCEEDED saying requested, used and limit
   */
  charge(owner: bigint, bytes: bigint): Charge | undefined {
    if (owner === DAEMON_OWNER) return undefined;
    const uid = this.uidOf(owner);
    const session = this.bySession.get(owner) ?? 0n;
    const user = uid === undefined ? 0n : (this.byUid.get(uid) ?? 0n);
    if (this.limits.perSession > 0n && session + bytes > this.limits.perSession) {
      this.refusals++;
      throw resourceExhausted('QUOTA_EXCEEDED', `session ${owner} quota: requested ${bytes} bytes, ${session} of ${this.limits.perSession} bytes in use`);
    }
    if (uid !== undefined && this.limits.perUid > 0n && user + bytes > this.limits.perUid) {
      this.refusals++;
      throw resourceExhausted('QUOTA_EXCEEDED', `uid ${uid} quota: requested ${bytes} bytes, ${user} of ${this.limits.perUid} bytes in use`);
    }
    this.add(this.bySession, owner, bytes);
    if (uid !== undefined) this.add(this.byUid, uid, bytes);
    return { session: owner, uid, bytes };
  }

  refund(charge: Charge): void {
    this.add(this.bySession, charge.session, -charge.bytes);
    if (charge.uid !== undefined) this.add(this.byUid, charge.uid, -charge.bytes);
  }

  used(): { byUid: Record<string, string>; bySession: Record<string, string> } {
    const text = <K>(map: Map<K, bigint>) => Object.fromEntries([...map].map(([key, value]) => [String(key), String(value)]));
    return { byUid: text(this.byUid), bySession: text(this.bySession) };
  }

  private add<K>(map: Map<K, bigint>, key: K, bytes: bigint): void {
    const total = (map.get(key) ?? 0n) + bytes;
    if (total === 0n) map.delete(key);
    else map.set(key, total);
  }
}

class QuotaAdaptor implements AllocationSource {
  // Invariant: the charge of every live handle created through this adaptor for a session.
  private readonly charges = new Map<BackendHandle, Charge>();

  constructor(
    private readonly quotas: Quotas,
    private readonly upstream: AllocationSource,
  ) {}

  async create(owner: bigint, device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    // Reserve, create, then commit or refund. The bytes are reserved before the
    // await: creates in flight at once are all counted, so none escapes the quota.
    const charge = this.quotas.charge(owner, size);
    let handle: BackendHandle;
    try {
      handle = await this.upstream.create(owner, device, location, size, handleTypes);
    } catch (error) {
      if (charge !== undefined) this.quotas.refund(charge);
      throw error;
    }
    if (charge !== undefined) this.charges.set(handle, charge);
    return handle;
  }

  adopt(owner: bigint, source: ImportSource, size: bigint): Promise<ImportedHandle> {
    // NOTE: memory handed over by a peer is not charged yet (issue 14 charges it by its real size).
    return this.upstream.adopt(owner, source, size);
  }

  async release(allocation: SourcedAllocation): Promise<void> {
    // Taken out before the upstream frees the handle: a handle number the
    // backend reuses at once (a memfd's) must not meet this charge.
    const charge = this.charges.get(allocation.handle);
    this.charges.delete(allocation.handle);
    try {
      await this.upstream.release(allocation);
    } catch (error) {
      if (charge !== undefined && !this.charges.has(allocation.handle)) this.charges.set(allocation.handle, charge);
      throw error;
    }
    if (charge !== undefined) this.quotas.refund(charge);
  }
}
