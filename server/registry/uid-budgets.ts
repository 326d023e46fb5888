/**
 * The budgets of what the registry and the stores hold for a uid: daemon
 * mappings, reservations and their address space, stores, allocations. Each
 * is a Budget per uid, and behind them the daemon's totals for all clients
 * together, which keep a reserve of the process's map entries, address space
 * and descriptors for the daemon itself: no client, nor all of them, can make
 * the daemon's own mmap or accept fail (past vm.max_map_count the next mmap
 * anywhere in the process fails, and V8 or malloc abort on it). The defaults
 * give one uid at most a quarter of what clients may use together.
 */
import { Budget, Holder } from './budgets';

/** What a uid may hold at once; 0: no limit (the daemon's totals still apply). */
export interface UidBudgetLimits {
  /** Mappings the daemon holds for the uid: Map into its reservations, and each store's own mapping. */
  mappingsPerUid: number;
  reservationsPerUid: number;
  /** Bytes of the uid's reservations. */
  addressSpacePerUid: number;
  storesPerUid: number;
  /** Allocations created or imported. */
  allocationsPerUid: number;
}

/** What all clients together may make the daemon hold: what the daemon keeps back is the rest. */
export interface ClientTotals {
  /** Process map entries: a reservation takes one, a mapping splits one into up to three (two more). */
  mapEntries: number;
  addressSpace: number;
  /** Descriptors: an allocation's (a memfd on the host), a store's (its read-only or attached descriptor). */
  descriptors: number;
}

/** What the system allows the daemon: read at start. */
export interface SystemLimits {
  /** /proc/sys/vm/max_map_count. */
  maxMapCount: number;
  /** RLIMIT_NOFILE, once raised to the hard limit. */
  descriptors: number;
}

/** One uid's share of what clients may use together: a quarter. */
export const UID_SHARE = 4;

/** Process map entries clients may use together, at most (the daemon's memory per record bounds it where vm.max_map_count does not). */
export const CLIENT_MAP_ENTRIES_MAX = 1 << 18;

/** Descriptors clients may make the daemon hold for their objects together, at most. */
export const CLIENT_DESCRIPTORS_MAX = 1 << 18;

/** A 47-bit user address space (x86-64 and arm64 with 4-level page tables): 128 TiB. */
export const USER_ADDRESS_SPACE = 2 ** 47;

/** Address space clients may reserve together: half of it (64 TiB, MAX_RESERVATION_BYTES); the daemon keeps the rest. */
export const CLIENT_ADDRESS_SPACE = USER_ADDRESS_SPACE / 2;

/** The part of a system limit the daemon keeps for itself: an eighth, at least `floor`, at most half. */
function daemonReserve(limit: number, floor: number): number {
  return Math.min(Math.max(floor, Math.floor(limit / 8)), Math.floor(limit / 2));
}

/**
 * The totals clients may use and each uid's default share of them. A uid's
 * mappings and reservations take a third of its share of map entries each
 * (two entries a mapping, one a reservation, at worst), its allocations and
 * stores half of its share of descriptors each.
 */
export function derivedLimits(system: SystemLimits): { perUid: UidBudgetLimits; totals: ClientTotals } {
  const mapEntries = Math.min(system.maxMapCount - daemonReserve(system.maxMapCount, 4096), CLIENT_MAP_ENTRIES_MAX);
  const descriptors = Math.min(system.descriptors - daemonReserve(system.descriptors, 1024), CLIENT_DESCRIPTORS_MAX);
  const mapShare = Math.floor(mapEntries / UID_SHARE);
  const descriptorShare = Math.floor(descriptors / UID_SHARE);
  return {
    perUid: {
      mappingsPerUid: Math.max(1, Math.floor(mapShare / 3)),
      reservationsPerUid: Math.max(1, Math.floor(mapShare / 3)),
      addressSpacePerUid: CLIENT_ADDRESS_SPACE / UID_SHARE,
      storesPerUid: Math.max(1, Math.floor(descriptorShare / 2)),
      allocationsPerUid: Math.max(1, Math.floor(descriptorShare / 2)),
    },
    totals: { mapEntries, addressSpace: CLIENT_ADDRESS_SPACE, descriptors },
  };
}

/** What one object costs, by resource. */
export interface Costs {
  mappings?: number;
  reservations?: number;
  addressSpace?: number;
  stores?: number;
  allocations?: number;
}

/** The holder of the daemon's totals in refusals and metrics. */
export const ALL_UIDS = 'all uids';

/** What a take counted, given back once by give(), to the uid it was counted for whoever owns the object by then. */
export class Charge {
  private given = false;

  constructor(private readonly entries: ReadonlyArray<readonly [Budget, Holder, number]>) {}

  give(): void {
    if (this.given) return;
    this.given = true;
    for (const [budget, holder, amount] of this.entries) budget.give(holder, amount);
  }
}

export class UidBudgets {
  readonly mappings: Budget;
  readonly reservations: Budget;
  readonly addressSpace: Budget;
  readonly stores: Budget;
  readonly allocations: Budget;
  readonly mapEntries: Budget;
  readonly totalAddressSpace: Budget;
  readonly descriptors: Budget;

  /** @param uidOf the uid of an owner (a session); undefined for the daemon and stores' holders, which are not counted */
  constructor(
    limits: UidBudgetLimits,
    totals: ClientTotals,
    /** The uid an owner's objects count against; undefined for owners not counted. */
    readonly uidOf: (owner: bigint) => number | undefined,
  ) {
    this.mappings = new Budget('mappings per uid', limits.mappingsPerUid);
    this.reservations = new Budget('reservations per uid', limits.reservationsPerUid);
    this.addressSpace = new Budget('address space per uid', limits.addressSpacePerUid, ' bytes');
    this.stores = new Budget('stores per uid', limits.storesPerUid);
    this.allocations = new Budget('allocations per uid', limits.allocationsPerUid);
    this.mapEntries = new Budget("the daemon's map entries for clients", totals.mapEntries);
    this.totalAddressSpace = new Budget("the daemon's address space for clients", totals.addressSpace, ' bytes');
    this.descriptors = new Budget("the daemon's descriptors for clients' objects", totals.descriptors);
  }

  /** Every budget, for metrics and reports. */
  list(): Budget[] {
    return [this.mappings, this.reservations, this.addressSpace, this.stores, this.allocations, this.mapEntries, this.totalAddressSpace, this.descriptors];
  }

  /**
   * Counts what an object of `owner`'s costs against its uid's budgets and
   * the daemon's totals, all or nothing. Undefined when the owner has no uid
   * (the daemon, a store's holder): not counted.
   * @throws RpcError RESOURCE_EXHAUSTED BUDGET_EXCEEDED naming the first budget it does not fit
   */
  take(owner: bigint, costs: Costs): Charge | undefined {
    return this.count(owner, costs, false);
  }

  /**
   * take(), counted past the limits where it does not fit: for what the owner
   * holds already and cannot be refused (a detached store it keeps open). Its
   * uid's next requests are refused until it is back under.
   */
  takeAnyway(owner: bigint, costs: Costs): Charge | undefined {
    return this.count(owner, costs, true);
  }

  /**
   * Counts again what an object counted before the daemon's process
   * restarted (parked, now taken back) against the uid it counted for:
   * never refused, it fit then.
   */
  restore(uid: number, costs: Costs): Charge {
    const entries = this.entries(uid, costs);
    for (const [budget, holder, amount] of entries) budget.take(holder, amount, true);
    return new Charge(entries);
  }

  private count(owner: bigint, costs: Costs, anyway: boolean): Charge | undefined {
    const uid = this.uidOf(owner);
    if (uid === undefined) return undefined;
    const entries = this.entries(uid, costs);
    if (!anyway) for (const [budget, holder, amount] of entries) if (!budget.fits(holder, amount)) throw budget.refusal(holder, budget.usedBy(holder), amount);
    for (const [budget, holder, amount] of entries) budget.take(holder, amount, anyway);
    return new Charge(entries);
  }

  private entries(uid: number, costs: Costs): Array<[Budget, Holder, number]> {
    const entries: Array<[Budget, Holder, number]> = [];
    const add = (budget: Budget, holder: Holder, amount: number | undefined) => {
      if (amount === undefined || amount === 0) return;
      const entry = entries.find(([known, who]) => known === budget && who === holder);
      if (entry !== undefined) entry[2] += amount;
      else entries.push([budget, holder, amount]);
    };
    add(this.mappings, uid, costs.mappings);
    add(this.reservations, uid, costs.reservations);
    add(this.addressSpace, uid, costs.addressSpace);
    add(this.stores, uid, costs.stores);
    add(this.allocations, uid, costs.allocations);
    add(this.mapEntries, ALL_UIDS, 2 * (costs.mappings ?? 0) + (costs.reservations ?? 0));
    add(this.totalAddressSpace, ALL_UIDS, costs.addressSpace);
    add(this.descriptors, ALL_UIDS, (costs.allocations ?? 0) + (costs.stores ?? 0));
    return entries;
  }
}
