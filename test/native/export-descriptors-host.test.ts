/**
 * Exports handed out as dups of a kept descriptor, on real memfds:
 * the stock keeps the descriptor a stocked allocation's first export handed
 * out, so its later exports are dups of the same memory; the kept one goes
 * with the memory, so a handle number the host backend reuses at once (a
 * memfd's) never meets the old memory's descriptor. And the read-only
 * descriptors stores keep for their non-writers: a non-writer never gets a
 * writable descriptor, whichever open came first, nor from an attached
 * (SYSMEM, charged) store.
 */
import * as fs from 'node:fs';
import pino from 'pino';
import { HostBackend } from '../../server/backends/host';
import { StockedBackend } from '../../server/backends/stock';
import { Registry } from '../../server/registry';
import { StoreRecord, StoreRegistry } from '../../server/stores/stores';
import { addon } from '../../native';

const MiB = 1n << 20n;
const DEVICE0 = { type: 'DEVICE' as const, id: 0 };
const A = 1n;
const O_ACCMODE = 3;
const O_RDONLY = 0;

/** Which memory a descriptor is of. */
const fileOf = (fd: number) => {
  const info = addon.hostFdInfo(fd);
  return `${info.device}:${info.inode}`;
};

describe('exported descriptors kept on the host backend', () => {
  let stock: StockedBackend;
  let registry: Registry;
  const opened: number[] = [];
  const keep = (fd: number) => (opened.push(fd), fd);

  beforeEach(async () => {
    stock = new StockedBackend(new HostBackend({ capacity: 64n * MiB, granularity: 2n * MiB }), [{ size: 2n * MiB, depth: 1 }], pino({ level: 'silent' }));
    await stock.fill();
    registry = new Registry(stock);
  });

  afterEach(async () => {
    for (const fd of opened.splice(0)) addon.close(fd);
    await registry.reclaim(A);
    stock.close();
  });

  const create = (size = 2n * MiB) => registry.create(A, { size, location: DEVICE0, handleType: 'POSIX_FD' });
  const exportFd = async (allocationId: bigint) => keep((await registry.exportHandle(A, { allocationId, handleType: 'POSIX_FD', shareKey: '' })).fd!);

  it("exports a stocked allocation again as a dup of the kept descriptor: the same memory, a descriptor of the caller's own", async () => {
    const made = await create();
    const first = await exportFd(made.id);
    const second = await exportFd(made.id);
    expect(second).not.toBe(first);
    expect(fileOf(second)).toBe(fileOf(first));
    expect(stock.keptDescriptors).toBe(1);
    // Each is the caller's: closing one leaves the others working.
    addon.close(opened.shift()!);
    expect(fileOf(await exportFd(made.id))).toBe(fileOf(second));
    await registry.release(A, made.id);
    expect(stock.keptDescriptors).toBe(0);
  });

  it("attack: export A, release A, create B with the same handle number, export B: B is its own memory, not A's", async () => {
    const a = await create();
    // Every free number below A's taken, for the attack's precondition: the next descriptor made after A's
    // release is A's number (the kernel hands out the lowest free one).
    await new Promise((resolve) => setImmediate(resolve));
    const fillers: number[] = [];
    for (let fd = fs.openSync('/dev/null', 'r'); ; fd = fs.openSync('/dev/null', 'r')) {
      if (fd > Number(a.handle)) {
        fs.closeSync(fd);
        break;
      }
      fillers.push(fd);
    }
    const aFile = fileOf(await exportFd(a.id));
    await exportFd(a.id);
    // Our descriptors of A keep its file alive: its inode cannot be reused for B.
    await registry.release(A, a.id);
    const bs: Array<Awaited<ReturnType<typeof create>>> = [];
    try {
      for (let i = 0; i < 4 && !bs.some((b) => b.handle === a.handle); i++) bs.push(await create(4n * MiB));
    } finally {
      for (const fd of fillers) fs.closeSync(fd);
    }
    const b = bs.find((candidate) => candidate.handle === a.handle);
    // The host backend's handle is the memfd's number, reused at once: the attack's precondition.
    expect(b).toBeDefined();
    const bFd = await exportFd(b!.id);
    expect(fileOf(bFd)).not.toBe(aFile);
    expect(addon.hostFdInfo(bFd).size).toBe(4n * MiB);
    expect(fileOf(await exportFd(b!.id))).toBe(fileOf(bFd));
  });

  describe('stores', () => {
    let stores: StoreRegistry;
    beforeEach(() => {
      stores = new StoreRegistry(registry);
    });

    const accessMode = (fd: number) => addon.hostFdInfo(fd).accessMode & O_ACCMODE;
    /** Whether anything can write the memory through the descriptor: write(2), or a shared writable mapping. */
    const writable = (fd: number) => {
      try {
        fs.writeSync(fd, Buffer.from('x'), 0, 1, 0);
        return true;
      } catch {
        return accessMode(fd) !== O_RDONLY;
      }
    };

    async function checkOpens(store: StoreRecord) {
      // Writer first, then a non-writer, then each again: every non-writer's descriptor is O_RDONLY, every writer's not.
      const order = [false, true, false, true, true, false];
      for (const readOnly of order) {
        const fd = keep(await stores.open(A, store, !readOnly, readOnly));
        expect({ readOnly, writable: writable(fd) }).toEqual({ readOnly, writable: !readOnly });
      }
      // Detached, and every open closed: the store's memory (and its kept read-only descriptor) goes.
      await stores.detach(A, store);
      for (let open = store.opens.get(A) ?? 0; open > 0; open--) await stores.close(A, store);
    }

    it("a store of an allocation: non-writers get read-only descriptors (one kept, dup'ed), writers writable ones", async () => {
      const made = await create();
      const store = await stores.create(A, { allocationId: made.id, name: 'weights', readOnly: false, handOver: false, size: 0n });
      // A non-writer first: the kept read-only descriptor is made by its open.
      expect(writable(keep(await stores.open(A, store, false, true)))).toBe(false);
      await checkOpens(store);
      await registry.release(A, made.id);
    });

    it('an attached SYSMEM store (charged memfd): non-writers get read-only descriptors too', async () => {
      const memfd = addon.hostMemfdCreate('attached', 2n * MiB);
      const store = await stores.attach(A, memfd, { target: 'SYSMEM', device: 0, size: 2n * MiB, readOnly: false, name: 'attached', hasDeleter: false });
      await checkOpens(store);
    });
  });
});
