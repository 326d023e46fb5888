/**
 * Who may write a store (the trust rules of stores): a writable store is written
 * (Write, Fill, Copy into it, a writable open) only by the uid that made it
 * and by admins; other uids read it and open it read-only, with a descriptor
 * that cannot write where the backend can narrow one. One copy of the rule,
 * for the Stores service and the session socket's open alike.
 */
import { permissionDenied } from '../errors';
import type { StoreRecord, StoreRegistry } from './stores';

/** Who asks, as far as the store rules go: the caller's uid (its session's peer) and whether it is an admin. */
export interface StoreCaller {
  peer?: { uid: number };
  admin: boolean;
}

/** Whether a caller may write the store: its maker's uid or an admin (no caller: the daemon's own). */
export function mayWrite(store: StoreRecord, who: StoreCaller | undefined): boolean {
  if (who === undefined || who.admin) return true;
  return who.peer !== undefined && who.peer.uid === store.creatorUid;
}

/** @throws PERMISSION_DENIED NOT_STORE_WRITER when the caller may not write the store */
export function checkWriter(store: StoreRecord, who: StoreCaller | undefined): void {
  if (mayWrite(store, who)) return;
  const uid = who?.peer?.uid;
  const writers = store.creatorUid === undefined ? 'admins' : `uid ${store.creatorUid}, which made it, and admins`;
  throw permissionDenied(
    'NOT_STORE_WRITER',
    `store ${store.id} is written only by ${writers}; ${uid === undefined ? 'this caller' : `uid ${uid}`} may read it and open it read-only`,
  );
}

/**
 * Open as a caller asks it (Stores.Open and the session socket's open): a
 * writable open only by a writer; others get a descriptor that cannot write.
 * @returns the descriptor (the caller's) and whether it is read-only for this caller
 * @throws PERMISSION_DENIED NOT_STORE_WRITER; FAILED_PRECONDITION STORE_DETACHED, STORE_READ_ONLY
 */
export async function openFor(
  stores: StoreRegistry,
  session: bigint,
  store: StoreRecord,
  writable: boolean,
  who: StoreCaller | undefined,
): Promise<{ fd: number; descriptorReadOnly: boolean }> {
  const writer = mayWrite(store, who);
  if (writable && !store.readOnly) checkWriter(store, who);
  return { fd: await stores.open(session, store, writable, !writer), descriptorReadOnly: store.readOnly || !writer };
}
