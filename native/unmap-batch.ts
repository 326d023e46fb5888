/**
 * A process's own CUDA unmaps, gathered per device into one driver-thread
 * job (addon.cudaUnmapMany): one context synchronization for the lot, and
 * one stretch of driver work where each unmap alone ran beside the next
 * allocation's import and map (the driver serializes its calls: back to back,
 * nearly every allocation met the unmap of the one before). What the process frees in one turn goes at that turn's end,
 * when no job of the device runs (else at that job's end), or at once when
 * UNMAP_BATCH wait, or at flushUnmaps(): what a caller that needs the memory
 * gone now (out of memory, flush, reset) calls first. A process that has just
 * asked the daemon for memory calls flushUnmapsIfIdle(): while the answer is
 * on its way it makes no driver call of its own. Either way the unmaps run
 * while the process waits or computes, not beside its next import: they used
 * to wait 2 ms for company, and a process allocating every 2 ms had its own
 * unmap overlap the next allocation's import in 389 of 400 (the probe's
 * "apart" schedule).
 */
import { addon } from './index';

/** This many waiting unmaps of a device go at once. */
export const UNMAP_BATCH = 16;

interface Waiting {
  address: bigint;
  size: bigint;
  resolve(): void;
  reject(error: Error): void;
}

/** One device's gathered unmaps: at most one job of them runs at a time, but for flushUnmaps(). */
class DeviceUnmaps {
  // Invariant: the unmaps not yet handed to the driver, oldest first; while any waits, a turn's end is due or a job runs (whose end looks again).
  private readonly waiting: Waiting[] = [];
  private turnEnd: NodeJS.Immediate | undefined;
  // Invariant: the jobs handed to the driver and not yet settled.
  private running = 0;

  constructor(private readonly device: number) {}

  add(address: bigint, size: bigint): Promise<void> {
    return new Promise<void>((resolve, reject) => {
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
  flushIfIdle(): void {
    if (this.running === 0) this.flush();
  }

  /** Hands what waits to the driver now, job running or not (a caller that needs the memory gone). Never throws: a job that cannot start rejects its unmaps. */
  flush(): void {
    clearImmediate(this.turnEnd);
    this.turnEnd = undefined;
    const batch = this.waiting.splice(0);
    if (batch.length === 0) return;
    let job: Promise<Array<string | null>>;
    try {
      job = addon.cudaUnmapMany(
        this.device,
        batch.map((unmap) => unmap.address),
        batch.map((unmap) => unmap.size),
        true,
      );
    } catch (error) {
      job = Promise.reject(error);
    }
    this.running++;
    job
      .then((outcomes) =>
        batch.forEach((unmap, index) => {
          const error = outcomes[index] === undefined ? 'NO_OUTCOME' : outcomes[index];
          if (error === null) unmap.resolve();
          else unmap.reject(Object.assign(new Error(`${error}: cuMemUnmap of ${unmap.size} bytes at 0x${unmap.address.toString(16)}`), { code: error }));
        }),
      )
      // The job failed as a whole (the synchronization, or it could not start): every unmap of it with it.
      .catch((error: unknown) => batch.forEach((unmap) => unmap.reject(error as Error)))
      .then(() => {
        this.running--;
        this.handOn();
      });
  }

  /**
   * What waits goes now if a full batch does and no job runs; else at the end
   * of this turn (armed once), which flushes if no job runs, else that job's
   * end looks again.
   */
  private handOn(): void {
    if (this.waiting.length >= UNMAP_BATCH) this.flushIfIdle();
    if (this.waiting.length === 0 || this.turnEnd !== undefined) return;
    this.turnEnd = setImmediate(() => {
      this.turnEnd = undefined;
      this.flushIfIdle();
    });
  }
}

const devices = new Map<number, DeviceUnmaps>();

/**
 * Unmaps [address, address + size) of this process's own mapping on `device`
 * after the context is synchronized (as cuMemFree would), gathered with
 * others; resolves once it is unmapped.
 * @throws (rejects) the driver's error, with its name as `code`
 */
export function unmapGathered(device: number, address: bigint, size: bigint): Promise<void> {
  let unmaps = devices.get(device);
  if (unmaps === undefined) devices.set(device, (unmaps = new DeviceUnmaps(device)));
  return unmaps.add(address, size);
}

/** Hands every waiting unmap to the driver now. */
export function flushUnmaps(): void {
  for (const unmaps of devices.values()) unmaps.flush();
}

/** Hands the waiting unmaps of each device with no job of them running to the driver now (see the module's comment). */
export function flushUnmapsIfIdle(): void {
  for (const unmaps of devices.values()) unmaps.flushIfIdle();
}
