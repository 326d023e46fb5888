/**
 * The memfds behind what a client holds, attacked through the descriptor it
 * got: another uid's process tries every way of writing or resizing a store
 * it opened read-only, or an allocation a share key let it import
 * (writableViews in fixtures/peer.ts); the owner tries to grow its own
 * allocated, imported, attached and staging memfds past what the daemon
 * counted. Every attempt must fail in the kernel and leave the memory, the
 * host capacity and the quotas as they were. Peers of another uid need root
 * (CI runs as root).
 */
import * as grpc from '@grpc/grpc-js';
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import { connect, VmmdClient } from '../../client';
import { SESSION_METADATA_KEY } from '../../common/protocol';
import { addon, MEMFD_SEALS } from '../../native';
import { call, MiB, objectsOf, Peer, stopWhenClean, TestDaemon } from './harness';

const isRoot = process.getuid?.() === 0;
const NOBODY = 65534;
const SIZE = 2n * MiB;
const UIDS = ['--socket-group', String(NOBODY), '--allow-uids', '0', '--allow-gids', String(NOBODY), '--quota-per-uid', '16MiB'];
/** What another uid's read-only descriptor allows: reading and read-only mappings, nothing else. */
const READ_ONLY_DESCRIPTOR = {
  write: 'EBADF',
  writableMapping: 'EACCES',
  readOnlyMapping: 'ok',
  readOnlyMappingMadeWritable: 'EACCES',
  reopenReadWrite: 'EACCES',
  grow: 'EINVAL',
  shrink: 'EINVAL',
  seal: 'EPERM',
  chmod: 'EPERM',
};

let daemon: TestDaemon | undefined;
const clients: VmmdClient[] = [];
const peers: Peer[] = [];

afterEach(async () => {
  for (const peer of peers.splice(0)) await peer.stop();
  await stopWhenClean(daemon, clients);
  daemon = undefined;
});

async function client(): Promise<VmmdClient> {
  const connected = await connect({ socketDir: daemon!.dir });
  clients.push(connected);
  return connected;
}

const checksum = (data: Buffer) => createHash('sha256').update(data).digest('hex');
const sizeOf = (fd: number) => BigInt(fs.fstatSync(fd).size);
const grow = (fd: number) => {
  try {
    fs.ftruncateSync(fd, Number(SIZE) * 4);
    return 'ok';
  } catch (error) {
    return (error as NodeJS.ErrnoException).code;
  }
};

/** What the daemon counts: its objects and bytes, and the free bytes of the host capacity. */
async function counted(d: TestDaemon) {
  const devices = await call(d.raw.devices, 'ListDevices', {});
  return { objects: objectsOf(await d.stats()), free: devices.devices[0].freeBytes };
}

describe('memfds another uid holds a descriptor of', () => {
  (isRoot ? it : it.skip)("cannot be written or resized through a read-only open of another uid's store, by any way", async () => {
    daemon = await TestDaemon.start(UIDS);
    const owner = await client();
    const writable = await owner.stores.createStore({ allocationId: (await owner.vmm.create({ size: SIZE })).id, name: 'owner-rw' });
    const frozen = await owner.stores.createStore({ allocationId: (await owner.vmm.create({ size: SIZE })).id, name: 'owner-ro', readOnly: true });
    // The owner's own memfd as any program makes one (mode 0777, sealable), attached writable.
    const own = addon._memfdCreate('owner-attached', SIZE, true);
    const attached = await owner.stores.attachDescriptor(own, { target: 'STORE_TARGET_SYSMEM', device: 0, size: SIZE, readOnly: false });
    for (const store of [writable, attached]) await owner.stores.fill({ storeId: store.id }, SIZE, 0x5a);
    const sums = async () => Promise.all([writable, frozen, attached].map(async (store) => checksum(await owner.stores.read({ storeId: store.id }, SIZE))));
    const before = await sums();
    const attacker = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
    peers.push(attacker);
    for (const store of [writable, frozen, attached]) {
      expect({ store: store.name || 'attached', views: await attacker.do({ op: 'writableViews', storeId: store.id, size: String(SIZE) }) }).toEqual({
        store: store.name || 'attached',
        views: READ_ONLY_DESCRIPTOR,
      });
    }
    expect(await sums()).toEqual(before);
    // The owner's own descriptor still works: the daemon narrowed the file's mode, not the owner's access.
    expect(sizeOf(own)).toBe(SIZE);
    addon.close(own);
    // The owner may still write its writable stores, and SetAccess READWRITE of its memory still works.
    await owner.stores.fill({ storeId: writable.id }, 4096n, 0x11);
  });

  (isRoot ? it : it.skip)("cannot grow or shrink the owner's allocation through a share key's descriptor", async () => {
    daemon = await TestDaemon.start(UIDS);
    const owner = await client();
    const allocation = await owner.vmm.create({ size: SIZE });
    const { shareKey } = await owner.vmm.share({ allocationId: allocation.id });
    const baseline = await counted(daemon);
    const holder = await Peer.start(daemon.dir, { uid: NOBODY, gid: NOBODY });
    peers.push(holder);
    const views = await holder.do<Record<string, string>>({ op: 'writableViews', allocationId: allocation.id, shareKey, size: String(SIZE) });
    // A share key lets it write (that is what it is for), never resize, reopen or re-mode the owner's memory.
    expect(views).toMatchObject({ write: 'ok', writableMapping: 'ok', grow: 'EPERM', shrink: 'EPERM', reopenReadWrite: 'EACCES', chmod: 'EPERM' });
    const { fd } = await owner.session.export(String(allocation.id), '');
    expect(sizeOf(fd)).toBe(SIZE);
    expect(fs.fstatSync(fd).mode & 0o777).toBe(0o600);
    addon.close(fd);
    expect(await counted(daemon)).toEqual(baseline);
    await owner.vmm.release({ allocationId: allocation.id });
  });
});

describe('memfds the daemon maps or makes', () => {
  it('cannot grow: allocated, imported, attached and staging memfds refuse ftruncate larger, and capacity and quotas stay exact', async () => {
    daemon = await TestDaemon.start(['--quota-per-uid', '16MiB']);
    const owner = await client();
    const allocation = await owner.vmm.create({ size: SIZE });
    const { fd: allocated } = await owner.session.export(String(allocation.id), '');
    const imported = addon._memfdCreate('imported', SIZE, true);
    const importedAllocation = await owner.vmm.importDescriptor(imported, { size: SIZE });
    const attached = addon._memfdCreate('attached', SIZE, true);
    const store = await owner.stores.attachDescriptor(attached, { target: 'STORE_TARGET_SYSMEM', device: 0, size: SIZE, readOnly: false });
    const staging = addon._memfdCreate('staging', SIZE, true);
    const metadata = new grpc.Metadata();
    metadata.set(SESSION_METADATA_KEY, owner.session.token);
    await call(daemon.raw.vmm, 'OpenStaging', { transferId: owner.session.sendDescriptor(staging) }, metadata);
    const baseline = await counted(daemon);
    const outcomes = Object.fromEntries(Object.entries({ allocated, imported, attached, staging }).map(([name, fd]) => [name, grow(fd)]));
    expect(outcomes).toEqual({ allocated: 'EPERM', imported: 'EPERM', attached: 'EPERM', staging: 'EPERM' });
    for (const fd of [allocated, imported, attached, staging]) expect(sizeOf(fd)).toBe(SIZE);
    expect(await counted(daemon)).toEqual(baseline);
    // The uid's 16 MiB quota holds what was counted: the allocation, the import and the attachment (6 MiB) leave room for 5 more of 2 MiB.
    const more = [];
    for (let i = 0; i < 5; i++) more.push(await owner.vmm.create({ size: SIZE }));
    await expect(owner.vmm.create({ size: SIZE })).rejects.toMatchObject({ code: 'QUOTA_EXCEEDED' });
    for (const extra of more) await owner.vmm.release({ allocationId: extra.id });
    for (const fd of [allocated, imported, attached, staging]) addon.close(fd);
    await owner.stores.detach(BigInt(store.id));
    await owner.vmm.release({ allocationId: importedAllocation.id });
    await owner.vmm.release({ allocationId: allocation.id });
  });

  it('refuses a client memfd that cannot be sealed against growth (F_SEAL_SEAL without F_SEAL_GROW), naming the rule', async () => {
    daemon = await TestDaemon.start();
    const owner = await client();
    const baseline = objectsOf(await daemon.stats());
    const metadata = new grpc.Metadata();
    metadata.set(SESSION_METADATA_KEY, owner.session.token);
    for (const way of ['import', 'attach', 'staging']) {
      const fd = addon._memfdCreate(`unsealable-${way}`, SIZE, true);
      addon.hostMemfdAddSeals(fd, MEMFD_SEALS.SHRINK | MEMFD_SEALS.SEAL);
      const attempt =
        way === 'import'
          ? owner.vmm.importDescriptor(fd, { size: SIZE })
          : way === 'attach'
            ? owner.stores.attachDescriptor(fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: SIZE, readOnly: false })
            : call(daemon.raw.vmm, 'OpenStaging', { transferId: owner.session.sendDescriptor(fd) }, metadata);
      const refusal = await attempt.then(
        () => ({ way, refused: false }),
        (error: { code?: unknown; status?: number; message: string }) => ({ way, refused: true, status: error.status ?? error.code, message: error.message }),
      );
      expect(refusal).toMatchObject({ way, refused: true, status: grpc.status.INVALID_ARGUMENT, message: expect.stringMatching(/must be sealed F_SEAL_GROW/) });
      addon.close(fd);
    }
    expect(objectsOf(await daemon.stats())).toEqual(baseline);
  });
});

describe('memory a client sealed through a descriptor the daemon exported', () => {
  it('is refused FAILED_PRECONDITION MEMORY_SEALED by SetAccess READWRITE and CreateStore, never INTERNAL, and nothing stays', async () => {
    daemon = await TestDaemon.start(['--stock', 'none']);
    const owner = await client();
    const baseline = objectsOf(await daemon.stats());
    const sealed = async (seals: number) => {
      const allocation = await owner.vmm.create({ size: SIZE });
      const { fd } = await owner.session.export(String(allocation.id), '');
      addon.hostMemfdAddSeals(fd, seals);
      addon.close(fd);
      return allocation;
    };
    const refused = { status: grpc.status.FAILED_PRECONDITION, code: 'MEMORY_SEALED' };
    // Sealed against writes: no writable mapping, by a session or by a store.
    const frozen = await sealed(MEMFD_SEALS.FUTURE_WRITE);
    const { address } = await owner.vmm.reserve({ size: SIZE });
    await owner.vmm.map({ address, size: SIZE, allocationId: frozen.id });
    await expect(
      owner.vmm.setAccess({ address, size: SIZE, descriptors: [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }] }),
    ).rejects.toMatchObject(refused);
    await owner.vmm.unmap({ address, size: SIZE });
    await owner.vmm.freeAddress({ address, size: SIZE });
    await expect(owner.stores.createStore({ allocationId: frozen.id, name: 'frozen-rw' })).rejects.toMatchObject(refused);
    // What the seal allows still works: a read-only store of it.
    const readable = await owner.stores.createStore({ allocationId: frozen.id, name: 'frozen-ro', readOnly: true });
    await owner.stores.detach(BigInt(readable.id));
    // Sealed F_SEAL_SEAL: the daemon cannot seal it read-only for a read-only store.
    const closed = await sealed(MEMFD_SEALS.SEAL);
    await expect(owner.stores.createStore({ allocationId: closed.id, name: 'closed-ro', readOnly: true })).rejects.toMatchObject(refused);
    for (const allocation of [frozen, closed]) await owner.vmm.release({ allocationId: allocation.id });
    expect(objectsOf(await daemon.stats())).toEqual(baseline);
  });
});

describe('with the daemon as deployed (its own uid, no capabilities)', () => {
  const MAKER_GROUP = { uid: 4242, gid: NOBODY };

  (isRoot ? it : it.skip)(
    'takes only the client memfds it can hand other uids read-only, and says why a store it cannot reopen read-only is not opened',
    async () => {
      daemon = await TestDaemon.start(['--socket-group', String(NOBODY)], 'host', {}, { as: { uid: NOBODY, gid: NOBODY } });
      const owner = await client();
      const attach = (fd: number) => owner.stores.attachDescriptor(fd, { target: 'STORE_TARGET_SYSMEM', device: 0, size: SIZE, readOnly: false });
      // Owner-only (0600, another uid's): the daemon could not reopen it read-only for other uids' opens.
      const ownerOnly = addon.hostMemfdCreate('owner-only', SIZE, 0o600);
      await expect(attach(ownerOnly)).rejects.toMatchObject({
        status: grpc.status.INVALID_ARGUMENT,
        code: 'BAD_DESCRIPTOR',
        message: expect.stringMatching(/fchmod it 0644/),
      });
      // Writable by all (0777, as memfd_create makes it): the daemon cannot take the others' write permission away.
      const everyones = addon._memfdCreate('everyones', SIZE, true);
      await expect(attach(everyones)).rejects.toMatchObject({
        status: grpc.status.INVALID_ARGUMENT,
        code: 'BAD_DESCRIPTOR',
        message: expect.stringMatching(/cannot narrow it/),
      });
      // 0644, as the vmmd libraries make it: attached, and another uid's read-only open cannot write it.
      const shared = addon.hostMemfdCreate('shared', SIZE, 0o644);
      const store = await attach(shared);
      const own = await owner.stores.createStore({ allocationId: (await owner.vmm.create({ size: SIZE })).id, name: 'daemon-memory' });
      const reader = await Peer.start(daemon.dir, MAKER_GROUP);
      peers.push(reader);
      for (const id of [store.id, own.id]) expect(await reader.do({ op: 'writableViews', storeId: id, size: String(SIZE) })).toEqual(READ_ONLY_DESCRIPTOR);
      // An owner-only memfd imported (nothing reopens an import) and made a store: another uid's open is refused, naming why.
      const imported = await owner.vmm.importDescriptor(ownerOnly, { size: SIZE });
      const importedStore = await owner.stores.createStore({ allocationId: imported.id, name: 'imported' });
      await expect(reader.do({ op: 'storeOpen', name: 'imported' })).rejects.toMatchObject({ code: 'NOT_REOPENABLE' });
      await owner.stores.detach(BigInt(importedStore.id));
      await owner.stores.detach(BigInt(store.id));
      await owner.stores.detach(BigInt(own.id));
      for (const fd of [ownerOnly, everyones, shared]) addon.close(fd);
    },
  );
});
