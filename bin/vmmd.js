#!/usr/bin/env node
'use strict';
const { main } = require('../dist/server/main.js');

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (error) => {
    process.stderr.write(`vmmd: ${(error && error.stack) || error}\n`);
    process.exit(1);
  },
);
