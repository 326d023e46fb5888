#!/usr/bin/env node
/**
 * Finds import circles among the TypeScript sources (what
 * `madge --circular --extensions ts` reports, type-only imports included):
 *   node scripts/import-cycles.js [dir...]   (default: server client common native bench)
 * Exits 1 and prints each circle when there is one. `npm test` runs it
 * through test/unit/import-cycles.test.ts.
 */
'use strict';
const fs = require('node:fs');
const path = require('node:path');

const DEFAULT_DIRS = ['server', 'client', 'common', 'native', 'bench'];

function sources(dir) {
  const found = [];
  for (const entry of fs.readdirSync(dir, { withFileTypes: true })) {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) found.push(...sources(full));
    else if (entry.name.endsWith('.ts') && !entry.name.endsWith('.d.ts')) found.push(full);
  }
  return found;
}

/** The file a relative specifier names: x.ts, or x/index.ts. */
function resolve(from, specifier) {
  const base = path.resolve(path.dirname(from), specifier);
  for (const candidate of [`${base}.ts`, path.join(base, 'index.ts'), base]) {
    if (candidate.endsWith('.ts') && fs.existsSync(candidate)) return candidate;
  }
  return undefined;
}

// import … from '…', import '…', export … from '…', require('…'), import('…'): relative ones only.
const SPECIFIERS = /(?:\bfrom\s+|\bimport\s+|\brequire\(\s*|\bimport\(\s*)['"](\.{1,2}\/[^'"]+)['"]/g;

/**
 * The import circles among the .ts files under `dirs` of `root`, each as the
 * list of its files (relative to root), and how many files were read.
 */
function findCircles(root, dirs = DEFAULT_DIRS) {
  const files = dirs.filter((dir) => fs.existsSync(path.join(root, dir))).flatMap((dir) => sources(path.join(root, dir)));
  const graph = new Map();
  for (const file of files) {
    const text = fs.readFileSync(file, 'utf8').replace(/\/\*[\s\S]*?\*\//g, '').replace(/^\s*\/\/.*$/gm, '');
    const edges = new Set();
    for (const match of text.matchAll(SPECIFIERS)) {
      const target = resolve(file, match[1]);
      if (target !== undefined) edges.add(target);
    }
    graph.set(file, [...edges]);
  }

  // Tarjan's strongly connected components: every component of two or more files (or a file importing itself) is a circle.
  let index = 0;
  const stack = [];
  const state = new Map();
  const circles = [];
  function visit(file) {
    const mine = { index, low: index, onStack: true };
    index++;
    state.set(file, mine);
    stack.push(file);
    for (const next of graph.get(file) ?? []) {
      if (!graph.has(next)) continue;
      const seen = state.get(next);
      if (seen === undefined) {
        visit(next);
        mine.low = Math.min(mine.low, state.get(next).low);
      } else if (seen.onStack) {
        mine.low = Math.min(mine.low, seen.index);
      }
    }
    if (mine.low === mine.index) {
      const component = [];
      let member;
      do {
        member = stack.pop();
        state.get(member).onStack = false;
        component.push(member);
      } while (member !== file);
      if (component.length > 1 || (graph.get(file) ?? []).includes(file)) circles.push(component);
    }
  }
  for (const file of graph.keys()) if (!state.has(file)) visit(file);
  const name = (file) => path.relative(root, file);
  return { files: files.length, circles: circles.map((circle) => circle.map(name).sort()) };
}

module.exports = { findCircles, DEFAULT_DIRS };

if (require.main === module) {
  const root = path.resolve(__dirname, '..');
  const dirs = process.argv.slice(2).length > 0 ? process.argv.slice(2) : DEFAULT_DIRS;
  const { files, circles } = findCircles(root, dirs);
  if (circles.length > 0) {
    console.error(`import circles: ${circles.length}`);
    for (const circle of circles) console.error(`  ${circle.join(' <-> ')}`);
    process.exit(1);
  }
  console.log(`no import circles among ${files} TypeScript files (${dirs.join(', ')})`);
}
