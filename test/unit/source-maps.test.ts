/**
 * The package ships dist/ without the TypeScript sources: each source map
 * must carry its sources itself (inlineSources), or a stack trace points a
 * debugger at files the tarball does not hold.
 */
import * as fs from 'node:fs';
import * as path from 'node:path';

const DIST = path.resolve(__dirname, '..', '..', 'dist');

(fs.existsSync(DIST) ? test : test.skip)('every source map of the shipped folders carries its sources', () => {
  const lacking: string[] = [];
  const walk = (dir: string): void => {
    for (const entry of fs.readdirSync(dir, { withFileTypes: true })) {
      const at = path.join(dir, entry.name);
      if (entry.isDirectory()) walk(at);
      else if (entry.name.endsWith('.js.map')) {
        const map = JSON.parse(fs.readFileSync(at, 'utf8')) as { sources: string[]; sourcesContent?: Array<string | null> };
        if (map.sourcesContent === undefined || map.sourcesContent.length !== map.sources.length || map.sourcesContent.some((text) => typeof text !== 'string'))
          lacking.push(path.relative(DIST, at));
      }
    }
  };
  for (const shipped of ['client', 'common', 'server', 'native']) walk(path.join(DIST, shipped));
  expect(lacking).toEqual([]);
});
