#!/usr/bin/env node
// Generates TypeScript types for proto/ with the same options the daemon and
// the client load the protos with (proto/loader-options.json), so that the
// types describe exactly the objects grpc-js hands out.
'use strict';
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const options = require(path.join(root, 'proto', 'loader-options.json'));
const protoDir = path.join(root, 'proto', 'vmmd', 'v1');
const files = fs
  .readdirSync(protoDir)
  .filter((f) => f.endsWith('.proto'))
  .map((f) => `vmmd/v1/${f}`);
const outDir = path.join(root, 'generated');
fs.rmSync(outDir, { recursive: true, force: true });

const args = [
  require.resolve('@grpc/proto-loader/build/bin/proto-loader-gen-types.js'),
  '--grpcLib=@grpc/grpc-js',
  '--includeComments',
  `--outDir=${outDir}`,
  `--longs=${options.longs}`,
  `--enums=${options.enums}`,
  ...(options.keepCase ? ['--keepCase'] : []),
  ...(options.defaults ? ['--defaults'] : []),
  ...(options.oneofs ? ['--oneofs'] : []),
  ...options.includeDirs.map((dir) => `--includeDirs=${path.join(root, dir)}`),
];
// The file names go first: yargs lets an array option swallow the words after it.
args.splice(1, 0, ...files);
execFileSync(process.execPath, args, { stdio: 'inherit', cwd: root });

// What `Admin.GetVersion` reports as the build: the commit this tree was built from.
let commit = 'unknown';
try {
  commit = execFileSync('git', ['rev-parse', '--short', 'HEAD'], { cwd: root, stdio: ['ignore', 'pipe', 'ignore'] })
    .toString()
    .trim();
} catch {
  // not a git checkout (a bundle, a container build): 'unknown'
}
fs.writeFileSync(path.join(outDir, 'build-info.json'), `${JSON.stringify({ commit, built: new Date().toISOString() })}\n`);
