/**
 * The shape of the sources (small files, each saying what it is for): no TypeScript file under server/,
 * client/, common/ or native/ over 500 lines, and each opens with the
 * comment that names its one job.
 */
import * as fs from 'node:fs';
import * as path from 'node:path';

const root = path.resolve(__dirname, '..', '..');
const MAX_LINES = 500;

function sources(dir: string): string[] {
  return fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    return entry.isDirectory() ? sources(full) : entry.name.endsWith('.ts') && !entry.name.endsWith('.d.ts') ? [full] : [];
  });
}

const files = ['server', 'client', 'common', 'native'].flatMap((dir) => sources(path.join(root, dir))).map((file) => ({
  name: path.relative(root, file),
  text: fs.readFileSync(file, 'utf8'),
}));

describe('source files', () => {
  it(`have at most ${MAX_LINES} lines each`, () => {
    expect(files.length).toBeGreaterThan(50);
    const long = files.map(({ name, text }) => ({ name, lines: text.split('\n').length - (text.endsWith('\n') ? 1 : 0) })).filter(({ lines }) => lines > MAX_LINES);
    expect(long).toEqual([]);
  });

  it('open with a doc comment of at least one sentence saying what the file is for', () => {
    const bare = files.filter(({ text }) => !/^(#![^\n]*\n)?\/\*\*\s*\n?\s*\*?\s*\S[^\n]{15,}/.test(text)).map(({ name }) => name);
    expect(bare).toEqual([]);
  });
});
