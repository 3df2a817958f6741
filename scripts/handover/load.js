'use strict';
// The Node client's share of scripts/handover's load: SOCKET, CLIENT (its key), MAX (the
// concurrency rule's max); stops when its stdin ends, then prints one line of JSON.
const path = require('path');
const rl = require(path.join(__dirname, '..', '..', 'clients', 'node'));

const c = new rl.Client({ socket: process.env.SOCKET, timeoutMs: Number(process.env.TIMEOUT_MS || 1000) });
const name = process.env.CLIENT;
const max = Number(process.env.MAX);
const n = { checks: 0, policy: 0, errors: 0, hyb: 0, hybDegraded: 0, glob: 0, globDegraded: 0, leases: 0, lost: 0, relFails: 0, inflight: 0, maxInflight: 0 };
let stop = false;
process.stdin.on('data', () => {});
process.stdin.on('end', () => { stop = true; });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function check(attrs) {
  n.checks++;
  try {
    const d = await c.check(attrs);
    if (d.unreachable) { n.policy++; return null; }
    return d;
  } catch (e) {
    n.errors++;
    return null;
  }
}

async function loop(pause, f) {
  for (let i = 0; !stop; i++) {
    await f(i);
    await sleep(pause);
  }
}

const workers = [];
for (let w = 0; w < 2; w++) workers.push(loop(1, (i) => check({ client: name, kind: 'rate', u: String(w * 1000 + (i % 1000)) })));
for (const kind of ['hyb', 'glob']) {
  workers.push(loop(2, async () => {
    const d = await check({ client: name, kind });
    if (d && d.allowed) n[d.degraded ? kind + 'Degraded' : kind]++;
  }));
}
for (let w = 0; w < 2 * max; w++) {
  workers.push(loop(5, async () => {
    const d = await check({ client: name, kind: 'lease' });
    if (!d || !d.allowed || !d.lease) return;
    n.leases++;
    if (++n.inflight > max) n.lost++;
    n.maxInflight = Math.max(n.maxInflight, n.inflight);
    await sleep(20);
    n.inflight--;
    let ok = false;
    try { ok = await c.release(d.lease); } catch (e) { ok = false; }
    if (!ok) n.relFails++;
  }));
}

Promise.all(workers).then(async () => {
  const probe = [];
  for (let i = 0; i <= max; i++) {
    const d = await c.check({ client: name, kind: 'lease' });
    if (d.allowed && !d.degraded && !d.unreachable) probe.push(d.lease);
  }
  for (const l of probe) await c.release(l);
  c.close();
  n.free = probe.length;
  delete n.inflight;
  console.log(JSON.stringify(n));
});
