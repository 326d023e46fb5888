/**
 * Quotas: bytes of allocations a uid, and a session, may hold at once. A
 * charge checks and adds in one synchronous step before the backend creates
 * anything, so concurrent requests never overshoot; the refund runs when the
 * memory is freed. Calls without a session (operators) are not limited.
 */
import { resourceExhausted } from './errors';
import { DAEMON_OWNER } from './registry';

export interface QuotaLimits {
  /** 0: no limit. */
  perUid: bigint;
  perSession: bigint;
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

  /**
   * Charges `bytes` to the owner's session and uid; returns the refund.
   * @throws RESOURCE_EXHAUSTED QUOTA_EXCEEDED saying requested, used and limit
   */
  charge(owner: bigint, bytes: bigint): () => void {
    if (owner === DAEMON_OWNER) return () => undefined;
    const uid = this.uidOf(owner);
    const session = this.bySession.get(owner) ?? 0n;
    const user = uid === undefined ? 0n : (this.byUid.get(uid) ?? 0n);
    if (this.limits.perSession > 0n && session + bytes > this.limits.perSession) {
      this.refusals++;
      throw resourceExhausted(
        'QUOTA_EXCEEDED',
        `session ${owner} quota: requested ${bytes} bytes, ${session} of ${this.limits.perSession} bytes in use`,
      );
    }
    if (uid !== undefined && this.limits.perUid > 0n && user + bytes > this.limits.perUid) {
      this.refusals++;
      throw resourceExhausted('QUOTA_EXCEEDED', `uid ${uid} quota: requested ${bytes} bytes, ${user} of ${this.limits.perUid} bytes in use`);
    }
    this.add(this.bySession, owner, bytes);
    if (uid !== undefined) this.add(this.byUid, uid, bytes);
    let refunded = false;
    return () => {
      if (refunded) return;
      refunded = true;
      this.add(this.bySession, owner, -bytes);
      if (uid !== undefined) this.add(this.byUid, uid, -bytes);
    };
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
