/** No import circles in the tree (each layer loads without the ones above it): the check `npm test` runs, and proof that it finds one. */
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';

// The CommonJS script the command line runs too (node scripts/import-cycles.js).
const { findCircles } = require('../../scripts/import-cycles.js') as {
  findCircles(root: string, dirs?: string[]): { files: number; circles: string[][] };
};

describe('import circles', () => {
  it('finds none among the TypeScript sources (server, client, common, native, bench), type-only imports included', () => {
    const { files, circles } = findCircles(path.resolve(__dirname, '..', '..'));
    expect(files).toBeGreaterThan(50);
    expect(circles).toEqual([]);
  });

  it('finds a circle through a type-only import, an index file and a re-export', () => {
    const root = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-cycles-'));
    try {
      fs.mkdirSync(path.join(root, 'src', 'part'), { recursive: true });
      fs.writeFileSync(path.join(root, 'src', 'a.ts'), "import type { B } from './part';\nexport interface A { b?: B }\n");
      fs.writeFileSync(path.join(root, 'src', 'part', 'index.ts'), "export { B } from './b';\n");
      fs.writeFileSync(path.join(root, 'src', 'part', 'b.ts'), "import { A } from '../a';\nexport class B { a?: A }\n");
      fs.writeFileSync(path.join(root, 'src', 'alone.ts'), "// import { A } from './a'\nexport const C = 1;\n");
      expect(findCircles(root, ['src']).circles).toEqual([['src/a.ts', 'src/part/b.ts', 'src/part/index.ts']]);
    } finally {
      fs.rmSync(root, { recursive: true, force: true });
    }
  });
});
