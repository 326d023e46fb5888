/**
 * Restore at start: the descriptors the file-descriptor store handed back
 * (LISTEN_FDS) and the newest whole journal among them become the registry's
 * allocations and the stores again, under their own ids, owners, references,
 * share keys and quota charges. A record whose descriptor is missing, or
 * whose device is not this machine's, is dropped; a descriptor no record
 * names (parked by a process that died before writing its record) is
 * closed and dropped from the store. Then the parked state starts again
 * from what came back.
 */
import type { Logger } from 'pino';
import { addon } from '../../native';
import type { Backend } from '../backends/backend';
import type { AllocationRecord, Registry } from '../registry';
import type { StoreRegistry } from '../stores/stores';
import type { DescriptorParking } from './fd-store';
import { Journal } from './journal';
import { emptyState, ParkedSessionRecord, ParkedState } from './parked-records';
import { JOURNAL_NAME, Parking, ParkingSlot, SessionPeers } from './parking';

export interface RestoreDeps {
  registry: Registry;
  stores: StoreRegistry;
  backend: Backend;
  client: DescriptorParking;
  peers: SessionPeers;
  log: Logger;
}

export interface Restored {
  parking: Parking;
  /** The sessions that owned what came back: theirs until they resume or their grace ends. */
  sessions: ParkedSessionRecord[];
  allocations: number;
  stores: number;
  /** Records without their descriptor (or of another device), and descriptors without a record. */
  dropped: number;
}

/**
 * Restores what `inherited` holds and starts parking in `slot`.
 * @throws the fd store's error when the new journal cannot be parked
 */
export async function restoreParked(deps: RestoreDeps, inherited: Map<string, number[]>, slot: ParkingSlot): Promise<Restored> {
  const { registry, stores, log } = deps;
  const generations = [...inherited.keys()]
    .map((name) => JOURNAL_NAME.exec(name))
    .filter((m) => m !== null)
    .map((m) => Number(m![1]));
  generations.sort((a, b) => b - a);
  let state: ParkedState = emptyState();
  // The newest journal goes on (the parked state is written before the answers, not rewritten at start); the older
  // ones (a compaction cut short) and extra copies are closed.
  let resumed: { journal: Journal; generation: number } | undefined;
  if (generations.length > 0) {
    const newest = inherited.get(`j${generations[0]}`)!;
    const read = Journal.resume(newest.shift()!);
    state = read.state;
    resumed = { journal: read.journal, generation: generations[0] };
  }
  for (const generation of generations) for (const fd of inherited.get(`j${generation}`)!) addon.close(fd);
  for (const generation of generations) inherited.delete(`j${generation}`);

  registry.ids.advanceTo(state.nextId);
  const kept: ParkedState = { ...emptyState(), sessions: state.sessions, nextId: state.nextId, nextStoreId: state.nextStoreId };
  const handles: Array<[AllocationRecord, string]> = [];
  let dropped = 0;
  // Records that do not come back: recorded as gone in the journal that goes on.
  const droppedAllocations: string[] = [];
  const droppedStores: string[] = [];
  for (const parked of state.allocations.values()) {
    const fds = inherited.get(parked.fd);
    inherited.delete(parked.fd);
    if (fds === undefined) {
      droppedAllocations.push(parked.id);
      dropped++;
      continue;
    }
    for (const extra of fds.slice(1)) addon.close(extra);
    const uuid = registry.devices[parked.device]?.uuid;
    if (uuid !== parked.deviceUuid) {
      log.error(
        { allocation: parked.id, device: parked.device, parkedOn: parked.deviceUuid, here: uuid ?? 'none' },
        'a parked allocation is of a device this daemon does not have: dropped',
      );
      addon.close(fds[0]);
      deps.client.remove(parked.fd);
      droppedAllocations.push(parked.id);
      dropped++;
      continue;
    }
    try {
      const record = await registry.restoreAllocation({
        id: BigInt(parked.id),
        owner: BigInt(parked.owner),
        location: parked.location,
        references: new Map(parked.references.map(([holder, count]) => [BigInt(holder), count])),
        shareKey: parked.shareKey,
        request: parked.request,
        memory: {
          fd: fds[0],
          size: BigInt(parked.size),
          imported: parked.imported,
          charged: parked.charged === undefined ? undefined : { session: BigInt(parked.charged.session), uid: parked.charged.uid },
          parkedAs: parked.fd,
        },
      });
      handles.push([record, parked.fd]);
      kept.allocations.set(parked.id, parked);
    } catch (error) {
      log.error({ err: error, allocation: parked.id }, 'a parked allocation could not be taken back: dropped');
      deps.client.remove(parked.fd);
      droppedAllocations.push(parked.id);
      dropped++;
    }
  }
  for (const parked of state.stores.values()) {
    const allocation = kept.allocations.has(parked.allocationId) ? registry.allocation(BigInt(parked.allocationId)) : undefined;
    if (allocation === undefined) {
      droppedStores.push(parked.id);
      dropped++;
      continue;
    }
    try {
      await stores.restore(
        {
          id: BigInt(parked.id),
          name: parked.name,
          owner: BigInt(parked.owner),
          target: parked.target,
          device: parked.device,
          size: BigInt(parked.size),
          readOnly: parked.readOnly,
          attached: parked.attached,
          creatorUid: parked.creatorUid,
        },
        allocation,
      );
      kept.stores.set(parked.id, parked);
    } catch (error) {
      log.error({ err: error, store: parked.id, name: parked.name }, 'a parked store could not be mapped again: dropped');
      droppedStores.push(parked.id);
      dropped++;
    }
  }
  // Descriptors no record names: parked by a process that died before it wrote the record.
  for (const [name, fds] of inherited) {
    for (const fd of fds) addon.close(fd);
    deps.client.remove(name);
    dropped++;
  }

  const parking = Parking.start(
    { ...deps, nextId: () => registry.ids.peek() },
    kept,
    generations,
    handles.map(([, name]) => name),
    resumed,
  );
  parking.forgetDropped(droppedAllocations, droppedStores);
  parking.compactAfterStart();
  for (const [record, name] of handles) parking.adopted(record.handle, name);
  slot.parking = parking;
  registry.allocations.observer = parking;
  stores.on('event', (event) => parking.storeEvent(event));
  // What nothing references any more (its store was detached when the process died) goes now, recorded.
  for (const [record] of handles) if (registry.referenceCount(record) === 0) await registry.allocations.freeIfUnused(record);
  return { parking, sessions: [...state.sessions.values()], allocations: handles.length, stores: kept.stores.size, dropped };
}
