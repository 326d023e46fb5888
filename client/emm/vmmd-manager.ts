/**
 * The vmmd memory manager: NBEP 7 over the daemon. memalloc carves pooled
 * chunks the session leases from the daemon (each mapped into this process
 * once); requests above the large threshold get an allocation of their own.
 * Frees go through Numba's deferred strategy; chunks go back to the daemon on
 * clearCaches() or reset(), and with the session if the process dies; the
 * leasing and giving back itself is ./leases.ts.
 */
import { status as Status } from '@grpc/grpc-js';
import type { VmmdClient } from '../connection';
import { VmmdError } from '../errors';
import { CudaImportedMemory, type ImportedMemory } from '../local-memory';
import { native } from '../../native/client';
import { AheadSettings, DEFAULT_AHEAD } from './ahead';
import { DaemonLeases, Lease, Location } from './leases';
import { HostAllocOptions, HostOnlyMemoryManager } from './base';
import { DEFAULT_DEFERRED_FREE, DeferredFreeSettings } from './deallocations';
import { IpcHandle, ManagerContext, MappedMemory, MemoryInfo, MemoryPointer, PinnedMemory } from './memory';
import { noteAllocation } from './plugin';
import { Chunk, DEFAULT_POOL, Pool, PoolBlock, PoolSettings, sizeClassBytes } from './pool';
import { PreparedOffload, Sleeper, SleepOptions, SleepReport, WakeOptions, WakeReport } from '../sleep-wake';
import { PoolSleep } from './pool-sleep';

export interface VmmdManagerContext extends ManagerContext {
  readonly client: VmmdClient;
  readonly pool?: PoolSettings;
  readonly deferred?: DeferredFreeSettings;
  /** Allocations received ahead of need for sizes asked for repeatedly (./ahead.ts); maxBytes 0 turns them off. */
  readonly ahead?: AheadSettings;
  /** Create device memory host-located (HOST_NUMA), reachable by the CPU too: unified memory 1. */
  readonly unified?: boolean;
  /** Check the pool's invariant after every change (debugging). */
  readonly checks?: boolean;
  /** Registers the pool under this tag with the client (client.sleep(tag), client.wake(tag)). */
  readonly tag?: string;
  /**
   * Makes each chunk's and large allocation's host copy for an offload sleep ahead, as it is leased, and keeps it
   * while awake (client/sleep-wake.ts, TagOptions.prepareOffload): the first sleep costs the copy alone; host memory
   * as large as the pool is held and charged meanwhile.
   */
  readonly prepareOffload?: boolean;
}

export interface ManagerStats {
  pool: { chunks: number; bytes: string; used: string; blocks: number };
  large: { allocations: number; bytes: string };
  host: { allocations: number };
  pending: { frees: number; bytes: string };
  ahead: { allocations: number; bytes: string; arriving: number; requested: number; taken: number; expired: number; refused: number; dropped: number };
  counters: Record<string, number>;
}

const isOutOfMemory = (error: unknown) => error instanceof VmmdError && error.status === Status.RESOURCE_EXHAUSTED;

export class VmmdMemoryManager extends HostOnlyMemoryManager implements Sleeper {
  private readonly client: VmmdClient;
  private readonly settings: PoolSettings;
  // Requests up to this many bytes come from the pool (the threshold as a number, for the hot path).
  private readonly largeThresholdBytes: number;
  private readonly pool = new Pool<Lease>();
  // Invariant: every large allocation handed out and not yet given back, by address.
  private readonly large = new Map<bigint, Lease>();
  // Invariant: every memhostalloc allocation not yet given back, by address.
  private readonly hostLeases = new Map<bigint, Lease>();
  // Invariant: the mappings openIpcHandle made and free() has not yet closed; read and write reach them.
  private readonly opened = new Set<ImportedMemory>();
  // This manager's allocations of the daemon: leased, given back, and what is in flight of that.
  private readonly leases: DaemonLeases;
  private initialized?: Promise<void>;
  // The chunk lease in progress: concurrent requests that find no room wait for it rather than lease their own.
  private leasing?: Promise<void>;
  private granularity = 0n;
  private hostNumaId = 0;
  // reset() starts a new generation: finalizers of earlier pointers then do nothing.
  private generation = 0;
  // The local device of the chunks when they are device memory (CUDA mappings), else undefined (host memory).
  private mappedDevice?: number;
  // Sleep and wake of the chunks and large allocations, and leases given back meanwhile.
  private readonly sleeper: PoolSleep;
  readonly counters = { memalloc: 0, pooled: 0, large: 0, chunksLeased: 0, chunksReturned: 0, frees: 0, outOfMemoryRetries: 0 };

  constructor(override readonly context: VmmdManagerContext) {
    super(context, context.deferred ?? DEFAULT_DEFERRED_FREE);
    this.client = context.client;
    this.settings = context.pool ?? DEFAULT_POOL;
    this.largeThresholdBytes = Number(this.settings.largeThreshold);
    this.leases = new DaemonLeases(this.client, context.ahead ?? DEFAULT_AHEAD);
    // Frees carry no stream: a kernel queued before one may still use its block, so a batch of frees waits
    // for the device's work (as cuMemFree does for Numba's own manager) before blocks go back to the pool.
    this.deallocations.beforeBatch = () => (this.mappedDevice === undefined ? Promise.resolve() : native.cudaSynchronize(this.mappedDevice));
    if (context.tag !== undefined) context.client.tags.register(context.tag, this);
    this.sleeper = new PoolSleep(this.client, context.tag ?? 'pool', context.prepareOffload === true, this.leases, () => this.sleepingLeases());
  }

  /** What the pool holds ahead for its next offload (prepareOffload), or undefined without it. */
  get prepared(): PreparedOffload | undefined {
    return this.sleeper.prepared;
  }

  get asleep(): boolean {
    return this.sleeper.asleep;
  }

  /**
   * Puts the pool to sleep: pending frees run and empty chunks go back, then
   * every chunk and large allocation sleeps at its address (./pool-sleep.ts).
   * Blocks stay as they were; memalloc refuses (ASLEEP) until wake(); frees are
   * taken (one during the sleep or a wake is done once that has ended).
   * @throws VmmdError FAILED_PRECONDITION ASLEEP; the offload's refusals (awake and unchanged then)
   */
  async sleep(options: SleepOptions = {}): Promise<SleepReport> {
    if (this.sleeper.asleep) throw new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, 'the pool sleeps already');
    await this.initialize();
    await this.makeRoom();
    return this.sleeper.sleep(options);
  }

  /**
   * Wakes the pool at the same addresses, all of its memory as one request to the daemon.
   * @throws VmmdError FAILED_PRECONDITION ASLEEP (awake); RESOURCE_EXHAUSTED OUT_OF_MEMORY (still asleep and intact)
   */
  wake(options: WakeOptions = {}): Promise<WakeReport> {
    return this.sleeper.wake(options);
  }

  private sleepingLeases(): Lease[] {
    return [...this.pool.chunks.map((chunk) => chunk.lease), ...this.large.values()];
  }

  /** Reads the device's size and granularity once; later calls return at once. */
  override initialize(): Promise<void> {
    this.initialized ??= (async () => {
      const info = await this.client.devices.getMemoryInfo({ device: this.context.device });
      this.deallocations.capacity = BigInt(info.totalBytes);
      const { devices } = await this.client.devices.listDevices();
      this.hostNumaId = Math.max(0, devices[this.context.device]?.hostNumaId ?? 0);
      const granularity = await this.client.devices.getGranularity({ location: this.location() });
      this.granularity = BigInt(granularity.minimum);
    })().catch((error) => {
      this.initialized = undefined;
      throw VmmdError.from(error);
    });
    return this.initialized;
  }

  /**
   * Device memory of `size` bytes, 256-byte aligned.
   * @throws VmmdError INVALID_ARGUMENT ZERO_SIZE; RESOURCE_EXHAUSTED (errorCode OUT_OF_MEMORY) when even
   *   after flushing deferred frees and returning empty chunks there is no room
   */
  memalloc(size: bigint | number): Promise<MemoryPointer> {
    // The hot path: a block of a chunk already held, with no await and no bigint arithmetic.
    if (this.granularity !== 0n && !this.sleeper.asleep) {
      const bytes = Number(size);
      const rounded = sizeClassBytes(bytes);
      if (bytes > 0 && rounded <= this.largeThresholdBytes) {
        const block = this.pool.takeClass(rounded);
        if (block !== undefined) {
          this.counters.memalloc++;
          noteAllocation();
          return Promise.resolve(this.pooledPointer(block, typeof size === 'bigint' ? size : BigInt(size)));
        }
      }
    }
    return this.memallocSlow(BigInt(size));
  }

  private async memallocSlow(bytes: bigint): Promise<MemoryPointer> {
    if (bytes <= 0n) throw new VmmdError('ZERO_SIZE', Status.INVALID_ARGUMENT, `memalloc size ${bytes} must be greater than 0`);
    if (this.sleeper.asleep) throw new VmmdError('ASLEEP', Status.FAILED_PRECONDITION, `memalloc of ${bytes} bytes: the pool sleeps; wake it first`);
    await this.initialize();
    this.counters.memalloc++;
    noteAllocation();
    return this.withRoomRetry(() => this.allocate(bytes));
  }

  /**
   * `attempt`, and once more if it ran out of memory, as Numba does: after the
   * pending frees ran and what is cached (empty chunks, allocations ahead) went
   * back; nothing is asked for ahead meanwhile.
   */
  private async withRoomRetry<T>(attempt: () => Promise<T>): Promise<T> {
    try {
      return await attempt();
    } catch (error) {
      if (!isOutOfMemory(error)) throw VmmdError.from(error);
      this.counters.outOfMemoryRetries++;
      const resume = this.leases.ahead.pause();
      try {
        await this.makeRoom();
        return await attempt();
      } finally {
        resume();
      }
    }
  }

  /** Runs pending frees, gives back empty chunks and what is held ahead; resolves once the daemon has it back. */
  private async makeRoom(): Promise<void> {
    await this.deallocations.flush();
    await this.releaseEmptyChunks();
    await this.leases.ahead.dropAll();
    // Memory freed here stays in use until its unmap completes, and counts in the daemon until its release is answered.
    await this.leases.settle();
  }

  /** Host memory from the daemon (shareable), mapped here with CPU access. */
  override async memhostalloc(size: bigint | number, options: HostAllocOptions = {}): Promise<MappedMemory | PinnedMemory> {
    const bytes = BigInt(size);
    if (bytes <= 0n) throw new VmmdError('ZERO_SIZE', Status.INVALID_ARGUMENT, `memhostalloc size ${bytes} must be greater than 0`);
    await this.initialize();
    noteAllocation();
    const location =
      this.context.backend === 'cuda'
        ? { type: 'LOCATION_TYPE_HOST_NUMA' as const, id: this.hostNumaId }
        : { type: 'LOCATION_TYPE_DEVICE' as const, id: this.context.device };
    const granularity = BigInt((await this.client.devices.getGranularity({ location })).minimum);
    const rounded = ((bytes + granularity - 1n) / granularity) * granularity;
    const lease = await this.withRoomRetry(() => this.leases.lease(rounded, location));
    this.hostLeases.set(lease.memory.address, lease);
    const generation = this.generation;
    const finalizer = () => {
      this.counters.frees++;
      return this.deallocations.add(() => this.giveBack(generation, lease), bytes);
    };
    let buffer: ArrayBuffer | undefined;
    try {
      buffer = lease.memory.buffer;
    } catch {
      buffer = undefined; // device memory without a CPU view
    }
    return options.mapped
      ? new MappedMemory(this.context, lease.memory.address, bytes, lease, finalizer, buffer)
      : new PinnedMemory(this.context, lease.memory.address, bytes, lease, finalizer, buffer);
  }

  /**
   * What another process needs to open `memory`: the chunk's allocation, a share key, and the offset.
   * @throws VmmdError FAILED_PRECONDITION NOT_MANAGED when the memory is not this manager's
   */
  async getIpcHandle(memory: MemoryPointer): Promise<IpcHandle> {
    const found = this.find(memory.pointer);
    if (found === undefined) {
      throw new VmmdError('NOT_MANAGED', Status.FAILED_PRECONDITION, `0x${memory.pointer.toString(16)} is not memory of this manager`);
    }
    const { lease, base } = found;
    lease.shareKey ??= (await this.client.vmm.share({ allocationId: lease.allocationId })).shareKey;
    const { devices } = await this.client.devices.listDevices();
    return {
      allocationId: String(lease.allocationId),
      offset: String(memory.pointer - base),
      size: String(memory.size),
      device: this.context.device,
      deviceUuid: devices[this.context.device]?.uuid ?? '',
      shareKey: lease.shareKey,
    };
  }

  /**
   * Opens another process's IPC handle: maps its allocation here and points at
   * the offset. free() unmaps it.
   */
  async openIpcHandle(handle: IpcHandle): Promise<MemoryPointer> {
    const memory = await this.client.vmm.import(handle.allocationId, { shareKey: handle.shareKey });
    this.opened.add(memory);
    return new MemoryPointer(this.context, memory.address + BigInt(handle.offset), BigInt(handle.size), memory, async () => {
      this.opened.delete(memory);
      this.leases.unmapInBackground(memory);
    });
  }

  /** The IPC-opened mapping holding `pointer`, and the pointer's offset in it. */
  private findOpened(pointer: bigint): { memory: ImportedMemory; offset: bigint } | undefined {
    for (const memory of this.opened) {
      if (pointer >= memory.address && pointer < memory.address + memory.size) return { memory, offset: pointer - memory.address };
    }
    return undefined;
  }

  /** The device's free and total bytes, as the daemon accounts them. */
  async getMemoryInfo(): Promise<MemoryInfo> {
    const info = await this.client.devices.getMemoryInfo({ device: this.context.device });
    return { free: BigInt(info.freeBytes), total: BigInt(info.totalBytes) };
  }

  /** Frees everything: host memory, pooled chunks, large allocations. Earlier pointers become inert. */
  override async reset(): Promise<void> {
    await super.reset();
    this.generation++;
    const leases = [...this.pool.chunks.map((chunk) => chunk.lease), ...this.large.values(), ...this.hostLeases.values()];
    this.pool.chunks.length = 0;
    this.large.clear();
    this.hostLeases.clear();
    for (const lease of leases) this.sleeper.giveBack(lease);
    await this.leases.ahead.dropAll();
    await this.leases.settle();
    this.sleeper.reset();
  }

  /** Runs pending frees and gives empty chunks and allocations held ahead back to the daemon; resolves once their memory is unmapped here. */
  async clearCaches(): Promise<void> {
    await this.makeRoom();
  }

  /** Runs pending frees (unless deferCleanup holds them); resolves once their memory is unmapped here. */
  async flush(): Promise<void> {
    await this.deallocations.flush();
    await this.leases.settle();
  }

  /** Copies bytes into managed memory at a device pointer. */
  async write(pointer: bigint, data: Uint8Array): Promise<void> {
    const found = this.find(pointer);
    if (found !== undefined) return found.lease.memory.write(pointer - found.base, data);
    const opened = this.findOpened(pointer);
    if (opened !== undefined) return opened.memory.write(opened.offset, data);
    if (this.context.backend === 'cuda') return native.cudaCopyToDevice(this.context.device, pointer, Buffer.from(data));
    throw new VmmdError('NOT_MANAGED', Status.FAILED_PRECONDITION, `0x${pointer.toString(16)} is not memory of this manager`);
  }

  /** Copies bytes out of managed memory at a device pointer. */
  async read(pointer: bigint, length: bigint | number): Promise<Buffer> {
    const found = this.find(pointer);
    if (found !== undefined) return found.lease.memory.read(pointer - found.base, length);
    const opened = this.findOpened(pointer);
    if (opened !== undefined) return opened.memory.read(opened.offset, length);
    if (this.context.backend === 'cuda') return native.cudaCopyFromDevice(this.context.device, pointer, BigInt(length));
    throw new VmmdError('NOT_MANAGED', Status.FAILED_PRECONDITION, `0x${pointer.toString(16)} is not memory of this manager`);
  }

  stats(): ManagerStats {
    const pool = this.pool.occupancy();
    let largeBytes = 0n;
    for (const lease of this.large.values()) largeBytes += lease.memory.size;
    return {
      pool: { chunks: pool.chunks, bytes: String(pool.bytes), used: String(pool.used), blocks: pool.blocks },
      large: { allocations: this.large.size, bytes: String(largeBytes) },
      host: { allocations: this.hostLeases.size },
      pending: { frees: this.deallocations.pendingCount, bytes: String(this.deallocations.pendingBytes) },
      ahead: {
        allocations: this.leases.ahead.held,
        bytes: String(this.leases.ahead.heldBytes),
        arriving: this.leases.ahead.arriving,
        ...this.leases.ahead.counters,
      },
      counters: { ...this.counters },
    };
  }

  private location(): Location {
    return this.context.unified && this.context.backend === 'cuda'
      ? { type: 'LOCATION_TYPE_HOST_NUMA' as const, id: this.hostNumaId }
      : { type: 'LOCATION_TYPE_DEVICE' as const, id: this.context.device };
  }

  private roundToGranularity(bytes: bigint): bigint {
    return ((bytes + this.granularity - 1n) / this.granularity) * this.granularity;
  }

  private async allocate(bytes: bigint): Promise<MemoryPointer> {
    const generation = this.generation;
    if (sizeClassBytes(Number(bytes)) > this.largeThresholdBytes) {
      const lease = await this.leases.lease(this.roundToGranularity(bytes), this.location());
      if (lease.memory instanceof CudaImportedMemory) this.mappedDevice = lease.memory.device;
      this.sleeper.joined(lease.memory);
      this.large.set(lease.memory.address, lease);
      this.counters.large++;
      const finalizer = () => {
        this.counters.frees++;
        return this.deallocations.add(() => this.giveBackLarge(generation, lease), lease.memory.size);
      };
      return new MemoryPointer(this.context, lease.memory.address, bytes, lease, finalizer);
    }
    let block = this.pool.take(Number(bytes));
    while (block === undefined) {
      if (this.leasing === undefined) {
        this.leasing = (async () => {
          const lease = await this.leases.lease(this.roundToGranularity(this.settings.chunkSize), this.location());
          if (lease.memory instanceof CudaImportedMemory) this.mappedDevice = lease.memory.device;
          this.counters.chunksLeased++;
          this.sleeper.joined(lease.memory);
          this.pool.add(new Chunk(lease, lease.memory.address, lease.memory.size));
        })().finally(() => {
          this.leasing = undefined;
        });
      }
      await this.leasing;
      block = this.pool.take(Number(bytes));
    }
    return this.pooledPointer(block, bytes);
  }

  /** The pointer to a pooled block; its free goes through the deferred frees back to the pool. */
  private pooledPointer(block: PoolBlock<Lease>, bytes: bigint): MemoryPointer {
    this.counters.pooled++;
    this.check();
    return new MemoryPointer(this.context, block.chunk.base + BigInt(block.offset), bytes, block.chunk, new PooledFree(this, this.generation, block));
  }

  /** Called by PooledFree when a pooled pointer is freed: the block waits in the deferred frees. */
  freeBlock(pending: PooledFree): Promise<void> {
    this.counters.frees++;
    return this.deallocations.add(pending, pending.block.size);
  }

  /** Called by PooledFree when the deferred frees run: the block goes back to the pool. */
  giveBlock(generation: number, block: PoolBlock<Lease>): void {
    if (generation !== this.generation) return;
    this.pool.give(block);
    this.check();
  }

  private async giveBackLarge(generation: number, lease: Lease): Promise<void> {
    if (generation !== this.generation) return;
    this.large.delete(lease.memory.address);
    this.sleeper.giveBack(lease);
  }

  private async giveBack(generation: number, lease: Lease): Promise<void> {
    if (generation !== this.generation) return;
    this.hostLeases.delete(lease.memory.address);
    this.leases.giveBack(lease);
  }

  private async releaseEmptyChunks(): Promise<void> {
    for (const chunk of [...this.pool.chunks]) {
      if (!chunk.empty) continue;
      this.pool.remove(chunk);
      this.counters.chunksReturned++;
      this.sleeper.giveBack(chunk.lease);
    }
  }

  private find(pointer: bigint): { lease: Lease; base: bigint } | undefined {
    const chunk = this.pool.chunkAt(pointer);
    if (chunk !== undefined) return { lease: chunk.lease, base: chunk.base };
    for (const leases of [this.large, this.hostLeases]) {
      for (const [base, lease] of leases) {
        if (pointer >= base && pointer < base + lease.memory.size) return { lease, base };
      }
    }
    return undefined;
  }

  private check(): void {
    if (this.context.checks) for (const chunk of this.pool.chunks) chunk.check();
  }
}

/**
 * A pooled pointer's finalizer and its place in the deferred frees: one
 * object per allocation, where closures would be two more.
 */
class PooledFree {
  constructor(
    private readonly manager: VmmdMemoryManager,
    private readonly generation: number,
    readonly block: PoolBlock<Lease>,
  ) {}

  /** The pointer was freed (or collected): queue the block. */
  run(): Promise<void> {
    return this.manager.freeBlock(this);
  }

  /** The deferred frees run: the block goes back to the pool. */
  release(): void {
    this.manager.giveBlock(this.generation, this.block);
  }
}
