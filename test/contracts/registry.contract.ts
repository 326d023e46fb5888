/**
 * Every rule of the driver API that the registry enforces, as a contract any
 * backend must pass: each refusal has its own status and code, and leaves the
 * registry and the backend untouched. Run on the fake backend (test/unit), the
 * host backend (test/native) and the cuda backend (test/gpu).
 */
import { status as Status } from '@grpc/grpc-js';
import { AccessGrant, Backend } from '../../server/backends/backend';
import { RpcError, toServiceError } from '../../server/errors';
import { QuotaLimits, Quotas } from '../../server/registry/quotas';
import { DAEMON_OWNER, MAX_RESERVATION_BYTES, Registry } from '../../server/registry';
import { addon } from '../../native';
import { RecordingBackend } from './recording-backend';

const MiB = 1n << 20n;
const A = 1n;
const B = 2n;
const DEVICE0 = { type: 'DEVICE' as const, id: 0 };
const RW: AccessGrant[] = [{ location: DEVICE0, access: 3 }];
const RO: AccessGrant[] = [{ location: DEVICE0, access: 1 }];

export interface ContractOptions {
  /** The backend refuses creation past this many bytes in all (an out-of-memory test runs when set). */
  capacity?: bigint;
}

export function registryContract(makeBackend: () => Backend | Promise<Backend>, options: ContractOptions = {}): void {
  let backend: RecordingBackend;
  let registry: Registry;
  let GRANULARITY: bigint;

  beforeEach(async () => {
    backend = new RecordingBackend(await makeBackend());
    registry = new Registry(backend);
    GRANULARITY = backend.devices()[0].granularityMinimum;
  });

  afterEach(async () => {
    // Give every byte back, so that a real backend ends each test as it began.
    for (const owner of [A, B, DAEMON_OWNER]) await registry.reclaim(owner);
    expect({ handles: backend.liveHandles, mappings: backend.liveMappings, reservations: backend.liveReservations }).toEqual({
      handles: 0,
      mappings: 0,
      reservations: 0,
    });
  });

  /** Asserts the refusal's status and code, and that nothing changed anywhere. */
  async function expectRefused(action: () => unknown, status: Status, code: string, message?: RegExp): Promise<RpcError> {
    const before = registry.snapshot();
    const calls = backend.calls.length;
    let caught: unknown;
    try {
      await action();
    } catch (error) {
      caught = error;
    }
    expect(caught).toBeInstanceOf(RpcError);
    const error = caught as RpcError;
    expect({ status: Status[error.status], code: error.code }).toEqual({ status: Status[status], code });
    if (message) expect(error.message).toMatch(message);
    expect(registry.snapshot()).toEqual(before);
    expect(backend.calls.slice(calls)).toEqual([]);
    return error;
  }

  function closeExported(fd: number) {
    // Real backends hand out real descriptors; the fake's are plain numbers.
    if (backend.inner.constructor.name !== 'FakeBackend') addon.close(fd);
  }

  function create(caller = A, size = GRANULARITY) {
    return registry.create(caller, { size, location: DEVICE0, handleType: 'POSIX_FD' });
  }

  function reserve(caller = A, size = 8n * MiB) {
    return registry.reserve(caller, { size, alignment: 0n, address: 0n });
  }

  async function mapped(caller = A, size = GRANULARITY) {
    const reservation = reserve(caller, size * 2n);
    const allocation = await create(caller, size);
    await registry.map(caller, { address: reservation.address, size, offset: 0n, allocationId: allocation.id });
    return { reservation, allocation, address: reservation.address, size };
  }

  /** An allocation of A's, unmapped, with `retains` driver references retained (RetainHandle) while it was mapped: 1 + retains references. */
  async function retainedUnmapped(retains: number) {
    const { address, size, allocation } = await mapped();
    for (let i = 0; i < retains; i++) registry.retainHandle(A, address);
    await registry.unmap(A, address, size);
    return allocation;
  }

  describe('Reserve', () => {
    it('refuses size 0', () => expectRefused(() => reserve(A, 0n), Status.INVALID_ARGUMENT, 'ZERO_SIZE'));
    it('refuses a size that is not a multiple of the granularity', () =>
      expectRefused(() => reserve(A, GRANULARITY + 4096n), Status.INVALID_ARGUMENT, 'NOT_ALIGNED', /granularity 2097152/));
    it('refuses an alignment that is not a power of two', () =>
      expectRefused(
        () => registry.reserve(A, { size: GRANULARITY, alignment: 3n * GRANULARITY, address: 0n }),
        Status.INVALID_ARGUMENT,
        'BAD_ALIGNMENT',
        /6291456 is not a power of two/,
      ));
    it('refuses an alignment larger than the largest reservation as out of range, with a code of its own', () =>
      expectRefused(
        () => registry.reserve(A, { size: GRANULARITY, alignment: MAX_RESERVATION_BYTES * 2n, address: 0n }),
        Status.OUT_OF_RANGE,
        'ALIGNMENT_TOO_LARGE',
        /exceeds/,
      ));
    it('refuses an unaligned address hint', () =>
      expectRefused(() => registry.reserve(A, { size: GRANULARITY, alignment: 0n, address: 4096n }), Status.INVALID_ARGUMENT, 'NOT_ALIGNED'));
    it('refuses a reservation past the largest', () =>
      expectRefused(() => reserve(A, MAX_RESERVATION_BYTES + GRANULARITY), Status.OUT_OF_RANGE, 'RESERVATION_TOO_LARGE'));
    it('aligns to a requested power of two above the granularity', () => {
      const reservation = registry.reserve(A, { size: GRANULARITY, alignment: 64n * MiB, address: 0n });
      expect(reservation.size).toBe(GRANULARITY);
      expect(reservation.address % (64n * MiB)).toBe(0n);
      expect(reservation.alignment).toBe(64n * MiB);
    });
    it('takes alignment 0 as the granularity', () => {
      expect(reserve().alignment).toBe(GRANULARITY);
    });
  });

  describe('FreeAddress', () => {
    it('refuses an address where no reservation starts', async () => {
      const reservation = reserve();
      await expectRefused(() => registry.freeAddress(A, 0x1000n, GRANULARITY), Status.NOT_FOUND, 'NOT_RESERVED');
      await expectRefused(() => registry.freeAddress(A, reservation.address + GRANULARITY, GRANULARITY), Status.NOT_FOUND, 'NOT_RESERVED');
    });
    it('refuses a size other than the whole reservation', async () => {
      const reservation = reserve(A, 8n * MiB);
      await expectRefused(() => registry.freeAddress(A, reservation.address, 4n * MiB), Status.INVALID_ARGUMENT, 'PARTIAL_FREE');
    });
    it('refuses while mappings are left', async () => {
      const { reservation } = await mapped();
      await expectRefused(() => registry.freeAddress(A, reservation.address, reservation.size), Status.FAILED_PRECONDITION, 'RESERVATION_MAPPED', /1 mapping/);
    });
    it('frees once, then the address is unknown', async () => {
      const reservation = reserve();
      await registry.freeAddress(A, reservation.address, reservation.size);
      expect(backend.liveReservations).toBe(0);
      await expectRefused(() => registry.freeAddress(A, reservation.address, reservation.size), Status.NOT_FOUND, 'NOT_RESERVED');
    });
    it("refuses another session's reservation", async () => {
      const reservation = reserve(A);
      await expectRefused(() => registry.freeAddress(B, reservation.address, reservation.size), Status.PERMISSION_DENIED, 'NOT_OWNER');
    });
  });

  describe('Create', () => {
    it('refuses size 0', () => expectRefused(() => create(A, 0n), Status.INVALID_ARGUMENT, 'ZERO_SIZE'));
    it('refuses an unaligned size', () => expectRefused(() => create(A, MiB), Status.INVALID_ARGUMENT, 'NOT_ALIGNED'));
    it('refuses an unknown device with OUT_OF_RANGE', () =>
      expectRefused(
        () => registry.create(A, { size: GRANULARITY, location: { type: 'DEVICE', id: 3 }, handleType: 'POSIX_FD' }),
        Status.OUT_OF_RANGE,
        'UNKNOWN_DEVICE',
      ));
    it('refuses a handle type the device cannot export (where fabric is not usable)', async () => {
      if (backend.devices()[0].handleTypes.includes('FABRIC')) return;
      await expectRefused(
        () => registry.create(A, { size: GRANULARITY, location: DEVICE0, handleType: 'FABRIC' }),
        Status.FAILED_PRECONDITION,
        'UNSUPPORTED_HANDLE_TYPE',
      );
    });
    (options.capacity === undefined ? it.skip : it)('passes out of memory on as RESOURCE_EXHAUSTED with requested, used and limit', async () => {
      const capacity = options.capacity!;
      await create(A, capacity - 2n * MiB);
      const before = registry.snapshot();
      let caught: unknown;
      try {
        await create(A, 4n * MiB);
      } catch (error) {
        caught = error;
      }
      const wire = toServiceError(caught);
      expect(wire.code).toBe(Status.RESOURCE_EXHAUSTED);
      expect(wire.details).toMatch(new RegExp(`requested 4194304 bytes, ${capacity - 2n * MiB} of ${capacity}`));
      expect(registry.snapshot()).toEqual(before);
    });
    it('never reuses an id, and refusals consume none', async () => {
      const first = await create();
      await registry.release(A, first.id);
      await expect(create(A, 0n)).rejects.toThrow(RpcError);
      const second = await create();
      expect(second.id).toBe(first.id + 1n);
      await expectRefused(() => registry.release(A, first.id), Status.NOT_FOUND, 'UNKNOWN_ALLOCATION');
    });
  });

  describe('Map', () => {
    it('refuses size 0', async () => {
      const reservation = reserve();
      const allocation = await create();
      await expectRefused(
        () => registry.map(A, { address: reservation.address, size: 0n, offset: 0n, allocationId: allocation.id }),
        Status.INVALID_ARGUMENT,
        'ZERO_SIZE',
      );
    });
    it('refuses a non-zero offset', async () => {
      const reservation = reserve();
      const allocation = await create(A, 4n * MiB);
      await expectRefused(
        () => registry.map(A, { address: reservation.address, size: GRANULARITY, offset: GRANULARITY, allocationId: allocation.id }),
        Status.INVALID_ARGUMENT,
        'NONZERO_OFFSET',
      );
    });
    it('refuses an address outside every reservation', async () => {
      const allocation = await create();
      await expectRefused(
        () => registry.map(A, { address: 0x1000_0000n, size: GRANULARITY, offset: 0n, allocationId: allocation.id }),
        Status.NOT_FOUND,
        'NOT_RESERVED',
      );
    });
    it('refuses an unknown allocation', async () => {
      const reservation = reserve();
      await expectRefused(
        () => registry.map(A, { address: reservation.address, size: GRANULARITY, offset: 0n, allocationId: 999n }),
        Status.NOT_FOUND,
        'UNKNOWN_ALLOCATION',
      );
    });
    it('refuses a released allocation', async () => {
      const { allocation, reservation } = await mapped();
      await registry.release(A, allocation.id);
      await expectRefused(
        () => registry.map(A, { address: reservation.address + GRANULARITY, size: GRANULARITY, offset: 0n, allocationId: allocation.id }),
        Status.FAILED_PRECONDITION,
        'ALREADY_RELEASED',
      );
    });
    it('refuses an unaligned address and an unaligned size', async () => {
      const reservation = reserve();
      const allocation = await create(A, 4n * MiB);
      await expectRefused(
        () => registry.map(A, { address: reservation.address + 4096n, size: GRANULARITY, offset: 0n, allocationId: allocation.id }),
        Status.INVALID_ARGUMENT,
        'NOT_ALIGNED',
      );
      await expectRefused(
        () => registry.map(A, { address: reservation.address, size: 3n * MiB, offset: 0n, allocationId: allocation.id }),
        Status.INVALID_ARGUMENT,
        'NOT_ALIGNED',
      );
    });
    it('refuses offset + size beyond the allocation', async () => {
      const reservation = reserve();
      const allocation = await create(A, GRANULARITY);
      await expectRefused(
        () => registry.map(A, { address: reservation.address, size: 2n * GRANULARITY, offset: 0n, allocationId: allocation.id }),
        Status.OUT_OF_RANGE,
        'BEYOND_ALLOCATION',
      );
    });
    it('refuses a range running past the reservation', async () => {
      const reservation = reserve(A, 2n * GRANULARITY);
      const allocation = await create(A, 2n * GRANULARITY);
      await expectRefused(
        () => registry.map(A, { address: reservation.address + GRANULARITY, size: 2n * GRANULARITY, offset: 0n, allocationId: allocation.id }),
        Status.OUT_OF_RANGE,
        'BEYOND_RESERVATION',
      );
    });
    it('refuses any overlap with a mapping: same range, front, back, inside', async () => {
      const reservation = reserve(A, 8n * GRANULARITY);
      const base = reservation.address;
      const middle = await create(A, 2n * GRANULARITY);
      await registry.map(A, { address: base + 2n * GRANULARITY, size: 2n * GRANULARITY, offset: 0n, allocationId: middle.id });
      const other = await create(A, 2n * GRANULARITY);
      const one = await create(A, GRANULARITY);
      for (const [address, allocation] of [
        [base + 2n * GRANULARITY, other],
        [base + GRANULARITY, other],
        [base + 3n * GRANULARITY, other],
        [base + 3n * GRANULARITY, one],
      ] as const) {
        await expectRefused(
          () => registry.map(A, { address, size: allocation.size, offset: 0n, allocationId: allocation.id }),
          Status.FAILED_PRECONDITION,
          'ALREADY_MAPPED',
        );
      }
      // Adjacent on both sides is fine.
      await registry.map(A, { address: base, size: 2n * GRANULARITY, offset: 0n, allocationId: other.id });
      await registry.map(A, { address: base + 4n * GRANULARITY, size: GRANULARITY, offset: 0n, allocationId: one.id });
      expect(backend.liveMappings).toBe(3);
    });
    it("refuses another session's reservation or allocation", async () => {
      const reservationOfA = reserve(A);
      const allocationOfA = await create(A);
      const reservationOfB = reserve(B);
      await expectRefused(
        () => registry.map(B, { address: reservationOfA.address, size: GRANULARITY, offset: 0n, allocationId: allocationOfA.id }),
        Status.PERMISSION_DENIED,
        'NOT_OWNER',
      );
      await expectRefused(
        () => registry.map(B, { address: reservationOfB.address, size: GRANULARITY, offset: 0n, allocationId: allocationOfA.id }),
        Status.PERMISSION_DENIED,
        'NOT_OWNER',
      );
    });
    it('lets a session use daemon-owned objects, and the daemon only its own', async () => {
      const daemonReservation = reserve(DAEMON_OWNER);
      const allocation = await create(A);
      await registry.map(A, { address: daemonReservation.address, size: GRANULARITY, offset: 0n, allocationId: allocation.id });
      const reservationOfA = reserve(A);
      const daemonAllocation = await create(DAEMON_OWNER);
      await expectRefused(
        () => registry.map(DAEMON_OWNER, { address: reservationOfA.address, size: GRANULARITY, offset: 0n, allocationId: daemonAllocation.id }),
        Status.PERMISSION_DENIED,
        'NOT_OWNER',
      );
    });
  });

  describe('Unmap', () => {
    it('refuses an address with nothing mapped', async () => {
      const reservation = reserve();
      await expectRefused(() => registry.unmap(A, reservation.address, GRANULARITY), Status.NOT_FOUND, 'NOT_MAPPED');
      await expectRefused(() => registry.unmap(A, 0x1000n, GRANULARITY), Status.NOT_FOUND, 'NOT_MAPPED');
    });
    it('refuses a sub-range, a larger range and a range starting inside', async () => {
      const { address } = await mapped(A, 2n * GRANULARITY);
      await expectRefused(() => registry.unmap(A, address, GRANULARITY), Status.INVALID_ARGUMENT, 'PARTIAL_UNMAP');
      await expectRefused(() => registry.unmap(A, address, 3n * GRANULARITY), Status.INVALID_ARGUMENT, 'PARTIAL_UNMAP');
      await expectRefused(() => registry.unmap(A, address + GRANULARITY, GRANULARITY), Status.INVALID_ARGUMENT, 'PARTIAL_UNMAP');
    });
    it('unmaps one whole mapping, once', async () => {
      const { address, size, allocation } = await mapped();
      expect(await registry.unmap(A, address, size)).toEqual({ freed: false });
      expect(registry.allocation(allocation.id).mappingCount).toBe(0);
      await expectRefused(() => registry.unmap(A, address, size), Status.NOT_FOUND, 'NOT_MAPPED');
    });
    it("refuses another session's mapping", async () => {
      const { address, size } = await mapped(A);
      await expectRefused(() => registry.unmap(B, address, size), Status.PERMISSION_DENIED, 'NOT_OWNER');
    });
  });

  describe('SetAccess', () => {
    it('refuses an empty descriptor list and a duplicated location', async () => {
      const { address, size } = await mapped();
      await expectRefused(() => registry.setAccess(A, address, size, []), Status.INVALID_ARGUMENT, 'NO_DESCRIPTORS');
      await expectRefused(() => registry.setAccess(A, address, size, [...RW, ...RO]), Status.INVALID_ARGUMENT, 'DUPLICATE_LOCATION');
    });
    it('refuses an unknown device', async () => {
      const { address, size } = await mapped();
      await expectRefused(
        () => registry.setAccess(A, address, size, [{ location: { type: 'DEVICE', id: 7 }, access: 3 }]),
        Status.OUT_OF_RANGE,
        'UNKNOWN_DEVICE',
      );
    });
    it('refuses size 0 and unaligned ranges', async () => {
      const { address, size } = await mapped();
      await expectRefused(() => registry.setAccess(A, address, 0n, RW), Status.INVALID_ARGUMENT, 'ZERO_SIZE');
      await expectRefused(() => registry.setAccess(A, address + 4096n, size, RW), Status.INVALID_ARGUMENT, 'NOT_ALIGNED');
      await expectRefused(() => registry.setAccess(A, address, size - 4096n, RW), Status.INVALID_ARGUMENT, 'NOT_ALIGNED');
    });
    it('refuses a range that is not fully mapped', async () => {
      const { address, size } = await mapped(A, GRANULARITY);
      await expectRefused(() => registry.setAccess(A, address, size * 2n, RW), Status.FAILED_PRECONDITION, 'NOT_FULLY_MAPPED');
      await expectRefused(() => registry.setAccess(A, address + size, size, RW), Status.FAILED_PRECONDITION, 'NOT_FULLY_MAPPED');
      await expectRefused(() => registry.setAccess(A, 0x1000_0000n, size, RW), Status.NOT_FOUND, 'NOT_MAPPED');
    });
    it('refuses a range that cuts a mapping', async () => {
      const { address } = await mapped(A, 2n * GRANULARITY);
      await expectRefused(() => registry.setAccess(A, address, GRANULARITY, RW), Status.INVALID_ARGUMENT, 'PARTIAL_MAPPING');
    });
    it('sets access across adjacent mappings, and revokes it with NONE', async () => {
      const reservation = reserve(A, 4n * GRANULARITY);
      for (const offset of [0n, GRANULARITY]) {
        const allocation = await create();
        await registry.map(A, { address: reservation.address + offset, size: GRANULARITY, offset: 0n, allocationId: allocation.id });
      }
      await registry.setAccess(A, reservation.address, 2n * GRANULARITY, RW);
      expect(registry.getAccess(A, reservation.address + GRANULARITY, DEVICE0)).toBe(3);
      await registry.setAccess(A, reservation.address, GRANULARITY, [{ location: DEVICE0, access: 0 }]);
      expect(registry.getAccess(A, reservation.address, DEVICE0)).toBe(0);
      expect(registry.getAccess(A, reservation.address + GRANULARITY, DEVICE0)).toBe(3);
    });
  });

  describe('GetAccess', () => {
    it('refuses an unmapped address', async () => {
      const reservation = reserve();
      await expectRefused(() => registry.getAccess(A, reservation.address, DEVICE0), Status.NOT_FOUND, 'NOT_MAPPED');
    });
    it('answers NONE right after map, as the driver does', async () => {
      const { address } = await mapped();
      expect(registry.getAccess(A, address, DEVICE0)).toBe(0);
    });
  });

  describe('Release', () => {
    it('refuses an unknown allocation', () => expectRefused(() => registry.release(A, 42n), Status.NOT_FOUND, 'UNKNOWN_ALLOCATION'));
    it('frees an unmapped allocation at once', async () => {
      const allocation = await create();
      expect(await registry.release(A, allocation.id)).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
      expect(backend.liveHandles).toBe(0);
    });
    it('keeps released memory while mapped, and frees it at the last unmap', async () => {
      const reservation = reserve(A, 4n * GRANULARITY);
      const allocation = await create();
      for (const offset of [0n, GRANULARITY]) {
        await registry.map(A, { address: reservation.address + offset, size: GRANULARITY, offset: 0n, allocationId: allocation.id });
      }
      expect(await registry.release(A, allocation.id)).toEqual({ freed: false, handleReferences: 0, mappingCount: 2 });
      expect(backend.liveHandles).toBe(1);
      expect(await registry.unmap(A, reservation.address, GRANULARITY)).toEqual({ freed: false });
      expect(backend.liveHandles).toBe(1);
      expect(await registry.unmap(A, reservation.address + GRANULARITY, GRANULARITY)).toEqual({ freed: true });
      expect(backend.liveHandles).toBe(0);
      await expectRefused(() => registry.release(A, allocation.id), Status.NOT_FOUND, 'UNKNOWN_ALLOCATION');
    });
    it('refuses a second release while the memory still lives', async () => {
      const { allocation } = await mapped();
      await registry.release(A, allocation.id);
      await expectRefused(() => registry.release(A, allocation.id), Status.FAILED_PRECONDITION, 'ALREADY_RELEASED', /1 mapping/);
    });
    it('counts retained handles: as many releases as retains, plus one', async () => {
      const { address, size, allocation } = await mapped();
      registry.retainHandle(A, address);
      registry.retainHandle(A, address + 4096n);
      expect(registry.referenceCount(registry.allocation(allocation.id))).toBe(3);
      await registry.unmap(A, address, size);
      expect((await registry.release(A, allocation.id)).freed).toBe(false);
      expect((await registry.release(A, allocation.id)).freed).toBe(false);
      expect(await registry.release(A, allocation.id)).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
    });
    it('drops a retained reference once when two Releases come at once, and answers them in order', async () => {
      const { address, size, allocation } = await mapped();
      registry.retainHandle(A, address);
      await registry.unmap(A, address, size);
      // The second comes while the first waits for the driver: it must not drop the same retained reference again.
      const [first, second] = await Promise.all([registry.release(A, allocation.id), registry.release(A, allocation.id)]);
      expect([first, second]).toEqual([
        { freed: false, handleReferences: 1, mappingCount: 0 },
        { freed: true, handleReferences: 0, mappingCount: 0 },
      ]);
      expect(backend.calls.filter((call) => call === 'releaseReference')).toHaveLength(1);
      expect({ retains: backend.liveRetains.size, handles: backend.liveHandles }).toEqual({ retains: 0, handles: 0 });
    });
    it('three Releases at once with two retained references drop one each, in order', async () => {
      const allocation = await retainedUnmapped(2);
      const results = await Promise.allSettled([0, 1, 2].map(() => registry.release(A, allocation.id)));
      expect(results.map((outcome) => (outcome.status === 'fulfilled' ? outcome.value : String(outcome.reason)))).toEqual([
        { freed: false, handleReferences: 2, mappingCount: 0 },
        { freed: false, handleReferences: 1, mappingCount: 0 },
        { freed: true, handleReferences: 0, mappingCount: 0 },
      ]);
      expect({ retains: backend.liveRetains.size, handles: backend.liveHandles }).toEqual({ retains: 0, handles: 0 });
    });
    it('a reclaim behind two Releases waiting on the driver drops what is left and frees it', async () => {
      const allocation = await retainedUnmapped(2);
      let open!: () => void;
      backend.releaseReferenceGate = new Promise<void>((resolve) => (open = resolve));
      const releases = [registry.release(A, allocation.id), registry.release(A, allocation.id)];
      const reclaiming = registry.reclaim(A);
      for (let turn = 0; turn < 20; turn++) await new Promise((resolve) => setImmediate(resolve));
      backend.releaseReferenceGate = undefined;
      open();
      await reclaiming;
      await Promise.allSettled(releases);
      expect(() => registry.allocation(allocation.id)).toThrow(/does not exist/);
      expect({ retains: backend.liveRetains.size, handles: backend.liveHandles }).toEqual({ retains: 0, handles: 0 });
    });
    it("a create waits for a reclaim's free to start, not for it to finish", async () => {
      const { address, size, reservation } = await mapped();
      registry.retainHandle(A, address);
      await registry.unmap(A, address, size);
      await registry.freeAddress(A, reservation.address, reservation.size);
      let open!: () => void;
      backend.releaseGate = new Promise<void>((resolve) => (open = resolve));
      try {
        const reclaiming = registry.reclaim(A);
        for (let turn = 0; !backend.calls.includes('release') && turn < 100; turn++) await new Promise((resolve) => setImmediate(resolve));
        expect(backend.calls).toContain('release');
        let done = false;
        const creating = create(B).finally(() => (done = true));
        // The free stays gated: a create that waited for it to finish would never end. A real driver's create takes
        // its own time off the event loop (more than 20 turns on an H200), so the wait is bounded by time, not turns.
        const until = Date.now() + 10_000;
        while (!done && Date.now() < until) await new Promise((resolve) => setTimeout(resolve, 1));
        const early = done;
        open();
        await reclaiming;
        await creating;
        expect(early).toBe(true);
      } finally {
        backend.releaseGate = undefined;
        open();
      }
    });
    it('Releases behind a drop in flight are refused after waiting as they would be after it: UNKNOWN_ALLOCATION, ALREADY_RELEASED, NOT_OWNER', async () => {
      // UNKNOWN_ALLOCATION: one retained reference, three Releases: the second frees it, the third finds it gone.
      const first = await mapped();
      registry.retainHandle(A, first.address);
      await registry.unmap(A, first.address, first.size);
      const gone = await Promise.allSettled([0, 1, 2].map(() => registry.release(A, first.allocation.id)));
      expect(gone.map((o) => (o.status === 'fulfilled' ? o.value.freed : (o.reason as RpcError).code))).toEqual([false, true, 'UNKNOWN_ALLOCATION']);
      // ALREADY_RELEASED: still mapped.
      const second = await mapped();
      registry.retainHandle(A, second.address);
      const kept = await Promise.allSettled([0, 1, 2].map(() => registry.release(A, second.allocation.id)));
      expect(kept.map((o) => (o.status === 'fulfilled' ? o.value.handleReferences : (o.reason as RpcError).code))).toEqual([1, 0, 'ALREADY_RELEASED']);
      // NOT_OWNER: B's Release waits behind A's drop, then is refused.
      const third = await mapped();
      registry.retainHandle(A, third.address);
      const refused = await Promise.allSettled([registry.release(A, third.allocation.id), registry.release(B, third.allocation.id)]);
      expect(refused.map((o) => (o.status === 'fulfilled' ? o.value.handleReferences : (o.reason as RpcError).code))).toEqual([1, 'NOT_OWNER']);
    });
    it('a Release with no driver reference to drop starts its free in the same turn', async () => {
      const allocation = await create();
      const releasing = registry.release(A, allocation.id);
      const startedAtOnce = backend.calls.includes('release');
      await releasing;
      expect(startedAtOnce).toBe(true);
    });
    it('the recording backend refuses two drops at once of one retained reference (what the registry must never do)', async () => {
      const { address, allocation } = await mapped();
      registry.retainHandle(A, address);
      const record = registry.allocation(allocation.id);
      const both = await Promise.allSettled([backend.releaseReference(record.handle, record.device), backend.releaseReference(record.handle, record.device)]);
      expect(both.map((o) => o.status).sort()).toEqual(['fulfilled', 'rejected']);
      // Dropped behind the registry's back: its books set right for the reclaim after the test.
      record.backendRetains = 0;
      record.references.set(A, 1);
    });
    it("refuses another session's allocation", async () => {
      const allocation = await create(A);
      await expectRefused(() => registry.release(B, allocation.id), Status.PERMISSION_DENIED, 'NOT_OWNER');
    });
    it('keeps an allocation the backend failed to free, accounted, and frees it at the next Release', async () => {
      const allocation = await create(A);
      const driverError = Object.assign(new Error('cuMemRelease: CUDA_ERROR_UNKNOWN'), { code: 'CUDA_ERROR_UNKNOWN' });
      backend.failOnce('release', driverError);
      await expect(registry.release(A, allocation.id)).rejects.toBe(driverError);
      expect(registry.allocation(allocation.id)).toBe(allocation);
      expect(registry.stats()).toMatchObject({ allocations: 1, allocatedBytes: GRANULARITY });
      expect(backend.liveHandles).toBe(1);
      await expectRefused(() => registry.release(B, allocation.id), Status.PERMISSION_DENIED, 'NOT_OWNER');
      expect(await registry.release(A, allocation.id)).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
      expect(backend.liveHandles).toBe(0);
    });
    it('keeps a retained reference the backend failed to drop', async () => {
      const { address, size, allocation } = await mapped();
      registry.retainHandle(A, address);
      await registry.unmap(A, address, size);
      backend.failOnce('releaseReference', new Error('cuMemRelease failed'));
      await expect(registry.release(A, allocation.id)).rejects.toThrow('cuMemRelease failed');
      expect(registry.referenceCount(registry.allocation(allocation.id))).toBe(2);
      expect((await registry.release(A, allocation.id)).freed).toBe(false);
      expect(await registry.release(A, allocation.id)).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
    });
    it('lets a holder of a retained reference release only that reference', async () => {
      const reservation = reserve(DAEMON_OWNER);
      const allocation = await create(A);
      await registry.map(A, { address: reservation.address, size: GRANULARITY, offset: 0n, allocationId: allocation.id });
      registry.retainHandle(B, reservation.address);
      expect((await registry.release(B, allocation.id)).handleReferences).toBe(1);
      await expectRefused(() => registry.release(B, allocation.id), Status.PERMISSION_DENIED, 'NOT_OWNER');
    });
  });

  describe('RetainHandle', () => {
    it('refuses an unmapped address', async () => {
      const reservation = reserve();
      await expectRefused(() => registry.retainHandle(A, reservation.address), Status.NOT_FOUND, 'NOT_MAPPED');
    });
    it('retains a released but mapped allocation, as the driver allows', async () => {
      const { address, allocation } = await mapped();
      await registry.release(A, allocation.id);
      expect((await registry.retainHandle(A, address)).id).toBe(allocation.id);
      expect(registry.referenceCount(allocation)).toBe(1);
    });
  });

  describe('Export and Share', () => {
    it('refuses a released allocation', async () => {
      const { allocation } = await mapped();
      await registry.release(A, allocation.id);
      await expectRefused(
        () => registry.exportHandle(A, { allocationId: allocation.id, handleType: 'POSIX_FD', shareKey: '' }),
        Status.FAILED_PRECONDITION,
        'ALREADY_RELEASED',
      );
    });
    it("refuses another session's allocation without its share key", async () => {
      const allocation = await create(A);
      await expectRefused(
        () => registry.exportHandle(B, { allocationId: allocation.id, handleType: 'POSIX_FD', shareKey: '' }),
        Status.PERMISSION_DENIED,
        'NOT_OWNER',
      );
      registry.share(A, allocation.id);
      await expectRefused(
        () => registry.exportHandle(B, { allocationId: allocation.id, handleType: 'POSIX_FD', shareKey: 'not-the-key' }),
        Status.PERMISSION_DENIED,
        'BAD_SHARE_KEY',
      );
    });
    it('exports with the share key, and only the owner can share', async () => {
      const allocation = await create(A);
      expect(() => registry.share(B, allocation.id)).toThrow(expect.objectContaining({ code: 'NOT_OWNER' }));
      const key = registry.share(A, allocation.id);
      expect(registry.share(A, allocation.id)).toBe(key);
      const exported = await registry.exportHandle(B, { allocationId: allocation.id, handleType: 'POSIX_FD', shareKey: key });
      expect(exported.allocation.id).toBe(allocation.id);
      expect(exported.fd).toBeGreaterThanOrEqual(0);
      closeExported(exported.fd!);
    });
    it('refuses a handle type the allocation was not made for', async () => {
      const allocation = await create(A);
      expect(allocation.handleTypes).toEqual(['POSIX_FD']);
      await expectRefused(
        () => registry.exportHandle(A, { allocationId: allocation.id, handleType: 'FABRIC', shareKey: '' }),
        Status.FAILED_PRECONDITION,
        'UNSUPPORTED_HANDLE_TYPE',
      );
    });
  });

  describe('Read and Write', () => {
    it('refuses length 0 and unmapped ranges', async () => {
      const { address, size } = await mapped();
      await registry.setAccess(A, address, size, RW);
      await expectRefused(() => registry.write(A, address, Buffer.alloc(0)), Status.INVALID_ARGUMENT, 'ZERO_SIZE');
      await expectRefused(() => registry.write(A, address + size - 2n, Buffer.alloc(4)), Status.FAILED_PRECONDITION, 'NOT_FULLY_MAPPED');
      await expectRefused(() => registry.write(A, 0x1000n, Buffer.alloc(4)), Status.NOT_FOUND, 'NOT_MAPPED');
    });
    it('refuses a range past the reservation', async () => {
      const { reservation } = await mapped();
      await expectRefused(() => registry.checkIo(A, reservation.address + reservation.size - 2n, 4n, false), Status.OUT_OF_RANGE, 'BEYOND_RESERVATION');
    });
    it('refuses reads without access and writes without write access', async () => {
      const { address, size } = await mapped();
      await expectRefused(() => registry.checkIo(A, address, 4n, false), Status.FAILED_PRECONDITION, 'NO_ACCESS');
      await registry.setAccess(A, address, size, RO);
      registry.checkIo(A, address, 4n, false);
      await expectRefused(() => registry.write(A, address, Buffer.from('abcd')), Status.FAILED_PRECONDITION, 'NO_ACCESS');
    });
    it('writes and reads across two adjacent mappings, in chunks', async () => {
      const reservation = reserve(A, 2n * GRANULARITY);
      for (const offset of [0n, GRANULARITY]) {
        const allocation = await create();
        await registry.map(A, { address: reservation.address + offset, size: GRANULARITY, offset: 0n, allocationId: allocation.id });
      }
      await registry.setAccess(A, reservation.address, 2n * GRANULARITY, RW);
      const pattern = Buffer.alloc(3 * Number(MiB), 0);
      for (let i = 0; i < pattern.length; i++) pattern[i] = (i * 7) & 0xff;
      await registry.write(A, reservation.address + MiB, pattern);
      const chunks: Buffer[] = [];
      for await (const chunk of registry.read(A, reservation.address + MiB, BigInt(pattern.length))) chunks.push(chunk.data);
      expect(chunks).toHaveLength(3);
      expect(Buffer.concat(chunks).equals(pattern)).toBe(true);
    });
    it("refuses another session's memory", async () => {
      const { address } = await mapped(A);
      await expectRefused(() => registry.checkIo(B, address, 4n, false), Status.PERMISSION_DENIED, 'NOT_OWNER');
    });
  });

  describe('serialization per reservation', () => {
    it('makes a map into a range wait for the unmap in flight there', async () => {
      const { address, size } = await mapped();
      let open!: () => void;
      backend.unmapGate = new Promise((resolve) => (open = resolve));
      const unmapping = registry.unmap(A, address, size);
      const next = await create();
      const mapping = registry.map(A, { address, size, offset: 0n, allocationId: next.id });
      await new Promise((resolve) => setImmediate(resolve));
      expect(backend.calls.filter((call) => call === 'map')).toHaveLength(1);
      open();
      await unmapping;
      await mapping;
      expect(backend.liveMappings).toBe(1);
    });
  });

  describe('copies and unmaps of one range: no unmap under a copy in flight', () => {
    it('makes an unmap, a free of the address and a release wait for a write in flight, and the bytes land', async () => {
      const { address, size, allocation, reservation } = await mapped();
      await registry.setAccess(A, address, size, RW);
      let open!: () => void;
      backend.writeGate = new Promise((resolve) => (open = resolve));
      const data = Buffer.alloc(4096, 7);
      const writing = registry.write(A, address, data);
      const unmapping = registry.unmap(A, address, size);
      const releasing = registry.release(A, allocation.id);
      await new Promise((resolve) => setImmediate(resolve));
      expect(backend.calls.filter((call) => call === 'unmap')).toHaveLength(0);
      open();
      await writing;
      await unmapping;
      await releasing;
      const order = backend.calls.filter((call) => call === 'write landed' || call === 'unmap');
      expect(order).toEqual(['write landed', 'unmap']);
      await registry.freeAddress(A, reservation.address, reservation.size);
    });

    it('a write queued behind an unmap of its range is refused, not run on unmapped memory', async () => {
      const { address, size } = await mapped();
      await registry.setAccess(A, address, size, RW);
      let open!: () => void;
      backend.unmapGate = new Promise((resolve) => (open = resolve));
      const unmapping = registry.unmap(A, address, size);
      const writing = registry.write(A, address, Buffer.alloc(16, 1)).catch((error) => error);
      open();
      await unmapping;
      const refused = await writing;
      expect(refused).toBeInstanceOf(RpcError);
      expect(backend.calls).not.toContain('write');
    });
  });

  describe('reclaim', () => {
    it("frees everything a session owns and leaves others' objects", async () => {
      await mapped(A);
      await create(A);
      const keptByB = await mapped(B);
      const daemonReservation = reserve(DAEMON_OWNER);
      await registry.reclaim(A);
      const snapshot = registry.snapshot();
      expect(snapshot.reservations.map((r) => r.owner).sort()).toEqual(['0', '2']);
      expect(snapshot.allocations.map((a) => a.id)).toEqual([String(keptByB.allocation.id)]);
      expect(backend.liveHandles).toBe(1);
      expect(daemonReservation.freed).toBe(false);
    });
    it('passes an allocation still mapped in a daemon reservation to the daemon', async () => {
      const daemonReservation = reserve(DAEMON_OWNER);
      const allocation = await create(A);
      await registry.map(A, { address: daemonReservation.address, size: GRANULARITY, offset: 0n, allocationId: allocation.id });
      await registry.reclaim(A);
      const record = registry.allocation(allocation.id);
      expect(record.owner).toBe(DAEMON_OWNER);
      expect(registry.referenceCount(record)).toBe(0);
      expect((await registry.unmap(DAEMON_OWNER, daemonReservation.address, GRANULARITY)).freed).toBe(true);
    });
    it('drops the references a session retained on other allocations', async () => {
      const daemonReservation = reserve(DAEMON_OWNER);
      const allocation = await create(DAEMON_OWNER);
      await registry.map(DAEMON_OWNER, { address: daemonReservation.address, size: GRANULARITY, offset: 0n, allocationId: allocation.id });
      registry.retainHandle(A, daemonReservation.address);
      registry.retainHandle(A, daemonReservation.address);
      await registry.reclaim(A);
      expect(registry.referenceCount(registry.allocation(allocation.id))).toBe(1);
    });
  });

  /** Holds every create once the backend has made its memory, until the returned function runs. */
  function holdCreates(): () => void {
    let open!: () => void;
    backend.createGate = new Promise<void>((resolve) => (open = resolve));
    return () => {
      backend.createGate = undefined;
      open();
    };
  }

  /** Waits (at most 10 s: the cuda backend makes memory on driver threads) until `condition` holds. */
  async function until(condition: () => boolean): Promise<void> {
    for (let waited = 0; !condition() && waited < 10_000; waited++) await new Promise((resolve) => setTimeout(resolve, 1));
    expect(condition()).toBe(true);
  }

  const outcome = <T>(promise: Promise<T>) =>
    promise.then(
      (value) => ({ value }),
      (error: RpcError) => ({ error }),
    );

  describe('creates in flight (memory made off the event loop)', () => {
    it('lands every one of several creates in flight at once, each its own memory, recorded only once made', async () => {
      const open = holdCreates();
      const creating = Array.from({ length: 6 }, () => create(A));
      await until(() => backend.liveHandles === 6);
      expect(registry.stats().allocations).toBe(0);
      open();
      const made = await Promise.all(creating);
      expect(new Set(made.map((allocation) => allocation.id)).size).toBe(6);
      expect(new Set(made.map((allocation) => String(allocation.handle))).size).toBe(6);
      expect(registry.stats()).toMatchObject({ allocations: 6, allocatedBytes: 6n * GRANULARITY });
      for (const allocation of made) expect((await registry.release(A, allocation.id)).freed).toBe(true);
      expect(backend.liveHandles).toBe(0);
    });

    it('refuses a create whose owner is reclaimed while it is in flight (SESSION_CLOSED), and releases its memory: nothing leaks', async () => {
      const kept = await create(B);
      const open = holdCreates();
      const creating = [create(A), create(A, 2n * GRANULARITY)].map(outcome);
      await until(() => backend.liveHandles === 3);
      let reclaimed = false;
      const reclaim = registry.reclaim(A).then(() => (reclaimed = true));
      await new Promise((resolve) => setTimeout(resolve, 20));
      // The reclaim waits for the memory in flight: it cannot free what it cannot see yet.
      expect(reclaimed).toBe(false);
      open();
      await reclaim;
      for (const result of await Promise.all(creating)) {
        expect(result).toMatchObject({ error: { code: 'SESSION_CLOSED', status: Status.UNAVAILABLE } });
        expect((result as { error: RpcError }).error.message).toMatch(
          /session 1 was reclaimed while its \d+-byte allocation was being created; the memory was released/,
        );
      }
      expect(registry.snapshot().allocations.map((allocation) => allocation.id)).toEqual([String(kept.id)]);
      expect(registry.stats()).toMatchObject({ allocations: 1, allocatedBytes: GRANULARITY });
      expect(backend.liveHandles).toBe(1);
    });

    it('keeps in sight the memory of an abandoned create it could not release (the daemon holds it, no reference), and frees it at the next reclaim', async () => {
      const open = holdCreates();
      const creating = outcome(create(A));
      await until(() => backend.liveHandles === 1);
      // Fails for the abandoned create, and again for the reclaim's own try at the end.
      backend.failOnce('release', Object.assign(new Error('cuMemRelease: CUDA_ERROR_UNKNOWN'), { code: 'CUDA_ERROR_UNKNOWN' }), 2);
      const reclaim = registry.reclaim(A);
      open();
      await expect(reclaim).rejects.toThrow(/1 object\(s\) could not be freed/);
      const { error } = (await creating) as { error: RpcError };
      expect(error).toMatchObject({
        code: 'SESSION_CLOSED',
        message: expect.stringMatching(/releasing the memory failed \(cuMemRelease: CUDA_ERROR_UNKNOWN\): allocation \d+ is the daemon's/),
      });
      expect(registry.snapshot().allocations).toEqual([expect.objectContaining({ owner: '0', references: {}, mappingCount: 0 })]);
      expect(registry.stats()).toMatchObject({ allocations: 1, allocatedBytes: GRANULARITY });
      await registry.reclaim(B);
      expect(registry.snapshot().allocations).toEqual([]);
      expect(backend.liveHandles).toBe(0);
    });
  });

  describe('quotas with creates in flight (reserve, create, commit or refund)', () => {
    // A registry of its own over the same backend, with the daemon's quota adaptor; A and B are one uid's.
    function limited(limits: Partial<QuotaLimits>) {
      const quotas = new Quotas({ perUid: 0n, perSession: 0n, ...limits }, (session) => (session === A || session === B ? 1000 : undefined));
      return {
        quotas,
        limitedRegistry: new Registry(backend, (upstream) => quotas.around(upstream, (handle, device) => backend.memoryIdentity(handle, device))),
      };
    }
    const createIn = (where: Registry, caller: bigint, size = GRANULARITY) => where.create(caller, { size, location: DEVICE0, handleType: 'POSIX_FD' });

    it('charges creates in flight at once: of 8 against a session quota of 3, exactly 3 are made and 5 refused before reaching the backend', async () => {
      const { quotas, limitedRegistry } = limited({ perSession: 3n * GRANULARITY });
      const open = holdCreates();
      const creating = Array.from({ length: 8 }, () => outcome(createIn(limitedRegistry, A)));
      await until(() => backend.liveHandles === 3);
      expect(backend.calls.filter((call) => call === 'create')).toHaveLength(3);
      expect(quotas.used().bySession).toEqual({ [String(A)]: String(3n * GRANULARITY) });
      open();
      const results = await Promise.all(creating);
      const granted = results.flatMap((result) => ('value' in result ? [result.value] : []));
      expect(granted).toHaveLength(3);
      for (const result of results.filter((result) => 'error' in result)) {
        expect(result).toMatchObject({ error: { code: 'QUOTA_EXCEEDED', status: Status.RESOURCE_EXHAUSTED } });
      }
      expect(quotas.refusals).toBe(5);
      expect(limitedRegistry.stats()).toMatchObject({ allocations: 3, allocatedBytes: 3n * GRANULARITY });
      for (const allocation of granted) await limitedRegistry.release(A, allocation.id);
      expect(quotas.used()).toEqual({ byUid: {}, bySession: {} });
      expect(backend.liveHandles).toBe(0);
    });

    it("charges one uid's sessions together: of 4 + 4 creates in flight against a uid quota of 5, exactly 5 are made", async () => {
      const { quotas, limitedRegistry } = limited({ perUid: 5n * GRANULARITY });
      const open = holdCreates();
      const creating = Array.from({ length: 8 }, (_, i) => outcome(createIn(limitedRegistry, i % 2 === 0 ? A : B)));
      await until(() => backend.liveHandles === 5);
      open();
      const results = await Promise.all(creating);
      expect(results.filter((result) => 'value' in result)).toHaveLength(5);
      expect(results.filter((result) => 'error' in result && result.error.code === 'QUOTA_EXCEEDED')).toHaveLength(3);
      expect(quotas.used().byUid).toEqual({ 1000: String(5n * GRANULARITY) });
      await limitedRegistry.reclaim(A);
      await limitedRegistry.reclaim(B);
      expect(quotas.used()).toEqual({ byUid: {}, bySession: {} });
      expect(backend.liveHandles).toBe(0);
    });

    (options.capacity === undefined ? it.skip : it)('refunds a create the backend refuses while others are in flight', async () => {
      const { quotas, limitedRegistry } = limited({ perSession: options.capacity! * 2n });
      const big = await createIn(limitedRegistry, A, options.capacity! - GRANULARITY);
      const results = await Promise.all([outcome(createIn(limitedRegistry, A)), outcome(createIn(limitedRegistry, A))]);
      expect(results.filter((result) => 'value' in result)).toHaveLength(1);
      const refused = results.flatMap((result) => ('error' in result ? [toServiceError(result.error)] : []));
      expect(refused).toEqual([expect.objectContaining({ code: Status.RESOURCE_EXHAUSTED, details: expect.stringMatching(/out of memory/i) })]);
      expect(quotas.used().bySession).toEqual({ [String(A)]: String(options.capacity!) });
      expect(big.size).toBe(options.capacity! - GRANULARITY);
      await limitedRegistry.reclaim(A);
      expect(quotas.used()).toEqual({ byUid: {}, bySession: {} });
    });

    it('refunds the charge of a create abandoned by a reclaim of its owner', async () => {
      const { quotas, limitedRegistry } = limited({ perSession: 4n * GRANULARITY });
      const open = holdCreates();
      const creating = [outcome(createIn(limitedRegistry, A)), outcome(createIn(limitedRegistry, A))];
      await until(() => backend.liveHandles === 2);
      expect(quotas.used().bySession).toEqual({ [String(A)]: String(2n * GRANULARITY) });
      const reclaim = limitedRegistry.reclaim(A);
      open();
      await reclaim;
      for (const result of await Promise.all(creating)) expect(result).toMatchObject({ error: { code: 'SESSION_CLOSED' } });
      expect(quotas.used()).toEqual({ byUid: {}, bySession: {} });
      expect(limitedRegistry.stats()).toMatchObject({ allocations: 0, allocatedBytes: 0n });
      expect(backend.liveHandles).toBe(0);
    });
  });
}
