/**
 * The client's address arena on the cuda backend: allocations
 * mapped side by side in one cuMemAddressReserve'd range, memory freed while
 * a copy into its neighbour is in flight (the neighbour's bytes land whole,
 * the context stays healthy), a freed range handed out again only once its
 * unmap completed, and the NBEP 7 manager's frees that do not wait for the
 * unmap, over and over. The client's one-call import of a descriptor
 * (addon.cudaImportMap): a step that fails leaves nothing imported, mapped
 * or taken from the arena, and names the step.
 */
import { connect, VmmdClient, VmmdMemoryManager } from '../../client';
import { addon } from '../../native';
import { addressArenaStats, DeviceMapping } from '../../native/mapping';
import { MiB, TestDaemon } from '../e2e/harness';
import { describeGpu } from './gpu';

const SIZE = 64n * MiB;
const ROUNDS = 20;

describeGpu('the address arena on the cuda backend', () => {
  let daemon: TestDaemon;
  let client: VmmdClient;

  beforeAll(async () => {
    daemon = await TestDaemon.start([], 'cuda');
    client = await connect({ socketDir: daemon.dir });
  });

  afterAll(async () => {
    client.close();
    expect(await daemon.stop()).toBe(0);
  });

  it('memory freed while a copy into its neighbour is in flight: the copy lands, the range is reused only once unmapped', async () => {
    const a = await client.vmm.allocate({ size: SIZE });
    const b = await client.vmm.allocate({ size: SIZE });
    expect(b.address).toBe(a.address + SIZE);
    const reservations = addressArenaStats()['cuda:0'].reservations;
    await a.close();
    await client.vmm.release({ allocationId: a.allocationId });
    for (let round = 0; round < ROUNDS; round++) {
      // The lowest free range is a's: each round's x is b's neighbour.
      const x = await client.vmm.allocate({ size: SIZE });
      expect(x.address).toBe(a.address);
      const bytes = Buffer.alloc(Number(SIZE), round + 1);
      const writing = b.write(0, bytes);
      // x is freed while its neighbour is being written, without waiting, and the next allocation made at once.
      let unmapped = false;
      const closing = x.close().then(() => {
        unmapped = true;
      });
      const c = await client.vmm.allocate({ size: SIZE });
      // Either x's unmap had completed and c took its range, or c got another: never a range still being unmapped.
      if (c.address === x.address) expect(unmapped).toBe(true);
      await Promise.all([writing, closing]);
      expect((await b.read(0, SIZE)).equals(bytes)).toBe(true);
      await c.close();
      for (const memory of [x, c]) await client.vmm.release({ allocationId: memory.allocationId });
    }
    expect(addressArenaStats()['cuda:0'].reservations).toBe(reservations);
    await b.close();
    await client.vmm.release({ allocationId: b.allocationId });
    // The context is healthy: a new allocation copies both ways.
    const after = await client.vmm.allocate({ size: 2n * MiB });
    await after.write(0, Buffer.from('still usable'));
    expect((await after.read(0, 12)).toString()).toBe('still usable');
    await after.close();
    await client.vmm.release({ allocationId: after.allocationId });
  });

  it('a one-call import that fails at a step leaves nothing behind and names the step', async () => {
    const allocation = await client.vmm.create({ size: SIZE });
    const taken = addressArenaStats()['cuda:0']?.takenBytes ?? 0n;
    const memory = await client.vmm.import(allocation.id);
    await memory.close();
    // Not CUDA memory: the import step refuses it.
    const notCuda = addon.hostMemfdCreate('not-cuda', 2n * MiB);
    try {
      await expect(DeviceMapping.importDescriptor(0, notCuda, 2n * MiB, 2n * MiB, { readOnly: false })).rejects.toThrow(/cuMemImportFromShareableHandle/);
    } finally {
      addon.close(notCuda);
    }
    // A size that is not the allocation's own: the driver maps an allocation only whole, so the map step refuses it,
    // and the imported handle is released (the allocation's memory is freed below with its last reference).
    const exported = await client.vmm.export({ allocationId: allocation.id, handleType: 'HANDLE_TYPE_POSIX_FD' });
    const fd = await client.session.takeTransfer(exported.transferId);
    try {
      await expect(DeviceMapping.importDescriptor(0, fd, SIZE / 2n, 2n * MiB, { readOnly: false })).rejects.toThrow(/cuMemMap/);
    } finally {
      addon.close(fd);
    }
    expect(addressArenaStats()['cuda:0'].takenBytes).toBe(taken);
    // The same descriptor path, whole: mapped, written, read back.
    const again = await client.vmm.import(allocation.id);
    await again.write(0, Buffer.from('one call'));
    expect((await again.read(0, 8)).toString()).toBe('one call');
    await again.close();
    const released = await client.vmm.release({ allocationId: allocation.id });
    expect(released.freed).toBe(true);
  });

  describe('a one-call import whose driver calls fail (faults injected in this process)', () => {
    const importWith = async (plan: string) => {
      const allocation = await client.vmm.create({ size: SIZE });
      const exported = await client.vmm.export({ allocationId: allocation.id, handleType: 'HANDLE_TYPE_POSIX_FD' });
      const fd = await client.session.takeTransfer(exported.transferId);
      const taken = addressArenaStats()['cuda:0']?.takenBytes ?? 0n;
      const warnings: string[] = [];
      const warned = jest.spyOn(process, 'emitWarning').mockImplementation((warning) => void warnings.push(String(warning)));
      addon.faultsSet(plan);
      try {
        const outcome = await DeviceMapping.importDescriptor(0, fd, SIZE, 2n * MiB, { readOnly: false, synchronizeUnmap: true }).then(
          (mapping) => ({ mapping, error: undefined }),
          (error: Error & { stillMapped?: boolean }) => ({ mapping: undefined, error }),
        );
        return { ...outcome, allocation, taken, warnings, takenAfter: addressArenaStats()['cuda:0'].takenBytes };
      } finally {
        addon.faultsSet('');
        warned.mockRestore();
        addon.close(fd);
      }
    };

    it('set access fails: undone, the range back in the arena, the step named', async () => {
      const result = await importWith('cuMemSetAccess:1:CUDA_ERROR_INVALID_VALUE');
      expect(result.error?.message).toMatch(/cuMemSetAccess/);
      expect(result.error?.stillMapped).toBeUndefined();
      expect(result.takenAfter).toBe(result.taken);
      await expect(client.vmm.release({ allocationId: result.allocation.id })).resolves.toMatchObject({ freed: true });
    });

    it('set access fails and so does undoing the map: the error says stillMapped and the range is never handed out again', async () => {
      const result = await importWith('cuMemSetAccess:1:CUDA_ERROR_INVALID_VALUE,cuMemUnmap:1:CUDA_ERROR_UNKNOWN');
      expect(result.error).toMatchObject({ stillMapped: true, unmapError: 'CUDA_ERROR_UNKNOWN' });
      expect(result.takenAfter).toBe(result.taken + SIZE);
      expect(result.warnings).toEqual([expect.stringMatching(/left \d+ bytes mapped at 0x[0-9a-f]+ \(CUDA_ERROR_UNKNOWN\); that range is not used again/)]);
    });

    it("the imported handle's release fails after a mapping that works: the mapping is kept and works, with a warning", async () => {
      const result = await importWith('cuMemRelease:1:CUDA_ERROR_UNKNOWN');
      expect(result.error).toBeUndefined();
      expect(result.warnings).toEqual([expect.stringMatching(/releasing the imported handle .* failed \(CUDA_ERROR_UNKNOWN\); the mapping works/)]);
      const mapping = result.mapping!;
      await addon.cudaCopyToDevice(0, mapping.address, Buffer.from('kept'));
      expect((await addon.cudaCopyFromDevice(0, mapping.address, 4n)).toString()).toBe('kept');
      await mapping.unmap();
      expect(addressArenaStats()['cuda:0'].takenBytes).toBe(result.taken);
    });
  });

  it("the NBEP 7 manager's cold frees return before the unmap; allocations reuse the ranges, no new reservation each", async () => {
    const mm = new VmmdMemoryManager({
      client,
      device: 0,
      backend: 'cuda',
      pool: { chunkSize: 2n * MiB, largeThreshold: 0n },
      deferred: { count: 0, ratio: 1 },
    });
    await mm.initialize();
    const neighbour = await mm.memalloc(SIZE);
    const before = addressArenaStats()['cuda:0'].reservations;
    for (let round = 0; round < ROUNDS; round++) {
      const bytes = Buffer.alloc(Number(SIZE), 0x40 + round);
      const writing = mm.write(neighbour.pointer, bytes);
      const pointer = await mm.memalloc(SIZE);
      await mm.write(pointer.pointer, Buffer.from('mine'));
      expect((await mm.read(pointer.pointer, 4)).toString()).toBe('mine');
      await pointer.free();
      await writing;
      expect((await mm.read(neighbour.pointer, Number(SIZE))).equals(bytes)).toBe(true);
    }
    await mm.flush();
    expect(addressArenaStats()['cuda:0'].reservations).toBe(before);
    await neighbour.free();
    await mm.reset();
  });
});
