/**
 * What a store's memory must pass before the daemon holds it: memory mapped
 * writable cannot back a read-only store. (A client's memfd held for a SYSMEM
 * store is admitted and counted in sysmem-attachment.ts.)
 */
import { ACCESS_READWRITE } from '../backends/backend';
import { failedPrecondition } from '../errors';
import { AllocationRecord, DAEMON_OWNER, Registry } from '../registry';

/**
 * A read-only store is refused while the daemon maps its memory writable
 * anywhere (a session's mapping with READWRITE access, a writable store's
 * own mapping): those would keep writing what the store promises is fixed.
 * Mappings in clients' processes are not the daemon's to see or revoke
 * (docs/PROTOCOL.md, "Read-only stores").
 * @throws FAILED_PRECONDITION WRITABLE_MAPPINGS naming each mapping and whose it is
 */
export function checkNotMappedWritable(registry: Registry, allocation: AllocationRecord): void {
  const writable: string[] = [];
  for (const reservation of registry.space.all()) {
    for (const mapping of reservation.mappings) {
      if (mapping.allocation !== allocation || ![...mapping.access.values()].some((access) => access === ACCESS_READWRITE)) continue;
      const end = mapping.address + mapping.size;
      const whose = reservation.owner === DAEMON_OWNER ? 'the daemon (a writable store of it)' : `session ${reservation.owner}`;
      writable.push(`[0x${mapping.address.toString(16)}, 0x${end.toString(16)}) of ${whose}`);
    }
  }
  if (writable.length > 0) {
    throw failedPrecondition(
      'WRITABLE_MAPPINGS',
      `allocation ${allocation.id} cannot back a read-only store while it is mapped writable: ${writable.join(', ')}; set their access to READ, unmap them, or detach the writable store first`,
    );
  }
}
