/**
 * The referee of memory between processes on one device: AllocateAll's
 * requests (a waking pool's memory, all or none) are served one at a time
 * per device, or per host memory, in arrival order, so that two wakes never
 * interleave their driver calls. A request whose memory is not free waits
 * at the head of its queue, and those behind it wait too (a large wake is
 * not starved by small ones), until releases free the memory or its deadline
 * passes; then it fails OUT_OF_MEMORY with nothing made. Memory freed
 * through the registry wakes the queue at once; memory freed anywhere else
 * (another process on the GPU, a store, the stock) is seen by a poll.
 */
import { freemem, totalmem } from 'node:os';
import { MAX_ALLOCATE_ALL_SIZES, MAX_ALLOCATE_ALL_WAIT_MS } from '../../common/client-constants';
import { addon } from '../../native';
import type { Backend, HandleKind, MemLocation } from '../backends/backend';
import { describeLocation } from '../backends/backend';
import { failedPrecondition, invalidArgument, outOfRange, resourceExhausted, RpcError, unavailable } from '../errors';
import type { Allocations } from './allocations';
import { Budget } from './budgets';
import type { DeviceTable } from './devices';
import { checkAligned, Exported, ownerName } from './records';
import { PassThroughSource, type SourcedAllocation } from './source';
import type { UidBudgets } from './uid-budgets';

/** How often a waiting request looks again at its device's free memory (memory freed outside the registry). */
export const REFEREE_POLL_MS = 20;
/** How often a waiting request for host memory tries again when nothing was freed through the registry: host memory has no cheap free count on every backend. */
export const REFEREE_HOST_RETRY_MS = 200;
/** AllocateAll requests one uid may have waiting or running at once. */
export const MAX_WAITING_PER_UID = 64;

export interface AllocateAllArgs {
  sizes: bigint[];
  location: MemLocation;
  handleType: HandleKind;
  /** How long the request may wait for its turn and its memory; 0: answered at once. */
  deadlineMs: number;
  /** Aborted when the caller's session ends or its call is cancelled: the request leaves its queue and makes nothing. */
  signal?: AbortSignal;
}

export interface AllocatedAll {
  /** One per size, in order; each descriptor (fd) is the caller's to send and close. */
  exported: Exported[];
  waitedMs: number;
}

/** What the metrics and the report show of the referee. */
export interface RefereeStats {
  /** Requests waiting or running, by queue ("device 0", "host memory"). */
  waiting: Map<string, number>;
  /** Requests answered since start, by outcome. */
  outcomes: Map<'served' | 'out_of_memory' | 'abandoned' | 'refused', number>;
  /** Requests served after waiting for memory. */
  servedAfterWaiting: number;
}

interface Waiting {
  readonly caller: bigint;
  readonly args: AllocateAllArgs;
  readonly total: bigint;
  readonly queue: string;
  readonly device: number;
  readonly arrived: number;
  /** Attempts that met no memory. */
  attempts: number;
  lastAttempt: number;
  /** Memory was freed through the registry since the last attempt. */
  freedSince: boolean;
  timer?: NodeJS.Timeout;
  /** Set when the deadline passes or the session ends while an attempt runs: the attempt's outcome decides. */
  ended?: RpcError;
  settle(result: AllocatedAll | Error): void;
}

const isOutOfMemory = (error: unknown) => {
  const code = (error as { code?: unknown })?.code;
  return code === 'OUT_OF_MEMORY' || code === 'CUDA_ERROR_OUT_OF_MEMORY' || code === 'ENOMEM';
};

/**
 * An adaptor that tells the referee when memory was freed (any owner's,
 * through the registry), so that a waiting request tries at once.
 */
export class FreedSignal extends PassThroughSource {
  // Invariant: every function here is called after each free that succeeded, with the freed memory's device.
  readonly listeners = new Set<(device: number, location: MemLocation | undefined) => void>();

  override async release(allocation: SourcedAllocation, awaited: boolean): Promise<void> {
    await this.upstream.release(allocation, awaited);
    for (const listener of this.listeners) listener(allocation.device, allocation.location);
  }
}

export class Referee {
  // Invariant: per queue, the requests not yet answered, in arrival order; only the head attempts (calls the driver),
  // and `attempting` holds the queues whose head is attempting now. A queue with no request has no entry.
  private readonly queues = new Map<string, Waiting[]>();
  private readonly attempting = new Set<string>();
  private poll: NodeJS.Timeout | undefined;
  /** Requests waiting or running per uid (also shown with the daemon's budgets). */
  readonly waitingPerUid = new Budget('AllocateAll requests waiting per uid', MAX_WAITING_PER_UID);
  private readonly outcomes: RefereeStats['outcomes'] = new Map();
  private servedAfterWaiting = 0;

  constructor(
    private readonly backend: Backend,
    private readonly allocations: Allocations,
    private readonly devices: DeviceTable,
    private readonly freedSignal: FreedSignal,
    private readonly budgets?: UidBudgets,
  ) {
    // On the host backend every location is one memory: a free may serve any queue.
    freedSignal.listeners.add((device, location) =>
      this.freed(location === undefined || !this.backend.capabilities.gpuMemory ? undefined : this.queueOf(location, device)),
    );
  }

  /**
   * Creates and exports one allocation per size for the caller, all or none,
   * once its turn on the device comes and the memory is there.
   * @throws INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED; OUT_OF_RANGE TOO_MANY_SIZES, BAD_DEADLINE, UNKNOWN_DEVICE, BEYOND_DEVICE;
   *   FAILED_PRECONDITION UNSUPPORTED_HANDLE_TYPE; RESOURCE_EXHAUSTED OUT_OF_MEMORY (not freed before the deadline),
   *   BUDGET_EXCEEDED, QUOTA_EXCEEDED; UNAVAILABLE SESSION_CLOSED (the session ended while it waited)
   */
  allocateAll(caller: bigint, args: AllocateAllArgs): Promise<AllocatedAll> {
    const { device, total, queue } = this.check(args);
    const uid = this.budgets?.uidOf(caller);
    if (uid !== undefined) {
      const allocations = this.budgets!.allocations;
      if (!allocations.fits(uid, args.sizes.length)) throw allocations.refusal(uid, allocations.usedBy(uid), args.sizes.length);
      this.waitingPerUid.take(uid);
    }
    if (args.signal?.aborted) {
      if (uid !== undefined) this.waitingPerUid.give(uid);
      throw this.sessionClosed(caller, args.sizes.length, total, queue);
    }
    return new Promise<AllocatedAll>((resolve, reject) => {
      const now = performance.now();
      let settled = false;
      const onAbort = () => this.end(request, this.sessionClosed(caller, args.sizes.length, total, queue));
      const request: Waiting = {
        caller,
        args,
        total,
        queue,
        device,
        arrived: now,
        attempts: 0,
        lastAttempt: now,
        freedSince: false,
        settle: (result) => {
          if (settled) return;
          settled = true;
          clearTimeout(request.timer);
          args.signal?.removeEventListener('abort', onAbort);
          if (uid !== undefined) this.waitingPerUid.give(uid);
          const outcome = result instanceof Error ? outcomeOf(result) : 'served';
          this.outcomes.set(outcome, (this.outcomes.get(outcome) ?? 0) + 1);
          if (result instanceof Error) reject(result);
          else {
            if (request.attempts > 0) this.servedAfterWaiting++;
            resolve(result);
          }
        },
      };
      args.signal?.addEventListener('abort', onAbort, { once: true });
      request.timer = setTimeout(() => this.end(request, this.outOfMemory(request)), args.deadlineMs);
      const waiting = this.queues.get(queue);
      if (waiting === undefined) this.queues.set(queue, [request]);
      else waiting.push(request);
      this.pump(queue);
    });
  }

  stats(): RefereeStats {
    const waiting = new Map<string, number>();
    for (const [queue, requests] of this.queues) waiting.set(queue, requests.length);
    return { waiting, outcomes: new Map(this.outcomes), servedAfterWaiting: this.servedAfterWaiting };
  }

  /** Stops polling (the daemon's shutdown; requests still waiting end with their deadline or session). */
  close(): void {
    clearInterval(this.poll);
    this.poll = undefined;
  }

  /** The request's rules, checked before it waits: each is one the waiting cannot change. */
  private check(args: AllocateAllArgs): { device: number; total: bigint; queue: string } {
    if (!Number.isInteger(args.deadlineMs) || args.deadlineMs < 0 || args.deadlineMs > MAX_ALLOCATE_ALL_WAIT_MS) {
      throw outOfRange('BAD_DEADLINE', `deadline_ms ${args.deadlineMs} is out of range: 0 (answer at once) to ${MAX_ALLOCATE_ALL_WAIT_MS}`);
    }
    if (args.sizes.length === 0) throw invalidArgument('ZERO_SIZE', 'AllocateAll needs at least one size in sizes');
    if (args.sizes.length > MAX_ALLOCATE_ALL_SIZES) {
      throw outOfRange('TOO_MANY_SIZES', `AllocateAll names ${args.sizes.length} sizes; at most ${MAX_ALLOCATE_ALL_SIZES} in one request`);
    }
    const device = this.devices.deviceOf(args.location);
    if (args.handleType !== 'POSIX_FD') {
      throw failedPrecondition('UNSUPPORTED_HANDLE_TYPE', `AllocateAll hands out descriptors (POSIX_FD), not ${args.handleType} handles`);
    }
    const granularity = this.backend.granularity(args.location).minimum;
    let total = 0n;
    args.sizes.forEach((size, index) => {
      if (size === 0n) throw invalidArgument('ZERO_SIZE', `sizes[${index}] is 0: each allocation needs at least one granule (${granularity} bytes)`);
      checkAligned(`sizes[${index}]`, size, granularity);
      total += size;
    });
    const queue = this.queueOf(args.location, device);
    const capacity = this.capacityOf(queue, device);
    if (total > capacity) {
      throw outOfRange(
        'BEYOND_DEVICE',
        `AllocateAll asks for ${total} bytes in ${args.sizes.length} allocation(s) on ${queue}, which has ${capacity} bytes in all: it could never be served`,
      );
    }
    return { device, total, queue };
  }

  /**
   * A device's requests queue apart from host memory's, even on the host backend where both
   * draw on one memory: a sleep's offload copies (host memory) must never wait behind a wake
   * that waits for that very sleep to free the device.
   */
  private queueOf(location: MemLocation, device: number): string {
    if (location.type === 'DEVICE') return `device ${device}`;
    return `host memory (${describeLocation(location)})`;
  }

  /** Whether the queue's memory is what the backend counts per device (a device's; every location's on the host backend). */
  private countedByBackend(queue: string): boolean {
    return queue.startsWith('device ') || !this.backend.capabilities.gpuMemory;
  }

  private capacityOf(queue: string, device: number): bigint {
    return this.countedByBackend(queue) ? this.backend.memoryInfo(device).totalBytes : BigInt(totalmem());
  }

  private freeOf(queue: string, device: number): bigint {
    return this.countedByBackend(queue) ? this.backend.memoryInfo(device).freeBytes : BigInt(freemem());
  }

  /** Runs the head of a queue when it is its turn and its memory may be there. */
  private pump(queue: string): void {
    if (this.attempting.has(queue)) return;
    const requests = this.queues.get(queue);
    const head = requests?.[0];
    if (head === undefined) {
      this.queues.delete(queue);
      if (this.queues.size === 0) this.close();
      return;
    }
    if (head.attempts > 0 && !this.mayFit(head)) return this.polling();
    this.attempting.add(queue);
    head.freedSince = false;
    head.lastAttempt = performance.now();
    void this.attempt(head).then((outcome) => {
      this.attempting.delete(queue);
      if (outcome === 'no memory') {
        head.attempts++;
        // Ended while it tried (deadline, session): answered now, the next request's turn.
        if (head.ended === undefined) return this.polling();
        head.settle(head.ended);
      }
      this.remove(head);
      this.pump(queue);
    });
  }

  /** Whether the head's memory may be there now: something was freed through the registry, or the free count says so. */
  private mayFit(head: Waiting): boolean {
    if (head.freedSince) return true;
    if (this.countedByBackend(head.queue)) return this.freeOf(head.queue, head.device) >= head.total;
    return performance.now() - head.lastAttempt >= REFEREE_HOST_RETRY_MS;
  }

  /** Every allocation made, or none: rolled back (descriptors closed, memory released) when one cannot be made. */
  private async attempt(head: Waiting): Promise<'answered' | 'no memory'> {
    // Frees the stock holds back for a quiet moment go now: this request is waiting for memory.
    void this.freedSignal.settle();
    const made: Exported[] = [];
    try {
      for (const size of head.args.sizes) {
        made.push(await this.allocations.createExported(head.caller, { size, location: head.args.location, handleType: 'POSIX_FD' }, () => undefined));
      }
    } catch (error) {
      await this.undo(head.caller, made);
      if (isOutOfMemory(error)) return 'no memory';
      head.settle(error as Error);
      return 'answered';
    }
    head.settle({ exported: made, waitedMs: Math.round(performance.now() - head.arrived) });
    return 'answered';
  }

  /** Gives back what an attempt made: the daemon's copies of the descriptors, then the memory. */
  async undo(caller: bigint, made: Exported[]): Promise<void> {
    for (const { fd } of made) if (fd !== undefined) addon.close(fd);
    for (const { allocation } of made) {
      // Gone already when the owner's reclaim ran meanwhile.
      await this.allocations.release(caller, allocation.id).catch(() => undefined);
    }
  }

  /** Ends a request at its deadline or its session's end: at once when it waits, after its attempt when it runs. */
  private end(request: Waiting, reason: RpcError): void {
    if (this.attempting.has(request.queue) && this.queues.get(request.queue)?.[0] === request) {
      request.ended ??= reason;
      return;
    }
    request.settle(reason);
    this.remove(request);
    this.pump(request.queue);
  }

  private remove(request: Waiting): void {
    const requests = this.queues.get(request.queue);
    if (requests === undefined) return;
    const index = requests.indexOf(request);
    if (index >= 0) requests.splice(index, 1);
    if (requests.length === 0) this.queues.delete(request.queue);
  }

  /** Memory was freed through the registry: the heads of the queues it may serve try again now. */
  private freed(queue: string | undefined): void {
    for (const [name, requests] of this.queues) {
      if (queue !== undefined && name !== queue) continue;
      requests[0].freedSince = true;
      this.pump(name);
    }
  }

  /** Polls while any request waits: memory freed outside the registry wakes it too. */
  private polling(): void {
    if (this.poll !== undefined) return;
    this.poll = setInterval(() => {
      for (const name of [...this.queues.keys()]) this.pump(name);
    }, REFEREE_POLL_MS);
    this.poll.unref();
  }

  private outOfMemory(request: Waiting): RpcError {
    const ahead = Math.max(0, this.queues.get(request.queue)?.indexOf(request) ?? 0);
    const free = this.freeOf(request.queue, request.device);
    const what = ahead > 0 ? `its turn (${ahead} request(s) ahead of it) and for` : 'releases to free';
    return resourceExhausted(
      'OUT_OF_MEMORY',
      `out of memory: AllocateAll of ${request.total} bytes in ${request.args.sizes.length} allocation(s) on ${request.queue} waited ${request.args.deadlineMs} ms for ${what} its memory; ${free} bytes are free there now (${describeLocation(request.args.location)}); nothing was allocated`,
    );
  }

  private sessionClosed(caller: bigint, count: number, total: bigint, queue: string): RpcError {
    return unavailable(
      'SESSION_CLOSED',
      `${ownerName(caller)} closed, or the call was cancelled, while its AllocateAll of ${total} bytes in ${count} allocation(s) on ${queue} waited; nothing was allocated`,
    );
  }
}

function outcomeOf(error: Error): 'out_of_memory' | 'abandoned' | 'refused' {
  const code = (error as { code?: unknown }).code;
  return code === 'OUT_OF_MEMORY' ? 'out_of_memory' : code === 'SESSION_CLOSED' ? 'abandoned' : 'refused';
}
