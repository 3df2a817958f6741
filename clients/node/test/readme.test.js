'use strict';
// The README's first example runs against the real daemon and prints what it says it prints;
// the middleware example type-checks as a use of index.d.ts (types.test.js).

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('fs');
const path = require('path');
const { spawnSync } = require('child_process');

const { startDaemon } = require('./helpers');

const README = path.join(__dirname, '..', 'README.md');

test('README example', async (t) => {
  const d = await startDaemon(t);
  const blocks = [...fs.readFileSync(README, 'utf8').matchAll(/```js\n([\s\S]*?)```/g)].map((m) => m[1]);
  assert.equal(blocks.length, 2);
  // The example's 50 ms timeout, 5 s here: the test machine may be loaded, and a timeout
  // would (rightly) print the unreachable decision instead.
  assert.ok(blocks[0].includes('timeoutMs: 50,'));
  const code = blocks[0].replace("require('rlsidecar')", `require(${JSON.stringify(path.join(__dirname, '..'))})`)
    .replace('timeoutMs: 50,', 'timeoutMs: 5000,');
  const r = spawnSync(process.execPath, ['-e', code], { env: { ...process.env, RLSIDECAR_SOCKET: d.socket }, encoding: 'utf8', timeout: 20000 });
  assert.equal(r.status, 0, r.stderr);
  // Each console.log's "// ..." comment is what it prints.
  const promised = [...blocks[0].matchAll(/^\s*console\.log\(.*\); \/\/ (.*)$/gm)].map((m) => m[1]);
  assert.equal(promised.length, 5);
  assert.deepEqual(r.stdout.trimEnd().split('\n'), promised);
});
