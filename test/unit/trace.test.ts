/**
 * The driver trace's JavaScript lines (common/trace.ts): off by default,
 * and with VMMD_DRIVER_TRACE=1 one line per call in the addon's format, on
 * CLOCK_MONOTONIC (process.hrtime), which bench/probe/cold_timeline.py parses.
 */
import { execFileSync } from 'node:child_process';
import * as path from 'node:path';

const TRACE = path.join(__dirname, '..', '..', 'dist', 'common', 'trace.js');
const LINE = /^vmmd-trace pid=(\d+) tid=0 begin=(\d+) end=(\d+) result=0 address=0x0 call=(.*)$/;

/** Runs a few trace calls in a fresh process (the switch is read at load) and returns its stderr lines. */
function stderrOf(env: Record<string, string>): string[] {
  const script = `const t = require(${JSON.stringify(TRACE)}); const b = t.traceClock(); t.traceSince('session:allocate', b); t.traceMark('mark:answered');`;
  try {
    execFileSync(process.execPath, ['-e', `${script} process.exit(3)`], { env: { ...process.env, VMMD_DRIVER_TRACE: '', ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  } catch (error) {
    return String((error as { stderr: Buffer }).stderr).split('\n').filter((line) => line !== '');
  }
  throw new Error('the traced process should have exited 3');
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
