/**
 * The daemon's own turns (server/observability/turns.ts): an entry's synchronous run and
 * the microtasks it runs without yielding are one turn; a continuation after
 * a native completion is one; waiting for a timer ends a turn.
 */
import { GcPauses } from '../../server/observability/gc-pauses';
import { sessionTurnLabel } from '../../server/transport/session/sessions';
import { measureCompletions, TurnMeter } from '../../server/observability/turns';

/** Busy for `ms` milliseconds: a synchronous stretch of known length. */
function spin(ms: number): void {
  const until = process.hrtime.bigint() + BigInt(ms * 1e6);
  while (process.hrtime.bigint() < until) {
    // holding the event loop on purpose
  }
}

const settled = () => new Promise((resolve) => setImmediate(resolve));

describe('TurnMeter', () => {
  it("counts an entry's synchronous run and the continuations it ran without yielding as one turn", async () => {
    const meter = new TurnMeter();
    const seen: Array<[string, number]> = [];
    meter.observe = (kind, seconds) => seen.push([kind, seconds]);
    await new Promise<void>((resolve) =>
      setImmediate(() => {
        meter.enter('session');
        spin(3);
        void Promise.resolve()
          .then(() => spin(3))
          .then(() => spin(3))
          .then(resolve);
      }),
    );
    await settled();
    expect(seen).toHaveLength(1);
    expect(seen[0][0]).toBe('session');
    expect(seen[0][1]).toBeGreaterThanOrEqual(0.009);
    expect(meter.snapshot()).toMatchObject({ count: 1, longestKind: 'session' });
    expect(meter.snapshot().maxUs).toBeGreaterThanOrEqual(9000);
  });

  it('ends a turn where the code waits for the event loop (a timer), not where the work ends', async () => {
    const meter = new TurnMeter();
    const order: string[] = [];
    meter.observe = () => order.push('turn ended');
    await new Promise<void>((resolve) =>
      setImmediate(() => {
        meter.enter('grpc');
        spin(1);
        setTimeout(() => {
          order.push('timer');
          resolve();
        }, 1);
      }),
    );
    await settled();
    expect(order).toEqual(['turn ended', 'timer']);
    expect(meter.snapshot().count).toBe(1);
    expect(meter.snapshot().maxUs).toBeGreaterThanOrEqual(1000);
  });

  it("measures a completion's continuation: the code that awaited the native call, up to its next wait", async () => {
    const meter = new TurnMeter();
    const native = () => new Promise<number>((resolve) => setTimeout(() => resolve(7), 2));
    const value = await (async () => {
      const result = await meter.completion(native());
      spin(4);
      return result;
    })();
    expect(value).toBe(7);
    await settled();
    expect(meter.snapshot()).toMatchObject({ count: 1, longestKind: 'completion' });
    expect(meter.snapshot().maxUs).toBeGreaterThanOrEqual(4000);
    // A rejection is a completion too, and is passed on unchanged.
    const failure = new Error('CUDA_ERROR_OUT_OF_MEMORY');
    await expect(meter.completion(Promise.reject(failure))).rejects.toBe(failure);
    await settled();
    expect(meter.snapshot().count).toBe(2);
  });

  it('starts a new window on reset and keeps the longest since start', async () => {
    const meter = new TurnMeter();
    meter.enter('session');
    spin(2);
    await settled();
    meter.reset();
    expect(meter.snapshot()).toMatchObject({ count: 0, maxUs: 0, p99Us: 0, longestKind: 'session' });
    expect(meter.snapshot().longestUs).toBeGreaterThanOrEqual(2000);
  });
});

describe('TurnMeter with a CPU clock', () => {
  it("measures each turn by the thread's CPU time too: a turn the OS interrupted is long by wall clock, short by CPU", async () => {
    // The CPU clock advances by what the test says the thread ran; the wall clock by what really passed.
    let cpuNs = 5e9;
    const meter = new TurnMeter(() => cpuNs);
    const seen: Array<[string, number, number | undefined]> = [];
    meter.observe = (kind, seconds, cpuSeconds) => seen.push([kind, seconds, cpuSeconds]);
    meter.enter('session');
    spin(3); // 3 ms of wall time, of which the thread "ran" 0.2 ms: off its CPU the rest
    cpuNs += 200_000;
    await settled();
    meter.enter('completion');
    spin(1);
    cpuNs += 900_000; // 0.9 ms on the CPU: the window's longest by CPU, not by wall
    await settled();
    expect(seen.map(([kind]) => kind)).toEqual(['session', 'completion']);
    expect(seen[0][1]).toBeGreaterThanOrEqual(0.003);
    expect(seen[0][2]).toBeCloseTo(0.0002, 6);
    expect(seen[1][2]).toBeCloseTo(0.0009, 6);
    const snapshot = meter.snapshot();
    expect(snapshot.maxUs).toBeGreaterThanOrEqual(3000);
    expect(snapshot.cpuMaxUs).toBe(900);
    expect(snapshot.cpuMaxKind).toBe('completion');
    expect(snapshot.cpuP99Us).toBeLessThanOrEqual(snapshot.cpuMaxUs);
    meter.reset();
    expect(meter.snapshot()).toMatchObject({ count: 0, cpuMaxUs: 0, cpuP99Us: 0, cpuMaxKind: undefined });
  });

  it('reports no CPU time without a clock', async () => {
    const meter = new TurnMeter();
    const seen: Array<number | undefined> = [];
    meter.observe = (_kind, _seconds, cpuSeconds) => seen.push(cpuSeconds);
    meter.enter('grpc');
    await settled();
    expect(seen).toEqual([undefined]);
    expect(meter.snapshot()).toMatchObject({ count: 1, cpuMaxUs: 0, cpuMaxKind: undefined });
  });
});

describe('measureCompletions', () => {
  class Backend {
    readonly name = 'fake';
    #handles = 0;
    async create(size: number): Promise<number> {
      this.#handles++;
      return size * 2;
    }
    count(): number {
      return this.#handles;
    }
  }

  it("passes every call and property through, measuring only the promises' continuations", async () => {
    const meter = new TurnMeter();
    const backend = measureCompletions(new Backend(), meter);
    expect(backend.name).toBe('fake');
    expect(backend).toBeInstanceOf(Backend);
    // Private fields work: methods run on the backend itself.
    expect(await backend.create(21)).toBe(42);
    expect(backend.count()).toBe(1);
    await settled();
    expect(meter.snapshot().count).toBe(1);
    expect(backend.create).toBe(backend.create);
  });
});

describe('TurnMeter with the GC pauses', () => {
  /**
   * A meter asking `pauses`, and one turn of `wallMs` by the wall clock of
   * which the thread had `cpuMs` of CPU, with a pause of `pauseMs` 1 ms into it.
   */
  function turnWithPause(pauses: GcPauses, wallMs: number, cpuMs: number, pauseMs: number): { meter: TurnMeter; cpu: { ns: number } } {
    const cpu = { ns: 1e9 };
    const meter = new TurnMeter(
      () => cpu.ns,
      (from, to) => pauses.within(from, to),
    );
    meter.enter('session');
    const started = performance.now();
    spin(wallMs);
    cpu.ns += cpuMs * 1e6;
    pauses.add(started + 1, pauseMs);
    return { meter, cpu };
  }

  it('tells how much of the longest turn (by wall clock and by CPU) was a collector pause inside it', async () => {
    const pauses = new GcPauses();
    const { meter, cpu } = turnWithPause(pauses, 3, 3, 1.5);
    // And one long after it.
    pauses.add(performance.now() + 60_000, 5);
    await settled();
    // The longest by wall clock, read while it is the only turn (a loaded machine may stretch any later one).
    expect(meter.snapshot().maxGcUs).toBe(1500);
    meter.enter('completion');
    spin(1);
    cpu.ns += 1_000_000;
    await settled();
    const snapshot = meter.snapshot();
    expect(snapshot.cpuMaxKind).toBe('session');
    expect(snapshot.cpuMaxGcUs).toBe(1500);
    meter.reset();
    expect(meter.snapshot()).toMatchObject({ maxGcUs: 0, cpuMaxGcUs: 0 });
  });

  it('reports none without the pauses', async () => {
    const meter = new TurnMeter(() => 0);
    meter.enter('grpc');
    spin(1);
    await settled();
    expect(meter.snapshot()).toMatchObject({ maxGcUs: 0, cpuMaxGcUs: 0 });
  });

  it("never reports more of the longest CPU turn as a pause than the turn's CPU time (a pause the OS interrupted)", async () => {
    // 4 ms by wall clock of which the thread had 1 ms of CPU (preempted, as with 16 clients on 16 cores),
    // with a 2 ms collector pause (wall clock) inside it.
    const { meter } = turnWithPause(new GcPauses(), 4, 1, 2);
    await settled();
    const snapshot = meter.snapshot();
    expect(snapshot.cpuMaxUs).toBe(1000);
    // Reported as "max 1 ms (of which a GC pause 2 ms)".
    expect(snapshot.cpuMaxGcUs).toBeLessThanOrEqual(snapshot.cpuMaxUs);
  });

  it('does not carry into a new window the pause of a turn that ran before its reset', async () => {
    const pauses = new GcPauses();
    const meter = new TurnMeter(undefined, (from, to) => pauses.within(from, to));
    await new Promise<void>((resolve) =>
      setImmediate(() => {
        // A turn (say the GetStats call itself) with a pause in it, then the reset inside that same turn.
        meter.enter('grpc');
        const started = performance.now();
        spin(3);
        pauses.add(started + 1, 1.5);
        meter.snapshot();
        meter.reset();
        pauses.reset();
        resolve();
      }),
    );
    await settled();
    // Nothing has run since the reset, yet the new window has a turn whose 1.5 ms pause predates it
    // (and gc_pause_max_us of the new window is 0: event_loop_turn_max_gc_us > gc_pause_max_us).
    // (That the turn itself lands in the new window predates a3ac26e; its pause is new.)
    expect(meter.snapshot().maxGcUs).toBe(0);
  });
});

describe('what a turn was: what entered it, beyond its kind', () => {
  it('names the longest turn by CPU: what entered, and how many more entries ran inside it', async () => {
    let cpuNs = 1e9;
    const meter = new TurnMeter(() => cpuNs);
    // A session message whose type is known once decoded, and two more entries in the same synchronous run.
    await new Promise<void>((resolve) =>
      setImmediate(() => {
        const turn = meter.enter('session');
        turn.what = 'allocate';
        meter.enter('session').what = 'release';
        meter.enter('grpc', 'Map');
        cpuNs += 3_000_000;
        resolve();
      }),
    );
    await settled();
    meter.enter('completion', 'release');
    cpuNs += 100_000;
    await settled();
    const snapshot = meter.snapshot();
    expect(snapshot.cpuMaxKind).toBe('session');
    expect(snapshot.cpuMaxWhat).toBe('session allocate (+2 entries inside it)');
    meter.reset();
    expect(meter.snapshot().cpuMaxWhat).toBeUndefined();
  });

  it('tells each turn past the long-turn limit, by CPU time where measured, to onLong', async () => {
    let cpuNs = 0;
    const meter = new TurnMeter(() => cpuNs, undefined, 2);
    const long: Array<{ kind: string; what?: string; cpuMs?: number; entries: number }> = [];
    meter.onLong = (turn) => long.push({ kind: turn.kind, what: turn.what, cpuMs: turn.cpuMs, entries: turn.entries });
    meter.enter('grpc', 'GetStats');
    cpuNs += 1_000_000; // 1 ms: under the limit
    await settled();
    meter.enter('session').what = 'allocate';
    cpuNs += 4_500_000;
    await settled();
    expect(long).toEqual([{ kind: 'session', what: 'allocate', cpuMs: 4.5, entries: 1 }]);
    // Without a CPU clock, the wall clock decides.
    const walled = new TurnMeter(undefined, undefined, 2);
    const seen: string[] = [];
    walled.onLong = (turn) => seen.push(`${turn.kind} ${turn.what} ${turn.wallMs >= 3}`);
    walled.enter('completion', 'create');
    spin(3);
    await settled();
    expect(seen).toEqual(['completion create true']);
  });

  it('names a completion by the backend method whose promise resumed it', async () => {
    let cpuNs = 0;
    const meter = new TurnMeter(() => cpuNs);
    const backend = measureCompletions(
      {
        async exportHandle(): Promise<number> {
          return 7;
        },
      },
      meter,
    );
    await backend.exportHandle();
    cpuNs += 500_000;
    await settled();
    expect(meter.snapshot().cpuMaxWhat).toBe('completion exportHandle');
  });
});

describe("a session turn's name", () => {
  it("is the message's type only for types the daemon knows: a client's own text never reaches GetStats or the log", () => {
    const known = (type: string) => ['allocate', 'release', 'ping'].includes(type);
    expect(sessionTurnLabel('allocate', known)).toBe('allocate');
    expect(sessionTurnLabel('transfer', known)).toBe('transfer');
    expect(sessionTurnLabel('X'.repeat(4000), known)).toBe('unknown message');
    expect(sessionTurnLabel('allocate\n{"level":60}', known)).toBe('unknown message');
    expect(sessionTurnLabel('constructor', known)).toBe('unknown message');
  });
});

describe('entries inside a turn (one readable callback drains several messages)', () => {
  it('are counted in the outermost turn, not as turns of their own: one stretch, one record, one long-turn report', async () => {
    let cpuNs = 0;
    const meter = new TurnMeter(() => cpuNs, undefined, 2);
    const long: string[] = [];
    const observed: string[] = [];
    meter.onLong = (turn) => long.push(`${turn.kind} ${turn.what} entries=${turn.entries} cpu=${turn.cpuMs}`);
    meter.observe = (kind) => observed.push(kind);
    await new Promise<void>((resolve) =>
      setImmediate(() => {
        meter.enter('session').what = 'release';
        meter.enter('session').what = 'allocate';
        meter.enter('grpc', 'Map');
        cpuNs += 3_000_000;
        resolve();
      }),
    );
    await settled();
    expect(long).toEqual(['session release entries=3 cpu=3']);
    expect(observed).toEqual(['session']);
    expect(meter.snapshot()).toMatchObject({ count: 1, cpuMaxWhat: 'session release (+2 entries inside it)' });
    // The next stretch is a turn of its own again.
    meter.enter('completion', 'release');
    cpuNs += 100_000;
    await settled();
    expect(meter.snapshot().count).toBe(2);
  });
});
