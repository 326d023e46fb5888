#!/usr/bin/env node
/**
 * The npm package's prepack step: prebuildify compiles the addon and moves it
 * out of build/Release into prebuilds/<platform>-<arch>/, where the tarball
 * takes it (installing then needs no compiler). A copy goes back into
 * build/Release, so that the checkout that was packed still loads its addon
 * (npm start, the tests) after postpack has removed prebuilds/.
 *   node scripts/prebuild.js   (from the package root, as npm runs prepack)
 */
'use strict';
const { spawnSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');

const ROOT = path.resolve(__dirname, '..');
const TARGET = /"target_name":\s*"([^"]+)"/.exec(fs.readFileSync(path.join(ROOT, 'binding.gyp'), 'utf8'))[1];
const PREBUILDS = path.join(ROOT, 'prebuilds', `${process.platform}-${process.arch}`);
const BUILT = path.join(ROOT, 'build', 'Release', `${TARGET}.node`);

const prebuildify = require.resolve('prebuildify/bin.js', { paths: [ROOT] });
const args = ['--napi', '--strip', '--tag-libc', '--quiet', '--target', process.versions.node];
const result = spawnSync(process.execPath, [prebuildify, ...args], { cwd: ROOT, stdio: 'inherit' });
if (result.status !== 0) process.exit(result.status ?? 1);

const made = fs.readdirSync(PREBUILDS).filter((name) => name.endsWith('.node'));
if (made.length !== 1) throw new Error(`prebuildify left ${made.length} addons in ${PREBUILDS}, expected one: ${made.join(', ')}`);
fs.mkdirSync(path.dirname(BUILT), { recursive: true });
fs.copyFileSync(path.join(PREBUILDS, made[0]), BUILT);
