"use strict";
Object.defineProperty(exports, "__esModule", { value: true });
exports.StockedBackend = exports.RELEASE_BATCH = exports.REFILL_AT_FRACTION = exports.REFILL_PARALLEL = exports.MAX_REFILL_DELAY_MS = exports.QUIET_MS = exports.DEMAND_SHARE = exports.DEMAND_MAX_DEPTH = exports.DEMAND_MAX_SHELVES = exports.DEMAND_MIN_COUNT = exports.DEMAND_WINDOW = void 0;
const close_later_1 = require("../../common/close-later");
const exported_descriptors_1 = require("./exported-descriptors");
const held_releases_1 = require("./held-releases");
/** A refill stops when the device has less free than this many times the shelf's size. */
const REFILL_HEADROOM = 4n;
/** How long a device's free bytes are trusted before the backend is asked again. */
const FREE_BYTES_TTL_MS = 100;
/** Stockable requests (device memory, a descriptor handle) remembered per device: the demand the stock follows. */
exports.DEMAND_WINDOW = 64;
/** A size asked this many times in the window gets a shelf of depth 1, and one more per as many again. */
exports.DEMAND_MIN_COUNT = 4;
/** Shelves the demand may add per device, beside the configured ones. */
exports.DEMAND_MAX_SHELVES = 4;
/** The deepest a shelf the demand added gets. */
exports.DEMAND_MAX_DEPTH = 8;
/** All shelves the demand added hold at most the device's total bytes divided by this. */
exports.DEMAND_SHARE = 32n;
/** The daemon is quiet once no Create came for this long: refills and held frees wait for it (a client allocating every 2 ms leaves 1 ms quiet after each, time enough for one free and one refill). */
exports.QUIET_MS = 1;
/** A refill waits for quiet at most this long after a shelf was taken from: a steady stream still finds a stock. */
exports.MAX_REFILL_DELAY_MS = 100;
/** Allocations a refill creates at once (each on a driver thread; libuv has four, the frees need some). */
exports.REFILL_PARALLEL = 2;
/** A shelf left with at most its depth divided by this refills at once, in one burst. */
exports.REFILL_AT_FRACTION = 4;
var held_releases_2 = require("./held-releases");
Object.defineProperty(exports, "RELEASE_BATCH", { enumerable: true, get: function () { return held_releases_2.RELEASE_BATCH; } });
const shelfKey = (device, size) => `${device}:${size}`;
const isOutOfMemory = (error) => {
    const code = error?.code;
    return code === 'CUDA_ERROR_OUT_OF_MEMORY' || code === 'OUT_OF_MEMORY' || code === 'ENOMEM';
};
class StockedBackend {
    inner;
    log;
    closeDescriptor;
    // Invariant: one shelf per (device, size) of the levels; items are created, exported, and in no registry.
    shelves = new Map();
    // Invariant: the ready descriptor of every stocked handle handed out and not yet exported nor released.
    ready = new Map();
    // Invariant: descriptors of stocked handles handed out, exported and not yet released (bounded, least recently used out first).
    exported;
    closed = false;
    // The last free bytes asked of each device, and when; refills count down what they take.
    free = new Map();
    counters = { hits: 0, misses: 0, created: 0, refillFailures: 0 };
    // Invariant: per device, the sizes of its last DEMAND_WINDOW stockable requests, oldest first, and how often each occurs there.
    demand = new Map();
    // When the last stockable Create came, and when the first refill not yet run was asked for (performance.now()).
    lastRequestAt = -Infinity;
    refillAskedAt = 0;
    refillTimer;
    // The releases held back; empty once closed.
    held = new held_releases_1.HeldReleases((handle, size, imported, device) => this.releaseNow(handle, size, imported, device));
    /**
     * @param closeDescriptor closes a descriptor the stock exported (tests give fakes their own)
     * @param keptDescriptors how the kept exported descriptors are dup'ed and closed, and how many at most (tests give fakes their own)
     */
    constructor(inner, levels, log, 
    // Off the event loop: a stocked descriptor is its memory's last, and its close frees the driver's export object.
    closeDescriptor = (fd) => (0, close_later_1.closeLater)(fd), keptDescriptors = {}) {
        this.inner = inner;
        this.log = log;
        this.closeDescriptor = closeDescriptor;
        this.exported = new exported_descriptors_1.ExportedDescriptors(keptDescriptors.limit ?? (0, exported_descriptors_1.defaultExportCacheLimit)(), keptDescriptors.calls);
        for (const device of inner.devices()) {
            for (const level of levels) {
                if (level.depth <= 0 || level.size % device.granularityMinimum !== 0n)
                    continue;
                this.shelves.set(shelfKey(device.index, level.size), { device: device.index, size: level.size, depth: level.depth, items: [], refilling: false, demand: false });
            }
        }
    }
    get name() {
        return this.inner.name;
    }
    get capabilities() {
        return this.inner.capabilities;
    }
    /** Fills every shelf; resolves when they are full (or a refill gave up). */
    async fill() {
        await Promise.all([...this.shelves.values()].map((shelf) => this.refill(shelf)));
    }
    stats() {
        return {
            levels: [...this.shelves.values()].map((shelf) => ({
                device: shelf.device,
                size: String(shelf.size),
                depth: shelf.depth,
                held: shelf.items.length,
                ...(shelf.demand ? { demand: true } : {}),
            })),
            ...this.counters,
        };
    }
    async create(device, location, size, handleTypes) {
        const stockable = location.type === 'DEVICE' && handleTypes.length === 1 && handleTypes[0] === 'POSIX_FD';
        // A size just asked often enough for a shelf of its own gets one now, filled at once: until it exists every
        // request of that size is created on its path (a steady stream of a new size never left the daemon quiet
        // long enough for it: the cold probe on the H100 had 89 of 200 64 MiB allocations missing the stock).
        if (stockable && this.noteDemand(device, size) === exports.DEMAND_MIN_COUNT && !this.shelves.has(shelfKey(device, size))) {
            const added = this.addDemandShelf(device, size);
            if (added !== undefined)
                setImmediate(() => void this.refillBurst(added));
        }
        const shelf = stockable ? this.shelves.get(shelfKey(device, size)) : undefined;
        if (shelf !== undefined) {
            const item = shelf.items.pop();
            // At a quarter of its depth a shelf refills at once, quiet or not: a steady stream must not run it dry.
            if (shelf.items.length * exports.REFILL_AT_FRACTION <= shelf.depth)
                setImmediate(() => void this.refillBurst(shelf));
            // The quiet moment also fits the shelves to the demand.
            this.refillWhenQuiet();
            if (item !== undefined) {
                this.counters.hits++;
                this.ready.set(item.handle, item.fd);
                return item.handle;
            }
            this.counters.misses++;
        }
        try {
            return await this.inner.create(device, location, size, handleTypes);
        }
        catch (error) {
            // Stocked memory yields to sessions': the next Create finds it free.
            if (isOutOfMemory(error)) {
                this.empty(device);
                this.free.delete(device);
            }
            throw error;
        }
    }
    /** A stocked handle's first export: its ready descriptor (a dup of it kept); later ones: a dup of the kept one. */
    async exportHandle(handle, device) {
        const fd = this.ready.get(handle);
        if (fd === undefined)
            return this.exported.duplicate(BigInt(handle)) ?? this.inner.exportHandle(handle, device);
        this.ready.delete(handle);
        this.exported.keep(BigInt(handle), fd);
        return fd;
    }
    /** Frees the handle, held back until the daemon is quiet (or hurried); resolves once it is freed. */
    release(handle, size, imported, device) {
        const fd = this.ready.get(handle);
        if (fd !== undefined) {
            this.ready.delete(handle);
            this.closeDescriptor(fd);
        }
        if (this.closed)
            return this.releaseNow(handle, size, imported, device);
        const released = this.held.hold(handle, size, imported, device);
        this.refillWhenQuiet();
        return released;
    }
    /** Starts the held releases now, and those on their way here within this turn. */
    hurry() {
        this.held.hurry();
    }
    /** Releases held back now. */
    get heldReleases() {
        return this.held.size;
    }
    async releaseNow(handle, size, imported, device) {
        // Out before the backend frees the handle: a handle value it hands out again (a host memfd's number) never meets it.
        const kept = this.exported.remove(BigInt(handle));
        try {
            await this.inner.release(handle, size, imported, device);
        }
        catch (error) {
            if (kept !== undefined)
                this.exported.restore(BigInt(handle), kept);
            throw error;
        }
        if (kept !== undefined)
            await this.exported.close(kept);
    }
    /** Descriptors of handed-out stocked memory kept for later exports. */
    get keptDescriptors() {
        return this.exported.size;
    }
    close() {
        this.closed = true;
        this.held.runAll();
        clearTimeout(this.refillTimer);
        this.refillTimer = undefined;
        for (const device of this.inner.devices())
            this.empty(device.index);
        for (const fd of this.ready.values())
            this.closeDescriptor(fd);
        this.ready.clear();
        this.exported.clear();
        this.inner.close();
    }
    /** Gives back every stocked allocation of a device. */
    empty(device) {
        for (const shelf of this.shelves.values()) {
            if (shelf.device !== device)
                continue;
            for (const item of shelf.items.splice(0))
                this.discard(shelf, item);
        }
    }
    discard(shelf, item) {
        this.closeDescriptor(item.fd);
        this.inner.release(item.handle, shelf.size, false, shelf.device).catch((error) => this.log.error({ err: error }, 'stock: releasing stocked memory failed'));
    }
    /** Counts a stockable request of `size` on `device`; returns how often the window now holds that size. */
    noteDemand(device, size) {
        this.lastRequestAt = performance.now();
        let seen = this.demand.get(device);
        if (seen === undefined)
            this.demand.set(device, (seen = { sizes: [], counts: new Map() }));
        seen.sizes.push(size);
        const count = (seen.counts.get(size) ?? 0) + 1;
        seen.counts.set(size, count);
        if (seen.sizes.length > exports.DEMAND_WINDOW) {
            const oldest = seen.sizes.shift();
            const left = seen.counts.get(oldest) - 1;
            if (left === 0)
                seen.counts.delete(oldest);
            else
                seen.counts.set(oldest, left);
        }
        return seen.counts.get(size) ?? 0;
    }
    /** Refills (and follows the demand) once no Create came for QUIET_MS, or MAX_REFILL_DELAY_MS after the first ask. */
    refillWhenQuiet() {
        if (this.closed || this.refillTimer !== undefined)
            return;
        this.refillAskedAt = performance.now();
        this.scheduleRefill(exports.QUIET_MS);
    }
    scheduleRefill(delayMs) {
        this.refillTimer = setTimeout(() => {
            this.refillTimer = undefined;
            if (this.closed)
                return;
            const now = performance.now();
            const quietFor = now - this.lastRequestAt;
            if (quietFor < exports.QUIET_MS && now - this.refillAskedAt < exports.MAX_REFILL_DELAY_MS) {
                this.scheduleRefill(exports.QUIET_MS - quietFor);
                return;
            }
            // Quiet: the held frees first (their memory comes back), then the refills.
            this.held.runAll();
            this.followDemand();
            void this.fill();
        }, delayMs);
        // A pending refill never keeps the daemon alive.
        this.refillTimer.unref();
    }
    /**
     * A shelf of depth 1 for a size that just became steady demand, made on
     * the request's path: only when it fits beside the demand's shelves (their
     * number, their share of the device) as they are. The other shelves are
     * left alone: fitting them all to the demand is the quiet moment's work
     * (followDemand), never a request's (the outside review).
     */
    addDemandShelf(device, size) {
        const info = this.inner.devices().find((candidate) => candidate.index === device);
        if (info === undefined || size % info.granularityMinimum !== 0n)
            return undefined;
        const ours = [...this.shelves.values()].filter((shelf) => shelf.demand && shelf.device === device);
        const held = ours.reduce((total, shelf) => total + BigInt(shelf.depth) * shelf.size, 0n);
        if (ours.length >= exports.DEMAND_MAX_SHELVES || held + size > info.totalBytes / exports.DEMAND_SHARE)
            return undefined;
        const shelf = { device, size, depth: 1, items: [], refilling: false, demand: true };
        this.shelves.set(shelfKey(device, size), shelf);
        return shelf;
    }
    /**
     * Fits the shelves the demand added to the demand now: sizes asked at
     * least DEMAND_MIN_COUNT times in the window (a multiple of the device's
     * granularity, not configured already), most asked first, at most
     * DEMAND_MAX_SHELVES, each DEMAND_MIN_COUNT asks deep one more up to
     * DEMAND_MAX_DEPTH, all within the device's total / DEMAND_SHARE. A shelf
     * no longer wanted, or shallower, gives its extra memory back.
     */
    followDemand() {
        for (const device of this.inner.devices()) {
            const counts = this.demand.get(device.index)?.counts ?? new Map();
            const wanted = [...counts]
                .filter(([size, count]) => {
                if (count < exports.DEMAND_MIN_COUNT || size % device.granularityMinimum !== 0n)
                    return false;
                const shelf = this.shelves.get(shelfKey(device.index, size));
                return shelf === undefined || shelf.demand;
            })
                .sort(([sizeA, countA], [sizeB, countB]) => countB - countA || (sizeA < sizeB ? -1 : sizeA > sizeB ? 1 : 0))
                .slice(0, exports.DEMAND_MAX_SHELVES);
            let budget = device.totalBytes / exports.DEMAND_SHARE;
            const depths = new Map();
            for (const [size, count] of wanted) {
                let depth = Math.min(exports.DEMAND_MAX_DEPTH, Math.floor(count / exports.DEMAND_MIN_COUNT));
                while (depth > 0 && BigInt(depth) * size > budget)
                    depth--;
                if (depth === 0)
                    continue;
                depths.set(size, depth);
                budget -= BigInt(depth) * size;
            }
            for (const [key, shelf] of this.shelves) {
                if (!shelf.demand || shelf.device !== device.index)
                    continue;
                shelf.depth = depths.get(shelf.size) ?? 0;
                while (shelf.items.length > shelf.depth)
                    this.discard(shelf, shelf.items.pop());
                if (shelf.depth === 0)
                    this.shelves.delete(key);
            }
            for (const [size, depth] of depths) {
                const key = shelfKey(device.index, size);
                if (!this.shelves.has(key))
                    this.shelves.set(key, { device: device.index, size, depth, items: [], refilling: false, demand: true });
            }
        }
    }
    /** A shelf run low: the held frees and its refill, now, together. */
    refillBurst(shelf) {
        this.held.runAll();
        return this.refill(shelf);
    }
    async refill(shelf) {
        if (shelf.refilling)
            return;
        shelf.refilling = true;
        let making = 0;
        // One of REFILL_PARALLEL creating in turn: a burst is over sooner, so fewer requests meet it.
        const creating = async () => {
            while (!this.closed && shelf.items.length + making < shelf.depth) {
                if (this.freeBytes(shelf.device) - BigInt(making) * shelf.size < REFILL_HEADROOM * shelf.size)
                    return;
                making++;
                let item;
                try {
                    // Created and exported on a driver thread: a refill costs the event loop nothing but this turn.
                    item = await this.inner.createExported(shelf.device, { type: 'DEVICE', id: shelf.device }, shelf.size);
                }
                finally {
                    making--;
                }
                this.counters.created++;
                // What this refill took, until the driver is asked again.
                const known = this.free.get(shelf.device);
                if (known !== undefined)
                    known.bytes -= shelf.size;
                // A shelf the demand dropped (or made shallower) meanwhile does not keep what was made for it.
                if (this.closed || this.shelves.get(shelfKey(shelf.device, shelf.size)) !== shelf || shelf.items.length >= shelf.depth)
                    this.discard(shelf, item);
                else
                    shelf.items.push(item);
            }
        };
        try {
            const failed = (await Promise.allSettled(Array.from({ length: exports.REFILL_PARALLEL }, creating))).find((outcome) => outcome.status === 'rejected');
            if (failed !== undefined) {
                this.counters.refillFailures++;
                this.log.warn({ err: failed.reason, device: shelf.device, size: String(shelf.size) }, 'stock: a refill failed; the shelf stays short');
            }
        }
        finally {
            shelf.refilling = false;
        }
    }
    /** The device's free bytes, asked of the backend at most every FREE_BYTES_TTL_MS (cuMemGetInfo is not cheap under load). */
    freeBytes(device) {
        const now = performance.now();
        const known = this.free.get(device);
        if (known !== undefined && now - known.at < FREE_BYTES_TTL_MS)
            return known.bytes;
        const bytes = this.inner.memoryInfo(device).freeBytes;
        this.free.set(device, { bytes, at: now });
        return bytes;
    }
    // ---- everything else is the inner backend's ----
    devices() {
        return this.inner.devices();
    }
    createExported(device, location, size) {
        return this.inner.createExported(device, location, size);
    }
    memoryInfo(device) {
        return this.inner.memoryInfo(device);
    }
    granularity(location) {
        return this.inner.granularity(location);
    }
    canAccessPeer(device, owner) {
        return this.inner.canAccessPeer(device, owner);
    }
    reserve(size, alignment, hint) {
        return this.inner.reserve(size, alignment, hint);
    }
    freeAddress(address, size) {
        this.inner.freeAddress(address, size);
    }
    retainHandle(address, handle) {
        return this.inner.retainHandle(address, handle);
    }
    releaseReference(handle, device) {
        return this.inner.releaseReference(handle, device);
    }
    map(address, size, handle, offset) {
        return this.inner.map(address, size, handle, offset);
    }
    unmap(address, size, device) {
        return this.inner.unmap(address, size, device);
    }
    setAccess(address, size, grants) {
        return this.inner.setAccess(address, size, grants);
    }
    sealReadOnly(handle) {
        this.inner.sealReadOnly(handle);
    }
    memoryIdentity(handle, device) {
        return this.inner.memoryIdentity(handle, device);
    }
    holdClientMemfd(fd, size) {
        return this.inner.holdClientMemfd(fd, size);
    }
    dropClientMemfd(identity) {
        this.inner.dropClientMemfd(identity);
    }
    exportFabric(handle, device) {
        return this.inner.exportFabric(handle, device);
    }
    importHandle(source, size) {
        return this.inner.importHandle(source, size);
    }
    readBytes(address, length, device, into) {
        return this.inner.readBytes(address, length, device, into);
    }
    writeBytes(address, data, device) {
        return this.inner.writeBytes(address, data, device);
    }
}
exports.StockedBackend = StockedBackend;
//# sourceMappingURL=stock.js.map