/**
 * The published client reaches the addon only through small typed modules:
 * native/client.ts (its calls), native/mapping.ts (maps only into ranges it
 * reserved), native/seqpacket.ts (the session socket), native/busy-poll.ts
 * (spinning while a request waits for its answer).
 */
import * as fs from 'node:fs';
import * as path from 'node:path';
import { native } from '../../native/client';

const root = path.resolve(__dirname, '..', '..');
const ALLOWED = new Set(['native/client', 'native/mapping', 'native/seqpacket', 'native/busy-poll']);

function sources(dir: string): string[] {
  return fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    return entry.isDirectory() ? sources(full) : entry.name.endsWith('.ts') ? [full] : [];
  });
}

describe('the client library and the addon', () => {
  it('imports native code through native/client, native/mapping, native/seqpacket and native/busy-poll only', () => {
    const reached: string[] = [];
    for (const file of sources(path.join(root, 'client'))) {
      for (const [, specifier] of fs.readFileSync(file, 'utf8').matchAll(/from '(\.[^']+)'/g)) {
        const target = path.relative(root, path.resolve(path.dirname(file), specifier));
        if (target === 'native' || target.startsWith('native/')) reached.push(`${path.relative(root, file)} -> ${target}`);
      }
    }
    expect(reached.length).toBeGreaterThan(5);
    expect(reached.filter((edge) => !ALLOWED.has(edge.split(' -> ')[1]))).toEqual([]);
  });

  it('offers the client its calls only: no mapping at a chosen address, no fault injection, no daemon calls', () => {
    const names = Object.keys(native);
    expect(Object.isFrozen(native)).toBe(true);
    for (const hidden of ['hostMap', 'hostReserve', 'hostProtect', 'cudaMap', 'cudaSetAccess', 'faultsSet', 'seqpacketListen', 'hostMemfdSealReadOnly']) {
      expect(names).not.toContain(hidden);
    }
    expect(names).toEqual(expect.arrayContaining(['close', 'dup', 'cudaImportFd', 'cudaCopyToDevice', 'hostMemfdCreate']));
    expect(native.pageSize()).toBeGreaterThan(0);
  });
});
