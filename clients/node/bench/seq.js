'use strict';
// Sequential checks through the Node client, driven by bench/clients_test.go.
//
//   node seq.js SOCKET KEYFILE
//
// KEYFILE holds one user per line (the benchmark's Zipf sequence). For each line "N" read
// on stdin, it makes N checks one after another (each awaited before the next; attrs ip,
// method, path, user, cycling through the keys) and prints the elapsed nanoseconds and the
// CPU nanoseconds (user + system) this process spent on them. A
// check that is not a real answer from the sidecar aborts with exit status 1.

const fs = require('fs');
const readline = require('readline');
const rl = require('..');

async function main() {
  const [socket, keyfile] = process.argv.slice(2);
  const attrs = fs.readFileSync(keyfile, 'utf8').split('\n').filter(Boolean).map((u, i) => ({
    ip: `10.1.${Math.floor(i / 250) % 250}.${i % 250}`, method: 'POST', path: `/v1/events/${u}/holds`, user: `user-${u}`,
  }));
  const client = new rl.Client({ socket, timeoutMs: 5000, conns: 1 });
  let i = 0;
  for await (const line of readline.createInterface({ input: process.stdin })) {
    const n = Number(line);
    const start = process.hrtime.bigint();
    const cpu = process.cpuUsage();
    for (let k = 0; k < n; k++) {
      const d = await client.check(attrs[i]);
      if (!d.allowed || d.degraded) {
        process.stderr.write(`bad decision: ${JSON.stringify(d)}\n`);
        process.exit(1);
      }
      if (++i === attrs.length) i = 0;
    }
    const used = process.cpuUsage(cpu);
    process.stdout.write(`${process.hrtime.bigint() - start} ${(used.user + used.system) * 1000}\n`);
  }
  await client.close();
}

main();
