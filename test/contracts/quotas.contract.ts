/**
 * Quotas and capacity by physical memory, attacked through one's own
 * descriptors, on either backend: Create (charged) → Export → Import of one's
 * own descriptor → Release of the original kept memory alive uncharged (one
 * session held 160 MiB against an 8 MiB quota, and GetMemoryInfo still said
 * 64 MiB free), and a 32 TiB sparse memfd was accepted by Import and Attach.
 * The promises: the physical bytes a session or uid keeps alive through the
 * daemon never exceed its quota, memory counts once however many ids name it
 * and for whoever keeps it alive, client memory counts by its real size (a
 * sparse memfd by its size), refusals are RESOURCE_EXHAUSTED naming the
 * sizes and the limit, and (host) GetMemoryInfo's free bytes are the
 * capacity less what is alive. Import of a memfd is the host backend's (cuda
 * imports CUDA memory, each import counted on its own).
 */
import * as grpc from '@grpc/grpc-js';
import { connect, VmmdClient } from '../../client';
import type { AccessDescriptor } from '../../generated/vmmd/v1/AccessDescriptor';
import { addon } from '../../native';
import { call, MiB, objectsOf, stopWhenClean, TestDaemon } from '../e2e/harness';
import { figure } from '../reliability/figures';

type Backend = 'host' | 'cuda';
const QUOTA_FLAGS = ['--quota-per-session', '8MiB', '--quota-per-uid', '16MiB', '--host-capacity', '64MiB'];
const SESSION_QUOTA = 8n * MiB;
const UID_QUOTA = 16n * MiB;
const CAPACITY = 64n * MiB;
const TiB = 1n << 40n;
const access = (flags: AccessDescriptor['flags']): AccessDescriptor[] => [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags }];

export function quotaContract(backend: Backend, _options: { full: boolean }): void {
  let daemon: TestDaemon | undefined;
  const clients: VmmdClient[] = [];
  const figures: Record<string, Record<string, string | number | boolean>> = {};
  const start = (flags: string[]) => TestDaemon.start([...flags, ...(backend === 'cuda' ? ['--stock', 'none'] : [])], backend);

  async function client(): Promise<VmmdClient> {
    const connected = await connect({ socketDir: daemon!.dir });
    clients.push(connected);
    return connected;
  }

  /** What the quotas charge now, by uid and by session (GetReport; the tests run as root, an admin). */
  async function charged(): Promise<{ byUid: Record<string, string>; bySession: Record<string, string> }> {
    const report = JSON.parse((await call(daemon!.raw.admin, 'GetReport', {})).json);
    return report.quotas;
  }

  async function freeBytes(): Promise<bigint> {
    return BigInt((await call(daemon!.raw.devices, 'GetMemoryInfo', { device: 0 })).freeBytes);
  }

  /** Asserts no session or uid is charged past its quota. */
  async function withinQuotas(): Promise<void> {
    const used = await charged();
    for (const bytes of Object.values(used.bySession)) expect(BigInt(bytes)).toBeLessThanOrEqual(SESSION_QUOTA);
    for (const bytes of Object.values(used.byUid)) expect(BigInt(bytes)).toBeLessThanOrEqual(UID_QUOTA);
  }

  afterEach(async () => {
    await stopWhenClean(daemon, clients);
    daemon = undefined;
  });

  afterAll(() => {
    for (const [name, values] of Object.entries(figures)) figure(`quotas-${name}-${backend}`, { backend, ...values });
  });

  it('the attack as found: Create, Export, Import of its own descriptor, Release, 20 times, keeps no more than the quota alive', async () => {
    daemon = await start(QUOTA_FLAGS);
    const a = await client();
    const before = objectsOf(await daemon.stats());
    const rounds = 20; // 20 × 8 MiB: the 160 MiB the attack held in 0.1.0
    let creates = 0;
    let createsRefused = 0;
    let imports = 0;
    let importsRefused = 0;
    const kept: Array<{ id: string; address: string }> = [];
    for (let round = 0; round < rounds; round++) {
      let created;
      try {
        created = await a.vmm.create({ size: SESSION_QUOTA });
        creates++;
      } catch (error) {
        expect(error).toMatchObject({ code: 'QUOTA_EXCEEDED', status: grpc.status.RESOURCE_EXHAUSTED });
        expect((error as Error).message).toMatch(/requested 8388608 bytes, 8388608 of 8388608 bytes in use/);
        createsRefused++;
        continue;
      }
      const exported = await a.vmm.export({ allocationId: created.id });
      const fd = await a.session.takeTransfer(exported.transferId);
      try {
        const imported = await a.vmm.importDescriptor(fd, { size: SESSION_QUOTA });
        imports++;
        // Mapped, as the attacker did: the import is in use, not just named.
        const { address } = await a.vmm.reserve({ size: SESSION_QUOTA });
        await a.vmm.map({ address, size: SESSION_QUOTA, allocationId: imported.id });
        await a.vmm.setAccess({ address, size: SESSION_QUOTA, descriptors: access('ACCESS_FLAGS_READWRITE') });
        kept.push({ id: imported.id, address: String(address) });
      } catch (error) {
        // cuda counts each import on its own: the import of one's own memory does not fit beside it.
        expect(error).toMatchObject({ code: 'QUOTA_EXCEEDED', status: grpc.status.RESOURCE_EXHAUSTED });
        importsRefused++;
      } finally {
        addon.close(fd);
      }
      await a.vmm.release({ allocationId: created.id });
      await withinQuotas();
    }
    const stats = await daemon.stats();
    const alive = BigInt(stats.allocatedBytes) + BigInt(stats.importedBytes);
    expect(alive).toBeLessThanOrEqual(SESSION_QUOTA);
    if (backend === 'host') {
      // The import is the memory the Create made: it stays charged, so no second Create fits.
      expect({ creates, createsRefused, imports }).toEqual({ creates: 1, createsRefused: rounds - 1, imports: 1 });
      expect(await freeBytes()).toBe(CAPACITY - SESSION_QUOTA);
      expect((await charged()).bySession).toEqual({ [Object.keys((await charged()).bySession)[0]]: String(SESSION_QUOTA) });
    } else {
      expect(imports).toBe(0);
    }
    for (const { id, address } of kept) {
      await a.vmm.unmap({ address, size: SESSION_QUOTA });
      await a.vmm.freeAddress({ address, size: SESSION_QUOTA });
      await a.vmm.release({ allocationId: id });
    }
    expect(objectsOf(await daemon.stats())).toEqual(before);
    expect(await charged()).toEqual({ byUid: {}, bySession: {} });
    if (backend === 'host') expect(await freeBytes()).toBe(CAPACITY);
    figures['own-import'] = {
      rounds,
      creates,
      createsRefused,
      imports,
      importsRefused,
      heldMiB: Number(alive / MiB),
      quotaMiB: Number(SESSION_QUOTA / MiB),
      overshoots: 0,
      leaked: 0,
    };
  });

  (backend === 'cuda' ? it : it.skip)(
    "refuses a CUDA import whose stated size is not the memory's own (the attack: import 4 MiB as 2 MiB, then release the original)",
    async () => {
      daemon = await start(QUOTA_FLAGS);
      const a = await client();
      const before = objectsOf(await daemon.stats());
      const created = await a.vmm.create({ size: 4n * MiB });
      const exported = await a.vmm.export({ allocationId: created.id });
      const fd = await a.session.takeTransfer(exported.transferId);
      const withOriginal = objectsOf(await daemon.stats());
      let refused = 0;
      try {
        for (const claimed of [2n * MiB, 6n * MiB]) {
          await expect(a.vmm.importDescriptor(fd, { size: claimed })).rejects.toMatchObject({
            code: 'BAD_DESCRIPTOR',
            message: expect.stringContaining(`is not ${claimed} bytes`),
          });
          refused++;
          expect(objectsOf(await daemon.stats())).toEqual(withOriginal); // the trial import was released again
        }
        // Its own size is accepted (and charged: 4 + 4 MiB fill the session's 8 MiB).
        const imported = await a.vmm.importDescriptor(fd, { size: 4n * MiB });
        await withinQuotas();
        await a.vmm.release({ allocationId: imported.id });
      } finally {
        addon.close(fd);
      }
      await a.vmm.release({ allocationId: created.id });
      expect(objectsOf(await daemon.stats())).toEqual(before);
      expect(await charged()).toEqual({ byUid: {}, bySession: {} });
      figures['cuda-import-size'] = { tried: 2, refused, leaked: 0 };
    },
  );

  it('refuses a 32 TiB sparse memfd at Import and at Attach (charged by its size), naming the sizes and the limit', async () => {
    // The address-space budget would refuse the 32 TiB store first (test/e2e/budgets.test.ts): off here, the quotas are under test.
    daemon = await start([...QUOTA_FLAGS, '--max-address-space-per-uid', '0']);
    const a = await client();
    // The client's gRPC connection is its own (it reconnects by itself): opened before the daemon's descriptors are counted.
    await a.devices.listDevices();
    const before = objectsOf(await daemon.stats());
    const fdsBefore = daemon.openFds();
    const sizes = [32n * TiB, CAPACITY + 2n * MiB, SESSION_QUOTA + 2n * MiB];
    let tried = 0;
    let refused = 0;
    for (const size of sizes) {
      const fd = addon.hostMemfdCreate('sparse', size);
      try {
        const attempts: Array<() => Promise<unknown>> = [
          () => a.stores.attachDescriptor(fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: 2n * MiB, readOnly: false }),
          () => a.stores.attachDescriptor(fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size, readOnly: false }),
        ];
        if (backend === 'host') attempts.push(() => a.vmm.importDescriptor(fd));
        for (const attempt of attempts) {
          tried++;
          const error = await attempt().then(
            () => new Error('accepted'),
            (caught: Error) => caught,
          );
          expect(error).toMatchObject({ status: grpc.status.RESOURCE_EXHAUSTED });
          expect(String((error as { code?: unknown }).code)).toMatch(/^(QUOTA_EXCEEDED|OUT_OF_MEMORY)$/);
          // The memfd's size and the limit it is over, in bytes.
          expect(error.message).toContain(`${size} bytes`);
          expect(error.message).toMatch(new RegExp(`of (${SESSION_QUOTA}|${UID_QUOTA}|${CAPACITY}) bytes in use`));
          refused++;
        }
      } finally {
        addon.close(fd);
      }
    }
    expect(objectsOf(await daemon.stats())).toEqual(before);
    expect((await a.stores.list()).length).toBe(0);
    expect(await charged()).toEqual({ byUid: {}, bySession: {} });
    if (backend === 'host') expect(await freeBytes()).toBe(CAPACITY);
    expect(daemon.openFds()).toBe(fdsBefore);
    figures.sparse = { tried, refused, largestTiB: 32, leaked: 0 };
  });

  it('counts memory once however many ids name it, and for every session and uid that keeps it alive', async () => {
    daemon = await start(QUOTA_FLAGS);
    const a = await client();
    const b = await client();
    const size = 4n * MiB;
    const fd = addon.hostMemfdCreate('shared', size);
    try {
      // One memfd attached twice (and, on host, imported twice): 4 MiB for the session and the uid, once.
      const stores = [
        await a.stores.attachDescriptor(fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size, readOnly: false }),
        await a.stores.attachDescriptor(fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: 2n * MiB, readOnly: false }),
      ];
      const imports = backend === 'host' ? [await a.vmm.importDescriptor(fd), await a.vmm.importDescriptor(fd)] : [];
      const used = await charged();
      expect(Object.values(used.bySession)).toEqual([String(size)]);
      expect(Object.values(used.byUid)).toEqual([String(size)]);
      if (backend === 'host') expect(await freeBytes()).toBe(CAPACITY - size);
      // Another session of the uid holding it too: its session is charged, the uid not again.
      const created = await a.vmm.create({ size: 2n * MiB });
      const key = (await a.vmm.share({ allocationId: created.id })).shareKey;
      const exported = await b.vmm.export({ allocationId: created.id, shareKey: key });
      const bFd = await b.session.takeTransfer(exported.transferId);
      let bImport: string | undefined;
      try {
        if (backend === 'host') bImport = (await b.vmm.importDescriptor(bFd)).id;
      } finally {
        addon.close(bFd);
      }
      if (backend === 'host') {
        await a.vmm.release({ allocationId: created.id });
        // The creator let go; b keeps it alive, and b is charged for it.
        const after = await charged();
        expect(Object.values(after.byUid)).toEqual([String(size + 2n * MiB)]);
        expect(Object.values(after.bySession).sort()).toEqual([String(2n * MiB), String(size)].sort());
        expect(await freeBytes()).toBe(CAPACITY - size - 2n * MiB);
        await b.vmm.release({ allocationId: bImport! });
      } else {
        await a.vmm.release({ allocationId: created.id });
      }
      for (const imported of imports) await a.vmm.release({ allocationId: imported.id });
      for (const store of stores) await a.stores.detach({ id: store.id });
    } finally {
      addon.close(fd);
    }
    expect(await charged()).toEqual({ byUid: {}, bySession: {} });
    if (backend === 'host') expect(await freeBytes()).toBe(CAPACITY);
  });
}
