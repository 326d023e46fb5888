/**
 * The package as users get it: `npm pack`, then an install of the tarball into
 * a fresh project, offline (the registry is never asked: the dependencies come
 * from npm's cache, which `npm ci` filled for this repository, at the versions
 * of this repository's lockfile), with a PATH that holds no compiler. From
 * there: every example of the README and docs/CLIENT.md as written, `npx vmmd --help`,
 * `npx vmmctl --version`, and a TypeScript consumer type-checked against the
 * shipped declarations. And the checkout that was packed is left as it was:
 * its built addon still loads and its daemon still starts.
 */
import { ChildProcess, execFileSync, spawn, spawnSync, SpawnSyncReturns } from 'node:child_process';
import * as crypto from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';

const REPO = path.resolve(__dirname, '../..');
const TSC = path.join(REPO, 'node_modules', 'typescript', 'bin', 'tsc');
const pkg = JSON.parse(fs.readFileSync(path.join(REPO, 'package.json'), 'utf8'));

let work: string; // temporary: the tarball, the consumer project, the daemon's sockets
let source: string; // the checkout that was packed (a copy of this one)
let consumer: string;
let tarball: string;
let noCompilerPath: string; // a PATH with node, npm and a shell, and no compiler
let installLog = '';

function run(command: string, args: string[], options: { cwd: string; env?: NodeJS.ProcessEnv; input?: string; timeout?: number }): SpawnSyncReturns<string> {
  return spawnSync(command, args, { encoding: 'utf8', timeout: options.timeout ?? 120_000, ...options, env: options.env ?? process.env });
}

function ok(result: SpawnSyncReturns<string>, what: string): string {
  if (result.status !== 0) throw new Error(`${what} exited ${result.status ?? result.signal}:\n${result.stdout}\n${result.stderr}`);
  return result.stdout;
}

/** A directory of links to node, npm, npx and the few tools npm's scripts use: no g++, cc, make or python. */
function pathWithoutCompiler(dir: string): string {
  fs.mkdirSync(dir);
  const which = (tool: string) => execFileSync('sh', ['-c', `command -v ${tool}`], { encoding: 'utf8' }).trim();
  for (const tool of ['node', 'npm', 'npx', 'sh', 'env', 'cat', 'ls', 'rm', 'mkdir']) fs.symlinkSync(fs.realpathSync(which(tool)), path.join(dir, tool));
  return dir;
}

/**
 * The consumer's package.json and a lockfile that pins every dependency of the
 * tarball to this repository's lockfile (same versions, same integrity), so
 * `npm ci --offline` takes each from the cache by its integrity.
 */
function writeConsumer(dir: string, tgz: string): void {
  const lock = JSON.parse(fs.readFileSync(path.join(REPO, 'package-lock.json'), 'utf8'));
  const spec = `file:${path.relative(dir, tgz)}`;
  const integrity = `sha512-${crypto.createHash('sha512').update(fs.readFileSync(tgz)).digest('base64')}`;
  const packages: Record<string, unknown> = {
    '': { name: 'consumer', version: '1.0.0', dependencies: { vmmd: spec } },
    'node_modules/vmmd': {
      version: pkg.version,
      resolved: spec,
      integrity,
      license: pkg.license,
      hasInstallScript: true,
      dependencies: pkg.dependencies,
      bin: pkg.bin,
      engines: pkg.engines,
    },
  };
  for (const [where, entry] of Object.entries(lock.packages as Record<string, { dev?: boolean; link?: boolean; name?: string; version: string }>)) {
    if (where === '' || entry.dev || entry.link) continue;
    const name = entry.name ?? where.slice(where.lastIndexOf('node_modules/') + 'node_modules/'.length);
    // The repository's lockfile omits registry URLs; with one and the integrity npm needs no metadata.
    packages[where] = { resolved: `https://registry.npmjs.org/${name}/-/${name.split('/').pop()}-${entry.version}.tgz`, ...entry };
  }
  fs.writeFileSync(
    path.join(dir, 'package.json'),
    JSON.stringify({ name: 'consumer', version: '1.0.0', private: true, dependencies: { vmmd: spec } }, null, 2),
  );
  fs.writeFileSync(
    path.join(dir, 'package-lock.json'),
    JSON.stringify({ name: 'consumer', version: '1.0.0', lockfileVersion: 3, requires: true, packages }, null, 2),
  );
}

beforeAll(() => {
  work = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-package-'));
  consumer = path.join(work, 'consumer');
  fs.mkdirSync(consumer);
  const packed = path.join(work, 'packed');
  fs.mkdirSync(packed);
  // Packed from a copy of the source tree (what git holds, as a clone has it), so that
  // the rebuilds of pack do not touch the dist/ and build/ that other tests run from.
  source = path.join(work, 'source');
  const tracked = execFileSync('git', ['ls-files', '-z', '--cached', '--others', '--exclude-standard'], { cwd: REPO, encoding: 'utf8' })
    .split('\0')
    .filter(Boolean);
  for (const file of tracked) {
    if (!fs.existsSync(path.join(REPO, file))) continue; // deleted, not yet committed
    fs.mkdirSync(path.dirname(path.join(source, file)), { recursive: true });
    fs.copyFileSync(path.join(REPO, file), path.join(source, file));
  }
  fs.symlinkSync(path.join(REPO, 'node_modules'), path.join(source, 'node_modules'));
  // npm pack runs prepack (prebuildify: the addon into prebuilds/) and prepare (the TypeScript).
  ok(run('npm', ['pack', '--pack-destination', packed], { cwd: source, timeout: 400_000 }), 'npm pack');
  tarball = path.join(packed, `vmmd-${pkg.version}.tgz`);
  writeConsumer(consumer, tarball);
  noCompilerPath = pathWithoutCompiler(path.join(work, 'bin'));
  const installed = run('npm', ['ci', '--offline', '--no-audit', '--no-fund', '--foreground-scripts'], {
    cwd: consumer,
    env: { ...process.env, PATH: noCompilerPath },
    timeout: 180_000,
  });
  installLog = `${installed.stdout}\n${installed.stderr}`;
  ok(installed, 'npm ci --offline in the consumer');
}, 600_000);

afterAll(() => {
  if (work) fs.rmSync(work, { recursive: true, force: true });
});

const installedRoot = () => path.join(consumer, 'node_modules', 'vmmd');

describe('the tarball', () => {
  test('holds the compiled code of every directory the code requires, the prebuilt addon, the license, and no tests', () => {
    const files = execFileSync('tar', ['tzf', tarball], { encoding: 'utf8' }).split('\n').filter(Boolean);
    for (const needed of [
      'package/LICENSE',
      'package/README.md',
      'package/dist/common/paths.js',
      'package/dist/common/proto.js',
      'package/dist/client/index.js',
      'package/dist/client/index.d.ts',
      'package/dist/server/main.js',
      'package/dist/native/index.js',
      'package/bin/vmmd.js',
      'package/bin/vmmctl.js',
      `package/prebuilds/${process.platform}-${process.arch}/vmmd.glibc.node`,
      'package/binding.gyp',
      'package/native/src/addon.cc',
      'package/proto/vmmd/v1/virtual_memory.proto',
    ]) {
      expect(files).toContain(needed);
    }
    expect(files.filter((file) => file.startsWith('package/dist/test/') || file.startsWith('package/test/'))).toEqual([]);
    // Every relative require of the shipped JavaScript resolves inside the tarball.
    const shipped = new Set(files.map((file) => file.slice('package/'.length)));
    const missing: string[] = [];
    for (const file of shipped) {
      if (!file.endsWith('.js')) continue;
      const source = fs.readFileSync(path.join(installedRoot(), file), 'utf8');
      for (const [, request] of source.matchAll(/require\("(\.{1,2}\/[^"]+)"\)/g)) {
        const target = path.posix.normalize(path.posix.join(path.posix.dirname(file), request));
        if (!['', '.js', '.json', '/index.js'].some((ending) => shipped.has(`${target}${ending}`))) missing.push(`${file} → ${request}`);
      }
    }
    expect(missing).toEqual([]);
  });

  test('the license is the Apache License 2.0 that package.json names, in full', () => {
    const license = fs.readFileSync(path.join(REPO, 'LICENSE'), 'utf8');
    expect(pkg.license).toBe('Apache-2.0');
    expect(license).toMatch(/^\s*Apache License\s+Version 2\.0, January 2004/);
    expect(license).toContain('TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION');
    expect(license).toContain('END OF TERMS AND CONDITIONS');
    expect(license.split('\n').length).toBeGreaterThan(190);
  });
});

describe('the checkout that was packed', () => {
  test('still loads its own built addon and starts its daemon (npm start after npm pack)', async () => {
    // prebuildify moves build/Release's addon into prebuilds/, which postpack removes.
    expect(fs.existsSync(path.join(source, 'prebuilds'))).toBe(false);
    const loaded = ok(
      run('node', ['-e', "require('./dist/native'); process.stdout.write(Object.keys(require.cache).filter((f) => f.endsWith('.node')).join('\\n'))"], {
        cwd: source,
      }),
      "loading the checkout's addon",
    );
    expect(loaded).toBe(path.join(fs.realpathSync(source), 'build', 'Release', 'vmmd_native.node'));
    const sockets = path.join(work, 'packed-checkout-sockets');
    const daemon = spawn('node', ['bin/vmmd.js', '--backend', 'host', '--socket-dir', sockets, '--log-level', 'warn'], {
      cwd: source,
      stdio: ['ignore', 'ignore', 'pipe'],
    });
    let stderr = '';
    daemon.stderr!.on('data', (chunk) => (stderr += chunk));
    const exited = new Promise((resolve) => daemon.once('exit', resolve));
    try {
      const deadline = Date.now() + 30_000;
      while (!fs.existsSync(path.join(sockets, 'vmmd.session.sock'))) {
        if (Date.now() > deadline || daemon.exitCode !== null) throw new Error(`the packed checkout's daemon did not start:\n${stderr}`);
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
    } finally {
      if (daemon.exitCode === null) daemon.kill('SIGTERM');
      await exited;
    }
  }, 60_000);
});

describe('installed offline with no compiler', () => {
  test('the PATH used has no compiler, and the addon loads from the shipped prebuild', () => {
    const probe = run('sh', ['-c', 'command -v g++ || command -v c++ || command -v cc || command -v make || echo none'], {
      cwd: consumer,
      env: { PATH: noCompilerPath },
    });
    expect(probe.stdout.trim()).toBe('none');
    // Nothing was compiled in the installed package: no build/ directory.
    expect(fs.existsSync(path.join(installedRoot(), 'build'))).toBe(false);
    const loaded = ok(
      run('node', ['-e', "require('vmmd'); process.stdout.write(Object.keys(require.cache).filter((f) => f.endsWith('.node')).join('\\n'))"], {
        cwd: consumer,
        env: { ...process.env, PATH: noCompilerPath },
      }),
      'loading vmmd',
    );
    expect(loaded).toBe(path.join(fs.realpathSync(installedRoot()), 'prebuilds', `${process.platform}-${process.arch}`, 'vmmd.glibc.node'));
    expect(installLog).not.toMatch(/gyp (ERR|info spawn)/);
  });

  test('npx vmmd --help and npx vmmctl --version answer from the installed package', () => {
    const env = { ...process.env, PATH: noCompilerPath };
    const help = ok(run('npx', ['--offline', 'vmmd', '--help'], { cwd: consumer, env }), 'npx vmmd --help');
    expect(help).toMatch(/^Usage: vmmd/m);
    expect(help).toContain('--socket-dir');
    const version = ok(run('npx', ['--offline', 'vmmctl', '--version'], { cwd: consumer, env }), 'npx vmmctl --version');
    expect(version.trim()).toBe(`vmmctl ${pkg.version}`);
  });

  test('a TypeScript consumer type-checks against the shipped declarations', () => {
    const dir = path.join(consumer, 'typed');
    fs.mkdirSync(dir, { recursive: true });
    fs.writeFileSync(
      path.join(dir, 'consumer.ts'),
      `import { connect, VmmdClient, VmmdError, VmmdMemoryManager, ExternalAllocation, SharedHostMemory, Context, Config, ErrorCode } from 'vmmd';
export async function use(): Promise<number> {
  const client: VmmdClient = await connect({ socketDir: '/nonexistent' });
  const backend: 'host' | 'cuda' = client.backend;
  const manager = new VmmdMemoryManager({ client, device: 0, backend: client.backend });
  const allocation = await client.vmm.create({ size: 2n << 20n });
  const memory = await client.vmm.import(allocation.id);
  await memory.write(0, Uint8Array.of(1));
  const bytes: Uint8Array = await memory.read(0, 1);
  const shared = SharedHostMemory.allocate(4096);
  const attached = await ExternalAllocation.createSysmem(shared, 4096, { readOnly: true }).attach(client, { name: 'x' });
  await attached.detach(client);
  const context = await Context.create(new Config().setDevice('#0'));
  await context.close();
  try { await client.admin.getStats(); } catch (error) { if (error instanceof VmmdError) return error.errorCode === ErrorCode.OUT_OF_MEMORY ? 3 : 2; }
  void manager; void backend;
  return bytes.length;
}
`,
    );
    fs.writeFileSync(
      path.join(dir, 'tsconfig.json'),
      JSON.stringify({
        compilerOptions: {
          strict: true,
          noEmit: true,
          target: 'ES2022',
          module: 'commonjs',
          moduleResolution: 'node',
          lib: ['ES2022', 'ESNext.Disposable'],
          types: ['node'],
          typeRoots: [path.join(REPO, 'node_modules', '@types')],
        },
        files: ['consumer.ts'],
      }),
    );
    ok(run('node', [TSC, '-p', dir], { cwd: dir }), 'tsc on the consumer');
  });
});

/** The fenced blocks of a markdown text: [info string, body]. */
function fencedBlocks(markdown: string): Array<{ lang: string; body: string }> {
  return [...markdown.matchAll(/^```(\w*)\n([\s\S]*?)^```$/gm)].map(([, lang, body]) => ({ lang, body }));
}

/**
 * Blocks not run here, each with the reason. Any other block is run: a new
 * example that is neither run nor listed here fails the last test.
 */
const NOT_RUN: Array<[RegExp, string]> = [
  [/^npm ci && npm start/, 'commands of the repository (CI runs `npm ci` and `npm test` itself)'],
  [/^npx vmmd \[--config FILE\]/, 'a synopsis with placeholders, not a command'],
  [/^S=\/run\/vmmd\/vmmd\.sock\ngrpcurl/, 'grpcurl is not installed here; test/e2e/operations.test.ts does what it does'],
  [/^scripts\/gpu-bundle\.sh/, 'needs an offline GPU host (the bundle); the lead runs it'],
  [/^docker /, 'Docker is not available on these machines; test/deploy checks what the image runs'],
  [/^proto\/vmmd\/v1\/ +the contract/, 'the layout, not a command'],
  [/^pip install \.\/python/, 'the Python package, from the repository (not part of the npm package)'],
];
/** Languages whose blocks belong to other packages, with the reason. */
const OTHER_PACKAGES: Record<string, string> = { python: 'the Python package (python/); its own tests run its README examples' };

describe('the examples of the README and docs/CLIENT.md, as written, against the installed package', () => {
  let daemon: ChildProcess | undefined;
  let socketDir: string;
  let env: NodeJS.ProcessEnv;
  let readme: string;

  beforeAll(async () => {
    socketDir = path.join(work, 'sockets');
    env = { ...process.env, PATH: `${path.join(consumer, 'node_modules', '.bin')}:${noCompilerPath}`, VMMD_SOCKET_DIR: socketDir };
    // The README as shipped, and the client's reference page (not shipped: read from the repository).
    readme = `${fs.readFileSync(path.join(installedRoot(), 'README.md'), 'utf8')}\n${fs.readFileSync(path.join(REPO, 'docs', 'CLIENT.md'), 'utf8')}`;
    // The daemon as README users start it: npx vmmd, from the installed package.
    // Its own process group: npx runs vmmd as a child, and the group is stopped whole.
    daemon = spawn('npx', ['--offline', 'vmmd', '--backend', 'host', '--log-level', 'warn'], {
      cwd: consumer,
      env,
      stdio: ['ignore', 'ignore', 'inherit'],
      detached: true,
    });
    const deadline = Date.now() + 60_000;
    while (!fs.existsSync(path.join(socketDir, 'vmmd.session.sock'))) {
      if (Date.now() > deadline || daemon.exitCode !== null) throw new Error('the installed daemon did not start');
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }, 90_000);

  afterAll(async () => {
    if (daemon && daemon.exitCode === null) {
      const exited = new Promise((resolve) => daemon!.once('exit', resolve));
      process.kill(-daemon.pid!, 'SIGTERM');
      await exited;
    }
  });

  test('every TypeScript block type-checks and runs as an ES module', () => {
    const blocks = fencedBlocks(readme).filter((block) => block.lang === 'ts');
    expect(blocks.length).toBeGreaterThanOrEqual(3);
    const dir = path.join(consumer, 'examples');
    fs.mkdirSync(dir, { recursive: true });
    const files = blocks.map((block, i) => {
      fs.writeFileSync(path.join(dir, `example-${i}.mts`), block.body);
      return `example-${i}.mts`;
    });
    fs.writeFileSync(
      path.join(dir, 'tsconfig.json'),
      JSON.stringify({
        compilerOptions: {
          strict: true,
          target: 'ES2022',
          module: 'nodenext',
          moduleResolution: 'nodenext',
          lib: ['ES2022', 'ESNext.Disposable'],
          types: ['node'],
          typeRoots: [path.join(REPO, 'node_modules', '@types')],
          outDir: '.',
        },
        files,
      }),
    );
    ok(run('node', [TSC, '-p', dir], { cwd: dir }), 'tsc on the README examples');
    for (const file of files) {
      const result = run('node', [file.replace(/\.mts$/, '.mjs')], { cwd: dir, env, timeout: 60_000 });
      if (result.status !== 0)
        throw new Error(`README example ${file} failed:\n${fs.readFileSync(path.join(dir, file), 'utf8')}\n${result.stdout}\n${result.stderr}`);
    }
  }, 180_000);

  test('every vmmctl block runs line by line with exit status 0', () => {
    const blocks = fencedBlocks(readme).filter((block) => block.lang === 'sh' && /^vmmctl /.test(block.body));
    expect(blocks.length).toBeGreaterThanOrEqual(1);
    const dir = path.join(consumer, 'operator');
    fs.mkdirSync(dir, { recursive: true });
    // The file the README loads.
    fs.writeFileSync(path.join(dir, 'model.bin'), crypto.randomBytes(3 << 20));
    for (const block of blocks) {
      const result = run('sh', ['-ex', '-c', block.body], { cwd: dir, env, timeout: 120_000 });
      if (result.status !== 0) throw new Error(`README block failed:\n${block.body}\n${result.stdout}\n${result.stderr}`);
    }
    if (fs.existsSync(path.join(dir, 'copy.bin'))) {
      expect(fs.readFileSync(path.join(dir, 'copy.bin')).equals(fs.readFileSync(path.join(dir, 'model.bin')))).toBe(true);
    }
  }, 180_000);

  test('every other block is listed with the reason it is not run here', () => {
    const unclassified = fencedBlocks(readme).filter(
      (block) =>
        block.lang !== 'ts' &&
        !(block.lang === 'sh' && /^vmmctl /.test(block.body)) &&
        OTHER_PACKAGES[block.lang] === undefined &&
        !NOT_RUN.some(([pattern]) => pattern.test(block.body)),
    );
    expect(unclassified.map((block) => block.body.split('\n')[0])).toEqual([]);
  });
});

describe('without a prebuild for this platform', () => {
  test('installing compiles the addon (the fallback) when a compiler is there', () => {
    // The installed copy, its prebuild removed: `npm rebuild` runs the install script again.
    const root = installedRoot();
    fs.rmSync(path.join(root, 'prebuilds'), { recursive: true });
    ok(run('npm', ['rebuild', 'vmmd', '--offline', '--foreground-scripts'], { cwd: consumer, timeout: 300_000 }), 'npm rebuild vmmd');
    expect(fs.existsSync(path.join(root, 'build', 'Release', 'vmmd_native.node'))).toBe(true);
    const loaded = ok(
      run('node', ['-e', "require('vmmd'); process.stdout.write(Object.keys(require.cache).filter((f) => f.endsWith('.node')).join('\\n'))"], {
        cwd: consumer,
      }),
      'loading vmmd',
    );
    expect(loaded).toBe(path.join(fs.realpathSync(root), 'build', 'Release', 'vmmd_native.node'));
  }, 320_000);
});
