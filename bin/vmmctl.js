#!/usr/bin/env node
'use strict';
const { main } = require('../dist/client/cli/vmmctl.js');

main(process.argv.slice(2)).then((code) => process.exit(code));
