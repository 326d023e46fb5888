/**
 * The NBEP 7 memory manager, plugin selection, Config/Context and device
 * arrays against a real daemon: a contract for every backend (test/e2e runs
 * it on host, test/gpu on cuda).
 */
import { execFile } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import {
  Config,
  connect,
  Context,
  ErrorCode,
  HostOnlyMemoryManager,
  IpcHandle,
  MappedMemory,
  MemoryInfo,
  MemoryPointer,
  MEMORY_MANAGER_VARIABLE,
  PinnedMemory,
  resetMemoryManagerChoice,
  setMemoryManager,
  VmmdClient,
  VmmdError,
  VmmdMemoryManager,
} from '../../client';
import type { VmmdManagerContext } from '../../client';
import { addon } from '../../native';
import { addressArenaStats } from '../../native/mapping';
import { MiB, Peer, TestDaemon, packageRoot } from '../e2e/harness';

const ROOT = packageRoot();

/** A manager that adds device memory only, as NBEP 7 lets a HostOnly subclass do. */
class HostOnlyTestManager extends HostOnlyMemoryManager {
  readonly allocated: bigint[] = [];
  async memalloc(size: bigint | number): Promise<MemoryPointer> {
    const pointer = 0x1000n * BigInt(this.allocated.length + 1);
    this.allocated.push(pointer);
    return new MemoryPointer(this.context, pointer, BigInt(size));
  }
  async getIpcHandle(): Promise<IpcHandle> {
    throw new Error('no IPC in the test manager');
  }
  async getMemoryInfo(): Promise<MemoryInfo> {
    return { free: 1n, total: 2n };
  }
}

export function emmContract(backend: 'host' | 'cuda'): void {
  let daemon: TestDaemon;
  let client: VmmdClient;
  const managers: VmmdMemoryManager[] = [];

  beforeAll(async () => {
    daemon = await TestDaemon.start([], backend);
    client = await connect({ socketDir: daemon.dir });
  });

  afterAll(async () => {
    client.close();
    expect(await daemon.stop()).toBe(0);
  });

  afterEach(async () => {
    for (const manager of managers.splice(0)) await manager.reset();
    resetMemoryManagerChoice();
    delete process.env[MEMORY_MANAGER_VARIABLE];
  });

  async function manager(overrides: Partial<VmmdManagerContext> = {}): Promise<VmmdMemoryManager> {
    const made = new VmmdMemoryManager({ device: 0, backend, client, checks: true, ...overrides });
    managers.push(made);
    await made.initialize();
    return made;
  }

  async function total(): Promise<bigint> {
    return BigInt((await client.devices.getMemoryInfo({ device: 0 })).totalBytes);
  }

  function config(): Config {
    return new Config().setSocketDir(daemon.dir);
  }

  describe('the NBEP 7 interface', () => {
    it('is interface version 1; initialize() may run many times and keeps state', async () => {
      const mm = await manager();
      expect(mm.interfaceVersion).toBe(1);
      const pointer = await mm.memalloc(1000);
      await mm.write(pointer.pointer, Buffer.from('kept'));
      await mm.initialize();
      await mm.initialize();
      expect((await mm.read(pointer.pointer, 4)).toString()).toBe('kept');
      expect(mm.stats().pool.blocks).toBe(1);
    });

    it('resets before initialize()', async () => {
      const mm = new VmmdMemoryManager({ device: 0, backend, client });
      managers.push(mm);
      await mm.reset();
      await mm.initialize();
      expect((await mm.memalloc(256)).size).toBe(256n);
    });

    it('answers getMemoryInfo from the daemon', async () => {
      const mm = await manager();
      const info = await mm.getMemoryInfo();
      expect(info.total).toBe(await total());
      expect(info.free).toBeLessThanOrEqual(info.total);
      if (backend === 'host') {
        const before = info.free;
        await mm.memalloc(1000);
        expect((await mm.getMemoryInfo()).free).toBe(before - (32n << 20n));
      }
    });

    it('refuses size 0 as a PROGRAM_ERROR', async () => {
      const mm = await manager();
      const error = await mm.memalloc(0).catch((e) => e);
      expect(error).toBeInstanceOf(VmmdError);
      expect(error).toMatchObject({ code: 'ZERO_SIZE', errorCode: ErrorCode.PROGRAM_ERROR });
    });
  });

  describe('memalloc from the pool', () => {
    it('hands out aligned, disjoint blocks of one chunk, each holding its own bytes', async () => {
      const mm = await manager();
      const pointers = await Promise.all([100, 1000, 5000, 256].map((size) => mm.memalloc(size)));
      expect(mm.stats().counters.chunksLeased).toBe(1);
      const ranges = pointers.map((p) => [p.pointer, p.pointer + p.size] as const).sort((a, b) => (a[0] < b[0] ? -1 : 1));
      for (let i = 0; i < ranges.length; i++) {
        expect(ranges[i][0] % 256n).toBe(0n);
        if (i > 0) expect(ranges[i][0]).toBeGreaterThanOrEqual(ranges[i - 1][1]);
      }
      for (const [i, p] of pointers.entries()) await mm.write(p.pointer, Buffer.from(`block ${i}`));
      for (const [i, p] of pointers.entries()) expect((await mm.read(p.pointer, 7)).toString()).toBe(`block ${i}`);
    });

    it('gives a request above the large threshold an allocation of its own', async () => {
      const mm = await manager({ pool: { chunkSize: 4n * MiB, largeThreshold: 1n * MiB } });
      const big = await mm.memalloc(3n * MiB);
      expect(mm.stats().large).toEqual({ allocations: 1, bytes: String(4n * MiB) });
      expect(mm.stats().counters.chunksLeased).toBe(0);
      await mm.write(big.pointer + 3n * MiB - 4n, Buffer.from('tail'));
      expect((await mm.read(big.pointer + 3n * MiB - 4n, 4)).toString()).toBe('tail');
      await big.free();
      await mm.flush();
      expect(mm.stats().large.allocations).toBe(0);
    });

    it('maps cold allocations into reserved address space: no reservation per allocation, freed ranges reused', async () => {
      const mm = await manager({ pool: { chunkSize: 2n * MiB, largeThreshold: 0n }, deferred: { count: 0, ratio: 1 } });
      const arena = () => addressArenaStats()[backend === 'cuda' ? 'cuda:0' : 'host'];
      const held = await mm.memalloc(4n * MiB);
      const { reservations, takenBytes } = arena();
      expect(reservations).toBeGreaterThanOrEqual(1);
      const seen = new Set<bigint>();
      for (let i = 0; i < 20; i++) {
        const pointer = await mm.memalloc(4n * MiB);
        seen.add(pointer.pointer);
        const text = `round ${String(i).padStart(2, '0')}`;
        await mm.write(pointer.pointer, Buffer.from(text));
        expect((await mm.read(pointer.pointer, text.length)).toString()).toBe(text);
        await pointer.free();
        // flush() resolves once the freed memory is unmapped here and its range back in the arena.
        await mm.flush();
        expect(arena()).toMatchObject({ reservations, takenBytes });
      }
      // Each allocation took the range the one before gave back.
      expect(seen.size).toBe(1);
      await held.free();
    });

    it('coalesces freed neighbours so a larger block fits in the same chunk', async () => {
      const mm = await manager({ pool: { chunkSize: 2n * MiB, largeThreshold: 2n * MiB }, deferred: { count: 0, ratio: 1 } });
      // 512 KiB is a size class of its own: three blocks take 1.5 MiB of the chunk.
      const blocks = [await mm.memalloc(512n << 10n), await mm.memalloc(512n << 10n), await mm.memalloc(512n << 10n)];
      for (const block of blocks) await block.free();
      await mm.flush();
      expect(mm.stats().pool.used).toBe('0');
      await mm.memalloc(2n * MiB - 4096n);
      expect(mm.stats().counters.chunksLeased).toBe(1);
    });

    it('frees through free() once, and through Symbol.dispose', async () => {
      const mm = await manager({ deferred: { count: 0, ratio: 1 } });
      const pointer = await mm.memalloc(1000);
      await pointer.free();
      await pointer.free();
      expect(mm.stats().counters.frees).toBe(1);
      {
        using disposed = await mm.memalloc(1000);
        expect(disposed.freed).toBe(false);
      }
      await mm.flush();
      expect(mm.stats().counters.frees).toBe(2);
      expect(mm.stats().pool.used).toBe('0');
    });

    it('reclaims a dropped pointer through the finalizer (node --expose-gc)', async () => {
      const script = path.join(ROOT, 'dist', 'test', 'e2e', 'fixtures', 'finalizer.js');
      const output = await new Promise<string>((resolve, reject) =>
        execFile(process.execPath, ['--expose-gc', script], { env: { ...process.env, VMMD_SOCKET_DIR: daemon.dir } }, (error, stdout, stderr) =>
          error ? reject(new Error(`${error.message}\n${stderr}`)) : resolve(stdout),
        ),
      );
      expect(JSON.parse(output)).toEqual({ usedBefore: '1024', frees: 1, usedAfter: '0' });
    });
  });

  describe("Numba's deferred frees", () => {
    it('flush when more than `count` are pending', async () => {
      const mm = await manager({ deferred: { count: 3, ratio: 1 } });
      const pointers = await Promise.all([1, 2, 3, 4].map(() => mm.memalloc(1000)));
      for (const pointer of pointers.slice(0, 3)) await pointer.free();
      expect(mm.stats().pending.frees).toBe(3);
      expect(mm.stats().pool.blocks).toBe(4);
      await pointers[3].free();
      expect(mm.stats().pending.frees).toBe(0);
      expect(mm.stats().pool.blocks).toBe(0);
    });

    it('flush when pending bytes pass `ratio` of the device memory', async () => {
      const ratio = Number(3n * MiB) / Number(await total());
      const mm = await manager({ deferred: { count: 1000, ratio } });
      const small = await mm.memalloc(1n * MiB);
      const big = await mm.memalloc(4n * MiB);
      await small.free();
      expect(mm.stats().pending).toEqual({ frees: 1, bytes: String(1n * MiB) });
      await big.free();
      expect(mm.stats().pending).toEqual({ frees: 0, bytes: '0' });
      expect(mm.stats().pool.used).toBe('0');
    });

    it('are held while deferCleanup() is active, and flush again after', async () => {
      const mm = await manager({ deferred: { count: 1, ratio: 1 } });
      const pointers = await Promise.all([1, 2, 3, 4, 5].map(() => mm.memalloc(1000)));
      {
        using _hold = mm.deferCleanup();
        for (const pointer of pointers.slice(0, 4)) await pointer.free();
        await mm.flush();
        expect(mm.stats().pending.frees).toBe(4);
      }
      await pointers[4].free();
      expect(mm.stats().pending.frees).toBe(0);
      expect(mm.stats().pool.blocks).toBe(0);
    });
  });

  describe('out of memory', () => {
    it('surfaces as errorCode 3 after flushing and returning caches, and through a Context', async () => {
      const mm = await manager();
      const tooMuch = (await total()) + 64n * MiB;
      const error = await mm.memalloc(tooMuch).catch((e) => e);
      expect(error).toBeInstanceOf(VmmdError);
      expect(error.errorCode).toBe(ErrorCode.OUT_OF_MEMORY);
      expect(mm.stats().counters.outOfMemoryRetries).toBe(1);
      const context = await Context.create(config());
      try {
        const fromContext = await context.memalloc(tooMuch).catch((e) => e);
        expect(fromContext.errorCode).toBe(3);
        expect(context.getError()).toMatch(/^memalloc: /);
        expect(context.getError()).toBeNull();
      } finally {
        await context.close();
      }
    });
  });

  describe('IPC handles', () => {
    it('give two pointers of one chunk two handles, which another process opens at the right offset', async () => {
      const mm = await manager();
      const first = await mm.memalloc(1000);
      const second = await mm.memalloc(3000);
      await mm.write(first.pointer, Buffer.from('first block'));
      await mm.write(second.pointer, Buffer.from('second block'));
      const handles = [await mm.getIpcHandle(first), await mm.getIpcHandle(second)];
      expect(handles[0].allocationId).toBe(handles[1].allocationId);
      expect(handles[0]).not.toEqual(handles[1]);
      expect(JSON.parse(JSON.stringify(handles[1]))).toEqual(handles[1]);
      expect(handles[1]).toMatchObject({ offset: String(second.pointer - first.pointer + BigInt(handles[0].offset)), size: '3000', device: 0 });
      const other = await Peer.start(daemon.dir);
      try {
        const opened = await other.do({ op: 'openIpc', handle: handles[1] });
        expect((await other.do({ op: 'ipcRead', handle: opened.handle, length: 12 })).text).toBe('second block');
        await other.do({ op: 'ipcWrite', handle: opened.handle, text: 'SECOND' });
        expect((await mm.read(second.pointer, 12)).toString()).toBe('SECOND block');
        expect((await mm.read(first.pointer, 11)).toString()).toBe('first block');
        expect(await other.do({ op: 'ipcClose', handle: opened.handle })).toEqual({ unmapped: true });
        // The owner's memory is untouched by the other process closing its mapping.
        expect((await mm.read(second.pointer, 12)).toString()).toBe('SECOND block');
      } finally {
        await other.stop();
      }
    });

    it('refuses memory that is not the manager', async () => {
      const mm = await manager();
      const stranger = new MemoryPointer({ device: 0, backend }, 0x10n, 16n);
      await expect(mm.getIpcHandle(stranger)).rejects.toMatchObject({ code: 'NOT_MANAGED', errorCode: 2 });
    });
  });

  describe('host memory', () => {
    it('memhostalloc gives shareable daemon memory the CPU sees, mapped or pinned', async () => {
      const mm = await manager();
      const mapped = await mm.memhostalloc(10_000, { mapped: true, portable: true });
      expect(mapped).toBeInstanceOf(MappedMemory);
      new Uint8Array((mapped as MappedMemory).buffer!).set(Buffer.from('host bytes'));
      expect((await mm.read(mapped.pointer, 10)).toString()).toBe('host bytes');
      const handle = await mm.getIpcHandle(mapped);
      expect(handle.size).toBe('10000');
      const pinned = await mm.memhostalloc(4096);
      expect(pinned).toBeInstanceOf(PinnedMemory);
      expect(mm.stats().host.allocations).toBe(2);
      await mapped.free();
      await pinned.free();
      await mm.flush();
      expect(mm.stats().host.allocations).toBe(0);
    });

    it('mempin pins memory the process has, and refuses a range outside its owner', async () => {
      const mm = await manager();
      const owner = new Float64Array(4096);
      const base = addon.addressOf(owner);
      const pinned = await mm.mempin(owner, base, owner.byteLength);
      expect(pinned).toBeInstanceOf(PinnedMemory);
      expect((pinned as PinnedMemory).hostPointer).toBe(base);
      if (backend === 'cuda') {
        // The driver registers a range once: pinning part of it again is refused, by name.
        await expect(mm.mempin(owner, base + 8192n, 8192)).rejects.toMatchObject({
          code: 'CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED',
          errorCode: 2,
        });
      }
      await pinned.free();
      const mapped = await mm.mempin(owner.subarray(1024), base + 8192n, 8192, { mapped: true });
      expect(mapped).toBeInstanceOf(MappedMemory);
      expect(mapped.devicePointer).not.toBe(0n);
      await mapped.free();
      await expect(mm.mempin(owner, base + 8n, owner.byteLength)).rejects.toMatchObject({ code: 'BEYOND_ALLOCATION', errorCode: 2 });
    });

    it('lets a HostOnly subclass add device memory only, with host memory, reset and deferCleanup inherited', async () => {
      const mm = new HostOnlyTestManager({ device: 0, backend });
      await mm.initialize();
      const host = await mm.memhostalloc(5000, { mapped: true });
      new Uint8Array((host as MappedMemory).buffer!)[4999] = 7;
      using _hold = mm.deferCleanup();
      expect((await mm.memalloc(64)).pointer).toBe(0x1000n);
      await mm.reset();
      expect((host as MappedMemory).buffer!.byteLength).toBe(0);
      await host.free();
    });
  });

  describe('choosing the manager', () => {
    it('uses the class setMemoryManager() names, and refuses a change once memory was allocated', async () => {
      setMemoryManager(HostOnlyTestManager);
      const context = await Context.create(config());
      try {
        expect(JSON.parse(context.report()).manager).toBe('HostOnlyTestManager');
        await context.memalloc(64);
        expect(() => setMemoryManager(VmmdMemoryManager)).toThrow(expect.objectContaining({ code: 'MANAGER_IN_USE', errorCode: 2 }));
      } finally {
        await context.close();
      }
    });

    it('loads the module VMMD_MEMORY_MANAGER names, and warns when setMemoryManager() overrides it', async () => {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-plugin-'));
      const module = path.join(dir, 'plugin.js');
      const clientPath = path.join(ROOT, 'dist', 'client', 'index.js');
      fs.writeFileSync(
        module,
        `const { VmmdMemoryManager } = require(${JSON.stringify(clientPath)});\n` +
          `class PluginManager extends VmmdMemoryManager {}\nexports._numba_memory_manager = PluginManager;\n`,
      );
      process.env[MEMORY_MANAGER_VARIABLE] = module;
      const context = await Context.create(config());
      expect(JSON.parse(context.report()).manager).toBe('PluginManager');
      await context.close();
      const warn = jest.spyOn(process, 'emitWarning').mockImplementation(() => undefined);
      setMemoryManager(HostOnlyTestManager);
      expect(warn).toHaveBeenCalledWith(expect.stringContaining(`overrides ${MEMORY_MANAGER_VARIABLE}`), 'VmmdMemoryManagerWarning');
      warn.mockRestore();
      fs.rmSync(dir, { recursive: true, force: true });
    });
  });

  describe('Config and Context', () => {
    it('freezes the config once a context uses it, and picks devices by #k or name', async () => {
      const { devices } = await client.devices.listDevices();
      const cfg = config().setDevice('#0').setProfiling(true);
      const context = await Context.create(cfg);
      expect(() => cfg.setLogging(true)).toThrow(expect.objectContaining({ code: 'CONFIG_FROZEN', errorCode: 2 }));
      await context.close();
      const byName = await Context.create(config().setDevice(devices[0].name.slice(2, 9)));
      expect(byName.device).toBe(0);
      await byName.close();
      await expect(Context.create(config().setDevice('#99'))).rejects.toMatchObject({ code: 'BAD_DEVICE', errorCode: 2 });
      await expect(Context.create(config().setDevice('no such device'))).rejects.toMatchObject({ code: 'BAD_DEVICE' });
      expect(() => new Config().setUnifiedMemory(5 as 0)).toThrow(expect.objectContaining({ code: 'BAD_CONFIG' }));
      expect(() => new Config().setDeferredFree({ ratio: 2 })).toThrow(expect.objectContaining({ code: 'BAD_CONFIG' }));
    });

    it('reports allocations, pool occupancy and per-operation profiles; clears caches; closes to nothing', async () => {
      const before = await daemon.stats();
      const lines: string[] = [];
      const context = await Context.create(
        config()
          .setProfiling(true)
          .setLogging(true)
          .setLogger((line) => lines.push(line)),
      );
      const a = await context.memalloc(1000);
      await context.memalloc(2000);
      await context.free(a);
      await context.sync();
      const report = JSON.parse(context.report());
      expect(report.pool).toMatchObject({ chunks: 1, blocks: 2 });
      expect(report.pendingFrees.frees).toBe(1);
      expect(report.profiling.memalloc.count).toBe(2);
      expect(report.profiling.free.count).toBe(1);
      expect(lines.some((line) => line.startsWith('vmmd: memalloc ok'))).toBe(true);
      await context.clearCaches();
      expect(JSON.parse(context.report()).pool.blocks).toBe(1);
      await context.close();
      await expect(context.memalloc(1)).rejects.toMatchObject({ code: 'CONTEXT_CLOSED', errorCode: 2 });
      const after = await daemon.stats();
      expect({ allocations: after.allocations, allocatedBytes: after.allocatedBytes }).toEqual({
        allocations: before.allocations,
        allocatedBytes: before.allocatedBytes,
      });
    });

    it('gives cached chunks back to the daemon on clearCaches()', async () => {
      const context = await Context.create(config());
      const pointer = await context.memalloc(1000);
      const leased = (await daemon.stats()).allocations;
      await context.free(pointer);
      await context.clearCaches();
      expect(BigInt((await daemon.stats()).allocations)).toBe(BigInt(leased) - 1n);
      await context.close();
    });
  });

  describe('device arrays', () => {
    let context: Context;
    beforeEach(async () => {
      context = await Context.create(
        config()
          .setDebugging(true)
          .setLogger(() => undefined),
      );
    });
    afterEach(async () => {
      await context.close();
    });

    it('hold a typed array with a shape: values() and index()', async () => {
      const array = await context.newArray(Float32Array.from([1, 2, 3, 4, 5, 6]), [2, 3]);
      expect(array.shape).toEqual([2, 3]);
      expect(Array.from(await array.values())).toEqual([1, 2, 3, 4, 5, 6]);
      expect(await array.index(1, 2)).toBe(6);
      expect(await array.index(0, 1)).toBe(2);
      const big = await context.newArray(BigInt64Array.from([1n, -2n, 3n]));
      expect(await big.index(1)).toBe(-2n);
    });

    it('refuse an index outside the shape and a shape that does not fit, as PROGRAM_ERROR with getError()', async () => {
      const array = await context.newArray(Int32Array.from([1, 2, 3, 4]), [2, 2]);
      await expect(array.index(2, 0)).rejects.toMatchObject({ code: 'BAD_INDEX', errorCode: 2 });
      expect(context.getError()).toMatch(/index 2 is outside dimension 0 of extent 2/);
      await expect(array.index(0)).rejects.toMatchObject({ code: 'BAD_INDEX' });
      await expect(context.newArray(Int32Array.from([1, 2, 3]), [2, 2])).rejects.toMatchObject({ code: 'BAD_SHAPE', errorCode: 2 });
    });

    it('count references: memory goes with the last free(), and a freed array refuses use', async () => {
      const manager = context.manager as VmmdMemoryManager;
      const array = await context.newArray(Uint8Array.from([9, 8, 7]));
      array.retain();
      await array.free();
      expect(Array.from(await array.values())).toEqual([9, 8, 7]);
      await array.free();
      await manager.flush();
      expect(manager.stats().pool.blocks).toBe(0);
      await expect(array.values()).rejects.toMatchObject({ code: 'ALREADY_FREED' });
      await expect(array.free()).rejects.toMatchObject({ code: 'ALREADY_FREED' });
    });

    it('wrap existing memory without owning it', async () => {
      const manager = context.manager as VmmdMemoryManager;
      const memory = await context.memalloc(64);
      await context.write(memory.pointer, new Uint8Array(Float64Array.from([0.5, 1.5]).buffer));
      const wrapped = context.wrapArray(memory, Float64Array, [2]);
      expect(Array.from(await wrapped.values())).toEqual([0.5, 1.5]);
      await wrapped.free();
      await manager.flush();
      expect(manager.stats().pool.blocks).toBe(1);
      expect(() => context.wrapArray(memory, Float64Array, [9])).toThrow(expect.objectContaining({ code: 'BAD_SHAPE' }));
    });

    it('work with unified memory 1 (host-located memory on cuda)', async () => {
      const unified = await Context.create(config().setUnifiedMemory(1));
      try {
        const array = await unified.newArray(Float64Array.from([3.25, -1]));
        expect(Array.from(await array.values())).toEqual([3.25, -1]);
      } finally {
        await unified.close();
      }
    });
  });
}
