/**
 * The shape of the project's pages and records, so that the tree stays
 * readable: a short README that opens with the two commands, a BENCHMARKS.md
 * that holds the latest results and not their history, at most a handful of
 * kept measurement files (git history is the archive), no test counts
 * written by hand (they are wrong as soon as a test is added), and comments
 * and test names that give reasons rather than point at events a reader of
 * the repository cannot look up.
 */
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';

const root = path.resolve(__dirname, '..', '..');
const read = (file: string) => fs.readFileSync(path.join(root, file), 'utf8');
const lineCount = (text: string) => text.split('\n').length - (text.endsWith('\n') ? 1 : 0);

/** Tracked files, or undefined outside a git checkout (the GPU bundle has none). */
function tracked(...paths: string[]): string[] | undefined {
  try {
    return execFileSync('git', ['ls-files', '-z', '--', ...paths], { cwd: root, encoding: 'utf8' })
      .split('\0')
      .filter(Boolean);
  } catch {
    return undefined;
  }
}

// Written in pieces so that this file does not match itself.
const CITATION = new RegExp(['issue', '[0-9]+|outside', 'review|finding', '[0-9]'].join(' '));

const PAGES = ['README.md', 'BENCHMARKS.md', 'RELIABILITY.md', 'CHANGELOG.md', ...fs.readdirSync(path.join(root, 'docs')).map((name) => `docs/${name}`)];

describe('the pages', () => {
  it('README.md has at most 200 lines and opens with the commands to run it and to test it', () => {
    const readme = read('README.md');
    expect(lineCount(readme)).toBeLessThanOrEqual(200);
    expect(readme.split('\n').slice(0, 6).join('\n')).toMatch(/```sh\nnpm ci && npm start .*\nnpm test .*\n```/);
  });

  it('BENCHMARKS.md has at most 300 lines', () => {
    expect(lineCount(read('BENCHMARKS.md'))).toBeLessThanOrEqual(300);
  });

  it('write no test counts by hand', () => {
    const counted = PAGES.flatMap((page) =>
      read(page)
        .split('\n')
        .map((line, i) => ({ where: `${page}:${i + 1}`, line }))
        .filter(({ line }) => /\b\d[\d,]* (tests?|passed|skipped)\b|\b(tests?|passed|skipped):? \d/i.test(line)),
    );
    expect(counted).toEqual([]);
  });
});

describe('the kept measurements', () => {
  it('are at most 10 files under bench/results, bench/probe and test/gpu/results', () => {
    const files = tracked('bench/results', 'bench/probe', 'test/gpu/results');
    if (files === undefined) return; // not a git checkout
    expect(files.length).toBeLessThanOrEqual(10);
  });
});

describe('comments and test names', () => {
  it('cite reasons, not issues, findings or reviews', () => {
    const files = tracked('server', 'client', 'native', 'common', 'python/src', 'test');
    if (files === undefined) return;
    // Logs of test runs record the names the tests had when they ran; they are records, not sources.
    const sources = files.filter((file) => !file.startsWith('test/gpu/results/') && fs.existsSync(path.join(root, file)));
    const cited = sources.flatMap((file) =>
      read(file)
        .split('\n')
        .map((line, i) => ({ where: `${file}:${i + 1}`, line }))
        .filter(({ line }) => CITATION.test(line)),
    );
    expect(cited).toEqual([]);
  });
});
