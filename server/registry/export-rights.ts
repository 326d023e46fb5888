/**
 * Who may export an allocation, and as what: its owner or whoever may act
 * for the owner, a holder of one of its references, or any session that
 * presents the share key the owner made (Share); and only as a handle type
 * the allocation was created for.
 */
import { randomBytes, timingSafeEqual } from 'node:crypto';
import type { Backend } from '../backends/backend';
import { failedPrecondition, permissionDenied } from '../errors';
import { type AllocationRecord, type ExportArgs, ownerName, type Ownership } from './records';

/** A fresh share key: unguessable, printable. */
export function newShareKey(): string {
  return randomBytes(24).toString('base64url');
}

/** Whether `key` is the allocation's share key (compared in constant time). */
export function shareKeyMatches(allocation: AllocationRecord, key: string): boolean {
  if (allocation.shareKey === undefined) return false;
  const expected = Buffer.from(allocation.shareKey);
  const given = Buffer.from(key);
  return expected.length === given.length && timingSafeEqual(expected, given);
}

/**
 * Lets `caller` export `allocation` as `args` asks, or refuses. A session let
 * in by the share key gets a writable descriptor, which could add seals: the
 * seals are frozen first, so no such holder can seal the memory against its
 * owner's writes (the owner cannot seal it read-only any more either).
 * @throws PERMISSION_DENIED NOT_OWNER, BAD_SHARE_KEY; FAILED_PRECONDITION UNSUPPORTED_HANDLE_TYPE
 */
export function admitExport(ownership: Ownership, backend: Pick<Backend, 'freezeSeals'>, caller: bigint, allocation: AllocationRecord, args: ExportArgs): void {
  if (!ownership.mayAct(caller, allocation.owner) && !allocation.references.has(caller)) {
    if (args.shareKey === '') {
      throw permissionDenied('NOT_OWNER', `allocation ${allocation.id} belongs to ${ownerName(allocation.owner)}; its owner can Share it and hand you the key`);
    }
    if (!shareKeyMatches(allocation, args.shareKey)) {
      throw permissionDenied('BAD_SHARE_KEY', `the share key does not open allocation ${allocation.id}`);
    }
    if (args.handleType === 'POSIX_FD') backend.freezeSeals?.(allocation.handle);
  }
  if (!allocation.handleTypes.includes(args.handleType)) {
    throw failedPrecondition(
      'UNSUPPORTED_HANDLE_TYPE',
      `allocation ${allocation.id} was created for ${allocation.handleTypes.join(', ')} handles, not ${args.handleType}`,
    );
  }
}
