#!/usr/bin/env node
// Writes the files generated from the declarations in common/ (error codes,
// daemon settings, client constants and environment): the Python client's
// constants module and the tables of docs/PROTOCOL.md and
// docs/CONFIGURATION.md. Runs after tsc (it reads dist/common); with --check
// it only says which files are out of date and exits 1.
'use strict';
const fs = require('node:fs');
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const { GENERATED_FILES } = require(path.join(root, 'dist', 'common', 'render-declared.js'));
const check = process.argv.includes('--check');
let stale = 0;
for (const file of GENERATED_FILES) {
  const where = path.join(root, file.path);
  const current = fs.existsSync(where) ? fs.readFileSync(where, 'utf8') : '';
  const wanted = file.render(current);
  if (wanted === current) continue;
  if (check) {
    stale += 1;
    console.error(`${file.path} is out of date: run npm run build`);
  } else {
    fs.writeFileSync(where, wanted);
    console.log(`wrote ${file.path}`);
  }
}
process.exit(stale === 0 ? 0 : 1);
