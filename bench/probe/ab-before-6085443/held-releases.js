"use strict";
Object.defineProperty(exports, "__esModule", { value: true });
exports.HeldReleases = exports.RELEASE_BATCH = void 0;
/** At most this many releases are held; one more and they all run. */
exports.RELEASE_BATCH = 16;
class HeldReleases {
    release;
    // Invariant: the releases not yet started, oldest first.
    held = [];
    // A hurry() is still to look again at the next turn (releases on their way through the registry's adaptors).
    hurrying = false;
    constructor(release) {
        this.release = release;
    }
    get size() {
        return this.held.length;
    }
    /** Holds a release; resolves (or rejects) once it ran. Runs them all when RELEASE_BATCH are held. */
    hold(handle, size, imported, device) {
        return new Promise((resolve, reject) => {
            this.held.push({ handle, size, imported, device, resolve, reject });
            if (this.held.length >= exports.RELEASE_BATCH)
                this.runAll();
        });
    }
    /** Starts every held release now. */
    runAll() {
        for (const held of this.held.splice(0))
            this.release(held.handle, held.size, held.imported, held.device).then(held.resolve, held.reject);
    }
    /** Starts the held releases now, and those that reach hold() later in this turn. */
    hurry() {
        this.runAll();
        if (this.hurrying)
            return;
        this.hurrying = true;
        setImmediate(() => {
            this.hurrying = false;
            this.runAll();
        });
    }
}
exports.HeldReleases = HeldReleases;
//# sourceMappingURL=held-releases.js.map