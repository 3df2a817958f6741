// A use of every declaration in index.d.ts; types.test.js compiles it with tsc --strict.
import * as http from 'http';
import { Client, Decision, RuleDecision, ProtocolError, RequestTooLargeError, ClosedError, middleware, upgrade, defaultAttrs, peerIP, normalizePath, PROTOCOL } from '..';

async function use(): Promise<void> {
  const c = new Client({ socket: '/run/rlsidecar/rlsidecar.sock', timeoutMs: 50, onUnavailable: 'closed', conns: 2, maxFrame: 65536 });
  const d: Decision = await c.check({ user: 'alice' }, { cost: 2, limits: [{ key: 'k', limit: 10, windowMs: 1000, algorithm: 'fixed_window' }] });
  const allowed: boolean = d.allowed;
  const r: RuleDecision | undefined = d.rules[0];
  const h: Record<string, string> = d.headers();
  const rej = d.rejection();
  if (rej !== null) {
    const s: 429 | 431 | 503 = rej.status;
    const b: Buffer = rej.body;
    void s, b;
  }
  const cause: string | null = d.cause;
  const v: string = await c.ping();
  const lease: string = d.lease;
  const released: boolean = await c.release(lease);
  const { renewed, expiresMs }: { renewed: boolean; expiresMs: number } = await c.renew(lease, 60000);
  void released, renewed, expiresMs;
  try {
    await c.check({ user: 'x' });
  } catch (e) {
    if (e instanceof ProtocolError) console.log(e.code, e.sidecarMessage, e.decision?.status);
    if (e instanceof RequestTooLargeError) console.log(e.code, e.size, e.maxFrame, e.decision?.tooLarge, e.decision?.status);
    if (e instanceof ClosedError) console.log(e.message);
  }
  const p: 1 = PROTOCOL;
  const mw = middleware<http.IncomingMessage, http.ServerResponse>(c, { cost: () => 1, attrs: (req) => ({ path: req.url || '' }) });
  http.createServer((req, res) => mw(req, res, () => res.end('ok')))
    .on('upgrade', upgrade<http.IncomingMessage>(c, (req, socket, head, d) => {
      socket.write(`HTTP/1.1 101 Switching Protocols\r\nRateLimit: ${d.headers().RateLimit ?? ''}\r\n\r\n`);
      void req, head;
    }, { cost: () => 1, renewLeases: true }));
  const a: { ip?: string; method: string; path: string | Buffer } = defaultAttrs({ method: 'GET', url: '/' });
  // @ts-expect-error: ip is left out when the request has no peer address (as here)
  const peer: string = defaultAttrs({ method: 'GET', url: '/' }).ip;
  void peer;
  const ip: string = peerIP('::ffff:203.0.113.7');
  const np: string | Buffer = normalizePath('/a/../b');
  await c.check({ ...a, user: 'alice', raw: Buffer.from([0xff]) });
  await c.close();
  void allowed, r, h, cause, v, p, a, ip, np;
}

void use;

// @ts-expect-error: onUnavailable is 'open' or 'closed'
new Client({ socket: 's', onUnavailable: 'maybe' });
// @ts-expect-error: attrs are strings
void new Client({ socket: 's' }).check({ user: 1 });
