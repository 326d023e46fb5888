/**
 * The shape of the sources: each TypeScript file under server/, client/,
 * common/ or native/ opens with the comment that names its one job. (How long
 * a file may be and which folder may import which are the lint's rules:
 * test/unit/lint-rules.test.ts.)
 */
import * as fs from 'node:fs';
import * as path from 'node:path';

const root = path.resolve(__dirname, '..', '..');

function sources(dir: string): string[] {
  return fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    return entry.isDirectory() ? sources(full) : entry.name.endsWith('.ts') && !entry.name.endsWith('.d.ts') ? [full] : [];
  });
}

const files = ['server', 'client', 'common', 'native']
  .flatMap((dir) => sources(path.join(root, dir)))
  .map((file) => ({
    name: path.relative(root, file),
    text: fs.readFileSync(file, 'utf8'),
  }));

describe('source files', () => {
  it('open with a doc comment of at least one sentence saying what the file is for', () => {
    expect(files.length).toBeGreaterThan(50);
    const bare = files.filter(({ text }) => !/^(#![^\n]*\n)?\/\*\*\s*\n?\s*\*?\s*\S[^\n]{15,}/.test(text)).map(({ name }) => name);
    expect(bare).toEqual([]);
  });
});
