/**
 * A SYSMEM attachment's memory: a client's memfd, admitted by the rules of
 * client memory (server/backends/client-memfd.ts), counted like an Import
 * (by its size, against the host capacity and the caller's quotas, once
 * however many holds name it) and mapped by the daemon. The charge goes when
 * the memory is released.
 */
import { addon } from '../../native';
import { admitClientMemfd } from '../backends/client-memfd';
import { invalidArgument } from '../errors';
import type { HeldMemfd, Registry } from '../registry';
import { ChargedMemory, MemfdMemory, StoreMemory } from './store-memory';

/**
 * Admits, charges and maps `fd` (taken over: closed on failure too) for `caller`'s store of `size` bytes.
 * @throws INVALID_ARGUMENT BAD_DESCRIPTOR; RESOURCE_EXHAUSTED OUT_OF_MEMORY (host capacity), QUOTA_EXCEEDED; the mapping's error
 */
export async function attachClientMemfd(registry: Registry, caller: bigint, fd: number, size: bigint, readOnly: boolean): Promise<StoreMemory> {
  let held: HeldMemfd;
  try {
    const info = admitClientMemfd(fd, { what: 'a SYSMEM attachment', writable: !readOnly, sealReadOnly: readOnly, handedOut: true, reopenedReadOnly: true });
    if (info.size < size) {
      throw invalidArgument('BAD_DESCRIPTOR', `a SYSMEM attachment is a memfd of at least ${size} bytes (this one: ${info.size} bytes)`);
    }
    // Through the registry's allocation source: the backend's capacity and the caller's quotas, as an Import.
    held = await registry.holdClientMemfd(caller, fd, info.size);
  } catch (error) {
    addon.close(fd);
    throw error;
  }
  try {
    return new ChargedMemory(MemfdMemory.map(fd, size, readOnly), () => held.release());
  } catch (error) {
    held.release();
    throw error;
  }
}
