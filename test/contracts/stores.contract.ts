/**
 * Stores with Legate's semantics, on every backend: the deleter exactly once,
 * detach waiting for operations in flight, write-through, read-only refusal on
 * every path, lifetimes, and a named store shared by several processes.
 */
import { execFile } from 'node:child_process';
import { createHash, randomFillSync } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import * as grpc from '@grpc/grpc-js';
import { connect, ExternalAllocation, LocalDeviceMemory, SharedHostMemory, VmmdClient } from '../../client';
import { addon, HOST_ACCESS } from '../../native';
import { call, eventually, MiB, Peer, TestDaemon, packageRoot } from '../e2e/harness';

const ROOT = packageRoot();

function vmmctl(dir: string, args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) =>
    execFile(process.execPath, [path.join(ROOT, 'bin', 'vmmctl.js'), '--socket-dir', dir, ...args], { maxBuffer: 1 << 24 }, (error, stdout, stderr) =>
      resolve({ code: error ? Number(error.code) : 0, stdout, stderr }),
    ),
  );
}

export function storesContract(backend: 'host' | 'cuda'): void {
  let daemon: TestDaemon;
  const clients: VmmdClient[] = [];

  beforeAll(async () => {
    daemon = await TestDaemon.start(['--host-capacity', '1GiB'], backend);
  });

  afterAll(async () => {
    expect(await daemon.stop()).toBe(0);
  });

  afterEach(() => {
    for (const client of clients.splice(0)) client.close();
  });

  async function client(): Promise<VmmdClient> {
    const connected = await connect({ socketDir: daemon.dir });
    clients.push(connected);
    return connected;
  }

  async function mutableStore(owner: VmmdClient, size = 4n * MiB, name = '') {
    const allocation = await owner.vmm.create({ size });
    const store = await owner.stores.createStore({ allocationId: allocation.id, name });
    await owner.vmm.release({ allocationId: allocation.id });
    return store;
  }

  function released(events: Array<{ kind: string; store?: { id: string } | null }>, id: string): number {
    return events.filter((event) => event.kind === 'KIND_RELEASED' && event.store?.id === id).length;
  }

  /** The event log replayed from the start, read until it holds `storeId`'s release (a loaded machine streams the replay in parts), and 50 ms more. */
  async function eventLog(watcher: VmmdClient, storeId: string): Promise<Array<{ kind: string; store?: { id: string } | null }>> {
    const { events, cancel } = watcher.stores.watch(0n);
    const seen: Array<{ kind: string; store?: { id: string } | null }> = [];
    const done = (async () => {
      for await (const event of events) seen.push(event);
    })();
    const releasedThere = () => seen.some((event) => event.kind === 'KIND_RELEASED' && event.store?.id === storeId);
    await eventually(async () => (releasedThere() ? true : undefined), 20_000, `the event replay up to store ${storeId}'s release`);
    await new Promise((resolve) => setTimeout(resolve, 50));
    cancel();
    await done;
    return seen;
  }

  describe('ExternalAllocation', () => {
    it("applies Legate's checks: empty or null memory, an unknown device, device targets without cuda", async () => {
      const owner = await client();
      const memory = SharedHostMemory.allocate(4096);
      expect(() => ExternalAllocation.createSysmem(null, 16)).toThrow(expect.objectContaining({ status: grpc.status.INVALID_ARGUMENT }));
      expect(() => ExternalAllocation.createSysmem(memory, 0)).toThrow(expect.objectContaining({ status: grpc.status.INVALID_ARGUMENT }));
      expect(() => ExternalAllocation.createSysmem(memory, 8192)).toThrow(expect.objectContaining({ status: grpc.status.INVALID_ARGUMENT }));
      const onDevice9 = ExternalAllocation.createFbmem(9, memory as never, 4096);
      if (backend === 'host') {
        await expect(onDevice9.attach(owner)).rejects.toMatchObject({ code: 'NO_CUDA_BACKEND', status: grpc.status.FAILED_PRECONDITION });
        const fd = addon.dup(memory.fd);
        await expect(owner.stores.attachDescriptor(fd, { target: 'STORE_TARGET_FBMEM', device: 0, size: 4096n, readOnly: false })).rejects.toMatchObject({
          code: 'NO_CUDA_BACKEND',
        });
        addon.close(fd);
      } else {
        await expect(onDevice9.attach(owner)).rejects.toMatchObject({ code: 'UNKNOWN_DEVICE', status: grpc.status.OUT_OF_RANGE });
      }
      const sysmem = ExternalAllocation.createSysmem(memory, 4096, { readOnly: true });
      expect([sysmem.readOnly(), sysmem.target(), sysmem.ptr(), sysmem.size()]).toEqual([true, 'SYSMEM', memory.address, 4096n]);
      memory.free();
    });
  });

  (backend === 'cuda' ? describe : describe.skip)('device memory of the client (cuda)', () => {
    it.each([
      ['FBMEM', undefined],
      ['ZCMEM', 0],
    ] as const)('attaches %s the client made, another process reads it, the deleter frees it once', async (target, hostNuma) => {
      const owner = await client();
      const memory = await LocalDeviceMemory.allocate(0, 2n * MiB, { hostNuma });
      await memory.write(0n, Buffer.from(`${target} bytes`));
      let runs = 0;
      const create = target === 'FBMEM' ? ExternalAllocation.createFbmem : ExternalAllocation.createZcmem;
      const attached = await create(0, memory, 2n * MiB, {
        deleter: async () => {
          runs++;
          await memory.free();
        },
      }).attach(owner, { name: `client-${target}` });
      expect(attached.store).toMatchObject({ target: `STORE_TARGET_${target}`, attached: true });
      const reader = await Peer.start(daemon.dir);
      try {
        const opened = await reader.do({ op: 'storeOpen', name: `client-${target}` });
        expect((await owner.stores.read({ storeId: attached.store.id }, 11)).toString()).toBe(`${target} bytes`);
        await owner.stores.write({ storeId: attached.store.id, offset: 100n }, Buffer.from('through'));
        expect((await memory.read(100n, 7n)).toString()).toBe('through');
        await attached.detach(owner);
        await reader.do({ op: 'storeClose', handle: opened.handle });
      } finally {
        await reader.stop();
      }
      await attached.gone;
      expect(runs).toBe(1);
    });
  });

  describe('the deleter', () => {
    it('runs exactly once: after detach, when the last reader closes', async () => {
      const owner = await client();
      const reader = await client();
      const memory = SharedHostMemory.allocate(2n * MiB);
      let runs = 0;
      const attached = await ExternalAllocation.createSysmem(memory, 2n * MiB, { deleter: () => void runs++ }).attach(owner, { name: 'deleter-once' });
      const opened = await reader.stores.open('deleter-once');
      await attached.detach(owner);
      await new Promise((resolve) => setTimeout(resolve, 100));
      expect(runs).toBe(0);
      await opened.close();
      await attached.gone;
      expect(runs).toBe(1);
      expect(released(await eventLog(owner, attached.store.id), attached.store.id)).toBe(1);
      memory.free();
    });

    it('runs once when the owner session dies and the owner watches again from a new session', async () => {
      const owner = await client();
      const reader = await client();
      const memory = SharedHostMemory.allocate(2n * MiB);
      let runs = 0;
      const attached = await ExternalAllocation.createSysmem(memory, 2n * MiB, { deleter: () => void runs++ }).attach(owner);
      const opened = await reader.stores.open(BigInt(attached.store.id));
      owner.session.close();
      await eventually(async () => ((await reader.stores.list()).find((s) => s.id === attached.store.id)?.state === 'STORE_STATE_DETACHED' ? true : undefined));
      const again = await client();
      attached.watch(again);
      await opened.close();
      await attached.gone;
      expect(runs).toBe(1);
      memory.free();
    });

    it('is released once when detach races the last close, and a throwing deleter is not rerun', async () => {
      const owner = await client();
      const reader = await client();
      const memory = SharedHostMemory.allocate(2n * MiB);
      let runs = 0;
      const attached = await ExternalAllocation.createSysmem(memory, 2n * MiB, {
        deleter: () => {
          runs++;
          throw new Error('deleter failure, reported once');
        },
      }).attach(owner);
      const opened = await reader.stores.open(BigInt(attached.store.id));
      await Promise.all([attached.detach(owner), opened.close()]);
      await attached.gone;
      expect(runs).toBe(1);
      expect(released(await eventLog(reader, attached.store.id), attached.store.id)).toBe(1);
      memory.free();
    });

    it('is told even when the owner process is killed: the store goes with the last reader', async () => {
      await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'earlier sessions to be reclaimed');
      const before = await daemon.stats();
      const owner = await Peer.start(daemon.dir);
      const allocation = await owner.do({ op: 'call', api: 'vmm', method: 'create', args: { size: String(2n * MiB) } });
      const store = await owner.do({ op: 'call', api: 'stores', method: 'createStore', args: { allocationId: allocation.id, name: 'orphan' } });
      const reader = await client();
      const opened = await reader.stores.open('orphan');
      await owner.kill('SIGKILL');
      await eventually(async () => ((await reader.stores.list()).find((s) => s.id === store.id)?.state === 'STORE_STATE_DETACHED' ? true : undefined));
      expect((await daemon.stats()).allocations).not.toBe(before.allocations);
      await opened.close();
      await eventually(async () => ((await daemon.stats()).allocatedBytes === before.allocatedBytes ? true : undefined));
      expect(released(await eventLog(reader, store.id), store.id)).toBe(1);
    });
  });

  describe('detach', () => {
    it('waits for a read in flight, and refuses new opens and operations meanwhile and after', async () => {
      const owner = await client();
      const store = await mutableStore(owner, 64n * MiB);
      // A slow reader keeps the daemon's Read in flight (the stream waits for it to drain).
      let received = 0;
      let receivedWhenDetached = -1;
      const reading = owner.stores.read({ storeId: store.id }, 64n * MiB, async (chunk) => {
        received += chunk.length;
        await new Promise((resolve) => setTimeout(resolve, 10));
      });
      await eventually(() => (received > 0 ? true : undefined), 20_000, 'the first chunk');
      const detaching = owner.stores.detach(BigInt(store.id)).then((detached) => {
        receivedWhenDetached = received;
        return detached;
      });
      // Open takes the session socket, Detach gRPC: two transports, not ordered with each other.
      await eventually(
        async () => ((await owner.stores.list()).find((listed) => listed.id === store.id)?.state !== 'STORE_STATE_LIVE' ? true : undefined),
        20_000,
        'the detach to begin',
      );
      await expect(owner.stores.open(BigInt(store.id))).rejects.toMatchObject({ code: 'STORE_DETACHED' });
      await expect(owner.stores.fill({ storeId: store.id }, 1, 0)).rejects.toMatchObject({ code: 'STORE_DETACHED' });
      expect((await reading).length).toBe(Number(64n * MiB));
      expect((await detaching).state).toBe('STORE_STATE_DETACHED');
      // Detach returned only once the daemon had sent (nearly) the whole read: at most what flow control buffers was still on its way.
      expect(receivedWhenDetached).toBeGreaterThanOrEqual(Number(32n * MiB));
      await expect(owner.stores.open(BigInt(store.id))).rejects.toMatchObject({ code: 'UNKNOWN_STORE' });
    });

    it('lets only the owner detach a session store', async () => {
      const owner = await client();
      const other = await client();
      const store = await mutableStore(owner);
      await expect(other.stores.detach(BigInt(store.id))).rejects.toMatchObject({ code: 'NOT_OWNER', status: grpc.status.PERMISSION_DENIED });
      await owner.stores.detach(BigInt(store.id));
    });
  });

  describe('the data path', () => {
    it('writes through: the owner sees the bytes the moment Write returns', async () => {
      const owner = await client();
      const writer = await client();
      const memory = SharedHostMemory.allocate(2n * MiB);
      const attached = await ExternalAllocation.createSysmem(memory, 2n * MiB).attach(owner);
      await writer.stores.write({ storeId: attached.store.id, offset: 1000n }, Buffer.from('written through'));
      expect(Buffer.from(memory.buffer, 1000, 15).toString()).toBe('written through');
      await writer.stores.fill({ storeId: attached.store.id, offset: 0n }, 10, 0x41);
      expect(Buffer.from(memory.buffer, 0, 10).toString()).toBe('AAAAAAAAAA');
      await attached.detach(owner);
      memory.free();
    });

    it('fills, copies between stores and to daemon-mapped memory, and checks bounds', async () => {
      const owner = await client();
      const a = await mutableStore(owner, 4n * MiB);
      const b = await mutableStore(owner, 4n * MiB);
      await owner.stores.fill({ storeId: a.id }, 3n * MiB, 0x5a);
      await owner.stores.write({ storeId: a.id, offset: 3n * MiB }, Buffer.from('tail of a'));
      await owner.stores.copy({ storeId: a.id, offset: 3n * MiB - 4n }, { storeId: b.id, offset: 100n }, 13);
      expect((await owner.stores.read({ storeId: b.id, offset: 100n }, 13)).toString()).toBe('ZZZZtail of a');
      const allocation = await owner.vmm.create({ size: 2n * MiB });
      const reservation = await owner.vmm.reserve({ size: 2n * MiB });
      await owner.vmm.map({ address: reservation.address, size: 2n * MiB, allocationId: allocation.id });
      await owner.vmm.setAccess({
        address: reservation.address,
        size: 2n * MiB,
        descriptors: [{ location: { type: 'LOCATION_TYPE_DEVICE', id: 0 }, flags: 'ACCESS_FLAGS_READWRITE' }],
      });
      await owner.stores.copy({ storeId: b.id, offset: 104n }, { address: reservation.address }, 9);
      expect((await owner.vmm.read(reservation.address, 9)).toString()).toBe('tail of a');
      await expect(owner.stores.read({ storeId: a.id, offset: 4n * MiB - 1n }, 2)).rejects.toMatchObject({
        code: 'BEYOND_STORE',
        status: grpc.status.OUT_OF_RANGE,
      });
      await expect(owner.stores.fill({ storeId: a.id }, 0, 1)).rejects.toMatchObject({ code: 'ZERO_SIZE' });
      await expect(owner.stores.fill({ storeId: a.id }, 1, 256)).rejects.toMatchObject({ code: 'BAD_VALUE' });
    });
  });

  describe('read-only stores', () => {
    it('refuse writes on every path, and are handed out read-only', async () => {
      const owner = await client();
      const allocation = await owner.vmm.create({ size: 2n * MiB });
      const store = await owner.stores.createStore({ allocationId: allocation.id, name: 'frozen', readOnly: true });
      const target = { storeId: store.id };
      const writable = await mutableStore(owner);
      // One at a time: a refusal that comes back before the loop awaits it would be an unhandled rejection.
      for (const attempt of [
        () => owner.stores.write(target, Buffer.from('x')),
        () => owner.stores.fill(target, 1, 0),
        () => owner.stores.copy({ storeId: writable.id }, target, 1),
        () => owner.stores.open('frozen', { writable: true }),
      ]) {
        await expect(attempt()).rejects.toMatchObject({ code: 'STORE_READ_ONLY', status: grpc.status.FAILED_PRECONDITION });
      }
      const opened = await owner.stores.open('frozen');
      expect(opened.memory.readOnly).toBe(true);
      await expect(opened.memory.write(0, Buffer.from('x'))).rejects.toMatchObject({ code: 'READ_ONLY' });
      await opened.close();
      if (backend === 'host') {
        // The kernel enforces it too: the descriptor handed out is sealed against writable mappings.
        const metadata = new grpc.Metadata();
        metadata.set('vmmd-session-token', owner.session.token);
        const response = await new Promise<any>((resolve, reject) =>
          (owner.stores as any).client.Open({ store: { name: 'frozen' } }, metadata, (e: Error, r: unknown) => (e ? reject(e) : resolve(r))),
        );
        const fd = await owner.session.takeTransfer(response.transferId);
        expect(addon.hostFdInfo(fd).readOnlySealed).toBe(true);
        const address = addon.hostReserve(2n * MiB, 2n * MiB, 0n);
        addon.hostMap(address, 2n * MiB, fd, 0n);
        expect(() => addon.hostProtect(address, 2n * MiB, HOST_ACCESS.READWRITE)).toThrow(expect.objectContaining({ code: 'EACCES' }));
        addon.hostUnmap(address, 2n * MiB);
        addon.hostFreeAddress(address, 2n * MiB);
        addon.close(fd);
        await owner.stores.close(store.id);
      }
    });
  });

  describe('lifetimes and names', () => {
    it("frees a session's stores with it, and keeps daemon-owned ones", async () => {
      // Earlier tests' sessions may still be reclaiming (slower on cuda): start from none.
      await eventually(async () => ((await daemon.stats()).sessions === 0 ? true : undefined), 10_000, 'earlier sessions to be reclaimed');
      const before = await daemon.stats();
      const owner = await client();
      await mutableStore(owner, 2n * MiB, 'mine');
      const allocation = await owner.vmm.create({ size: 2n * MiB });
      await owner.stores.createStore({ allocationId: allocation.id, name: 'kept', handOver: true });
      await owner.vmm.release({ allocationId: allocation.id });
      owner.close();
      await eventually(async () => ((await daemon.stats()).sessions === before.sessions ? true : undefined));
      const observer = await client();
      const names = (await observer.stores.list()).map((s) => s.name);
      expect(names).toContain('kept');
      expect(names).not.toContain('mine');
      await observer.stores.detach('kept');
      await eventually(async () => ((await daemon.stats()).allocatedBytes === before.allocatedBytes ? true : undefined));
    });

    it('keeps names unique among stores not detached', async () => {
      const owner = await client();
      await mutableStore(owner, 2n * MiB, 'unique');
      await expect(mutableStore(owner, 2n * MiB, 'unique')).rejects.toMatchObject({ code: 'NAME_TAKEN', status: grpc.status.ALREADY_EXISTS });
      await owner.stores.detach('unique');
      await mutableStore(owner, 2n * MiB, 'unique');
    });

    it('refuses sessionless opens, and reports events in order', async () => {
      await expect(call(daemon.raw.admin, 'GetStats', {})).resolves.toBeDefined();
      const storesRaw = new (require('../../common/proto').loadProtos().proto.vmmd.v1.Stores)(
        `unix://${daemon.dir}/vmmd.sock`,
        grpc.credentials.createInsecure(),
      );
      await expect(call(storesRaw, 'Open', { store: { name: 'anything' } })).rejects.toMatchObject({ code: grpc.status.FAILED_PRECONDITION });
      grpc.Client.prototype.close.call(storesRaw); // the service's own Close RPC shadows close()
      const owner = await client();
      const store = await mutableStore(owner, 2n * MiB);
      const opened = await owner.stores.open(BigInt(store.id));
      await opened.close();
      await owner.stores.detach(BigInt(store.id));
      const kinds = (await eventLog(owner, store.id)).filter((e) => e.store?.id === store.id).map((e) => e.kind);
      expect(kinds).toEqual(['KIND_CREATED', 'KIND_OPENED', 'KIND_CLOSED', 'KIND_DETACHED', 'KIND_RELEASED']);
    });
  });

  describe('a named read-only store shared by processes', () => {
    const cases: Array<[string, string[]]> =
      backend === 'cuda'
        ? [
            ['device-located', []],
            ['host-located', ['--host']],
          ]
        : [['', []]];
    it.each(cases)(
      '%s: a loader fills 256 MiB from a file and exits; four readers verify it; the memory goes at rm and the last close',
      async (_label, flags) => {
        const file = path.join(os.tmpdir(), `vmmd-store-${process.pid}.bin`);
        const data = Buffer.alloc(256 * 1024 * 1024);
        randomFillSync(data);
        fs.writeFileSync(file, data);
        const expected = createHash('sha256').update(data).digest('hex');
        const before = await daemon.stats();
        const loaded = await vmmctl(daemon.dir, ['store', 'load', 'weights', file, ...flags]);
        expect(loaded.stderr).toMatch(/load weights: 100%/);
        expect(loaded).toMatchObject({
          code: 0,
          stdout: expect.stringMatching(/^loaded 256\.0 MiB in [\d.]+ s \([\d.]+ [KMG]iB\/s\) into store \d+ "weights", read-only/),
        });
        const readers = await Promise.all([1, 2, 3, 4].map(() => Peer.start(daemon.dir)));
        try {
          const handles = await Promise.all(readers.map((reader) => reader.do({ op: 'storeOpen', name: 'weights' })));
          const sums = await Promise.all(readers.map((reader, i) => reader.do({ op: 'storeChecksum', handle: handles[i].handle })));
          expect(sums.map((sum) => sum.sha256)).toEqual([expected, expected, expected, expected]);
          expect(await vmmctl(daemon.dir, ['store', 'rm', 'weights'])).toMatchObject({
            code: 0,
            stdout: expect.stringMatching(/freed when its 4 open\(s\) close/),
          });
          expect(BigInt((await daemon.stats()).allocatedBytes)).toBeGreaterThanOrEqual(256n * MiB);
          for (const [i, reader] of readers.entries()) await reader.do({ op: 'storeClose', handle: handles[i].handle });
          await eventually(
            async () => ((await daemon.stats()).allocatedBytes === before.allocatedBytes ? true : undefined),
            10_000,
            'the store memory to be freed',
          );
        } finally {
          for (const reader of readers) await reader.stop();
          fs.rmSync(file, { force: true });
        }
      },
      120_000,
    );
  });
}
