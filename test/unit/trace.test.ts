/**
 * The driver trace's JavaScript lines (common/trace.ts): off by default,
 * and with VMMD_DRIVER_TRACE=1 one line per call in the addon's format, on
 * CLOCK_MONOTONIC (process.hrtime), which bench/cold_timeline.py parses.
 */
const LINE = /^vmmd-trace pid=(\d+) tid=0 begin=(\d+) end=(\d+) result=0 address=0x0 call=(.*)$/;

/**
 * Loads common/trace.ts from the sources afresh with VMMD_DRIVER_TRACE set to `env`'s value (the switch is read
 * at load), runs a few trace calls and returns the lines it wrote to descriptor 2 (its writeSync, captured).
 */
function stderrOf(env: Record<string, string>): string[] {
  const lines: string[] = [];
  const saved = process.env.VMMD_DRIVER_TRACE;
  process.env.VMMD_DRIVER_TRACE = env.VMMD_DRIVER_TRACE ?? '';
  try {
    jest.isolateModules(() => {
      jest.doMock('node:fs', () => ({
        ...jest.requireActual('node:fs'),
        writeSync: (fd: number, text: string) => {
          if (fd === 2)
            lines.push(
              ...String(text)
                .split('\n')
                .filter((line) => line !== ''),
            );
          return String(text).length;
        },
      }));

      const t = require('../../common/trace') as typeof import('../../common/trace');
      const b = t.traceClock();
      t.traceSince('session:allocate', b);
      t.traceMark('mark:answered');
    });
  } finally {
    jest.dontMock('node:fs');
    if (saved === undefined) delete process.env.VMMD_DRIVER_TRACE;
    else process.env.VMMD_DRIVER_TRACE = saved;
  }
  return lines;
}

describe('the driver trace from JavaScript', () => {
  it('writes nothing unless VMMD_DRIVER_TRACE is set', () => {
    expect(stderrOf({})).toEqual([]);
    expect(stderrOf({ VMMD_DRIVER_TRACE: '0' })).toEqual([]);
  });

  it('writes one line per call in the addon format, begin before end, on the monotonic clock', () => {
    const before = process.hrtime.bigint();
    const lines = stderrOf({ VMMD_DRIVER_TRACE: '1' });
    expect(lines).toHaveLength(2);
    const [call, mark] = lines.map((line) => LINE.exec(line));
    expect(call?.[4]).toBe('session:allocate');
    expect(mark?.[4]).toBe('mark:answered');
    for (const found of [call!, mark!]) {
      expect(BigInt(found[2])).toBeGreaterThanOrEqual(before);
      expect(BigInt(found[3])).toBeGreaterThanOrEqual(BigInt(found[2]));
    }
    // A mark has no length.
    expect(mark![2]).toBe(mark![3]);
  });
});
