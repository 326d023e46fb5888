/**
 * vmmctl as an operator runs it: a real daemon, the real bin/vmmctl.js, its
 * exit status, standard output and standard error: what it prints, where,
 * and with which exit status.
 */
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { packageRoot, sleep, TestDaemon } from './harness';

const ROOT = packageRoot();
const VERSION = JSON.parse(fs.readFileSync(path.join(ROOT, 'package.json'), 'utf8')).version;

interface Ran {
  code: number | null;
  stdout: Buffer;
  stderr: string;
  text: string;
}

/** Runs vmmctl with `input` on its standard input (a pipe), or a file opened on it. */
function vmmctl(args: string[], options: { input?: Buffer; stdinFile?: string; shell?: boolean } = {}): Promise<Ran> {
  return new Promise((resolve, reject) => {
    const stdin = options.stdinFile !== undefined ? fs.openSync(options.stdinFile, 'r') : 'pipe';
    const [command, commandArgs] = options.shell ? ['sh', args] : [process.execPath, [path.join(ROOT, 'bin', 'vmmctl.js'), ...args]];
    const child = spawn(command, commandArgs, { stdio: [stdin, 'pipe', 'pipe'] });
    if (typeof stdin === 'number') fs.closeSync(stdin);
    const out: Buffer[] = [];
    const err: Buffer[] = [];
    child.stdout!.on('data', (chunk) => out.push(chunk));
    child.stderr!.on('data', (chunk) => err.push(chunk));
    child.on('error', reject);
    child.on('close', (code) => {
      const stdout = Buffer.concat(out);
      resolve({ code, stdout, stderr: Buffer.concat(err).toString(), text: stdout.toString() });
    });
    if (child.stdin) child.stdin.end(options.input ?? Buffer.alloc(0));
  });
}

describe('vmmctl without a daemon', () => {
  const nowhere = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmctl-nowhere-'));
  afterAll(() => fs.rmSync(nowhere, { recursive: true, force: true }));

  test('an unknown command prints the usage and exits 2 without trying the daemon', async () => {
    const ran = await vmmctl(['--socket-dir', nowhere, 'bogus']);
    expect(ran.code).toBe(2);
    expect(ran.stderr).toMatch(/^vmmctl: unknown command "bogus"\nUsage: vmmctl/);
    expect(ran.stderr).not.toContain('DAEMON_UNREACHABLE');
  });

  test('wrong arguments are usage errors, found before connecting', async () => {
    for (const args of [
      ['store'],
      ['store', 'load', 'x'],
      ['store', 'load', '12', 'file'],
      ['objects', 'abc'],
      ['objects', '-1'],
      ['stats', 'extra'],
      ['devices', '--mutable'],
    ]) {
      const ran = await vmmctl(['--socket-dir', nowhere, ...args]);
      expect({ args, code: ran.code, unreachable: ran.stderr.includes('DAEMON_UNREACHABLE'), usage: ran.stderr.includes('Usage: vmmctl') }).toEqual({
        args,
        code: 2,
        unreachable: false,
        usage: true,
      });
    }
  });

  test("--version is vmmctl's own and needs no daemon; --json too", async () => {
    expect(await vmmctl(['--socket-dir', nowhere, '--version'])).toMatchObject({ code: 0, text: `vmmctl ${VERSION}\n` });
    expect(JSON.parse((await vmmctl(['--json', '--version'])).text)).toEqual({ vmmctl: VERSION });
  });

  test('health without a daemon: exit 1, and why', async () => {
    const ran = await vmmctl(['--socket-dir', nowhere, 'health']);
    expect(ran.code).toBe(1);
    expect(ran.text).not.toBe('SERVING\n');
  });

  test('a refusal is said once: code, then the message', async () => {
    const ran = await vmmctl(['--socket-dir', nowhere, 'stats']);
    expect(ran.code).toBe(2);
    expect(ran.stderr).toMatch(/^vmmctl: DAEMON_UNREACHABLE: cannot reach vmmd at /);
    expect(ran.stderr.match(/DAEMON_UNREACHABLE/g)).toHaveLength(1);
    // Where it looked, and how to point it elsewhere.
    expect(ran.stderr).toContain(`set VMMD_SOCKET_DIR (vmmctl --socket-dir) to the directory of the daemon's sockets`);
    const json = await vmmctl(['--socket-dir', nowhere, '--json', 'stats']);
    expect(JSON.parse(json.stderr)).toMatchObject({ error: { code: 'DAEMON_UNREACHABLE', status: 'UNAVAILABLE' } });
  });
});

describe('vmmctl against a daemon', () => {
  let daemon: TestDaemon;
  let dir: string;
  const ctl = (args: string[], options?: { input?: Buffer; stdinFile?: string }) => vmmctl(['--socket-dir', daemon.dir, ...args], options);

  beforeAll(async () => {
    daemon = await TestDaemon.start(['--host-capacity', '256MiB']);
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmctl-files-'));
  });

  afterAll(async () => {
    fs.rmSync(dir, { recursive: true, force: true });
    expect(await daemon.stop()).toBe(0);
  });

  async function storeIds(): Promise<Array<{ id: string; name: string; state: string; size: string }>> {
    return JSON.parse((await ctl(['--json', 'store', 'ls'])).text);
  }

  test('a taken name is refused before any byte is uploaded', async () => {
    const file = path.join(dir, 'taken.bin');
    fs.writeFileSync(file, randomBytes(3 << 20));
    expect((await ctl(['store', 'load', 'taken', file])).code).toBe(0);
    const before = await daemon.stats();
    const again = await ctl(['store', 'load', 'taken', file]);
    expect(again.code).toBe(2);
    expect(again.stderr).toMatch(/^vmmctl: NAME_TAKEN: a store named "taken" exists \(store \d+\)/);
    // No progress was shown: nothing was read or sent.
    expect(again.stderr).not.toMatch(/%/);
    const after = await daemon.stats();
    expect({ allocations: after.allocations, bytes: after.allocatedBytes }).toEqual({ allocations: before.allocations, bytes: before.allocatedBytes });
    expect((await ctl(['store', 'rm', 'taken'])).code).toBe(0);
  });

  test('- loads from standard input (a pipe) and dumps to standard output, byte for byte', async () => {
    const data = randomBytes((5 << 20) + 123);
    const loaded = await ctl(['store', 'load', 'piped', '-'], { input: data });
    expect(loaded).toMatchObject({ code: 0, text: expect.stringMatching(/^loaded 5\.0 MiB in [\d.]+ s \(.+\/s\) into store \d+ "piped", read-only\n$/) });
    const dumped = await ctl(['store', 'dump', 'piped', '-']);
    expect(dumped.code).toBe(0);
    expect(dumped.stdout.equals(data)).toBe(true);
    // What was done goes to standard error, so standard output is only the bytes.
    expect(dumped.stderr).toMatch(/dumped 5\.0 MiB .* to standard output/);
    expect(fs.existsSync('-')).toBe(false);
    expect((await ctl(['store', 'rm', 'piped'])).code).toBe(0);
  });

  test('/dev/stdin and a file redirected onto standard input load too (no ZERO_SIZE)', async () => {
    const file = path.join(dir, 'redirected.bin');
    const data = randomBytes(1 << 20);
    fs.writeFileSync(file, data);
    // A shell pipe, as operators write it (Node's own 'pipe' would be a socket, which /dev/stdin cannot reopen).
    const piped = await vmmctl(
      ['-c', `cat '${file}' | '${process.execPath}' '${path.join(ROOT, 'bin', 'vmmctl.js')}' --socket-dir '${daemon.dir}' store load devstdin /dev/stdin`],
      { shell: true },
    );
    expect({ code: piped.code, stderr: piped.stderr }).toEqual({ code: 0, stderr: 'load devstdin: 100% (1.0 MiB of 1.0 MiB)\n' });
    expect((await ctl(['store', 'load', 'redirected', '-'], { stdinFile: file })).code).toBe(0);
    for (const name of ['devstdin', 'redirected']) {
      expect((await ctl(['store', 'dump', name, '-'])).stdout.equals(data)).toBe(true);
      expect((await ctl(['store', 'rm', name])).code).toBe(0);
    }
    const empty = await ctl(['store', 'load', 'empty', '-'], { input: Buffer.alloc(0) });
    expect(empty).toMatchObject({ code: 2, stderr: 'vmmctl: ZERO_SIZE: standard input is empty: a store holds at least one byte\n' });
  });

  test('Ctrl-C during store dump FILE leaves no file, whole or cut short', async () => {
    const data = randomBytes(64 << 20);
    expect((await ctl(['store', 'load', 'big', '-'], { input: data })).code).toBe(0);
    const target = path.join(dir, 'interrupted.bin');
    const child = spawn(process.execPath, [path.join(ROOT, 'bin', 'vmmctl.js'), '--socket-dir', daemon.dir, 'store', 'dump', 'big', target], {
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let stderr = '';
    let interrupted = false;
    child.stderr.on('data', (chunk) => {
      stderr += chunk;
      // Once some of it is written (the first progress line past 0%), as a person at a terminal would.
      if (!interrupted && /dump big: [1-9]\d*%/.test(stderr)) {
        interrupted = true;
        child.kill('SIGINT');
      }
    });
    const code = await new Promise((resolve) => child.once('close', resolve));
    expect({ interrupted, code }).toEqual({ interrupted: true, code: 130 });
    expect(fs.readdirSync(dir).filter((name) => name.startsWith('interrupted.bin'))).toEqual([]);
    expect(stderr).toContain(`${target} not written`);
    expect((await ctl(['store', 'rm', 'big'])).code).toBe(0);
  }, 120_000);

  test('a directory where a file is wanted is named in the refusal', async () => {
    expect((await ctl(['store', 'load', 'isdir', dir])).stderr).toBe(`vmmctl: EISDIR: ${dir} is a directory: name a file\n`);
    expect((await ctl(['store', 'load', 'small', '-'], { input: randomBytes(4096) })).code).toBe(0);
    expect((await ctl(['store', 'dump', 'small', dir])).stderr).toBe(`vmmctl: EISDIR: ${dir} is a directory: name a file\n`);
    expect((await ctl(['store', 'rm', 'small'])).code).toBe(0);
  });

  test('the throughput of a load from a pipe counts the time spent reading the pipe', async () => {
    const file = path.join(dir, 'slow.bin');
    fs.writeFileSync(file, randomBytes(1 << 20));
    const slow = await vmmctl(
      ['-c', `(sleep 3; cat '${file}') | '${process.execPath}' '${path.join(ROOT, 'bin', 'vmmctl.js')}' --socket-dir '${daemon.dir}' --json store load slow -`],
      { shell: true },
    );
    expect(slow.code).toBe(0);
    expect(JSON.parse(slow.text).seconds).toBeGreaterThanOrEqual(1);
    expect((await ctl(['store', 'rm', 'slow'])).code).toBe(0);
  });

  test('a store is named by its name or by the id store ls shows', async () => {
    const data = randomBytes(1 << 20);
    expect((await ctl(['store', 'load', 'byid', '-'], { input: data })).code).toBe(0);
    const { id } = (await storeIds()).find((store) => store.name === 'byid')!;
    const copy = path.join(dir, 'copy.bin');
    const dumped = await ctl(['store', 'dump', id, copy]);
    expect(dumped).toMatchObject({ code: 0, text: expect.stringContaining(`from store ${id} "byid" to ${copy}`) });
    expect(fs.readFileSync(copy).equals(data)).toBe(true);
    expect(await ctl(['store', 'dump', '999999', copy])).toMatchObject({ code: 2, stderr: 'vmmctl: UNKNOWN_STORE: store 999999 does not exist\n' });
    expect(await ctl(['store', 'rm', id])).toMatchObject({ code: 0, text: `detached store ${id} "byid"\n` });
  });

  test('objects of an unknown session is an error; of a known one, its objects', async () => {
    expect(await ctl(['objects', '999'])).toMatchObject({
      code: 2,
      stderr: 'vmmctl: UNKNOWN_SESSION: no open session has id 999 (vmmctl sessions lists them)\n',
    });
    const all = await ctl(['--json', 'objects']);
    expect(all.code).toBe(0);
    expect(Array.isArray(JSON.parse(all.text))).toBe(true);
  });

  test('errors from the file system are said once', async () => {
    const missing = path.join(dir, 'missing.bin');
    const ran = await ctl(['store', 'load', 'nofile', missing]);
    expect(ran.code).toBe(2);
    expect(ran.stderr).toBe(`vmmctl: ENOENT: no such file or directory, open '${missing}'\n`);
  });

  test('sizes are human by default and in bytes with --bytes', async () => {
    expect((await ctl(['store', 'load', 'sized', '-'], { input: randomBytes(3 << 20) })).code).toBe(0);
    const human = (await ctl(['store', 'ls'])).text;
    expect(human).toMatch(/^id +name +target +device +size +readOnly +state +opens +owner$/m);
    expect(human).toMatch(/ sized +sysmem +0 +3\.0 MiB +true +live +0 +daemon$/m);
    expect((await ctl(['--bytes', 'store', 'ls'])).text).toMatch(/ sized +sysmem +0 +3145728 +true /);
    expect((await ctl(['devices'])).text).toMatch(/ \d+\.\d (KiB|MiB|GiB|TiB) /);
    const stats = (await ctl(['stats'])).text;
    // One field a line, not one row of every column.
    expect(stats).toMatch(/^allocatedBytes +\d+(\.\d)? (B|KiB|MiB|GiB)$/m);
    expect(stats.split('\n').length).toBeGreaterThan(5);
    expect((await ctl(['--bytes', 'stats'])).text).toMatch(/^allocatedBytes +\d+$/m);
    expect((await ctl(['store', 'rm', 'sized'])).code).toBe(0);
  });

  test('--json works for every command', async () => {
    const file = path.join(dir, 'json.bin');
    fs.writeFileSync(file, randomBytes(1 << 20));
    const load = JSON.parse((await ctl(['--json', 'store', 'load', 'json', file])).text);
    expect(load).toMatchObject({ loaded: String(1 << 20), store: { name: 'json', readOnly: true } });
    const parsed: Record<string, unknown> = {};
    for (const args of [
      ['devices'],
      ['stats'],
      ['sessions'],
      ['objects'],
      ['report'],
      ['clear-caches'],
      ['version'],
      ['store', 'ls'],
      ['store', 'dump', 'json', path.join(dir, 'out.bin')],
      ['store', 'rm', 'json'],
    ]) {
      const ran = await ctl(['--json', ...args]);
      expect({ args, code: ran.code }).toEqual({ args, code: 0 });
      parsed[args.join(' ')] = JSON.parse(ran.text);
    }
    expect(parsed['store rm json']).toMatchObject({ name: 'json', state: 'STORE_STATE_DETACHED' });
    expect(parsed.version).toMatchObject({ vmmctl: VERSION });
    expect(parsed['store dump json ' + path.join(dir, 'out.bin')]).toMatchObject({ dumped: String(1 << 20) });
  });
});

describe("vmmctl's inspection in the daemon's log", () => {
  // A container's health check runs vmmctl every 30 s: an inspection that logged a line or two at info each time
  // would write thousands of lines a day. Inspection goes without a session, so the daemon logs nothing of it.
  test('one inspection call of each kind writes no line at info in the daemon log', async () => {
    const daemon = await TestDaemon.start(['--log-level', 'info']);
    try {
      const infoLines = () => daemon.logs.filter((line) => line.startsWith('{') && JSON.parse(line).level === 30);
      const before = infoLines().length;
      for (const args of [['stats'], ['sessions'], ['devices'], ['objects'], ['store', 'ls'], ['version'], ['report'], ['health']]) {
        const ran = await vmmctl(['--socket-dir', daemon.dir, ...args]);
        expect({ args, code: ran.code, stderr: ran.stderr }).toEqual({ args, code: 0, stderr: '' });
      }
      // What a closing session logs comes after the client is gone.
      await sleep(500);
      expect(infoLines().slice(before)).toEqual([]);
    } finally {
      expect(await daemon.stop()).toBe(0);
    }
  });
});
