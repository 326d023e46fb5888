/**
 * Memory created and exported ahead of time: a backend in front of another
 * that keeps, per device and size, a few allocations already created, each
 * with its descriptor already exported. A Create of a stocked size (device
 * memory, descriptor handles) takes one from the shelf and its first Export
 * returns the ready descriptor, so a cold Allocate costs neither driver call
 * on its path; the shelf refills after the reply, off the request's path.
 *
 * Stocked memory is the daemon's, not any session's: it is not in the
 * registry and counts against no quota until a Create takes it. It is given
 * back when memory runs short (a refill stops below REFILL_HEADROOM free
 * sizes, a failed Create empties every shelf of its device) and at close().
 *
 * The ready descriptor a stocked allocation's first export hands out is
 * kept too (a dup, in a bounded ExportedDescriptors): its later exports
 * (Export again, a store's opens) are dups, never a driver export. Taken out
 * before the handle is released, as the cuda backend does with its own.
 *
 * The stock follows what clients ask for too (stock-demand.ts): a size asked
 * often gets a shelf of its own at once, deeper the more it is asked, and any
 * shelf as deep as the bursts its size comes in (fitted at quiet moments),
 * all within a share of the device (DEMAND_SHARE); a size no longer asked
 * loses what the demand gave it. A shelf above a quarter of its depth refills
 * when the daemon is quiet (no Create for QUIET_MS) or MAX_REFILL_DELAY_MS
 * after a take; at a quarter it refills at once, to full, in one burst. Frees
 * are held back the same way (held-releases.ts): the stock's driver work goes
 * in few stretches, after a client's burst rather than beside it.
 */
import type { Logger } from 'pino';
import { closeLater } from '../../common/close-later';
import { defaultExportCacheLimit, DescriptorCalls, ExportedDescriptors, SYSTEM_DESCRIPTORS } from './exported-descriptors';
import { HeldReleases } from './held-releases';
import { PassThroughBackend } from './pass-through';
import { BURST_IDLE_MS, DEMAND_MAX_SHELVES, DEMAND_MIN_COUNT, DEMAND_SHARE, StockDemand } from './stock-demand';
import type { Backend, BackendHandle, HandleKind, ImportedHandle, ImportSource, MemLocation } from './backend';
import {
  CLOSE_WAIT_MS,
  FREE_BYTES_TTL_MS,
  MAX_REFILL_DELAY_MS,
  newShelf,
  QUIET_MS,
  REFILL_AT_FRACTION,
  REFILL_HEADROOM,
  REFILL_PARALLEL,
  shelfKey,
} from './stock-shelves';
import type { Item, Shelf, StockLevel, StockStats } from './stock-shelves';

export type { StockLevel, StockStats } from './stock-shelves';
export { CLOSE_WAIT_MS, MAX_REFILL_DELAY_MS, QUIET_MS, REFILL_AT_FRACTION, REFILL_PARALLEL } from './stock-shelves';
export { RELEASE_HOLD_MAX, RELEASE_HOLD_MIN_BYTES, RELEASE_START_BATCH } from './held-releases';
export {
  BURST_HEADROOM,
  BURST_IDLE_MS,
  BURST_MAX_DEPTH,
  BURST_MEMORY,
  DEMAND_MAX_DEPTH,
  DEMAND_MAX_SHELVES,
  DEMAND_MIN_COUNT,
  DEMAND_SHARE,
  DEMAND_WINDOW,
} from './stock-demand';

const isOutOfMemory = (error: unknown) => {
  const code = (error as { code?: unknown })?.code;
  return code === 'CUDA_ERROR_OUT_OF_MEMORY' || code === 'OUT_OF_MEMORY' || code === 'ENOMEM';
};

export class StockedBackend extends PassThroughBackend {
  // Invariant: one shelf per (device, size) of the levels; items are created, exported, and in no registry.
  private readonly shelves = new Map<string, Shelf>();
  // Invariant: the ready descriptor of every stocked handle handed out and not yet exported nor released.
  private readonly ready = new Map<BackendHandle, number>();
  // Invariant: descriptors of stocked handles handed out, exported and not yet released (bounded, least recently used out first).
  private readonly exported: ExportedDescriptors;
  private closed = false;
  private closing: Promise<void> | undefined;
  // Invariant: the driver work started and not yet settled (frees, refills); close() waits for it.
  private readonly working = new Set<Promise<unknown>>();
  // The last free bytes asked of each device, and when; refills count down what they take.
  private readonly free = new Map<number, { bytes: bigint; at: number }>();
  private readonly counters = { hits: 0, misses: 0, created: 0, refillFailures: 0 };
  private readonly demand = new StockDemand();
  // How the stock copies and closes a descriptor of its own (an import's spare).
  private readonly descriptors: DescriptorCalls;
  // When the last stockable Create came, and when the first refill not yet run was asked for (performance.now()).
  private lastRequestAt = -Infinity;
  private refillAskedAt = 0;
  private refillTimer: NodeJS.Timeout | undefined;
  private idleTimer: NodeJS.Timeout | undefined;
  // The releases held back (at most the demand's share of a device in bytes); empty once closed.
  private readonly held = new HeldReleases(
    (handle, size, imported, device) => this.track(this.releaseNow(handle, size, imported, device)),
    (device) => (this.inner.devices().find((info) => info.index === device)?.totalBytes ?? 0n) / DEMAND_SHARE,
  );

  /**
   * @param closeDescriptor closes a descriptor the stock exported (tests give fakes their own)
   * @param keptDescriptors how the kept exported descriptors are dup'ed and closed, and how many at most (tests give fakes their own)
   */
  constructor(
    inner: Backend,
    levels: StockLevel[],
    private readonly log: Logger,
    // Off the event loop: a stocked descriptor is its memory's last, and its close frees the driver's export object.
    private readonly closeDescriptor: (fd: number) => void | Promise<void> = (fd) => closeLater(fd),
    keptDescriptors: { calls?: DescriptorCalls; limit?: number } = {},
  ) {
    super(inner);
    this.exported = new ExportedDescriptors(keptDescriptors.limit ?? defaultExportCacheLimit(), keptDescriptors.calls);
    this.descriptors = keptDescriptors.calls ?? SYSTEM_DESCRIPTORS;
    for (const device of inner.devices()) {
      for (const level of levels) {
        if (level.depth <= 0 || level.size % device.granularityMinimum !== 0n) continue;
        this.shelves.set(shelfKey(device.index, level.size), newShelf(device.index, level.size, level.depth, level.depth));
      }
    }
  }

  /** Fills every shelf; resolves when they are full (or a refill gave up). */
  async fill(): Promise<void> {
    await Promise.all([...this.shelves.values()].map((shelf) => this.refill(shelf)));
  }

  stats(): StockStats {
    return {
      levels: [...this.shelves.values()].map((shelf) => ({
        device: shelf.device,
        size: String(shelf.size),
        depth: shelf.depth,
        held: shelf.items.length,
        ...(shelf.floor === 0 ? { demand: true as const } : {}),
      })),
      ...this.counters,
    };
  }

  override async create(device: number, location: MemLocation, size: bigint, handleTypes: HandleKind[]): Promise<BackendHandle> {
    const stockable = location.type === 'DEVICE' && handleTypes.length === 1 && handleTypes[0] === 'POSIX_FD';
    // A size just asked often enough for a shelf of its own gets one now, filled at once: until it exists every request
    // of that size is created on its path (a steady stream of a new size never left the daemon quiet long enough).
    if (stockable) this.lastRequestAt = performance.now();
    if (stockable && this.demand.note(device, size) === DEMAND_MIN_COUNT && !this.shelves.has(shelfKey(device, size))) {
      const added = this.addDemandShelf(device, size);
      if (added !== undefined) setImmediate(() => void this.refillBurst(added));
    }
    const shelf = stockable ? this.shelves.get(shelfKey(device, size)) : undefined;
    if (shelf !== undefined) {
      const item = shelf.items.pop();
      // At a quarter of its depth a shelf refills at once, quiet or not: a steady stream must not run it dry.
      if (shelf.items.length * REFILL_AT_FRACTION <= shelf.depth) setImmediate(() => void this.refillBurst(shelf));
      // The quiet moment also fits the shelves to the demand.
      this.refillWhenQuiet();
      if (item !== undefined) {
        this.counters.hits++;
        this.ready.set(item.handle, item.fd);
        return item.handle;
      }
      this.counters.misses++;
    }
    return this.yielding(device, () => this.inner.create(device, location, size, handleTypes));
  }

  /**
   * An import that runs out of memory gets what the stock holds, and is tried
   * once more, with a copy of the descriptor made before the first try (the
   * backend takes a descriptor over, and closes it when the import fails).
   * Without anything to give back, or a descriptor to spare, one try.
   */
  override async importHandle(source: ImportSource, size: bigint): Promise<ImportedHandle> {
    if (!('fd' in source) || !this.holdsMemory()) return this.inner.importHandle(source, size);
    let spare: number | undefined;
    try {
      spare = this.descriptors.dup(source.fd);
    } catch {
      // Out of descriptors: the import gets one try.
    }
    try {
      return await this.inner.importHandle(source, size);
    } catch (error) {
      if (spare === undefined || !isOutOfMemory(error) || !(await this.giveBack())) throw error;
      const again = spare;
      spare = undefined;
      return await this.inner.importHandle({ fd: again }, size);
    } finally {
      if (spare !== undefined) this.descriptors.close(spare);
    }
  }

  /** A client's memfd held for a store: what the stock holds yields to it as to a Create. */
  override holdClientMemfd(fd: number, size: bigint): Promise<string> {
    return this.yielding(undefined, () => this.inner.holdClientMemfd(fd, size));
  }

  /**
   * `attempt`, and, when it runs out of memory, once more after the stock gave
   * back what it holds for speed: stocked memory and held frees yield to
   * sessions' requests, whichever needs the memory.
   * @param device the device whose stocked memory goes back (undefined: every device's)
   */
  private async yielding<T>(device: number | undefined, attempt: () => Promise<T>): Promise<T> {
    try {
      return await attempt();
    } catch (error) {
      if (!isOutOfMemory(error) || !(await this.giveBack(device))) throw error;
      return attempt();
    }
  }

  /** Whether the stock holds memory it could give back: stocked allocations, or frees held back or running. */
  private holdsMemory(): boolean {
    return this.held.busy || [...this.shelves.values()].some((shelf) => shelf.items.length > 0);
  }

  /**
   * Gives back the stocked memory of `device` (of every device when undefined)
   * and runs every held free now; resolves once that memory is freed.
   * @returns whether there was anything to give back
   */
  private async giveBack(device?: number): Promise<boolean> {
    const devices = device === undefined ? this.inner.devices().map((info) => info.index) : [device];
    const given: Array<Promise<unknown>> = [];
    for (const index of devices) {
      this.free.delete(index);
      given.push(...this.empty(index));
    }
    const frees = this.held.drain();
    if (frees !== undefined) given.push(frees);
    if (given.length === 0) return false;
    await Promise.allSettled(given);
    return true;
  }

  /** A stocked handle's first export: its ready descriptor (a dup of it kept); later ones: a dup of the kept one. */
  override async exportHandle(handle: BackendHandle, device: number): Promise<number> {
    const fd = this.ready.get(handle);
    if (fd === undefined) return this.exported.duplicate(BigInt(handle)) ?? this.inner.exportHandle(handle, device);
    this.ready.delete(handle);
    this.exported.keep(BigInt(handle), fd);
    return fd;
  }

  /** Frees the handle, held back until the daemon is quiet unless `awaited` (then the held ones go with it); resolves once freed. */
  override release(handle: BackendHandle, size: bigint, imported: boolean, device: number, awaited = false): Promise<void> {
    const fd = this.ready.get(handle);
    if (fd !== undefined) this.closeDescriptor(fd);
    this.ready.delete(handle);
    if (this.closed) return this.track(this.releaseNow(handle, size, imported, device));
    const released = this.held.hold(handle, size, imported, device);
    this.refillWhenQuiet();
    if (awaited) this.held.hurry();
    return released;
  }

  /** Someone waits for the frees in flight: the held ones start now; resolves once every one given so far has settled. */
  override settleReleases(): Promise<void> {
    return this.held.settle();
  }

  /** Releases held back now. */
  get heldReleases(): number {
    return this.held.size;
  }

  private async releaseNow(handle: BackendHandle, size: bigint, imported: boolean, device: number): Promise<void> {
    // Out before the backend frees the handle: a handle value it hands out again (a host memfd's number) never meets it.
    const kept = this.exported.remove(BigInt(handle));
    try {
      await this.inner.release(handle, size, imported, device);
    } catch (error) {
      if (kept !== undefined) this.exported.restore(BigInt(handle), kept);
      throw error;
    }
    if (kept !== undefined) await this.exported.close(kept);
  }

  /** Descriptors of handed-out stocked memory kept for later exports. */
  get keptDescriptors(): number {
    return this.exported.size;
  }

  /**
   * Gives everything back, and resolves once the driver work the stock
   * started (frees, creates of a refill in flight) has settled, at most
   * CLOSE_WAIT_MS: the daemon exits next, and a driver call still running on a
   * driver thread then meets the driver's teardown (a deep stock gives back
   * hundreds at once: the cuda load test's daemon died of it).
   */
  override close(): Promise<void> {
    this.closing ??= this.closeNow();
    return this.closing;
  }

  private async closeNow(): Promise<void> {
    this.closed = true;
    clearTimeout(this.refillTimer);
    clearTimeout(this.idleTimer);
    this.refillTimer = undefined;
    this.held.runAll(true);
    for (const device of this.inner.devices()) this.empty(device.index);
    for (const fd of this.ready.values()) this.closeDescriptor(fd);
    this.ready.clear();
    this.exported.clear();
    const deadline = performance.now() + CLOSE_WAIT_MS;
    while (this.working.size > 0 && performance.now() < deadline) {
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<void>((resolve) => (timer = setTimeout(resolve, deadline - performance.now())));
      await Promise.race([Promise.allSettled([...this.working]), late]);
      clearTimeout(timer);
    }
    if (this.working.size > 0) this.log.warn({ running: this.working.size }, `stock: closing with driver work still running after ${CLOSE_WAIT_MS} ms`);
    await this.inner.close();
  }

  /** Counts `work` (driver work the stock started) until it settles: close() waits for it. */
  private track<T>(work: Promise<T>): Promise<T> {
    this.working.add(work);
    const done = () => void this.working.delete(work);
    work.then(done, done);
    return work;
  }

  /** Gives back every stocked allocation of a device; each settles once its memory is freed and its descriptor closed. */
  private empty(device: number): Array<Promise<unknown>> {
    const given: Array<Promise<unknown>> = [];
    for (const shelf of this.shelves.values()) {
      if (shelf.device !== device) continue;
      for (const item of shelf.items.splice(0)) given.push(this.discard(shelf, item));
    }
    return given;
  }

  private discard(shelf: Shelf, item: Item): Promise<unknown> {
    const closed = this.closeDescriptor(item.fd);
    const released = this.track(
      this.inner
        .release(item.handle, shelf.size, false, shelf.device)
        .catch((error) => this.log.error({ err: error }, 'stock: releasing stocked memory failed')),
    );
    return Promise.all([closed, released]);
  }

  /** Refills (and follows the demand) once no Create came for QUIET_MS, or MAX_REFILL_DELAY_MS after the first ask. */
  private refillWhenQuiet(): void {
    if (this.closed || this.refillTimer !== undefined) return;
    this.refillAskedAt = performance.now();
    this.scheduleRefill(QUIET_MS);
  }

  private scheduleRefill(delayMs: number): void {
    this.refillTimer = setTimeout(() => {
      this.refillTimer = undefined;
      if (this.closed) return;
      const now = performance.now();
      const quietFor = now - this.lastRequestAt;
      if (quietFor < QUIET_MS && now - this.refillAskedAt < MAX_REFILL_DELAY_MS) {
        this.scheduleRefill(QUIET_MS - quietFor);
        return;
      }
      // Quiet (else waited for long enough): the held frees first (their memory comes back), then the refills.
      if (quietFor >= QUIET_MS) this.demand.quiet();
      this.held.runAll();
      this.followDemand();
      void this.fill();
      this.forgetBurstsWhenIdle();
    }, delayMs);
    // A pending refill never keeps the daemon alive.
    this.refillTimer.unref();
  }

  /** BURST_IDLE_MS from now, if no stockable request came meanwhile, the bursts are forgotten and what they added goes back. */
  private forgetBurstsWhenIdle(): void {
    clearTimeout(this.idleTimer);
    const armedAt = performance.now();
    this.idleTimer = setTimeout(() => {
      this.idleTimer = undefined;
      if (this.closed || this.lastRequestAt > armedAt) return;
      this.demand.forgetBursts();
      this.followDemand();
    }, BURST_IDLE_MS);
    this.idleTimer.unref();
  }

  /**
   * A shelf of depth 1 for a size that just became steady demand, made on
   * the request's path: only when it fits beside the demand's shelves (their
   * number, their share of the device) as they are. The other shelves are
   * left alone: fitting them all to the demand is the quiet moment's work
   * (followDemand), never a request's: a request would pay for reshaping
   * shelves it does not use.
   */
  private addDemandShelf(device: number, size: bigint): Shelf | undefined {
    const info = this.inner.devices().find((candidate) => candidate.index === device);
    if (info === undefined || size % info.granularityMinimum !== 0n) return undefined;
    const ours = [...this.shelves.values()].filter((shelf) => shelf.device === device);
    const added = ours.reduce((total, shelf) => total + BigInt(shelf.depth - shelf.floor) * shelf.size, 0n);
    if (ours.filter((shelf) => shelf.floor === 0).length >= DEMAND_MAX_SHELVES || added + size > info.totalBytes / DEMAND_SHARE) return undefined;
    const shelf = newShelf(device, size, 1, 0);
    this.shelves.set(shelfKey(device, size), shelf);
    return shelf;
  }

  /**
   * Fits every shelf to the demand now (StockDemand.plan): shelves the demand
   * added come, deepen, shrink or go; configured ones deepen to their bursts
   * and shrink back, never below their configured depth. A shelf made
   * shallower gives its extra memory back.
   */
  private followDemand(): void {
    for (const device of this.inner.devices()) {
      const ours = [...this.shelves.entries()].filter(([, shelf]) => shelf.device === device.index);
      const depths = this.demand.plan(
        device.index,
        device.totalBytes,
        device.granularityMinimum,
        ours.map(([, shelf]) => shelf),
      );
      for (const [key, shelf] of ours) {
        shelf.depth = depths.get(shelf.size) ?? 0;
        while (shelf.items.length > shelf.depth) this.discard(shelf, shelf.items.pop()!);
        if (shelf.depth === 0) this.shelves.delete(key);
      }
      for (const [size, depth] of depths) {
        const key = shelfKey(device.index, size);
        if (!this.shelves.has(key)) this.shelves.set(key, newShelf(device.index, size, depth, 0));
      }
    }
  }

  /** A shelf run low: the held frees and its refill, now, together. */
  private refillBurst(shelf: Shelf): Promise<void> {
    this.held.runAll();
    return this.refill(shelf);
  }

  private refill(shelf: Shelf): Promise<void> {
    return shelf.refilling ? Promise.resolve() : this.track(this.refillNow(shelf));
  }

  private async refillNow(shelf: Shelf): Promise<void> {
    shelf.refilling = true;
    let making = 0;
    // One of REFILL_PARALLEL creating in turn: a burst is over sooner, so fewer requests meet it.
    const creating = async () => {
      while (!this.closed && shelf.items.length + making < shelf.depth) {
        if (this.freeBytes(shelf.device) - BigInt(making) * shelf.size < REFILL_HEADROOM * shelf.size) return;
        making++;
        let item: Item;
        try {
          // Created and exported on a driver thread: a refill costs the event loop nothing but this turn.
          item = await this.inner.createExported(shelf.device, { type: 'DEVICE', id: shelf.device }, shelf.size);
        } finally {
          making--;
        }
        this.counters.created++;
        // What this refill took, until the driver is asked again.
        const known = this.free.get(shelf.device);
        if (known !== undefined) known.bytes -= shelf.size;
        // A shelf the demand dropped (or made shallower) meanwhile does not keep what was made for it.
        if (this.closed || this.shelves.get(shelfKey(shelf.device, shelf.size)) !== shelf || shelf.items.length >= shelf.depth) this.discard(shelf, item);
        else shelf.items.push(item);
      }
    };
    try {
      const failed = (await Promise.allSettled(Array.from({ length: REFILL_PARALLEL }, creating))).find((outcome) => outcome.status === 'rejected');
      if (failed !== undefined) {
        this.counters.refillFailures++;
        this.log.warn(
          { err: (failed as PromiseRejectedResult).reason, device: shelf.device, size: String(shelf.size) },
          'stock: a refill failed; the shelf stays short',
        );
      }
    } finally {
      shelf.refilling = false;
    }
  }

  /** The device's free bytes, asked of the backend at most every FREE_BYTES_TTL_MS (cuMemGetInfo is not cheap under load). */
  private freeBytes(device: number): bigint {
    const now = performance.now();
    const known = this.free.get(device);
    if (known !== undefined && now - known.at < FREE_BYTES_TTL_MS) return known.bytes;
    const bytes = this.inner.memoryInfo(device).freeBytes;
    this.free.set(device, { bytes, at: now });
    return bytes;
  }
}
