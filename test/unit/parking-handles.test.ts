/**
 * The parked state keyed by handle values that come back: a host memfd's
 * number or a driver's allocation handle is free again once the backend has
 * freed it, and new memory can get the same value before the free's own
 * continuation runs (a stock's held free that closes a kept descriptor off
 * the event loop, a refill creating meanwhile). The new memory's parked
 * descriptor and record must survive the old one's removal.
 */
import pino from 'pino';
import { addon } from '../../native';
import type { Backend, BackendHandle, HandleKind, MemLocation } from '../../server/backends/backend';
import type { FdStoreClient } from '../../server/lifecycle/fd-store';
import { Journal } from '../../server/lifecycle/journal';
import { emptyState } from '../../server/lifecycle/parked-records';
import { Parking, ParkingSlot } from '../../server/lifecycle/parking';
import type { AllocationRecord, AllocationSource } from '../../server/registry';

const SIZE = 2n << 20n;
const LOCATION: MemLocation = { type: 'DEVICE', id: 0 };
const OWNER = 5n;

/** A file-descriptor store in this process: a copy of each descriptor, by name. */
class MemoryFdStore {
  readonly held = new Map<string, number>();
  store(name: string, fd: number): void {
    if (!this.held.has(name)) this.held.set(name, addon.dup(fd));
  }
  remove(name: string): void {
    const fd = this.held.get(name);
    if (fd !== undefined) addon.close(fd);
    this.held.delete(name);
  }
  closeAll(): void {
    for (const name of [...this.held.keys()]) this.remove(name);
  }
}

const record = (id: bigint, handle: BackendHandle): AllocationRecord => ({
  id,
  owner: OWNER,
  device: 0,
  location: LOCATION,
  size: SIZE,
  handle,
  handleTypes: ['POSIX_FD'],
  imported: false,
  granularity: SIZE,
  references: new Map([[OWNER, 1]]),
  backendRetains: 0,
  mappingCount: 0,
  busy: 0,
  freed: false,
});

describe('parking, when a freed handle value names new memory', () => {
  it("keeps the new memory's descriptor and record when the old free's continuation comes after it was parked", async () => {
    const fdStore = new MemoryFdStore();
    const memfd = addon.stateMemfdCreate('parking-handles');
    const backend = { devices: () => [{ uuid: '' }], exportHandle: async () => addon.dup(memfd) } as unknown as Backend;
    // The backend frees the handle at once; the free's promise settles only when the test says (a kept descriptor's close off the loop).
    let finishRelease: () => void = () => undefined;
    const upstream = {
      create: async (_owner: bigint, _device: number, _location: MemLocation, _size: bigint, _types: HandleKind[]) => 7,
      release: () => new Promise<void>((resolve) => (finishRelease = resolve)),
    } as unknown as AllocationSource;
    let next = 1n;
    const slot: ParkingSlot = {};
    const peers = { peerOf: () => ({ uid: 1000, gid: 1000 }) };
    slot.parking = Parking.start(
      { client: fdStore as unknown as FdStoreClient, backend, peers, log: pino({ level: 'silent' }), nextId: () => next },
      emptyState(),
      [],
      [],
    );
    const adaptor = Parking.adaptor(slot, upstream);
    try {
      const first = record(next++, await adaptor.create(OWNER, 0, LOCATION, SIZE, ['POSIX_FD']));
      slot.parking.changed(first);
      // The registry frees the first: its record goes, then its memory.
      first.freed = true;
      slot.parking.gone(first);
      const releasing = adaptor.release(first, false);
      // New memory under the same handle value, parked and recorded before the free's continuation.
      const second = record(next++, await adaptor.create(OWNER, 0, LOCATION, SIZE, ['POSIX_FD']));
      expect(second.handle).toBe(first.handle);
      slot.parking.changed(second);
      finishRelease();
      await releasing;
      await new Promise((resolve) => setImmediate(resolve));

      // What a restart would find: the journal names the second allocation, under a name whose descriptor is parked.
      const state = Journal.read(fdStore.held.get('j1')!);
      expect([...state.allocations.keys()]).toEqual(['2']);
      const parkedAs = state.allocations.get('2')!.fd;
      expect([...fdStore.held.keys()].sort()).toEqual(['j1', parkedAs].sort());
      // And later changes of the second allocation are still recorded.
      second.shareKey = 'key';
      slot.parking.changed(second);
      expect(Journal.read(fdStore.held.get('j1')!).allocations.get('2')!.shareKey).toBe('key');
    } finally {
      slot.parking.freeze();
      fdStore.closeAll();
      addon.close(memfd);
    }
  });

  it('keeps the name of memory whose free failed: it lives on, and its next change is recorded', async () => {
    const fdStore = new MemoryFdStore();
    const memfd = addon.stateMemfdCreate('parking-handles');
    const backend = { devices: () => [{ uuid: '' }], exportHandle: async () => addon.dup(memfd) } as unknown as Backend;
    const upstream = {
      create: async () => 9,
      release: async () => {
        throw new Error('the driver refused the free');
      },
    } as unknown as AllocationSource;
    const slot: ParkingSlot = {};
    slot.parking = Parking.start(
      { client: fdStore as unknown as FdStoreClient, backend, peers: { peerOf: () => ({ uid: 1, gid: 1 }) }, log: pino({ level: 'silent' }), nextId: () => 2n },
      emptyState(),
      [],
      [],
    );
    const adaptor = Parking.adaptor(slot, upstream);
    try {
      const allocation = record(1n, await adaptor.create(OWNER, 0, LOCATION, SIZE, ['POSIX_FD']));
      slot.parking.changed(allocation);
      slot.parking.gone(allocation);
      await expect(adaptor.release(allocation, true)).rejects.toThrow('refused');
      // The registry records it again, as it does after a failed free.
      slot.parking.changed(allocation);
      await new Promise((resolve) => setImmediate(resolve));
      const state = Journal.read(fdStore.held.get('j1')!);
      expect(fdStore.held.has(state.allocations.get('1')!.fd)).toBe(true);
    } finally {
      slot.parking.freeze();
      fdStore.closeAll();
      addon.close(memfd);
    }
  });
});

describe('parking, once frozen (the daemon stops)', () => {
  it('keeps the record of a session that ends after the freeze: its frees were not recorded, so the next start must reclaim what it owned', () => {
    const fdStore = new MemoryFdStore();
    const backend = { devices: () => [{ uuid: '' }] } as unknown as Backend;
    const parking = Parking.start(
      {
        client: fdStore as unknown as FdStoreClient,
        backend,
        peers: { peerOf: () => ({ uid: 1, gid: 1 }), tokensOf: () => ({ token: 't', resumeToken: 'r' }) },
        log: pino({ level: 'silent' }),
        nextId: () => 1n,
      },
      emptyState(),
      [],
      [],
    );
    try {
      parking.sessionOpened(3n);
      parking.freeze();
      parking.sessionEnded(3n);
      parking.sessionOpened(4n);
      expect([...Journal.read(fdStore.held.get('j1')!).sessions.keys()]).toEqual(['3']);
    } finally {
      fdStore.closeAll();
    }
  });
});
