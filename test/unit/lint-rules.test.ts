/**
 * The lint's rules bite: dependency-cruiser (.dependency-cruiser.cjs) refuses
 * an import up the layers, an import circle and the client reaching the
 * addon's daemon side, and ESLint (eslint.config.mjs) a source file over 500
 * lines, each shown on a small tree made for the purpose. `npm run lint` runs
 * both over the real tree.
 */
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';

const root = path.resolve(__dirname, '..', '..');
const bin = (name: string) => path.join(root, 'node_modules', '.bin', name);

function tree(files: Record<string, string>): string {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-lint-'));
  fs.writeFileSync(path.join(dir, 'tsconfig.json'), JSON.stringify({ compilerOptions: { module: 'commonjs', target: 'es2022', strict: true } }));
  for (const [name, text] of Object.entries(files)) {
    fs.mkdirSync(path.dirname(path.join(dir, name)), { recursive: true });
    fs.writeFileSync(path.join(dir, name), text);
  }
  return dir;
}

function violations(dir: string): string[] {
  const result = spawnSync(
    bin('depcruise'),
    ['server', 'client', 'native', 'common', '--config', path.join(root, '.dependency-cruiser.cjs'), '--output-type', 'json'],
    {
      cwd: dir,
      encoding: 'utf8',
    },
  );
  const report = JSON.parse(result.stdout) as { summary: { violations: Array<{ from: string; to: string; rule: { name: string } }> } };
  return report.summary.violations.map((v) => `${v.rule.name}: ${v.from} -> ${v.to}`).sort();
}

describe('lint rules', () => {
  it('refuse an import up the layers, a circle and the client reaching past its addon modules', () => {
    const dir = tree({
      'server/app/config.ts': 'export const A = 1;\n',
      'server/backends/select.ts': "import { A } from '../app/config';\nexport const B = A;\n",
      'server/registry/a.ts': "import type { D } from './b';\nexport interface C { d?: D }\n",
      'server/registry/b.ts': "import type { C } from './a';\nexport interface D { c?: C }\n",
      'server/transport/session/s.ts': "import { G } from '../grpc/g';\nexport const S = G;\n",
      'server/transport/grpc/g.ts': 'export const G = 1;\n',
      'native/index.ts': 'export const N = 1;\n',
      'native/client.ts': "export { N } from './index';\n",
      'client/c.ts': "import { N } from '../native/index';\nimport { N as M } from '../native/client';\nexport const X = N + M;\n",
      'common/p.ts': 'export const P = 1;\n',
    });
    try {
      expect(violations(dir)).toEqual([
        'backends-not-up: server/backends/select.ts -> server/app/config.ts',
        'client-addon-surface: client/c.ts -> native/index.ts',
        'no-circular: server/registry/a.ts -> server/registry/b.ts',
        'transports-apart: server/transport/session/s.ts -> server/transport/grpc/g.ts',
      ]);
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  it('refuse a source file over 500 lines', () => {
    const dir = tree({
      'server/long.ts': `/** A file too long. */\n${'export const x0 = 0;\n'.repeat(500)}`,
      'server/short.ts': '/** A short file. */\nexport const y = 1;\n',
    });
    try {
      fs.copyFileSync(path.join(root, 'eslint.config.mjs'), path.join(dir, 'eslint.config.mjs'));
      fs.symlinkSync(path.join(root, 'node_modules'), path.join(dir, 'node_modules'));
      const result = spawnSync(bin('eslint'), ['server', '-f', 'json'], { cwd: dir, encoding: 'utf8' });
      const report = JSON.parse(result.stdout) as Array<{ filePath: string; messages: Array<{ ruleId: string }> }>;
      const found = report.flatMap((file) => file.messages.map((m) => `${path.basename(file.filePath)} ${m.ruleId}`));
      expect(found).toEqual(['long.ts max-lines']);
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
