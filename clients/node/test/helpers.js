'use strict';
// The real rlsidecar daemon for the tests: built once per test file with go build (or
// taken from $RLSIDECAR_BIN), started on a temp socket with a temp rules file.

const { execFileSync, spawnSync, spawn } = require('child_process');
const fs = require('fs');
const os = require('os');
const path = require('path');

const ROOT = path.resolve(__dirname, '..', '..', '..');

const RULES = `
rules:
  - name: per-user
    key: user
    limit: { requests: 5, per: 60s }
  - name: login-per-ip
    match: { method: POST, path: /login }
    key: ip
    limit: { requests: 3, per: 60s }
`;

let built = null;

function binary() {
  if (process.env.RLSIDECAR_BIN) return process.env.RLSIDECAR_BIN;
  if (built) return built;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rls-node-bin'));
  const out = path.join(dir, 'rlsidecar');
  const r = spawnSync('go', ['build', '-o', out, './cmd/rlsidecar'], { cwd: ROOT, stdio: 'inherit' });
  if (r.status !== 0) throw new Error('go build failed');
  process.on('exit', () => fs.rmSync(dir, { recursive: true, force: true }));
  built = out;
  return out;
}

function tempDir(t) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rls')); // short: a socket path is at most 107 bytes
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  return dir;
}

/** A running `rlsidecar serve`; stopped when the test ends. */
class Daemon {
  constructor(dir, rules, args = []) {
    this.args = args; // more flags for serve
    this.socket = path.join(dir, 's.sock');
    this.rules = path.join(dir, 'rules.yaml');
    fs.writeFileSync(this.rules, rules);
    this.proc = null;
  }

  start() {
    this.proc = spawn(binary(), ['serve', '--socket', this.socket, '--admin=', '--config', this.rules, ...this.args],
      { stdio: ['ignore', 'pipe', 'pipe'] });
    let stderr = '';
    this.proc.stderr.on('data', (b) => { stderr += b; });
    const proc = this.proc;
    return new Promise((resolve, reject) => {
      let out = '';
      const timer = setTimeout(() => reject(new Error(`daemon did not start in 10s: ${stderr}`)), 10000);
      const onData = (b) => {
        out += b;
        if (out.includes('\n')) {
          clearTimeout(timer);
          proc.stdout.removeListener('data', onData);
          proc.stdout.resume();
          if (out.includes('listening on')) resolve(this);
          else reject(new Error(`daemon did not start: ${out} ${stderr}`));
        }
      };
      proc.stdout.on('data', onData);
      proc.on('exit', (code) => reject(new Error(`daemon exited ${code}: ${stderr}`)));
    });
  }

  stop() {
    if (this.proc && this.proc.exitCode === null && this.proc.signalCode === null) {
      const p = this.proc;
      const exited = new Promise((resolve) => p.once('exit', resolve));
      p.kill('SIGCONT');
      p.kill('SIGKILL');
      return exited;
    }
    return Promise.resolve();
  }

  /** Stops the daemon with SIGSTOP and waits until it is stopped: a stalled sidecar. */
  pause() {
    return freeze(this.proc, 'the daemon');
  }

  resume() {
    this.proc.kill('SIGCONT');
  }
}

// freeze stops the child process proc with SIGSTOP and waits until it is stopped.
async function freeze(proc, what) {
  proc.kill('SIGSTOP');
  const deadline = Date.now() + 5000;
  while (Date.now() < deadline) {
    const stat = fs.readFileSync(`/proc/${proc.pid}/stat`, 'utf8');
    if (stat.slice(stat.lastIndexOf(')') + 2).startsWith('T')) return;
    await new Promise((r) => setTimeout(r, 1));
  }
  throw new Error(`${what} did not stop`);
}

// waitFor polls cond every 10 ms until it holds, failing after ms.
async function waitFor(what, ms, cond) {
  const deadline = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

/**
 * A redis-server on a Unix socket in a temp directory (no TCP port), killed when the test
 * ends: { socket, proc, freeze() (SIGSTOP, awaited: a Redis that stalls), thaw() }.
 */
async function startRedis(t) {
  const socket = path.join(tempDir(t), 'r.sock');
  const proc = spawn('redis-server', ['--port', '0', '--unixsocket', socket, '--save', '', '--appendonly', 'no'], { stdio: 'ignore' });
  t.after(() => {
    proc.kill('SIGCONT');
    proc.kill('SIGKILL');
  });
  await waitFor('redis-server', 10000, () => fs.existsSync(socket));
  return { socket, proc, freeze: () => freeze(proc, 'redis-server'), thaw: () => proc.kill('SIGCONT') };
}

async function startDaemon(t, rules = RULES, args = []) {
  const d = new Daemon(tempDir(t), rules, args);
  t.after(() => d.stop());
  return d.start();
}

// standIn serves a stand-in sidecar on a socket named name in a temp directory: each
// request frame is answered with the map answer(request, conn) returns (its id set to the
// request's); undefined sends nothing, and a script may answer later with conn.send(map)
// (conn.index: 1 for the first connection accepted, 2 for the next…). It returns the
// socket's path; the server stops with the test.
async function standIn(t, name, answer) {
  const net = require('net');
  const { encode } = require('@msgpack/msgpack');
  const proto = require('../lib/proto');
  const sock = path.join(tempDir(t), name);
  const conns = new Set();
  let accepted = 0;
  const srv = net.createServer((s) => {
    conns.add(s);
    const conn = {
      index: ++accepted,
      send: (m) => {
        const body = Buffer.from(encode(m));
        const head = Buffer.alloc(4);
        head.writeUInt32BE(body.length);
        s.write(Buffer.concat([head, body]));
      },
    };
    let buf = Buffer.alloc(0);
    s.on('data', (b) => {
      buf = Buffer.concat([buf, b]);
      while (buf.length >= 4 && buf.length >= 4 + buf.readUInt32BE(0)) {
        const req = proto.decode(buf.subarray(4, 4 + buf.readUInt32BE(0)));
        buf = buf.subarray(4 + buf.readUInt32BE(0));
        const m = answer(req, conn);
        if (m !== undefined) conn.send({ ...m, id: req.id });
      }
    });
  });
  await new Promise((r) => srv.listen(sock, r));
  t.after(() => new Promise((r) => {
    for (const s of conns) s.destroy();
    srv.close(r);
  }));
  return sock;
}

// peerClosed reports whether the daemon has closed its end of every connection accepted
// on the Unix socket path sock: ss lists an accepted connection under the socket's path.
function peerClosed(sock) {
  for (const line of execFileSync('ss', ['-xHn', 'state', 'established'], { encoding: 'utf8' }).split('\n')) {
    const f = line.trim().split(/\s+/);
    if (f.length >= 4 && f[3] === sock) return false;
  }
  return true;
}

// readShut reports whether the daemon has shut the read side of the one connection it
// accepted on the Unix socket path sock: ss -e shows its end as `-->` (sends only).
function readShut(sock) {
  for (const line of execFileSync('ss', ['-xHne', 'state', 'established'], { encoding: 'utf8' }).split('\n')) {
    const f = line.trim().split(/\s+/);
    if (f.length >= 8 && f[3] === sock) return f[7] === '-->';
  }
  return false;
}

// inOneWindow runs run(attempt) once more, with the next attempt number (for fresh keys),
// when the boundary of a fixed window of windowMs fell within the run (at most 3 runs),
// and returns what the last run returned. A fixed window is aligned to a multiple of its
// length on the wall clock (the daemon's, which is this one, to a millisecond): counts
// taken across a boundary start again, and a test asserting them would fail there. Assert
// on what it returns, after it.
async function inOneWindow(windowMs, run) {
  for (let attempt = 0; ; attempt++) {
    const w = Math.floor((Date.now() - 2) / windowMs);
    const got = await run(attempt);
    if (Math.floor((Date.now() + 2) / windowMs) === w || attempt === 2) return got;
  }
}

module.exports = { ROOT, RULES, Daemon, binary, tempDir, startDaemon, startRedis, waitFor, standIn, peerClosed, readShut, inOneWindow };
