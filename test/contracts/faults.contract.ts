/**
 * Injected faults (native/src/faults.h, VMMD_FAULTS), on either backend: each
 * step of a multi-step operation failing in turn leaves no partial state. For
 * each fault, a daemon of its own (counts start once its backend is open):
 *
 * - an operation that makes something (Create, Reserve, Export, Allocate, Map,
 *   SetAccess, CreateStore, Attach) fails with a clear error (never INTERNAL
 *   or UNKNOWN) and the daemon's objects, bytes and descriptors are as before;
 * - an operation that frees something (Unmap, FreeAddress, Release, Detach)
 *   fails with a clear error and what it was freeing is still accounted for
 *   (its steps before the failing one may have run);
 *
 * then the same call succeeds (the fault fired once), and after `cleanup`
 * the daemon holds exactly what it held before `prepare`.
 */
import * as grpc from '@grpc/grpc-js';
import { connect, VmmdClient, VmmdError } from '../../client';
import { LocalDeviceMemory } from '../../client/shared-memory';
import type { AccessDescriptor } from '../../generated/vmmd/v1/AccessDescriptor';
import type { StoreTarget } from '../../generated/vmmd/v1/StoreTarget';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import { addon } from '../../native';
import { eventually, MiB, objectsOf, TestDaemon } from '../e2e/harness';
import { figure } from '../reliability/figures';

type Backend = 'host' | 'cuda';
type Prepared = Record<string, string>;

const RW: AccessDescriptor[] = [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }];
const SIZE = 2n * MiB;

interface Case {
  /** VMMD_FAULTS for the daemon. */
  plan: string;
  what: string;
  /** Makes what the operation needs. */
  prepare?: (client: VmmdClient) => Promise<Prepared>;
  operation: (client: VmmdClient, prepared: Prepared) => Promise<unknown>;
  status: grpc.status;
  /** For operations that free: true while what they free is still accounted for (a store still listed). */
  stillThere?: (client: VmmdClient, prepared: Prepared) => Promise<boolean>;
  /** Frees what prepare and the operation left, so that the daemon is back where it started. */
  cleanup?: (client: VmmdClient, prepared: Prepared) => Promise<unknown>;
}

/** Memory of this process's to attach: a memfd (host) or CUDA memory this process made (cuda). */
async function externalMemory(backend: Backend): Promise<{ fd: number; target: StoreTarget; free: () => Promise<void> }> {
  if (backend === 'host') return { fd: addon.hostMemfdCreate('attached', SIZE), target: 'STORE_TARGET_SYSMEM', free: async () => undefined };
  const memory = await LocalDeviceMemory.allocate(0, SIZE);
  return { fd: await memory.exportFd(), target: 'STORE_TARGET_FBMEM', free: () => memory.free() };
}

/** Local memory attached by cases, freed when the case ends. */
const externals: Array<() => Promise<void>> = [];

async function attach(client: VmmdClient, backend: Backend): Promise<unknown> {
  const memory = await externalMemory(backend);
  externals.push(memory.free);
  try {
    return await client.stores.attachDescriptor(memory.fd, { target: memory.target, device: 0, size: SIZE, readOnly: false });
  } finally {
    addon.close(memory.fd);
  }
}

/** The Release RPC itself (the client library releases on the session socket, answered before the free). */
function releaseRpc(client: VmmdClient, allocationId: string): Promise<unknown> {
  const metadata = new grpc.Metadata();
  metadata.set(SESSION_METADATA_KEY, client.session.token);
  const raw = (
    client.vmm as unknown as { client: { Release(request: object, metadata: grpc.Metadata, done: (error: Error | null, value?: unknown) => void): void } }
  ).client;
  return new Promise((resolve, reject) =>
    raw.Release({ allocationId }, metadata, (error, value) => (error ? reject(VmmdError.fromServiceError(error as grpc.ServiceError)) : resolve(value))),
  );
}

const listed = async (client: VmmdClient, { store }: Prepared) => (await client.stores.list()).some((entry) => entry.id === store);

const prepareAllocation = async (c: VmmdClient): Promise<Prepared> => ({ allocation: (await c.vmm.create({ size: SIZE })).id });

const prepareMapping = async (c: VmmdClient): Promise<Prepared> => {
  const { allocation } = await prepareAllocation(c);
  const { address } = await c.vmm.reserve({ size: SIZE });
  await c.vmm.map({ address, size: SIZE, allocationId: allocation });
  return { allocation, address };
};

/** A store of an allocation the client then released: detaching it frees everything. */
const prepareCreatedStore = async (c: VmmdClient): Promise<Prepared> => {
  const { allocation } = await prepareAllocation(c);
  const store = await c.stores.createStore({ allocationId: allocation });
  await c.vmm.release({ allocationId: allocation });
  return { store: store.id };
};

const freeMapping = async (c: VmmdClient, { allocation, address }: Prepared) => {
  await c.vmm.freeAddress({ address, size: SIZE });
  await c.vmm.release({ allocationId: allocation });
};

/** The errors a plan names, as each backend spells running out. */
const exhausted = (backend: Backend) => (backend === 'host' ? 'ENOMEM' : 'CUDA_ERROR_OUT_OF_MEMORY');

/** The function each step calls, per backend. */
const STEP = {
  create: { host: 'memfd_create', cuda: 'cuMemCreate' },
  export: { host: 'dup', cuda: 'cuMemExportToShareableHandle' },
  reserve: { host: 'mmap:reserve', cuda: 'cuMemAddressReserve' },
  map: { host: 'mmap:map', cuda: 'cuMemMap' },
  access: { host: 'mprotect', cuda: 'cuMemSetAccess' },
  unmap: { host: 'mmap:unmap', cuda: 'cuMemUnmap' },
  free: { host: 'munmap', cuda: 'cuMemAddressFree' },
} as const;

function cases(backend: Backend): Case[] {
  const fail = (step: keyof typeof STEP, nth = 1) => `${STEP[step][backend]}:${nth}:${exhausted(backend)}`;
  const EXHAUSTED = grpc.status.RESOURCE_EXHAUSTED;
  const list: Case[] = [
    { plan: fail('create'), what: 'Create, when the memory cannot be made', operation: (c) => c.vmm.create({ size: SIZE }), status: EXHAUSTED },
    { plan: fail('reserve'), what: 'Reserve, when the address space cannot be had', operation: (c) => c.vmm.reserve({ size: SIZE }), status: EXHAUSTED },
    {
      plan: fail('export'),
      what: 'Export, when the descriptor cannot be made',
      prepare: prepareAllocation,
      operation: (c, { allocation }) => c.vmm.import(allocation),
      status: EXHAUSTED,
    },
    {
      plan: fail('export'),
      what: 'Allocate on the session socket, when its export fails after the create (the create is rolled back)',
      operation: (c) => c.vmm.allocate({ size: SIZE }),
      status: EXHAUSTED,
    },
    { plan: fail('create'), what: 'Allocate, when the create fails', operation: (c) => c.vmm.allocate({ size: SIZE }), status: EXHAUSTED },
    {
      plan: fail('map'),
      what: 'Map, when the mapping cannot be made',
      prepare: async (c) => ({ ...(await prepareAllocation(c)), address: (await c.vmm.reserve({ size: SIZE })).address }),
      operation: (c, { allocation, address }) => c.vmm.map({ address, size: SIZE, allocationId: allocation }),
      status: EXHAUSTED,
    },
    {
      plan: fail('access'),
      what: 'SetAccess, when the access cannot change',
      prepare: prepareMapping,
      operation: (c, { address }) => c.vmm.setAccess({ address, size: SIZE, descriptors: RW }),
      status: EXHAUSTED,
    },
    ...(['reserve', 'map', 'access'] as const).map((step): Case => ({
      plan: fail(step),
      what: `CreateStore, when its ${step} step fails`,
      prepare: prepareAllocation,
      operation: (c, { allocation }) => c.stores.createStore({ allocationId: allocation }),
      status: EXHAUSTED,
    })),
    ...(backend === 'host' ? (['reserve', 'map', 'access'] as const) : (['import', 'reserve', 'map', 'access'] as const)).map((step): Case => ({
      plan: step === 'import' ? `cuMemImportFromShareableHandle:1:${exhausted(backend)}` : fail(step),
      what: `Attach of a descriptor, when its ${step} step fails`,
      operation: (c) => attach(c, backend),
      status: EXHAUSTED,
    })),
    {
      plan: fail('unmap'),
      what: 'Unmap, when the unmapping fails',
      prepare: prepareMapping,
      operation: (c, { address }) => c.vmm.unmap({ address, size: SIZE }),
      status: EXHAUSTED,
      cleanup: freeMapping,
    },
    {
      plan: fail('free'),
      what: 'FreeAddress, when the address space cannot be given back',
      prepare: async (c) => ({ address: (await c.vmm.reserve({ size: SIZE })).address }),
      operation: (c, { address }) => c.vmm.freeAddress({ address, size: SIZE }),
      status: EXHAUSTED,
    },
    ...(['unmap', 'free', 'release'] as const).flatMap((step): Case[] => {
      if (step === 'release' && backend === 'host') return []; // the host backend's release is a close(), which cannot fail
      const plan = step === 'release' ? `cuMemRelease:1:${exhausted(backend)}` : fail(step);
      return [
        {
          plan,
          what: `Detach of a store the daemon made, when its ${step} step fails`,
          prepare: prepareCreatedStore,
          operation: (c, { store }) => c.stores.detach(BigInt(store)),
          status: EXHAUSTED,
          stillThere: listed,
        },
        {
          plan,
          what: `Detach of an attached store, when its ${step} step fails`,
          prepare: async (c) => ({ store: ((await attach(c, backend)) as { id: string }).id }),
          operation: (c, { store }) => c.stores.detach(BigInt(store)),
          status: EXHAUSTED,
          stillThere: listed,
        },
      ];
    }),
  ];
  if (backend === 'host') {
    list.push(
      {
        plan: 'fstat:1:EBADF',
        what: 'Attach of a descriptor, when the descriptor cannot be inspected',
        operation: (c) => attach(c, backend),
        status: grpc.status.INVALID_ARGUMENT,
      },
      {
        plan: 'sendmsg:2:ENOBUFS', // call 1 is the session's greeting
        what: 'Export, when the descriptor cannot be sent on the session socket',
        prepare: prepareAllocation,
        operation: (c, { allocation }) => c.vmm.import(allocation),
        status: EXHAUSTED,
      },
      {
        plan: 'sendmsg:2:ENOBUFS',
        what: 'Allocate on the session socket, when its answer cannot be sent (the allocation is released again)',
        operation: (c) => c.vmm.allocate({ size: SIZE }),
        status: EXHAUSTED,
      },
    );
  } else {
    list.push({
      plan: `cuMemRelease:1:${exhausted(backend)}`,
      what: 'Release (the RPC), when the driver cannot free the memory',
      prepare: prepareAllocation,
      operation: (c, { allocation }) => releaseRpc(c, allocation),
      status: EXHAUSTED,
    });
  }
  return list;
}

export function faultsContract(backend: Backend): void {
  const table = cases(backend);
  let passed = 0;

  afterAll(() => {
    figure(`faults-${backend}`, {
      backend,
      cases: table.length,
      passed,
      operations: new Set(table.map((entry) => entry.what.split(/[ ,]/)[0])).size,
      steps: new Set(table.map((entry) => entry.plan.replace(/:\d+:[A-Z_]+$/, ''))).size,
    });
  });

  if (backend === 'cuda') {
    it('release on the session socket, when the driver cannot free the memory: answered, the allocation stays charged, and the next Release frees it', async () => {
      const daemon = await TestDaemon.start(['--stock', 'none'], backend, { VMMD_FAULTS: `cuMemRelease:1:${exhausted(backend)}` });
      const client = await connect({ socketDir: daemon.dir });
      try {
        const { allocation } = await prepareAllocation(client);
        // Answered once the reference is dropped: the free had started.
        await expect(client.vmm.release({ allocationId: allocation })).resolves.toMatchObject({ freed: true, handleReferences: 0 });
        // The free failed behind the answer: the allocation is back, counted, and the next Release frees it
        // (while it is being freed a Release finds no such allocation).
        const retried = await eventually(
          () =>
            releaseRpc(client, allocation).then(
              (value) => value,
              (error: VmmdError) => (error.code === 'UNKNOWN_ALLOCATION' ? undefined : Promise.reject(error)),
            ),
          20_000,
          'the allocation whose free failed to be released again',
        );
        expect(retried).toMatchObject({ freed: true });
        expect(objectsOf(await daemon.stats())).toMatchObject({ allocations: '0' });
      } finally {
        client.close();
        await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'the session to close');
        expect(await daemon.stop()).toBe(0);
      }
    });
  }

  it.each(table.map((entry) => [entry.what, entry] as const))('%s: nothing is lost or left behind', async (_what, entry) => {
    // --stock none: the stock's refills would call the driver at times of their own.
    const daemon = await TestDaemon.start(backend === 'cuda' ? ['--stock', 'none'] : [], backend, { VMMD_FAULTS: entry.plan });
    const client = await connect({ socketDir: daemon.dir });
    try {
      // Its gRPC connection first: the client's channel is its own, opened by its first call.
      await client.devices.getGranularity();
      const start = objectsOf(await daemon.stats());
      const startFds = daemon.openFds();
      const prepared = (await entry.prepare?.(client)) ?? {};
      const before = objectsOf(await daemon.stats());
      const fds = daemon.openFds();
      const refusal = await entry.operation(client, prepared).then(
        () => undefined,
        (error: unknown) => error,
      );
      expect(refusal).toMatchObject({ status: entry.status });
      expect((refusal as Error).message).toMatch(/E[A-Z]+|CUDA_ERROR|memory|descriptor/);
      if (entry.stillThere) {
        await expect(entry.stillThere(client, prepared)).resolves.toBe(true);
      } else {
        expect(objectsOf(await daemon.stats())).toEqual(before);
        expect(daemon.openFds()).toBe(fds);
      }
      // The fault fired once: the same call now works, and the daemon served throughout.
      await expect(entry.operation(client, prepared)).resolves.toBeDefined();
      if (entry.stillThere) await expect(entry.stillThere(client, prepared)).resolves.toBe(false);
      await entry.cleanup?.(client, prepared);
      if (entry.stillThere || entry.cleanup) {
        expect(objectsOf(await daemon.stats())).toEqual(start);
        expect(daemon.openFds()).toBe(startFds);
      }
      passed++;
    } finally {
      client.close();
      await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'the session to close');
      expect(objectsOf(await daemon.stats())).toMatchObject({ reservations: '0', allocations: '0', mappings: '0' });
      expect(await daemon.stop()).toBe(0);
      for (const free of externals.splice(0)) await free();
    }
  });
}
