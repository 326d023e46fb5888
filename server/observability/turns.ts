/**
 * The daemon's own turns: how long its event loop runs without a break for
 * one piece of its work (what every client waiting on it pays). monitorEventLoopDelay measures how late a
 * timer fires, which also counts the host's scheduling (the OS running other
 * processes, a GC); this measures the daemon's synchronous stretches themselves.
 *
 * A turn starts where the event loop enters the daemon's code:
 * - a message on a session socket (sessions.ts, before it is framed),
 * - a gRPC call reaching its handler (services/handler.ts),
 * - a native completion (a driver-thread call, a host copy) resuming the code
 *   that awaited it (the backend adaptor below);
 * and ends when the microtasks and next-ticks that entry started have run out:
 * Node drains both queues before it returns to the event loop, and a next-tick
 * queued from a microtask runs only once the microtask queue is empty. So a
 * turn is the entry's synchronous run plus every continuation it ran without
 * yielding, exactly what holds up the next socket message. Other entries
 * (timers, grpc-js's own HTTP/2 reads before a call reaches a handler) are not
 * counted; the event-loop delay beside it counts everything.
 *
 * Each turn is measured twice: by the wall clock, and by the thread's own CPU
 * time where a CPU clock is given (native threadCpuNanos). The two differ by
 * the time the OS had the thread off its CPU in the middle of a turn: on a
 * host whose cores are all busy (16 clients spinning on 16 cores) a turn of
 * 100 us of work can take milliseconds of wall time. The CPU time is the
 * daemon's own work; the wall time is what the clients waited. A collector
 * pause that ran inside a turn counts in both: given the pauses
 * (server/observability/gc-pauses.ts), the window's longest turns tell how much of them it was.
 */
import { createHistogram, RecordableHistogram } from 'node:perf_hooks';

/** Where a turn entered the daemon's code. */
export type TurnKind = 'session' | 'grpc' | 'completion';

/** What a turn is doing, filled in by whoever entered it once known (a session message's type after decoding). */
export interface Turn {
  what?: string;
}

/** A turn past the long-turn limit, as onLong is told of it. */
export interface LongTurn {
  kind: TurnKind;
  what?: string;
  wallMs: number;
  cpuMs?: number;
  /** Entries that ran in it: itself and those entered inside its synchronous run. */
  entries: number;
}

/** A turn longer than this (by CPU time where measured, else by wall clock) is told to onLong: the daemon's target for its longest turn (BENCHMARKS.md). */
export const LONG_TURN_MS = 2;

const now = () => process.hrtime.bigint();

export class TurnMeter {
  // The window GetStats reports and resets (nanoseconds), by wall and by CPU; and since start.
  private window: RecordableHistogram = createHistogram();
  private cpuWindow: RecordableHistogram = createHistogram();
  private longestNs = 0n;
  private longestKind?: TurnKind;
  // Where the window's longest turn by CPU entered, and what it was.
  private cpuMaxKind?: TurnKind;
  private cpuMaxWhat?: string;
  // Entries so far: a turn's count at its end less that at its start is how many ran inside it.
  private entered = 0;
  // A turn is open (entered, not yet recorded): entries meanwhile are inside it, not turns of their own.
  private open = false;
  // The window's longest turn by wall clock and by CPU (kept here: the histograms' max is a bucket's bound), and
  // when each ran (performance.now() milliseconds); when the window began.
  private windowMaxNs = 0n;
  private cpuWindowMaxNs = 0;
  private maxSpan?: [number, number];
  private cpuMaxSpan?: [number, number];
  private windowStartMs = -Infinity;
  /** Sees each turn (seconds, by wall clock and by CPU time where measured), for the Prometheus histograms. */
  observe?: (kind: TurnKind, seconds: number, cpuSeconds?: number) => void;
  /** Told of each turn longer than the long-turn limit (the daemon logs it, rate-limited). */
  onLong?: (turn: LongTurn) => void;

  /**
   * @param cpuClock the calling thread's CPU time in nanoseconds; without it only wall time is measured
   * @param gcWithin milliseconds of collector pauses between two performance.now() times (GcPauses.within)
   * @param longMs the long-turn limit: a longer turn goes to onLong
   */
  constructor(
    private readonly cpuClock?: () => number,
    private readonly gcWithin?: (fromMs: number, toMs: number) => number,
    private readonly longMs = LONG_TURN_MS,
  ) {}

  /**
   * Starts a turn now, at an entry into the daemon's code; it ends once the
   * microtasks and next-ticks queued meanwhile have run. The returned turn's
   * `what` may be set until then.
   */
  enter(kind: TurnKind, what?: string): Turn {
    return this.begin(kind, { what }, (end) => queueMicrotask(() => process.nextTick(end)));
  }

  /**
   * The promise of a native call, its continuation measured as a turn: the
   * code that awaited it starts running when the completion resolves it.
   * @param what the call (a backend method's name)
   */
  completion<T>(promise: Promise<T>, what?: string): Promise<T> {
    return promise.then(
      (value) => {
        this.enterFromMicrotask('completion', what);
        return value;
      },
      (error: unknown) => {
        this.enterFromMicrotask('completion', what);
        throw error;
      },
    );
  }

  /**
   * Longest and 99th-percentile turn of the window, microseconds, by wall
   * clock and by CPU time (0 without a CPU clock), and the longest since start.
   */
  snapshot(): {
    maxUs: number;
    p99Us: number;
    cpuMaxUs: number;
    cpuP99Us: number;
    cpuMaxKind?: TurnKind;
    /** What the longest turn by CPU was: its kind, what entered it, and the entries that ran inside it. */
    cpuMaxWhat?: string;
    /** Of the longest turn by wall clock, and by CPU, the microseconds a collector pause took inside it. */
    maxGcUs: number;
    cpuMaxGcUs: number;
    count: number;
    longestUs: number;
    longestKind?: TurnKind;
  } {
    const count = this.window.count;
    const cpuCount = this.cpuWindow.count;
    return {
      maxUs: count === 0 ? 0 : Math.round(this.window.max / 1000),
      p99Us: count === 0 ? 0 : Math.round(this.window.percentile(99) / 1000),
      cpuMaxUs: cpuCount === 0 ? 0 : Math.round(this.cpuWindow.max / 1000),
      cpuP99Us: cpuCount === 0 ? 0 : Math.round(this.cpuWindow.percentile(99) / 1000),
      cpuMaxKind: this.cpuMaxKind,
      cpuMaxWhat: this.cpuMaxWhat,
      maxGcUs: this.gcUs(count === 0 ? undefined : this.maxSpan, Number(this.windowMaxNs)),
      cpuMaxGcUs: this.gcUs(cpuCount === 0 ? undefined : this.cpuMaxSpan, this.cpuWindowMaxNs),
      count,
      longestUs: Number(this.longestNs / 1000n),
      longestKind: this.longestKind,
    };
  }

  /** Starts a new window (GetStats with reset_event_loop_delay). */
  reset(): void {
    this.window.reset();
    this.cpuWindow.reset();
    this.cpuMaxKind = undefined;
    this.cpuMaxWhat = undefined;
    this.windowMaxNs = 0n;
    this.cpuWindowMaxNs = 0;
    this.maxSpan = undefined;
    this.cpuMaxSpan = undefined;
    this.windowStartMs = performance.now();
  }

  /**
   * Microseconds of collector pauses inside a turn's span, from the window's
   * start on (a turn recorded after a reset may have begun before it), and at
   * most the turn's own measure (`ns`): a pause during which the OS took the
   * thread off its CPU lasts longer by the wall clock than the CPU time it cost.
   */
  private gcUs(span: [number, number] | undefined, ns: number): number {
    if (span === undefined || this.gcWithin === undefined) return 0;
    const ms = this.gcWithin(Math.max(span[0], this.windowStartMs), span[1]);
    return Math.round(Math.min(ms * 1000, ns / 1000));
  }

  private enterFromMicrotask(kind: TurnKind, what?: string): void {
    // Already inside the microtask drain: a next-tick runs once it is over.
    this.begin(kind, { what }, (end) => process.nextTick(end));
  }

  /** Starts a turn now, recorded when `schedule` calls its end; an entry inside a turn still open is counted in it instead. */
  private begin(kind: TurnKind, turn: Turn, schedule: (end: () => void) => void): Turn {
    // Several messages drained in one readable callback: one stretch, one turn.
    if (this.open) {
      this.entered++;
      return turn;
    }
    this.open = true;
    const start = now();
    const cpuStart = this.cpuClock?.() ?? 0;
    const entered = this.entered++;
    schedule(() => this.record(kind, now() - start, cpuStart, turn, entered));
    return turn;
  }

  private record(kind: TurnKind, ns: bigint, cpuStart: number, turn: Turn, entered: number): void {
    this.open = false;
    // The span only of a new longest turn (a clock read then, not every turn).
    const span = (): [number, number] => {
      const end = performance.now();
      return [end - Number(ns) / 1e6, end];
    };
    if (ns > this.windowMaxNs) {
      this.windowMaxNs = ns;
      this.maxSpan = span();
    }
    // The histograms take integers from 1 up.
    this.window.record(ns > 0n ? ns : 1n);
    let cpuNs: number | undefined;
    if (this.cpuClock !== undefined) {
      cpuNs = Math.max(1, Math.round(this.cpuClock() - cpuStart));
      if (cpuNs > this.cpuWindowMaxNs) {
        this.cpuWindowMaxNs = cpuNs;
        this.cpuMaxKind = kind;
        const inside = this.entered - entered - 1;
        this.cpuMaxWhat = `${kind}${turn.what === undefined ? '' : ` ${turn.what}`}${inside > 0 ? ` (+${inside} entr${inside === 1 ? 'y' : 'ies'} inside it)` : ''}`;
        this.cpuMaxSpan = span();
      }
      this.cpuWindow.record(cpuNs);
    }
    if (this.onLong !== undefined && (cpuNs ?? Number(ns)) > this.longMs * 1e6) {
      this.onLong({
        kind,
        what: turn.what,
        wallMs: Number(ns) / 1e6,
        ...(cpuNs === undefined ? {} : { cpuMs: cpuNs / 1e6 }),
        entries: this.entered - entered,
      });
    }
    if (ns > this.longestNs) {
      this.longestNs = ns;
      this.longestKind = kind;
    }
    this.observe?.(kind, Number(ns) / 1e9, cpuNs === undefined ? undefined : cpuNs / 1e9);
  }
}

/**
 * A backend (or any object of async methods) whose promises are measured as
 * completions: every method that returns a promise returns it through
 * `meter.completion`. Other properties pass through unchanged.
 */
export function measureCompletions<T extends object>(target: T, meter: TurnMeter): T {
  const wrapped = new Map<PropertyKey, unknown>();
  return new Proxy(target, {
    get(object, property, receiver) {
      const value = Reflect.get(object, property, receiver) as unknown;
      if (typeof value !== 'function') return value;
      let method = wrapped.get(property);
      if (method === undefined || (method as { original?: unknown }).original !== value) {
        const original = value as (...args: unknown[]) => unknown;
        method = Object.assign(
          function (this: unknown, ...args: unknown[]) {
            const result = original.apply(this === receiver ? object : this, args);
            return result instanceof Promise ? meter.completion(result, String(property)) : result;
          },
          { original },
        );
        wrapped.set(property, method);
      }
      return method;
    },
  });
}
