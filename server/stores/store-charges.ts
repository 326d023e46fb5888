/**
 * What a store counts against a uid's budgets, and who pays for it: its
 * maker while it is live; once detached, the sessions that still have it
 * open, each charged what the store costs until its last close, so that no
 * other uid can keep a maker's detached store on the maker's budgets.
 */
import type { Charge, UidBudgets } from '../registry/uid-budgets';

/** The part of a store record its charges live in (server/stores/stores.ts). */
export interface ChargedStore {
  // Invariant: opens per session; no entry holds 0.
  readonly opens: Map<bigint, number>;
  /** What it counts against its maker's uid until its memory is freed, or its charge moved. */
  readonly charge?: Charge;
  /** The bytes its daemon mapping and address space are charged for. */
  readonly chargedBytes: bigint;
  /** Detached with opens left: its maker's charge went, and each session that had it open was charged instead. */
  chargeMoved: boolean;
  // Invariant: once the charge moved, the charge of each session with an open left.
  readonly openerCharges: Map<bigint, Charge>;
}

/** What a store of `size` bytes counts against its maker's uid: itself, and the daemon's mapping of its memory with the address space under it. */
export const storeCosts = (size: bigint) => ({ stores: 1, mappings: 1, addressSpace: Number(size) });

/**
 * A detached store others keep open is theirs to pay for: its maker's
 * charge goes, and each session with an open is charged what the store
 * costs, past its uid's limits if need be (the open is held already, and
 * refusing it would leave the maker charged instead). Once only.
 */
export function moveCharge(store: ChargedStore, budgets: UidBudgets | undefined): void {
  if (store.chargeMoved) return;
  store.chargeMoved = true;
  store.charge?.give();
  for (const session of store.opens.keys()) {
    const charge = budgets?.takeAnyway(session, storeCosts(store.chargedBytes));
    if (charge !== undefined) store.openerCharges.set(session, charge);
  }
}

/** Drops every open of the session, and what it was charged for them once the charge moved. */
export function closeOpens(store: ChargedStore, session: bigint): void {
  store.opens.delete(session);
  store.openerCharges.get(session)?.give();
  store.openerCharges.delete(session);
}
