'use strict';
// index.d.ts compiles (tsc --strict) and describes the module: types-usage.ts uses every
// declaration, and two @ts-expect-error lines prove wrong uses are refused.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('path');
const { spawnSync } = require('child_process');

test('index.d.ts type-checks', () => {
  const tsc = path.join(__dirname, '..', 'node_modules', 'typescript', 'bin', 'tsc');
  const r = spawnSync(process.execPath, [tsc, '--noEmit', '--strict', '--target', 'es2020', '--module', 'commonjs',
    '--esModuleInterop', '--types', 'node', path.join(__dirname, 'types-usage.ts')], { encoding: 'utf8', cwd: path.join(__dirname, '..') });
  assert.equal(r.status, 0, r.stdout + r.stderr);
});
