/**
 * Config and Context in the style of Futhark's C API: a Config is set up,
 * then frozen once a Context uses it; a Context owns a session, one device and
 * its memory manager, remembers the last error (getError), reports itself as
 * JSON (report), gives cached memory back (clearCaches), waits for work in
 * flight (sync) and ends everything (close). Every error it throws is a
 * VmmdError with errorCode PROGRAM_ERROR (2) or OUT_OF_MEMORY (3).
 */
import { status as Status } from '@grpc/grpc-js';
import { connect, VmmdClient } from './connection';
import { ArrayContext, DeviceArray, TypedArray, TypedArrayClass } from './device-array';
import { VmmdError } from './errors';
import type { BaseMemoryManager } from './emm/base';
import { DEFAULT_DEFERRED_FREE, DeferredFreeSettings } from './emm/deallocations';
import type { MemoryPointer } from './emm/memory';
import { createMemoryManager } from './emm/plugin';
import { DEFAULT_POOL, PoolSettings } from './emm/pool';
import { AheadSettings, checkAhead, DEFAULT_AHEAD } from './emm/ahead';
import { VmmdManagerContext, VmmdMemoryManager } from './emm/vmmd-manager';

/** Futhark's unified memory setting: 0 never, 1 always, 2 where the device supports it (the default). */
export type UnifiedMemory = 0 | 1 | 2;

export interface ConfigSettings {
  device: string;
  logging: boolean;
  debugging: boolean;
  profiling: boolean;
  unifiedMemory: UnifiedMemory;
  pool: PoolSettings;
  deferredFree: DeferredFreeSettings;
  ahead: AheadSettings;
  socketDir?: string;
  log: (line: string) => void;
}

const badConfig = (message: string) => new VmmdError('BAD_CONFIG', Status.INVALID_ARGUMENT, message);

export class Config {
  private readonly values: ConfigSettings = {
    device: '',
    logging: false,
    debugging: false,
    profiling: false,
    unifiedMemory: 2,
    pool: DEFAULT_POOL,
    deferredFree: DEFAULT_DEFERRED_FREE,
    ahead: DEFAULT_AHEAD,
    log: (line) => process.stderr.write(`${line}\n`),
  };
  private frozen = false;

  /** The settings as they stand (a copy). */
  get settings(): Readonly<ConfigSettings> {
    return { ...this.values };
  }

  get isFrozen(): boolean {
    return this.frozen;
  }

  /** "#k" for device k, or a substring of the device's name; "" for the first device. */
  setDevice(spec: string): this {
    return this.set('device', spec);
  }

  setLogging(on: boolean): this {
    return this.set('logging', on);
  }

  /** Logging, plus a check of the pool's invariant after every change. */
  setDebugging(on: boolean): this {
    return this.set('debugging', on);
  }

  /** Counts and times every operation, for report(). */
  setProfiling(on: boolean): this {
    return this.set('profiling', on);
  }

  /**
   * 0: device memory; 1: host-located memory the device and the CPU both reach
   * (HOST_NUMA on cuda); 2: device memory, as VMM has no managed memory.
   */
  setUnifiedMemory(mode: UnifiedMemory): this {
    if (mode !== 0 && mode !== 1 && mode !== 2) throw badConfig(`unified memory ${mode} is not 0, 1 or 2`);
    return this.set('unifiedMemory', mode);
  }

  setPool(settings: Partial<PoolSettings>): this {
    const pool = { ...this.values.pool, ...settings };
    if (pool.chunkSize <= 0n) throw badConfig(`pool chunk size ${pool.chunkSize} must be greater than 0`);
    if (pool.largeThreshold <= 0n || pool.largeThreshold > pool.chunkSize) {
      throw badConfig(`pool large threshold ${pool.largeThreshold} must be above 0 and at most the chunk size ${pool.chunkSize}`);
    }
    return this.set('pool', pool);
  }

  setDeferredFree(settings: Partial<DeferredFreeSettings>): this {
    const deferred = { ...this.values.deferredFree, ...settings };
    if (!Number.isInteger(deferred.count) || deferred.count < 0) throw badConfig(`deferred free count ${deferred.count} must be an integer >= 0`);
    if (!(deferred.ratio >= 0 && deferred.ratio <= 1)) throw badConfig(`deferred free ratio ${deferred.ratio} must be within [0, 1]`);
    return this.set('deferredFree', deferred);
  }

  /**
   * Allocations received ahead of need, for sizes asked for repeatedly: `depth` per size, at most `maxBytes` held
   * in all (0: none), each given back after `idleMs` unused.
   * @throws VmmdError INVALID_ARGUMENT BAD_CONFIG for a value out of its range
   */
  setAhead(settings: Partial<AheadSettings>): this {
    return this.set('ahead', checkAhead({ ...this.values.ahead, ...settings }));
  }

  setSocketDir(dir: string): this {
    return this.set('socketDir', dir);
  }

  /** Where log lines go (default: stderr). */
  setLogger(log: (line: string) => void): this {
    return this.set('log', log);
  }

  /** @internal A context uses the config: from now on it is read-only. */
  freeze(): void {
    this.frozen = true;
  }

  private set<K extends keyof ConfigSettings>(key: K, value: ConfigSettings[K]): this {
    if (this.frozen) {
      throw new VmmdError('CONFIG_FROZEN', Status.FAILED_PRECONDITION, `the config is in use by a context; ${key} can no longer change`);
    }
    this.values[key] = value;
    return this;
  }
}

interface OperationProfile {
  count: number;
  totalUs: number;
  maxUs: number;
}

export class Context implements ArrayContext {
  private lastError: string | null = null;
  private readonly profile = new Map<string, OperationProfile>();
  // Invariant: every operation started through run() and not yet settled.
  private readonly inFlight = new Set<Promise<unknown>>();
  private closed = false;

  private constructor(
    readonly config: Readonly<ConfigSettings>,
    readonly client: VmmdClient,
    readonly device: number,
    readonly deviceName: string,
    readonly manager: BaseMemoryManager,
  ) {}

  /**
   * Connects, picks the device, and makes and initializes the memory manager
   * (the one setMemoryManager or VMMD_MEMORY_MANAGER chose, else vmmd's). Freezes `config`.
   * @throws VmmdError BAD_DEVICE when no device matches; DAEMON_UNREACHABLE
   */
  static async create(config: Config = new Config()): Promise<Context> {
    config.freeze();
    const settings = config.settings;
    const client = await connect({ socketDir: settings.socketDir });
    try {
      const { devices, backend } = await client.devices.listDevices();
      const device = Context.pickDevice(settings.device, devices);
      const managerContext: VmmdManagerContext = {
        device: device.index,
        backend: backend === 'cuda' ? 'cuda' : 'host',
        client,
        pool: settings.pool,
        deferred: settings.deferredFree,
        ahead: settings.ahead,
        unified: settings.unifiedMemory === 1,
        checks: settings.debugging,
      };
      const manager = createMemoryManager(managerContext, VmmdMemoryManager);
      await manager.initialize();
      const context = new Context(settings, client, device.index, device.name, manager);
      context.log(`context on device ${device.index} (${device.name}), ${backend} backend, manager ${manager.constructor.name}`);
      return context;
    } catch (error) {
      client.close();
      throw VmmdError.from(error);
    }
  }

  private static pickDevice(spec: string, devices: Array<{ index: number; name: string }>): { index: number; name: string } {
    if (devices.length === 0) throw new VmmdError('BAD_DEVICE', Status.FAILED_PRECONDITION, 'the daemon has no device');
    if (spec === '') return devices[0];
    const numbered = /^#(\d+)$/.exec(spec);
    const found = numbered ? devices.find((device) => device.index === Number(numbered[1])) : devices.find((device) => device.name.includes(spec));
    if (found === undefined) {
      throw new VmmdError(
        'BAD_DEVICE',
        Status.NOT_FOUND,
        `no device matches ${JSON.stringify(spec)} (devices: ${devices.map((device) => `#${device.index} ${device.name}`).join(', ')})`,
      );
    }
    return found;
  }

  /** The last error's message, once: the next call returns null (futhark_context_get_error). */
  getError(): string | null {
    const error = this.lastError;
    this.lastError = null;
    return error;
  }

  /** @internal Records an error raised outside run() (arrays' own checks) and returns it. */
  noteError(operation: string, error: VmmdError): VmmdError {
    this.lastError = `${operation}: ${error.message}`;
    this.log(`${operation} failed: ${error.code}: ${error.message}`);
    return error;
  }

  /** Device memory of `size` bytes. @throws VmmdError (errorCode 3 when out of memory) */
  memalloc(size: bigint | number): Promise<MemoryPointer> {
    return this.run('memalloc', () => this.manager.memalloc(size));
  }

  /** Frees memory from memalloc (through the manager's deferred frees). */
  free(memory: MemoryPointer): Promise<void> {
    return this.run('free', async () => {
      await memory.free();
    });
  }

  /** A device array holding a copy of `data`, of the given shape (default: one dimension). */
  newArray<T extends TypedArray>(data: T, shape: readonly number[] = [data.length]): Promise<DeviceArray<T>> {
    return this.run('newArray', async () => {
      const elements = shape.reduce((product, extent) => product * extent, 1);
      if (shape.some((extent) => !Number.isInteger(extent) || extent < 0) || elements !== data.length) {
        throw new VmmdError('BAD_SHAPE', Status.INVALID_ARGUMENT, `shape [${shape.join(', ')}] does not hold ${data.length} elements`);
      }
      const memory = await this.manager.memalloc(Math.max(1, data.byteLength));
      try {
        if (data.byteLength > 0) await this.write(memory.pointer, new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
      } catch (error) {
        await memory.free();
        throw error;
      }
      return new DeviceArray<T>(this, memory, data.constructor as TypedArrayClass<T>, shape, true);
    });
  }

  /** A device array over memory that already exists; free() never frees that memory. */
  wrapArray<T extends TypedArray>(memory: MemoryPointer, dtype: TypedArrayClass<T>, shape: readonly number[]): DeviceArray<T> {
    const elements = shape.reduce((product, extent) => product * extent, 1);
    if (BigInt(elements * dtype.BYTES_PER_ELEMENT) > memory.size) {
      throw this.noteError(
        'wrapArray',
        new VmmdError('BAD_SHAPE', Status.OUT_OF_RANGE, `shape [${shape.join(', ')}] of ${dtype.name} needs more than the ${memory.size} bytes given`),
      );
    }
    return new DeviceArray<T>(this, memory, dtype, shape, false);
  }

  /** @internal Bytes at a device pointer, for arrays. */
  read(pointer: bigint, length: number): Promise<Buffer> {
    return this.run('read', () => this.dataPath().read(pointer, length));
  }

  /** @internal Bytes to a device pointer, for arrays. */
  write(pointer: bigint, data: Uint8Array): Promise<void> {
    return this.run('write', () => this.dataPath().write(pointer, data));
  }

  /** Runs pending frees and gives cached chunks back to the daemon (futhark_context_clear_caches). */
  clearCaches(): Promise<void> {
    return this.run('clearCaches', async () => {
      if (this.manager instanceof VmmdMemoryManager) await this.manager.clearCaches();
    });
  }

  /** Waits for every operation in flight to settle (futhark_context_sync). */
  async sync(): Promise<void> {
    while (this.inFlight.size > 0) await Promise.allSettled([...this.inFlight]);
  }

  /** The context as JSON: device, allocations, pool occupancy, and per-operation counts and latency when profiling. */
  report(): string {
    const manager = this.manager instanceof VmmdMemoryManager ? this.manager.stats() : undefined;
    return JSON.stringify(
      {
        device: { index: this.device, name: this.deviceName, backend: this.client.backend },
        manager: this.manager.constructor.name,
        allocations: manager ? { pooledBlocks: manager.pool.blocks, large: manager.large.allocations, largeBytes: manager.large.bytes } : undefined,
        pool: manager?.pool,
        pendingFrees: manager?.pending,
        counters: manager?.counters,
        profiling: this.config.profiling
          ? Object.fromEntries(
              [...this.profile].map(([operation, entry]) => [
                operation,
                { count: entry.count, totalUs: Math.round(entry.totalUs), meanUs: +(entry.totalUs / entry.count).toFixed(1), maxUs: Math.round(entry.maxUs) },
              ]),
            )
          : undefined,
      },
      null,
      2,
    );
  }

  /** Waits for work in flight, frees everything the manager holds, and ends the session. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await this.sync();
    try {
      await this.manager.reset();
    } finally {
      this.client.close();
    }
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }

  private dataPath(): VmmdMemoryManager {
    if (!(this.manager instanceof VmmdMemoryManager)) {
      throw new VmmdError('NO_DATA_PATH', Status.FAILED_PRECONDITION, `arrays need vmmd's memory manager, not ${this.manager.constructor.name}`);
    }
    return this.manager;
  }

  private log(line: string): void {
    if (this.config.logging || this.config.debugging) this.config.log(`vmmd: ${line}`);
  }

  /** Every operation goes through here: closed check, profiling, logging, and the last error. */
  private run<T>(operation: string, body: () => Promise<T>): Promise<T> {
    if (this.closed) {
      return Promise.reject(this.noteError(operation, new VmmdError('CONTEXT_CLOSED', Status.FAILED_PRECONDITION, `${operation} on a closed context`)));
    }
    const start = performance.now();
    const promise = (async () => {
      try {
        const result = await body();
        this.log(`${operation} ok`);
        return result;
      } catch (error) {
        throw this.noteError(operation, VmmdError.from(error));
      } finally {
        if (this.config.profiling) {
          const elapsed = (performance.now() - start) * 1000;
          const entry = this.profile.get(operation) ?? { count: 0, totalUs: 0, maxUs: 0 };
          entry.count++;
          entry.totalUs += elapsed;
          entry.maxUs = Math.max(entry.maxUs, elapsed);
          this.profile.set(operation, entry);
        }
      }
    })();
    this.inFlight.add(promise);
    void promise.then(
      () => this.inFlight.delete(promise),
      () => this.inFlight.delete(promise),
    );
    return promise;
  }
}
