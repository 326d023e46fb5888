/**
 * Injected faults (native/src/faults.h, VMMD_FAULTS): each step of a
 * multi-step operation failing in turn leaves no partial state. For each
 * fault, a daemon of its own: the operation fails with a clear error (never
 * INTERNAL or UNKNOWN), the daemon's objects, bytes and descriptors are as
 * before, and the same operation succeeds once the fault has fired.
 */
import * as grpc from '@grpc/grpc-js';
import { connect, VmmdClient } from '../../client';
import type { AccessDescriptor } from '../../generated/vmmd/v1/AccessDescriptor';
import { addon } from '../../native';
import { eventually, MiB, TestDaemon } from './harness';

const RW: AccessDescriptor[] = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];

function objectsOf(stats: Awaited<ReturnType<TestDaemon['stats']>>) {
  const { reservations, allocations, mappings, reservedBytes, allocatedBytes, mappedBytes, pendingTransfers } = stats;
  return { reservations, allocations, mappings, reservedBytes, allocatedBytes, mappedBytes, pendingTransfers };
}

interface Case {
  /** VMMD_FAULTS for the daemon: counts start when it starts. */
  plan: string;
  what: string;
  /** Makes what the operation needs (not counted in the baseline). */
  prepare?: (client: VmmdClient) => Promise<Record<string, string>>;
  operation: (client: VmmdClient, prepared: Record<string, string>) => Promise<unknown>;
  status: grpc.status;
}

/** A memfd of this process's, to attach as a SYSMEM store. */
const sysmem = () => addon.hostMemfdCreate('attached', 2n * MiB);

const cases: Case[] = [
  {
    plan: 'memfd_create:1:ENOMEM',
    what: 'Create, when the memory cannot be made',
    operation: (c) => c.vmm.create({ size: 2n * MiB }),
    status: grpc.status.RESOURCE_EXHAUSTED,
  },
  {
    plan: 'mmap:reserve:1:ENOMEM',
    what: 'Reserve, when the address space cannot be had',
    operation: (c) => c.vmm.reserve({ size: 2n * MiB }),
    status: grpc.status.RESOURCE_EXHAUSTED,
  },
  {
    plan: 'dup:1:EMFILE',
    what: 'Export, when the descriptor cannot be duplicated',
    prepare: async (c) => ({ allocation: (await c.vmm.create({ size: 2n * MiB })).id }),
    operation: (c, { allocation }) => c.vmm.import(allocation),
    status: grpc.status.RESOURCE_EXHAUSTED,
  },
  {
    plan: 'dup:1:EMFILE',
    what: 'Allocate on the session socket, when its export fails after the create (the create is rolled back)',
    operation: (c) => c.vmm.allocate({ size: 2n * MiB }),
    status: grpc.status.RESOURCE_EXHAUSTED,
  },
  {
    plan: 'memfd_create:1:ENOMEM',
    what: 'Allocate, when the create fails',
    operation: (c) => c.vmm.allocate({ size: 2n * MiB }),
    status: grpc.status.RESOURCE_EXHAUSTED,
  },
  {
    plan: 'mmap:map:1:ENOMEM',
    what: 'Map, when the mapping cannot be made',
    prepare: async (c) => ({
      allocation: (await c.vmm.create({ size: 2n * MiB })).id,
      address: (await c.vmm.reserve({ size: 2n * MiB })).address,
    }),
    operation: (c, { allocation, address }) => c.vmm.map({ address, size: 2n * MiB, allocationId: allocation }),
    status: grpc.status.RESOURCE_EXHAUSTED,
  },
  {
    plan: 'mprotect:1:ENOMEM',
    what: 'SetAccess, when the protection cannot change',
    prepare: async (c) => {
      const allocation = (await c.vmm.create({ size: 2n * MiB })).id;
      const { address } = await c.vmm.reserve({ size: 2n * MiB });
      await c.vmm.map({ address, size: 2n * MiB, allocationId: allocation });
      return { allocation, address };
    },
    operation: (c, { address }) => c.vmm.setAccess({ address, size: 2n * MiB, descriptors: RW }),
    status: grpc.status.RESOURCE_EXHAUSTED,
  },
  {
    plan: 'fstat:1:EBADF',
    what: 'Attach of a descriptor, when the descriptor cannot be inspected',
    operation: async (c) => {
      const fd = sysmem();
      try {
        return await c.stores.attachDescriptor(fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: 2n * MiB, readOnly: false });
      } finally {
        addon.close(fd);
      }
    },
    status: grpc.status.INVALID_ARGUMENT,
  },
  {
    plan: 'sendmsg:2:ENOBUFS', // call 1 is the session's greeting
    what: 'Export, when the descriptor cannot be sent on the session socket',
    prepare: async (c) => ({ allocation: (await c.vmm.create({ size: 2n * MiB })).id }),
    operation: (c, { allocation }) => c.vmm.import(allocation),
    status: grpc.status.RESOURCE_EXHAUSTED,
  },
];

describe('an operation whose step fails', () => {
  it.each(cases.map((entry) => [entry.what, entry] as const))('%s leaves nothing behind', async (_what, entry) => {
    const daemon = await TestDaemon.start([], 'host', { VMMD_FAULTS: entry.plan });
    const client = await connect({ socketDir: daemon.dir });
    try {
      const prepared = (await entry.prepare?.(client)) ?? {};
      const before = objectsOf(await daemon.stats());
      const fds = daemon.openFds();
      const refusal = await entry.operation(client, prepared).then(
        () => undefined,
        (error: unknown) => error,
      );
      expect(refusal).toMatchObject({ status: entry.status });
      expect((refusal as Error).message).toMatch(/E[A-Z]+|memory|descriptor/);
      expect(objectsOf(await daemon.stats())).toEqual(before);
      expect(daemon.openFds()).toBe(fds);
      // The fault fired once: the same operation now works, and the daemon served throughout.
      await expect(entry.operation(client, prepared)).resolves.toBeDefined();
    } finally {
      client.close();
      await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'the session to close');
      expect(objectsOf(await daemon.stats())).toMatchObject({ reservations: '0', allocations: '0', mappings: '0' });
      expect(await daemon.stop()).toBe(0);
    }
  });
});

describe('the fault plan', () => {
  afterEach(() => addon.faultsSet(''));

  it('fails exactly the N-th call of the function named, once, with the error named', () => {
    addon.faultsSet('dup:2:EMFILE');
    const fd = addon.hostMemfdCreate('faults', 4096n);
    try {
      addon.close(addon.dup(fd));
      expect(() => addon.dup(fd)).toThrow(expect.objectContaining({ code: 'EMFILE' }));
      addon.close(addon.dup(fd));
      expect(addon.faultsState()).toEqual({ active: true, calls: { memfd_create: 1, dup: 3 }, pending: [] });
    } finally {
      addon.close(fd);
    }
  });

  it.each([
    ['dup', /is not NAME:N:ERROR/],
    ['dup:0:EMFILE', /N must be a call number from 1/],
    ['dup:x:EMFILE', /N must be a call number/],
    ['dup:1:EWHATEVER', /unknown error EWHATEVER/],
  ])('refuses %s', (plan, message) => {
    expect(() => addon.faultsSet(plan)).toThrow(message);
    expect(addon.faultsState().active).toBe(false);
  });

  it('refuses a bad VMMD_FAULTS at start: the daemon does not run untested', async () => {
    await expect(TestDaemon.start([], 'host', { VMMD_FAULTS: 'dup:zero:EMFILE' })).rejects.toThrow(/VMMD_FAULTS/);
  });
});
