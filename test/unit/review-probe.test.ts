import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { parseCommandLine, USAGE } from '../../server/config';
function run(argv: string[], env: NodeJS.ProcessEnv = {}) {
  const parsed = parseCommandLine(argv, { VMMD_SOCKET_DIR: '/tmp/x', ...env }, 4096);
  if (parsed.kind !== 'run') throw new Error('x');
  return parsed.config;
}
function file(content: string): string {
  const name = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-config-')), 'vmmd.json');
  fs.writeFileSync(name, content);
  return name;
}
it('probe', () => {
  expect(run(['--config', file('{"turnCpu": false}')]).turnCpu).toBe(false);
  expect(run(['--config', file('{"turnCpu": true}')]).turnCpu).toBe(true);
  expect(run(['--config', file('{"turnCpu": "off"}')]).turnCpu).toBe(false);
  expect(() => run(['--config', file('{"turnCpu": 0}')])).toThrow(/vmmd\.json: turnCpu: "0" is not one of on, off, true, false/);
  expect(() => run([], { VMMD_TURN_CPU: 'no' })).toThrow(/^VMMD_TURN_CPU: "no" is not one of on, off, true, false/);
  expect(() => run([], { VMMD_TURN_CPU: '' })).toThrow(/VMMD_TURN_CPU/);
  expect(() => run(['--turn-cpu'])).toThrow(/turn-cpu/);
  console.log(USAGE.split('\n').filter((l) => /turn-cpu|busy-poll|TURN/.test(l)).join('\n'));
});
