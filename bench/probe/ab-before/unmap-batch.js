"use strict";
Object.defineProperty(exports, "__esModule", { value: true });
exports.UNMAP_BATCH = exports.UNMAP_DELAY_MS = void 0;
exports.unmapGathered = unmapGathered;
exports.flushUnmaps = flushUnmaps;
exports.flushUnmapsIfIdle = flushUnmapsIfIdle;
/**
 * A process's own CUDA unmaps, gathered per device into one driver-thread
 * job (addon.cudaUnmapMany): one context synchronization for the lot, and
 * one stretch of driver work where each unmap alone ran beside the next
 * allocation's import and map (the driver serializes its calls: the cold
 * probe of issue 18 had a client's own unmap overlap 396 of 400 back-to-back
 * allocations). An unmap waits at most UNMAP_DELAY_MS, or until UNMAP_BATCH
 * are waiting, or until flushUnmaps(): what a caller that needs the memory
 * gone now (out of memory, flush, reset) calls first. A process that has
 * just asked the daemon for memory calls flushUnmapsIfIdle(): while the
 * answer is on its way it makes no driver call of its own, so its unmaps
 * then meet none of its own import, map and set access (on the H100, cold
 * 2 MiB memallocs back to back were 9-14% faster than with the 2 ms wait).
 */
const index_1 = require("./index");
/** An unmap waits for others at most this long. */
exports.UNMAP_DELAY_MS = 2;
/** This many waiting unmaps of a device go at once. */
exports.UNMAP_BATCH = 16;
/** One device's gathered unmaps: at most one job of them runs at a time, but for flushUnmaps(). */
class DeviceUnmaps {
    device;
    // Invariant: the unmaps not yet handed to the driver, oldest first; while any waits, a timer runs or a job does (whose end looks again).
    waiting = [];
    timer;
    // Invariant: the jobs handed to the driver and not yet settled.
    running = 0;
    constructor(device) {
        this.device = device;
    }
    add(address, size) {
        return new Promise((resolve, reject) => {
            this.waiting.push({ address, size, resolve, reject });
            this.handOn();
        });
    }
    /**
     * flush(), unless a job of this device still runs: a busy GPU (each job
     * synchronizes first) then ties up one driver thread for it, not one per
     * flush; the job's end hands on what waited meanwhile. A job that never
     * ends (a kernel that never does) holds the device's later unmaps until
     * flushUnmaps(), whose job would block on the same synchronization.
     */
    flushIfIdle() {
        if (this.running === 0)
            this.flush();
    }
    /** Hands what waits to the driver now, job running or not (a caller that needs the memory gone). Never throws: a job that cannot start rejects its unmaps. */
    flush() {
        clearTimeout(this.timer);
        this.timer = undefined;
        const batch = this.waiting.splice(0);
        if (batch.length === 0)
            return;
        let job;
        try {
            job = index_1.addon.cudaUnmapMany(this.device, batch.map((unmap) => unmap.address), batch.map((unmap) => unmap.size), true);
        }
        catch (error) {
            job = Promise.reject(error);
        }
        this.running++;
        job
            .then((outcomes) => batch.forEach((unmap, index) => {
            const error = outcomes[index] === undefined ? 'NO_OUTCOME' : outcomes[index];
            if (error === null)
                unmap.resolve();
            else
                unmap.reject(Object.assign(new Error(`${error}: cuMemUnmap of ${unmap.size} bytes at 0x${unmap.address.toString(16)}`), { code: error }));
        }))
            // The job failed as a whole (the synchronization, or it could not start): every unmap of it with it.
            .catch((error) => batch.forEach((unmap) => unmap.reject(error)))
            .then(() => {
            this.running--;
            this.handOn();
        });
    }
    /**
     * What waits goes now if a full batch does and no job runs; else it waits
     * for UNMAP_DELAY_MS (a timer, armed once), whose end flushes if no job
     * runs, else that job's end looks again.
     */
    handOn() {
        if (this.waiting.length >= exports.UNMAP_BATCH)
            this.flushIfIdle();
        if (this.waiting.length === 0 || this.timer !== undefined)
            return;
        this.timer = setTimeout(() => {
            this.timer = undefined;
            this.flushIfIdle();
        }, exports.UNMAP_DELAY_MS);
    }
}
const devices = new Map();
/**
 * Unmaps [address, address + size) of this process's own mapping on `device`
 * after the context is synchronized (as cuMemFree would), gathered with
 * others; resolves once it is unmapped.
 * @throws (rejects) the driver's error, with its name as `code`
 */
function unmapGathered(device, address, size) {
    let unmaps = devices.get(device);
    if (unmaps === undefined)
        devices.set(device, (unmaps = new DeviceUnmaps(device)));
    return unmaps.add(address, size);
}
/** Hands every waiting unmap to the driver now. */
function flushUnmaps() {
    for (const unmaps of devices.values())
        unmaps.flush();
}
/** Hands the waiting unmaps of each device with no job of them running to the driver now (see the module's comment). */
function flushUnmapsIfIdle() {
    for (const unmaps of devices.values())
        unmaps.flushIfIdle();
}
//# sourceMappingURL=unmap-batch.js.map