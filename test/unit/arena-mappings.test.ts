/**
 * The client's CUDA mappings in the address arena, against a stand-in driver
 * that behaves like the real one where it matters: an
 * unmap and a copy finish when the test says so, an unmap under a copy in
 * flight poisons the context, a map over a mapped range is refused. Memory
 * freed while a copy into its neighbour is in flight: the neighbour's copy
 * lands, and the freed range is handed out again only once its unmap completed.
 */
const MiB = 1024n * 1024n;

/** What the stand-in driver holds and did. */
const driver = {
  reservations: new Map<bigint, bigint>(),
  mappings: new Map<bigint, { size: bigint; handle: bigint }>(),
  memory: new Map<bigint, Buffer>(),
  copies: [] as Array<{ address: bigint; size: bigint; land: () => void }>,
  unmaps: [] as Array<{ address: bigint; finish: () => void }>,
  calls: [] as string[],
  poisoned: undefined as string | undefined,
  nextAddress: 0x7f00_0000_0000n,
  nextHandle: 1n,
  reset() {
    this.reservations.clear();
    this.mappings.clear();
    this.memory.clear();
    this.copies.length = 0;
    this.unmaps.length = 0;
    this.calls.length = 0;
    this.poisoned = undefined;
  },
  /** The mapping holding [address, address + size), or undefined. */
  mappingAt(address: bigint, size: bigint) {
    for (const [base, mapping] of this.mappings) {
      if (address >= base && address + size <= base + mapping.size) return { base, ...mapping };
    }
    return undefined;
  },
};

jest.mock('../../native/index', () => {
  const actual = jest.requireActual('../../native/index');
  const fake = {
    ...actual.addon,
    cudaLoad: () => ({ loaded: true }),
    cudaDevices: () => [],
    close: (fd: number) => jest.requireActual('node:fs').closeSync(fd),
    // Each import is a handle of its own: descriptor numbers are reused once the client closes them.
    cudaImportFd: async (_fd: number) => {
      const handle = driver.nextHandle++;
      driver.memory.set(handle, Buffer.alloc(Number(8n * MiB)));
      return handle;
    },
    cudaRelease: async () => undefined,
    cudaReserve: (size: bigint, alignment: bigint) => {
      const address = ((driver.nextAddress + alignment - 1n) / alignment) * alignment;
      driver.nextAddress = address + size;
      driver.reservations.set(address, size);
      driver.calls.push(`reserve ${size / MiB} MiB`);
      return address;
    },
    cudaFreeAddress: (address: bigint, size: bigint) => {
      if (driver.reservations.get(address) !== size) throw new Error('CUDA_ERROR_INVALID_VALUE: cuMemAddressFree');
      driver.reservations.delete(address);
      driver.calls.push(`free ${size / MiB} MiB`);
    },
    cudaMap: async (address: bigint, size: bigint, _offset: bigint, handle: bigint) => {
      for (const [base, mapping] of driver.mappings) {
        if (address < base + mapping.size && base < address + size)
          throw Object.assign(new Error('CUDA_ERROR_INVALID_VALUE: cuMemMap'), { code: 'CUDA_ERROR_INVALID_VALUE' });
      }
      driver.mappings.set(address, { size, handle });
    },
    cudaSetAccess: async () => undefined,
    // The client's one-call import of a descriptor: import, map (refused over a mapped range), access, release;
    // a failed step undoes the ones before it on the spot (the real call's cuMemUnmap is synchronous).
    cudaImportMap: async (fd: number, address: bigint, size: bigint) => {
      const handle = await fake.cudaImportFd(fd);
      await fake.cudaMap(address, size, 0n, handle);
      try {
        await fake.cudaSetAccess();
      } catch (error) {
        driver.mappings.delete(address);
        throw error;
      }
    },
    cudaUnmap: (_device: number, address: bigint, size: bigint) => {
      driver.calls.push(`unmap 0x${address.toString(16)}`);
      if (driver.copies.some((copy) => copy.address < address + size && address < copy.address + copy.size)) {
        driver.poisoned = `unmapped 0x${address.toString(16)} under a copy in flight`;
      }
      return new Promise<void>((resolve) => {
        driver.unmaps.push({
          address,
          finish: () => {
            driver.mappings.delete(address);
            driver.calls.push(`unmapped 0x${address.toString(16)}`);
            resolve();
          },
        });
      });
    },
    cudaCopyToDevice: (_device: number, address: bigint, data: Buffer) =>
      new Promise<void>((resolve, reject) => {
        const size = BigInt(data.length);
        const copy = {
          address,
          size,
          land: () => {
            driver.copies.splice(driver.copies.indexOf(copy), 1);
            const mapping = driver.mappingAt(address, size);
            if (mapping === undefined || driver.poisoned !== undefined) {
              reject(Object.assign(new Error('CUDA_ERROR_LAUNCH_FAILED: cuMemcpyHtoDAsync'), { code: 'CUDA_ERROR_LAUNCH_FAILED' }));
              return;
            }
            data.copy(driver.memory.get(mapping.handle)!, Number(address - mapping.base));
            resolve();
          },
        };
        driver.copies.push(copy);
      }),
    cudaCopyFromDevice: async (_device: number, address: bigint, length: bigint) => {
      const mapping = driver.mappingAt(address, length);
      if (mapping === undefined) throw new Error('CUDA_ERROR_ILLEGAL_ADDRESS: cuMemcpyDtoH');
      const offset = Number(address - mapping.base);
      return Buffer.from(driver.memory.get(mapping.handle)!.subarray(offset, offset + Number(length)));
    },
  };
  return { ...actual, addon: fake };
});

import * as fs from 'node:fs';
import { CudaImportedMemory } from '../../client/local-memory';
import { status as Status } from '@grpc/grpc-js';
import { addressArenaStats, DeviceMapping, trimAddressArenas } from '../../native/mapping';

const SIZE = 2n * MiB;
const turn = () => new Promise((resolve) => setImmediate(resolve));
// A descriptor of the test's own for each import: the client closes it once mapped (a made-up number would close another's).
const map = () => CudaImportedMemory.map(1n, { fd: fs.openSync('/dev/null', 'r') }, SIZE, SIZE, 0, false);

/** Runs `body` while the stand-in driver refuses every cuMemSetAccess (out of memory). */
async function whileSetAccessFails(body: () => Promise<void>): Promise<void> {
  const { addon } = jest.requireMock('../../native/index') as { addon: { cudaSetAccess: () => Promise<void> } };
  const setAccess = addon.cudaSetAccess;
  addon.cudaSetAccess = async () => {
    throw Object.assign(new Error('CUDA_ERROR_OUT_OF_MEMORY: cuMemSetAccess'), { code: 'CUDA_ERROR_OUT_OF_MEMORY' });
  };
  try {
    await body();
  } finally {
    addon.cudaSetAccess = setAccess;
  }
}

/** Lets every unmap the driver was given finish. */
async function finishUnmaps(): Promise<void> {
  while (driver.unmaps.length > 0) driver.unmaps.shift()!.finish();
  await turn();
}

describe('client mappings in the address arena', () => {
  afterEach(async () => {
    await finishUnmaps();
    trimAddressArenas();
    expect(driver.reservations.size).toBe(0);
    driver.reset();
  });

  it('maps consecutive allocations side by side in one reservation', async () => {
    const a = await map();
    const b = await map();
    expect(b.address).toBe(a.address + SIZE);
    expect(driver.calls).toEqual(['reserve 65536 MiB']);
    expect(addressArenaStats()['cuda:0']).toMatchObject({ reservations: 1, takenBytes: 2n * SIZE });
    await Promise.all([a.close(), b.close(), finishUnmaps()]);
    expect(addressArenaStats()['cuda:0']).toMatchObject({ takenBytes: 0n });
  });

  it('memory freed while a copy into its neighbour is in flight: the copy lands, the range is reused only after its unmap', async () => {
    const a = await map();
    const b = await map();
    const bytes = Buffer.alloc(Number(SIZE), 0xb7);
    const write = b.write(0, bytes);
    expect(driver.copies).toHaveLength(1);

    // a is freed: its unmap starts at once (no copy of its own), while b's copy is still running.
    const closed = a.close();
    await turn();
    expect(driver.calls).toContain(`unmap 0x${a.address.toString(16)}`);

    // The next allocation while a's unmap has not completed gets another range, not a's.
    const c = await map();
    expect(c.address).not.toBe(a.address);
    expect(c.address).toBe(b.address + SIZE);

    // a's unmap completes: its range goes back, and the next allocation takes it.
    driver.unmaps.shift()!.finish();
    await closed;
    const d = await map();
    expect(d.address).toBe(a.address);

    // b's copy was never cut off: it lands, whole, and reads back.
    driver.copies[0].land();
    await write;
    expect((await b.read(0, SIZE)).equals(bytes)).toBe(true);
    expect(driver.poisoned).toBeUndefined();

    for (const memory of [b, c, d]) void memory.close();
    await finishUnmaps();
  });

  it('memory freed with its own copy in flight is unmapped only after the copy landed, and its range waits for that', async () => {
    const a = await map();
    const b = await map();
    const write = a.write(4096, Buffer.from('landed'));
    const closed = a.close();
    await turn();
    expect(driver.calls.filter((call) => call.startsWith('unmap'))).toEqual([]);
    // Until then a's range is not free: a new mapping goes after b.
    const c = await map();
    expect(c.address).toBe(b.address + SIZE);
    driver.copies[0].land();
    await write;
    await turn();
    expect(driver.calls).toContain(`unmap 0x${a.address.toString(16)}`);
    expect(driver.poisoned).toBeUndefined();
    await finishUnmaps();
    await closed;
    const d = await map();
    expect(d.address).toBe(a.address);
    for (const memory of [b, c, d]) void memory.close();
  });

  it('a failed map (on driver threads) gives its range back once it is unmapped: the next mapping takes it', async () => {
    const a = await map();
    const taken = addressArenaStats()['cuda:0'].takenBytes;
    // A mapping that fails at set access is unmapped and its range given back.
    await whileSetAccessFails(async () => {
      const failed = DeviceMapping.map(0, 7n, SIZE, SIZE, { readOnly: false });
      failed.catch(() => undefined);
      await turn();
      expect(addressArenaStats()['cuda:0'].takenBytes).toBe(taken + SIZE);
      await finishUnmaps();
      await expect(failed).rejects.toMatchObject({ code: 'CUDA_ERROR_OUT_OF_MEMORY' });
    });
    expect(addressArenaStats()['cuda:0'].takenBytes).toBe(taken);
    const b = await map();
    expect(b.address).toBe(a.address + SIZE);
    for (const memory of [a, b]) void memory.close();
  });

  it('a descriptor whose one-call import fails at set access leaves nothing mapped, and its range is free at once', async () => {
    const a = await map();
    const taken = addressArenaStats()['cuda:0'].takenBytes;
    await whileSetAccessFails(() => expect(map()).rejects.toMatchObject({ code: 'LOCAL_MAP_FAILED', status: Status.RESOURCE_EXHAUSTED }));
    expect(driver.mappings.size).toBe(1);
    expect(addressArenaStats()['cuda:0'].takenBytes).toBe(taken);
    const b = await map();
    expect(b.address).toBe(a.address + SIZE);
    for (const memory of [a, b]) void memory.close();
  });
});
