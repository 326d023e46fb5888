/**
 * What a store is, as the store registry (stores.ts) keeps it: its record,
 * target and state, the events told of it, and the registry holder ids that
 * stand for stores rather than sessions.
 */
import type { ChargedStore } from './store-charges';
import type { LoggedEvent } from './store-events';
import type { StoreMemory } from './store-memory';

export type { StoreEventKind } from './store-events';

export type StoreTarget = 'SYSMEM' | 'ZCMEM' | 'FBMEM';
export type StoreState = 'LIVE' | 'DETACHING' | 'DETACHED';

/** Store holders in the registry: far above any session id. */
export const STORE_HOLDER_BASE = 1n << 62n;

/** Whether a registry caller is a store's holder (the daemon acting for the store), not a session. */
export function isStoreHolder(caller: bigint): boolean {
  return caller >= STORE_HOLDER_BASE;
}

/** A store; what it is charged and to whom: ChargedStore. */
export interface StoreRecord extends ChargedStore {
  readonly id: bigint;
  name: string;
  readonly owner: bigint;
  readonly target: StoreTarget;
  readonly device: number;
  readonly size: bigint;
  readonly readOnly: boolean;
  readonly attached: boolean;
  readonly hasDeleter: boolean;
  readonly memory: StoreMemory;
  /** The uid that made it (attributed by its connection); who besides admins may detach it once it is the daemon's. */
  creatorUid?: number;
  state: StoreState;
  // Invariant: daemon operations on the store that started and have not settled.
  inFlight: number;
  drainWaiters: Array<() => void>;
  /** Its memory is being freed, or was. */
  releasing: boolean;
  /** Why freeing its memory failed last (a driver or OS error); the next Detach, close or session end tries again. */
  releaseFailure?: string;
}

export type StoreEvent = LoggedEvent<StoreRecord>;
