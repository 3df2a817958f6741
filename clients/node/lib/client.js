'use strict';
// The client: a small pool of kept-alive connections, checks pipelined on each.
//
// Model. A Client has `conns` slots, each holding at most one live connection. A check
// picks a slot round-robin (skipping slots that back off), dials it if needed, and writes
// its frame at once: many checks are in flight on one connection. The sidecar answers in
// request order, so each answer goes to the oldest pending check, whose id it must echo.
// A check that times out resolves with the policy decision and stays in the FIFO,
// abandoned, so the late answer still lands on the right entry and is dropped (a lease it
// took is released: the check was decided without it). A
// mismatched id, an undecodable frame or a socket error breaks the connection: every
// pending check resolves with the policy decision, and the next check redials. Failed
// dials back off per slot from 10 ms, doubling to 1 s, with jitter; a slot that backs
// off answers by the policy at once.
//
// A connection carries at most MAX_PENDING checks in flight (abandoned ones included). A
// check whose connection is full goes on another live connection with room; when every one
// is full, it joins the client's queue of waiting checks, and is sent, in the order they
// came, as answers free room (or a connection opens); a connection that breaks sends its
// waiters round again (its slot redials). A waiting check gives up at its own timeout and
// leaves the queue at once, answering by the policy. So a burst larger than the pool holds
// is decided by the sidecar, not by the policy, as long as it is answered in time; memory
// stays bounded: no connection holds more than MAX_PENDING, and the queue holds only checks
// still within their timeout.

const fs = require('fs');
const net = require('net');
const proto = require('./proto');
const { Decision } = require('./decision');

const { RequestTooLargeError } = proto;

// monoNow is the client's clock for every wait it times (backoff, a stall, a lease's hold,
// the outage log): ms on a clock that never steps. Date.now is the wall clock, which NTP or
// a resumed VM may step by hours: an end of backoff read on it, after a step back, kept a
// slot from redialing for as long as the step.
const monoNow = () => performance.now();

const BACKOFF_MIN = 10;
const BACKOFF_MAX = 1000;
// Checks in flight on one connection (abandoned ones included) beyond which a check waits
// for room, up to its timeout.
const MAX_PENDING = 4096;
// The longest wait a timer holds, in ms.
const MAX_TIMER = 2 ** 31 - 1;
const NO_ROOM = 'every connection had as many checks in flight as it may until the timeout';
// A connection that answers no check for max(STALL_MIN, 4 × timeoutMs) while checks time
// out on it (or waiting for room on it: noRoom) is given up and redialed: a sidecar that
// stopped answering on it (frozen; or an old sidecar stopped while its successor took the
// socket, in a blue/green switch) would otherwise keep it until that process ended. A
// shorter stall keeps it.
const STALL_MIN = 1000;
// The least time, in ms, between two lines of the outage log while the sidecar keeps
// failing (see Client.unreachable).
const OUTAGE_LOG_INTERVAL = 10000;

// WaitQueue is a FIFO of the checks waiting for room. A check that gives up leaves it at
// once (remove): it is only marked, and the marked ones are dropped as the queue is read,
// or all together when they are most of it, so the queue never holds much more than the
// checks still waiting.
class WaitQueue {
  constructor() {
    this.items = [];
    this.head = 0;
    this.size = 0; // checks still waiting
  }

  push(entry) {
    entry.queued = true;
    this.items.push(entry);
    this.size++;
  }

  remove(entry) {
    if (!entry.queued) return;
    entry.queued = false;
    this.size--;
    const held = this.items.length - this.head;
    if (held > 64 && this.size * 2 < held) {
      this.items = this.items.slice(this.head).filter((e) => e.queued);
      this.head = 0;
    }
  }

  shift() {
    while (this.head < this.items.length) {
      const e = this.items[this.head];
      this.items[this.head++] = undefined;
      if (e.queued) {
        e.queued = false;
        this.size--;
        if (this.head > 1024 && this.head * 2 > this.items.length) {
          this.items = this.items.slice(this.head);
          this.head = 0;
        }
        return e;
      }
    }
    this.items = [];
    this.head = 0;
    return null;
  }
}

function backoff(failures) {
  const d = failures >= 8 ? BACKOFF_MAX : Math.min(BACKOFF_MIN * 2 ** (failures - 1), BACKOFF_MAX);
  return d / 2 + Math.random() * (d / 2);
}

// The pause before a check a fresh connection's farewell gave back is sent again (see
// Conn.fail).
const FRESH_FAREWELL_PAUSE = 10;

class Conn {
  constructor(slot, socket) {
    this.slot = slot;
    this.socket = socket;
    this.pending = []; // entries in request order, from head
    this.head = 0;
    this.nextId = 0;
    this.buf = null; // bytes read beyond the last whole frame
    this.served = false;
    this.heard = false; // an answer arrived since the last check that timed out (timedOut)
    this.quietFrom = monoNow(); // when its quiet spell began: quiet since it was dialed
    this.broken = null;
    this.corked = false;
    // The leases taken on it and not yet released, and when the last of them expires: a
    // connection given up for a stall while it holds some is retired, not closed (see
    // giveUp), until they end; expiry is then the timer that closes it.
    this.leases = 0;
    this.holdUntil = 0;
    this.retired = false;
    this.expiry = null;
    // The connection was reset with no byte of an answer come: the last pending check's
    // frame was not all read by the sidecar (the unread bytes are the end of the
    // stream), so it was not decided: fail sends it again.
    this.resetUnread = false;
    // Bytes of the frames given to the socket (queued: each entry's end is the offset
    // just past its frame) and handed to the kernel's writes (dispatched), from the
    // start: a failed write says which checks it held (see writeFailed).
    this.queued = 0;
    this.dispatched = 0;
    // Why a write failed (null: none did): nothing more is written on the connection,
    // which still reads the answers to come to the checks written before (see
    // writeFailed); cutTimer ends that reading.
    this.cut = null;
    this.cutTimer = null;
    // The write that failed took no byte (the kernel holds whole frames only, up to it).
    this.cutWhole = false;
    // The write that failed was its first, and the sidecar had closed it before (see
    // writeFailed): its slot redials at once.
    this.endedUnused = false;
    // A failed write does not destroy the socket, as Node does with a write's error:
    // the sidecar at --idle-timeout shuts an idle connection's read side, answers what
    // it held, then closes it, so a check written after the shut fails its write while
    // the answer to one written before is still to come. Before, Node destroyed the
    // socket at the failed write, and that check, decided (counted) by the sidecar, got
    // the policy. Each write goes through dispatch, which notes what it held and takes
    // its error (see writeFailed).
    // These hooks are net.Socket's own (Node 18 to 20), not a public API: net.Socket
    // forces autoDestroy, and nothing public says how much of a failed write went out.
    // Each is wrapped only where Node has it: without _writev, Writable writes the
    // frames one by one through _write; without _write, no write is counted (counted
    // false), and no check is sent again for where the kernel's part ends (taken).
    // Before, a Node without _writev ended the process at the first write (a TypeError
    // from uncork: test/internals.test.js).
    const { _write, _writev, _destroy } = net.Socket.prototype;
    this.counted = typeof _write === 'function';
    if (this.counted) {
      socket._write = (data, encoding, cb) => this.dispatch(data.length, cb, (done) => _write.call(socket, data, encoding, done));
    }
    if (this.counted && typeof _writev === 'function') {
      socket._writev = (chunks, cb) => {
        let n = 0;
        for (const c of chunks) n += c.chunk.length;
        this.dispatch(n, cb, (done) => _writev.call(socket, chunks, done));
      };
    }
    // How many of the bytes dispatched the kernel took (the rest were in libuv's write
    // queue), noted as the socket is destroyed, before its handle goes (a reset read, an
    // error, fail): null until then. A frame that ends past it never reached the sidecar
    // whole, so it was not read, not decided, and fail sends it again (see taken).
    this.kernelTook = null;
    if (typeof _destroy === 'function') {
      socket._destroy = (err, cb) => {
        this.taken();
        _destroy.call(socket, err, cb);
      };
    }
    // The id of the first check whose frame certainly never reached the sidecar (0: none
    // known): it was written on a socket that could no longer write, or it came after a
    // frame the sidecar refused as too large (it reads nothing more). Every check from it
    // on was not read, so not decided: fail sends each again (the Go client's
    // unsentFrom). Those of a failed write are sent again by writeFailed.
    this.unsentFrom = 0;
    socket.on('data', (chunk) => this.onData(chunk));
    socket.on('error', (e) => {
      if (e.code === 'ECONNRESET' && e.syscall === 'read' && this.buf === null) this.resetUnread = true;
      this.fail(`connection lost: ${e.message}`);
    });
    socket.on('close', () => this.fail('the sidecar closed the connection'));
  }

  // dispatch makes a write of n bytes (write(done)) for the socket's stream, whose
  // callback is cb. A write that fails is the connection's (writeFailed), not the
  // stream's: cb is told it succeeded, so Node keeps the socket and reads on. Once a
  // write has failed, nothing more is written: a later frame certainly never reaches the
  // sidecar, which may not read it twice if it got through after one sent again.
  dispatch(n, cb, write) {
    if (this.cut !== null || this.broken !== null) {
      cb();
      return;
    }
    const from = this.dispatched;
    this.dispatched += n;
    let sync = true;
    write((e) => {
      // Failed as it was made (in write): the kernel took no byte of it. Failed later,
      // from the event loop: it may have taken some, never the last.
      if (e) this.writeFailed(e, sync ? from : from + n - 1, sync);
      cb();
    });
    sync = false;
  }

  // writeFailed ends the writing of a connection whose write failed (EPIPE, ECONNRESET):
  // the sidecar closed it (a graceful restart's drain answers what a connection held,
  // then closes it; a daemon that died), or shut its read side (--idle-timeout). Every
  // check whose frame ends past the offset unread (the write's first byte, when the
  // kernel took none of it; else its last, never taken) was not read, so not decided,
  // and is sent again on another connection within its timeout. The checks before it
  // may have been read (those of a write that failed after taking some bytes, which
  // Node does not count, too): the connection is detached (the next check redials) but
  // reads on, for up to timeoutMs, until each is answered; one still unanswered when
  // the sidecar closes it gets the policy, as at any end of file.
  writeFailed(e, unread, whole) {
    if (this.broken !== null) return;
    this.readLeft(); // an answer come already (frame_too_large, too_many_connections, a farewell) says more
    if (this.broken !== null) return;
    const client = this.slot.client;
    if (this.cut === null) {
      this.cut = `connection lost: ${e.message}`;
      this.cutWhole = whole;
      // Its first write, failed whole, with no word from the sidecar: no byte reached it.
      // It closed the connection before the client wrote to it: its --idle-timeout, the
      // event loop having run late (under load) between the accept and the write. The
      // slot redials at once, once (see Slot.detach), and the checks go on that
      // connection without counting a resend.
      this.endedUnused = this.slot.detach(this, this.cut, whole && unread === 0 && !this.served);
      client.reading.add(this);
      this.cutTimer = setTimeout(() => this.giveUp(this.cut), client.timeoutMs);
      if (typeof this.cutTimer.unref === 'function') this.cutTimer.unref();
    }
    let i = this.pending.length;
    while (i > this.head && this.pending[i - 1].end > unread) i--;
    const again = this.pending.splice(i);
    for (const en of again) {
      if (en.settled) continue;
      // Its frame never reached the sidecar: sent again as often as the pool has
      // connections, each of which the sidecar may have closed idle, unseen yet (before,
      // once: a resend that met the pool's other such connection got the policy).
      if (!this.endedUnused) en.unread = (en.unread || 0) + 1;
      if (en.unread > client.slots.length || en.msg === null || client.closed) {
        en.done(null, this.cut);
        continue;
      }
      en.resent = true;
      en.conn = null;
      client.route(en);
    }
    client.reroute();
    this.cutDone();
  }

  // taken notes, once, how many of the bytes dispatched the kernel took: the rest are in
  // libuv's write queue (its writeQueueSize: the bytes of queued writes not yet written),
  // never sent. A write that did not finish at once holds what the kernel would not take
  // there: with the socket full (a frozen sidecar), a whole tick's frames but the first
  // few.
  taken() {
    if (this.kernelTook !== null) return this.kernelTook;
    if (!this.counted) {
      this.kernelTook = Infinity; // no write counted: where the kernel's part ends is not known
      return this.kernelTook;
    }
    const h = this.socket._handle;
    const queued = h && typeof h.writeQueueSize === 'number' ? h.writeQueueSize : 0;
    this.kernelTook = this.dispatched - Math.min(Math.max(queued, 0), this.dispatched);
    return this.kernelTook;
  }

  // cutDone ends a connection whose write failed once every check written on it before is
  // answered: closed, or retired while it holds leases (see giveUp). The sidecar keeps a
  // connection it shut for idleness open while it holds a lease (one a check written as
  // the timeout fired took): closing it would free the slot of a request still running.
  cutDone() {
    if (this.cut !== null && this.head === this.pending.length) this.giveUp(this.cut);
  }

  // readLeft reads, at once, what the sidecar wrote before a write failed, and hands it to
  // onData. The sidecar refuses a frame over its --max-frame from its header: it answers
  // frame_too_large and closes, and the write of the rest fails (EPIPE), though the answer
  // is already in the receive queue; one over its --max-conns is answered
  // too_many_connections and closed as it connects, before the first check is read. libuv may report that failure
  // before reading (when the poll said only "writable"), and the socket is then destroyed,
  // its answer unread: the check would get the policy, not its 431. Node no longer
  // destroys it there (dispatch), but the answer is still read here, at once, from the
  // socket's descriptor (non-blocking: it stops at EAGAIN, or at the end), before
  // writeFailed takes the checks it may concern for unread.
  readLeft() {
    const h = this.socket._handle;
    const fd = h ? h.fd : -1;
    if (typeof fd !== 'number' || fd < 0) return;
    const buf = Buffer.allocUnsafe(65536);
    while (this.broken === null) {
      let n;
      try {
        n = fs.readSync(fd, buf, 0, buf.length, null);
      } catch {
        return; // EAGAIN: nothing more; or the connection reset
      }
      if (n === 0) return;
      this.onData(Buffer.from(buf.subarray(0, n)));
    }
  }

  send(entry, frame) {
    entry.id = ++this.nextId;
    entry.conn = this;
    this.queued += frame.length;
    entry.end = this.queued;
    this.pending.push(entry);
    // A socket that can no longer write (its write failed, or it is ending) sends nothing
    // more: this frame never goes out.
    if (this.unsentFrom === 0 && !this.socket.writable) this.unsentFrom = entry.id;
    // Frames written in the same tick go out in one write.
    if (!this.corked) {
      this.corked = true;
      this.socket.cork();
      process.nextTick(() => {
        this.corked = false;
        this.socket.uncork();
      });
    }
    this.socket.write(frame);
  }

  // timedOut notes a check this connection left unanswered for the whole timeout: the
  // first since an answer starts its quiet spell; one that ends a spell of
  // max(STALL_MIN, 4 × timeoutMs) gives the connection up.
  timedOut() {
    const now = monoNow();
    if (this.heard) {
      this.heard = false;
      this.quietFrom = now;
      return;
    }
    const quiet = now - this.quietFrom;
    if (this.broken === null && quiet >= Math.max(STALL_MIN, 4 * this.slot.client.timeoutMs)) {
      this.giveUp(`no answer on this connection for ${quiet} ms (the sidecar stalled?): it is given up, the next check redials`);
    }
  }

  // giveUp ends a connection that stalled: it is closed, unless it holds leases of
  // requests still running. The sidecar frees a lease when the connection that took it
  // closes, so closing it would free their slots and, after any stall, admit past a
  // concurrency rule's max. It is retired instead: detached from its slot (the next check
  // redials) and sent nothing more, but kept open, its late answers dropped, until its
  // leases are released through this client (on any connection), or have expired, or
  // the client is closed.
  giveUp(why) {
    if (this.retired || this.broken !== null) return;
    const c = this.slot.client;
    if (this.leases <= 0 || monoNow() >= this.holdUntil || c.closed) {
      this.fail(why);
      return;
    }
    this.retired = true;
    c.retired.add(this);
    this.slot.detach(this);
    this.expire();
    c.reroute();
  }

  // expire closes a retired connection once every lease it holds has expired.
  expire() {
    const left = this.holdUntil - monoNow();
    if (this.leases > 0 && left > 0) {
      this.expiry = setTimeout(() => this.expire(), left);
      if (typeof this.expiry.unref === 'function') this.expiry.unref();
      return;
    }
    this.fail('a connection given up for a stall closed once its leases ended');
  }

  inFlight() {
    return this.pending.length - this.head;
  }

  onData(chunk) {
    let buf = this.buf === null ? chunk : Buffer.concat([this.buf, chunk]);
    let off = 0;
    while (buf.length - off >= 4) {
      const n = buf.readUInt32BE(off);
      if (n > proto.MAX_RESPONSE_FRAME) return this.fail(`answer frame of ${n} bytes`);
      if (buf.length - off - 4 < n) break;
      const body = buf.subarray(off + 4, off + 4 + n);
      off += 4 + n;
      let msg;
      try {
        msg = proto.decode(body);
      } catch (e) {
        return this.fail(e.message);
      }
      if (this.broken !== null) return;
      if (this.head === this.pending.length) {
        const e = proto.errorOf(msg);
        return this.fail(e ? `the sidecar closed the connection: ${e[0]}` : 'an answer nobody asked for');
      }
      const entry = this.pending[this.head];
      this.pending[this.head++] = undefined;
      if (this.head > 1024 && this.head * 2 > this.pending.length) {
        this.pending = this.pending.slice(this.head);
        this.head = 0;
      }
      const e = proto.errorOf(msg);
      if (msg.id !== entry.id && !(e !== null && msg.id === 0)) {
        return this.fail(`answer id ${msg.id} where ${entry.id} was due`);
      }
      if (e !== null && e[0] === 'shutting_down') {
        // A drain's last word (or a connection it accepted and does not serve): entry and
        // every check after it on this connection were not read, not decided: each is
        // sent again on another connection (to the sidecar's successor), as often as a
        // farewell gives it back within its timeout (a resend may meet another
        // connection to the same draining sidecar). It answered: the slot redials at once.
        // A farewell on a connection that had answered nothing (fresh) may come from a
        // sidecar that says it to every new connection (a drain whose successor is not
        // up, a stand-in): see fail, such a check is not resent in a loop.
        const fresh = !this.served;
        this.served = true;
        return this.fail(`the sidecar closed the connection: ${e[0]}`, entry, fresh);
      }
      if (e !== null && e[0] === 'too_many_connections') {
        // The sidecar refused this connection as it accepted it (past its --max-conns)
        // and reads none of it: entry, taken off pending above, and every check after it
        // were not read, not decided. Each goes again on another connection of the pool
        // (this slot backs off: it answered nothing), as a fresh farewell's checks do: at
        // most once per slot, after a pause, then the policy, with the sidecar's reason.
        // Before, entry got the policy though another connection of the pool was served.
        return this.fail(`the sidecar closed the connection: ${e[0]}`, entry, true);
      }
      this.served = true;
      this.heard = true;
      const late = entry.settled;
      // A lease is tracked before its check's caller can release it (see giveUp).
      if (e === null && typeof msg.lease === 'string' && msg.lease !== '') this.slot.client.trackLease(this, msg.lease, msg.rules);
      entry.done(msg, null);
      if (late && typeof msg.lease === 'string' && msg.lease !== '') this.slot.client.releaseOrphan(msg.lease);
      if (e !== null && e[0] === 'frame_too_large') {
        // The sidecar closes the connection after this answer: no check may follow on it.
        // It answered from the frame's header and reads nothing more of the connection:
        // every check pending after entry was not read, not decided, and goes again on
        // a new connection (before, each got the policy: one oversized request refused
        // the concurrent ones pipelined behind it, under 'closed').
        if (this.unsentFrom === 0 || this.unsentFrom > entry.id + 1) this.unsentFrom = entry.id + 1;
        return this.fail('the sidecar closed the connection: frame_too_large');
      }
    }
    this.buf = off === buf.length ? null : buf.subarray(off);
    if (this.cut !== null) this.cutDone();
    else if (!this.retired) this.slot.client.admit(this);
  }

  // fail breaks the connection once: every pending check gets the policy decision, but
  // those the sidecar certainly did not read, sent again once (see below). unreadFrom: the
  // check the drain's farewell came in place of, taken off pending: it and every check
  // still pending were not read.
  // fresh: the farewell came on a connection that had answered nothing; such a farewell
  // gives a check back at most once per slot, after a pause (FRESH_FAREWELL_PAUSE):
  // before, a sidecar that says farewell to every connection was redialed in a loop for
  // each check's whole timeout (6,800 connections in 2 s from 4 callers).
  fail(why, unreadFrom, fresh = false) {
    if (this.broken !== null) return;
    this.broken = why;
    const took = this.taken();
    this.socket.destroy();
    clearTimeout(this.cutTimer);
    this.slot.client.reading.delete(this);
    this.slot.detach(this);
    if (this.retired) {
      this.slot.client.retired.delete(this);
      clearTimeout(this.expiry);
    }
    const pending = this.pending;
    const head = this.head;
    this.pending = [];
    this.head = 0;
    if (unreadFrom !== undefined) {
      const client = this.slot.client;
      for (const en of [unreadFrom, ...pending.slice(head)]) {
        if (en.settled) continue;
        if (en.msg === null || client.closed) {
          en.done(null, why);
          continue;
        }
        en.resent = true;
        en.conn = null;
        if (!fresh) {
          client.route(en);
          continue;
        }
        en.freshFarewells = (en.freshFarewells || 0) + 1;
        if (en.freshFarewells > client.slots.length) {
          en.done(null, why);
          continue;
        }
        // This slot is tried last: its backoff (5-10 ms after one failure) ends within the
        // pause, and round-robin sent the check straight back to it, to a sidecar still at
        // its --max-conns, refused again while another slot's connection was live.
        const slot = this.slot;
        setTimeout(() => {
          if (!en.settled && !client.closed) client.route(en, slot);
        }, FRESH_FAREWELL_PAUSE);
      }
      client.reroute();
      return;
    }
    // The last pending check, when its frame certainly was not all read (resetUnread: the
    // unread bytes are the end of the stream; after a failed write, only if it took no
    // byte: else the stream ends in a frame the write began, which writeFailed sent
    // again, or one before it), and every check from unsentFrom on (their frames never
    // reached the sidecar), is sent again, once, on another connection within its
    // timeout (so were those of a failed write: writeFailed); so is every check whose
    // frame ends past the bytes the kernel took (taken: the rest of it, and the frames
    // after it, were in libuv's queue or the stream's buffer), as often as the pool has
    // connections (never read, it cannot be counted twice). Before, such a check got the
    // policy: 3,999 of 4,000 written to a frozen sidecar that was then killed (its
    // successor on the socket's path), the 3,100 the kernel never took included
    // (test/killed.test.js). A check before them may have been read and decided, and
    // answers by the policy, as every check does after end-of-file.
    // A release may have been read, but releasing is idempotent: it is sent again too,
    // once, to the sidecar's successor when this one died (SIGKILL), which frees a global
    // lease's slots in Redis. Failed, they stayed held for the whole lease with no
    // request running.
    const client = this.slot.client;
    let last = pending.length - 1;
    if (last < head || !this.resetUnread || (this.cut !== null && !this.cutWhole) || pending[last].resent || pending[last].msg === null) last = -1;
    const again = [];
    for (let i = head; i < pending.length; i++) {
      const en = pending[i];
      const unsent = this.unsentFrom > 0 && en.id >= this.unsentFrom && en.msg !== null && !en.resent;
      if (i === last || unsent || (en.msg !== null && en.msg.op === 'release' && !en.resent)) again.push(en);
      else if (en.end > took && en.msg !== null && !en.settled && (en.unread || 0) < client.slots.length) {
        en.unread = (en.unread || 0) + 1;
        again.push(en);
      } else en.done(null, why);
    }
    for (const en of again) {
      if (en.settled) continue;
      if (client.closed) {
        en.done(null, why);
        continue;
      }
      en.resent = true;
      en.conn = null;
      client.route(en);
    }
    this.slot.client.reroute();
  }
}

class Slot {
  constructor(client) {
    this.client = client;
    this.conn = null;
    this.dialing = null; // a Promise while a dial is in progress
    this.failures = 0;
    this.retryAt = 0;
    this.lastError = null;
    this.endedUnused = false; // the last connection detached ended unused (see detach)
  }

  backingOff(now) {
    return this.conn === null && this.dialing === null && this.failures > 0 && now < this.retryAt;
  }

  // get returns the live connection, or a Promise of one (or of a string saying why not).
  get() {
    if (this.conn !== null) return this.conn;
    if (this.dialing === null) {
      if (this.failures > 0 && monoNow() < this.retryAt) {
        return `backing off after ${this.failures} failed attempt(s): ${this.lastError}`;
      }
      this.dialing = this.dial();
    }
    return this.dialing;
  }

  dial() {
    const c = this.client;
    return new Promise((resolve) => {
      const socket = net.createConnection({ path: c.socket });
      const timer = setTimeout(() => {
        socket.destroy();
        done(`connecting to ${c.socket}: timed out`);
      }, c.connectTimeoutMs);
      const done = (why) => {
        clearTimeout(timer);
        socket.removeListener('error', onError);
        this.dialing = null;
        if (why !== null) {
          this.failed(why);
          resolve(why);
          return;
        }
        if (c.closed) {
          socket.destroy();
          resolve('client closed');
          return;
        }
        socket.unref(); // an idle client does not keep the process alive; waiting checks hold a timer
        this.conn = new Conn(this, socket);
        c.admit(this.conn);
        resolve(this.conn);
      };
      const onError = (e) => done(`connecting to ${c.socket}: ${e.message}`);
      socket.once('error', onError);
      socket.once('connect', () => done(null));
    });
  }

  failed(why) {
    this.failures++;
    this.retryAt = monoNow() + backoff(this.failures);
    this.lastError = why;
  }

  // detach takes conn off the slot: one that answered nothing is a failed attempt (the
  // slot backs off), but for the first in a row that ended unused, with no byte of it read
  // (its first write failed whole: the sidecar closed it idle before the client wrote),
  // which is dialed again at once. Before, its checks got the policy ("backing off after 1
  // failed attempt(s): connection lost: write EPIPE"). A sidecar that closes every
  // connection so is backed off after the second.
  // It returns true when the slot redials at once for a connection that ended unused.
  detach(conn, why = conn.broken, unused = false) {
    if (this.conn !== conn) return false;
    this.conn = null;
    if (conn.served) {
      this.failures = 0;
      this.endedUnused = false;
    } else if (unused && !this.endedUnused) {
      this.endedUnused = true;
      return true;
    } else {
      this.failed(why);
    }
    return false;
  }

  close() {
    if (this.conn !== null) this.conn.fail('client closed');
  }
}

/**
 * Asks one sidecar for decisions over its Unix socket: a pool of `conns` (default 2)
 * kept-alive connections, checks pipelined on each. See the README for the policy when
 * the sidecar gives no answer.
 */
const CLIENT_OPTIONS = ['socket', 'timeoutMs', 'onUnavailable', 'conns', 'connectTimeoutMs', 'maxFrame', 'logger'];

class Client {
  constructor(opts = {}) {
    // A misspelled option (timeout for timeoutMs) would leave its default in force
    // without a word: every option is named.
    for (const k of Object.keys(opts ?? {})) {
      if (!CLIENT_OPTIONS.includes(k)) throw new TypeError(`unknown option ${JSON.stringify(k)} (options: ${CLIENT_OPTIONS.join(', ')})`);
    }
    const { socket, timeoutMs = 50, onUnavailable = 'open', conns = 2, connectTimeoutMs, maxFrame = proto.DEFAULT_MAX_FRAME, logger = console } = opts ?? {};
    if (typeof socket !== 'string' || socket === '') throw new TypeError('socket must be a non-empty string');
    // A timer holds at most 2^31 - 1 ms: Node runs a longer one after 1 ms, so a larger
    // timeout (a "no timeout") would give up every check, or dial, at once.
    for (const [k, v] of [['timeoutMs', timeoutMs], ['connectTimeoutMs', connectTimeoutMs]]) {
      if (k === 'connectTimeoutMs' && v === undefined) continue;
      if (!(typeof v === 'number' && v > 0 && v <= MAX_TIMER)) {
        throw new RangeError(`${k} must be a number of ms > 0 and at most 2^31 - 1, not ${String(v)}`);
      }
    }
    if (onUnavailable !== 'open' && onUnavailable !== 'closed') {
      throw new RangeError(`onUnavailable must be 'open' or 'closed', not ${JSON.stringify(onUnavailable)}`);
    }
    if (!(Number.isInteger(conns) && conns >= 1 && conns <= 1024)) throw new RangeError(`conns must be 1..1024, not ${conns}`);
    if (!(Number.isInteger(maxFrame) && maxFrame >= 1 && maxFrame <= 0xffffffff)) {
      throw new RangeError(`maxFrame must be an integer of 1..2^32-1 bytes, not ${maxFrame}`);
    }
    if (logger !== null && !(logger && typeof logger.warn === 'function')) {
      throw new TypeError('logger must have a warn(message) method, or be null');
    }
    this.socket = socket;
    this.logger = logger; // the outage log's: console (console.warn), or null for none
    this.failing = false; // a check was decided by onUnavailable since the sidecar last answered
    this.outage = { logged: false, last: null, decided: 0, now: monoNow };
    this.timeoutMs = timeoutMs;
    this.onUnavailable = onUnavailable;
    this.maxFrame = maxFrame; // the largest request frame body sent: the daemon's --max-frame
    this.connectTimeoutMs = connectTimeoutMs === undefined ? Math.max(timeoutMs, 100) : connectTimeoutMs;
    this.closed = false;
    this.slots = [];
    this.leases = new Map(); // lease → { conn, until }: leases taken and not yet released (trackLease)
    this.leasePrune = 0;
    this.retired = new Set(); // connections given up for a stall while holding leases (Conn.giveUp)
    this.reading = new Set(); // connections whose write failed, reading the answers still to come (Conn.writeFailed)
    for (let i = 0; i < conns; i++) this.slots.push(new Slot(this));
    this.next = 0;
    this.waiting = new WaitQueue(); // checks waiting for room on a connection
  }

  /**
   * Asks whether a request with these attributes may pass. attrs: an object of string to
   * string, sent in its key order. cost: what it consumes (default 1; 0 asks without
   * consuming). limits: inline limits. Resolves to a Decision; when the sidecar gives no
   * answer within timeoutMs, to the onUnavailable decision (degraded, unreachable). Rejects
   * only with a ProtocolError (the sidecar refused the request), a RequestTooLargeError
   * (its frame would be over maxFrame: not sent), a ClosedError, or a TypeError/RangeError
   * for bad arguments, before anything is sent. The .decision of a ProtocolError is the
   * onUnavailable decision, except for frame_too_large and attr_too_large; that of a
   * RequestTooLargeError, a frame_too_large or an attr_too_large (a value longer than the
   * sidecar's --max-attr-len) rejects whatever onUnavailable (tooLarge, status 431).
   */
  check(attrs, { cost = 1, limits } = {}) {
    let msg;
    try {
      msg = proto.checkMessage(0, attrs, cost, limits);
    } catch (e) {
      return Promise.reject(e);
    }
    return this.roundTrip(msg).then((m) => {
      if (typeof m === 'string') {
        this.unreachable(m);
        return this.policy(m, true);
      }
      if (this.failing) this.answered();
      const e = proto.errorOf(m);
      if (e !== null) {
        const why = `${e[0]}: ${e[1]}`;
        // frame_too_large and attr_too_large: the request's own fields are too large to
        // check (431), not a sidecar outage for the policy to decide.
        const big = e[0] === 'frame_too_large' || e[0] === 'attr_too_large';
        throw new proto.ProtocolError(e[0], e[1], big ? tooLarge(why) : this.policy(why, false));
      }
      return proto.decision(m);
    }, (e) => {
      if (e instanceof RequestTooLargeError) e.decision = tooLarge(e.message);
      throw e;
    });
  }

  /**
   * Frees the slots a concurrency lease holds: resolves to true when it did, false when
   * the lease was unknown, expired or already released (not an error: call it in a
   * finally). Resolves to false too when the sidecar is unreachable or gives no answer in
   * time (the lease then expires, or is freed when the connection that took it closes: a
   * connection retired for a stall closes once it holds no other lease); rejects with a
   * ProtocolError on an error answer.
   */
  release(lease) {
    if (!lease) return Promise.resolve(false);
    let msg;
    try {
      msg = proto.leaseMessage(0, 'release', lease, 0);
    } catch (e) {
      return Promise.reject(e);
    }
    // It is called in a finally: a sidecar unreachable or slow, or the client closed,
    // resolves to false rather than turning a request that succeeded into an error. The
    // lease then expires, or is freed with its connection (close() closes them all).
    //
    // Answered or not, the caller is done with the lease: a connection retired for a stall
    // that holds no other closes now, which frees it on the sidecar. Before, an unanswered
    // release (the sidecar still stalled) kept that connection open, its descriptor held,
    // until the lease expired (up to an hour).
    return this.roundTrip(msg).then((m) => {
      this.leaseEnded(lease);
      if (typeof m === 'string') return false;
      const e = proto.errorOf(m);
      if (e !== null) throw new proto.ProtocolError(e[0], e[1]);
      return m.released === true;
    }, (e) => {
      this.leaseEnded(lease);
      if (e instanceof proto.ClosedError) return false;
      throw e;
    });
  }

  // releaseOrphan releases the lease of an answer that came after its check timed out: the
  // check was decided by the policy, without the slot, and nothing else would free it
  // before it expires (a sidecar slowed past the timeout would otherwise leave a slot held
  // for a whole lease per late admission). Unreachable: it then expires.
  releaseOrphan(lease) {
    // No request runs under it: a connection retired for a stall need not stay open for
    // it (closing frees it as the release does), whether or not the release is answered.
    // Before, it was tracked until its release was answered, and a retired connection
    // stayed open for it, for a whole lease when that release failed.
    this.leaseEnded(lease);
    if (this.closed) return; // close() closes the connections, which frees their leases
    this.release(lease).catch(() => {});
  }

  /** Extends a live lease to leaseMs from now (0: each rule's own); resolves to { renewed, expiresMs }. */
  renew(lease, leaseMs = 0) {
    return this.leaseCall('renew', lease, leaseMs).then((m) => {
      const renewed = m.renewed === true;
      const expiresMs = m.expires_ms || 0;
      if (renewed) this.leaseRenewed(lease, expiresMs);
      return { renewed, expiresMs };
    });
  }

  // trackLease notes a lease taken on conn (its answer's rules say how long it lasts at
  // least: a concurrency rule's window is its lease), until it is released (leaseEnded);
  // one never released is forgotten once it has expired.
  trackLease(conn, lease, rules) {
    const now = monoNow();
    const until = now + leaseMs(rules);
    if (this.leases.size >= Math.max(this.leasePrune, 1024)) {
      for (const [k, v] of this.leases) {
        if (now > v.until) {
          this.leases.delete(k);
          v.conn.leases--;
        }
      }
      this.leasePrune = 2 * this.leases.size;
    }
    if (this.leases.has(lease)) return;
    this.leases.set(lease, { conn, until });
    conn.leases++;
    if (until > conn.holdUntil) conn.holdUntil = until;
  }

  leaseRenewed(lease, expiresMs) {
    const v = this.leases.get(lease);
    if (v === undefined) return;
    const until = monoNow() + expiresMs;
    if (until > v.until) v.until = until;
    if (until > v.conn.holdUntil) v.conn.holdUntil = until;
  }

  // leaseEnded forgets a lease whose release ended, answered or not (or whose check's
  // caller had left); a retired connection that held it closes once it holds no other.
  leaseEnded(lease) {
    const v = this.leases.get(lease);
    if (v === undefined) return;
    this.leases.delete(lease);
    v.conn.leases--;
    if (v.conn.retired && v.conn.leases <= 0) v.conn.fail('a connection given up for a stall closed once its leases ended');
  }

  leaseCall(op, lease, leaseMs) {
    let msg;
    try {
      msg = proto.leaseMessage(0, op, lease, leaseMs);
    } catch (e) {
      return Promise.reject(e);
    }
    return this.roundTrip(msg).then((m) => {
      if (typeof m === 'string') throw new Error(`rlsidecar: sidecar unreachable: ${m}`);
      const e = proto.errorOf(m);
      if (e !== null) throw new proto.ProtocolError(e[0], e[1]);
      return m;
    });
  }

  /** Resolves to the sidecar's version; rejects when it is unreachable. */
  ping() {
    return this.roundTrip({ id: 0, op: 'ping' }).then((m) => {
      if (typeof m === 'string') throw new Error(`rlsidecar: sidecar unreachable: ${m}`);
      const e = proto.errorOf(m);
      if (e !== null) throw new proto.ProtocolError(e[0], e[1]);
      return m.version;
    });
  }

  /** Closes every connection; checks in flight or waiting for room, and later ones, reject with a ClosedError. */
  close() {
    this.closed = true;
    for (let e = this.waiting.shift(); e !== null; e = this.waiting.shift()) e.done(null, 'client closed');
    for (const s of this.slots) s.close();
    for (const conn of [...this.retired, ...this.reading]) conn.fail('client closed');
    return Promise.resolve();
  }

  // unreachable records a check decided by onUnavailable because the sidecar gave no
  // answer (cause), and writes the outage log's line when one is due: the first such check
  // at once, then at most one line per OUTAGE_LOG_INTERVAL while checks keep being so
  // decided, each with how many were since the line before. A failure within the interval
  // after the last failure line is counted in the next line (so a sidecar that fails and
  // answers by turns writes at most two lines per interval).
  unreachable(cause) {
    const o = this.outage;
    this.failing = true;
    o.decided++;
    const now = o.now();
    if (o.last !== null && now - o.last < OUTAGE_LOG_INTERVAL) return;
    const still = o.logged;
    const n = o.decided;
    o.logged = true;
    o.last = now;
    o.decided = 0;
    if (this.logger === null) return;
    const p = `onUnavailable '${this.onUnavailable}'`;
    let what;
    if (still) what = `rlsidecar: sidecar at ${this.socket} still unreachable; requests are decided by ${p}`;
    else if (this.onUnavailable === 'open') what = `rlsidecar: sidecar at ${this.socket} unreachable; requests pass without rate limiting (${p}) until it answers`;
    else what = `rlsidecar: sidecar at ${this.socket} unreachable; requests are refused (${p}, 503) until it answers`;
    this.logger.warn(`${what}: ${cause} (${n} check${n === 1 ? '' : 's'} decided by the policy since the last line)`);
  }

  // answered is called when the sidecar answered a check while this.failing: it writes the
  // recovery line when a failure line is outstanding.
  answered() {
    const o = this.outage;
    this.failing = false;
    if (!o.logged) return; // failures within the interval of the last line: the next line counts them
    const n = o.decided;
    o.logged = false;
    o.decided = 0;
    if (this.logger === null) return;
    this.logger.warn(`rlsidecar: sidecar at ${this.socket} answers again; requests are rate limited ` +
      `(${n} check${n === 1 ? '' : 's'} decided by onUnavailable '${this.onUnavailable}' since the last line)`);
  }

  policy(cause, unreachable) {
    return new Decision({ allowed: this.onUnavailable === 'open', degraded: true, unreachable, cause });
  }

  // roundTrip sends msg (its id set per connection) and resolves to the answer map, or to a
  // string saying why there is none. A message whose frame body would be over maxFrame is
  // refused at once (nearly every one is far below: its bound says so without encoding it);
  // write checks again with the message's own id.
  roundTrip(msg) {
    if (this.closed) return Promise.reject(new proto.ClosedError());
    if (proto.frameBound(msg) > this.maxFrame) {
      let n;
      try {
        n = proto.encode(msg).length - 4;
      } catch (e) {
        return Promise.reject(e);
      }
      if (n > this.maxFrame) return Promise.reject(new RequestTooLargeError(n, this.maxFrame));
    }
    return new Promise((resolve, reject) => {
      const entry = {
        id: 0,
        msg, // until it is answered (sent again when a connection lost it unread)
        resent: false,
        settled: false,
        queued: false, // waiting for room (in this.waiting)
        timer: null,
        conn: null, // the connection it was sent on
        done: (m, why) => {
          if (entry.settled) return; // abandoned after a timeout: the late answer is dropped
          entry.settled = true;
          clearTimeout(entry.timer);
          this.waiting.remove(entry);
          entry.msg = null;
          if (why === 'client closed') reject(new proto.ClosedError());
          else if (why instanceof Error) reject(why);
          else resolve(m !== null ? m : why);
        },
      };
      entry.timer = setTimeout(() => {
        if (entry.queued) {
          entry.done(null, NO_ROOM);
          this.noRoom();
          return;
        }
        const conn = entry.conn;
        entry.done(null, 'no answer within the timeout');
        if (conn !== null) conn.timedOut();
      }, this.timeoutMs);
      this.route(entry);
    });
  }

  // route sends entry on the next slot round-robin (one that backs off passes to the next),
  // dialing it if needed; the slot last (when given) only when no other is usable.
  route(entry, last = null) {
    const n = this.slots.length;
    const now = monoNow();
    let slot = null;
    for (let i = 0; i < n; i++) {
      const s = this.slots[(this.next + i) % n];
      if (s !== last && !s.backingOff(now)) {
        slot = s;
        break;
      }
    }
    this.next = (this.next + 1) % n;
    if (slot === null && last !== null && !last.backingOff(now)) slot = last;
    if (slot === null) slot = this.slots[this.next];
    const got = slot.get();
    if (got instanceof Conn) this.sendOn(entry, got);
    else if (typeof got === 'string') entry.done(null, got);
    else got.then((conn) => this.sendOn(entry, conn));
  }

  // sendOn sends entry on conn when it has room and no check waits before entry; else entry
  // joins the checks waiting for room, which go, in order, on every live connection with room.
  sendOn(entry, conn) {
    if (entry.settled) return;
    if (typeof conn === 'string') return entry.done(null, conn);
    if (conn.broken !== null) return entry.done(null, conn.broken);
    if (conn.retired || conn.cut !== null) return this.route(entry); // given up meanwhile: its slot redials
    if (this.waiting.size === 0 && conn.inFlight() < MAX_PENDING) {
      this.write(entry, conn);
      return;
    }
    this.waiting.push(entry);
    for (let c = this.roomy(); c !== null && this.waiting.size > 0; c = this.roomy()) this.admit(c);
  }

  // noRoom notes a check that waited for room for its whole timeout: every full connection
  // left it unanswered, as if it had timed out on it (Conn.timedOut). Else a connection
  // filled with checks a stalled sidecar never answers would never be given up: no check
  // is sent on it, so none times out on it, and every check is decided by the policy
  // until that process ends.
  noRoom() {
    for (const s of this.slots) {
      const c = s.conn;
      if (c !== null && c.broken === null && !c.retired && c.inFlight() >= MAX_PENDING) c.timedOut();
    }
  }

  // roomy returns a live connection with room, or null.
  roomy() {
    for (const s of this.slots) {
      const c = s.conn;
      if (c !== null && c.broken === null && c.inFlight() < MAX_PENDING) return c;
    }
    return null;
  }

  // admit sends waiting checks on conn while it has room.
  admit(conn) {
    while (this.waiting.size > 0 && conn.broken === null && conn.cut === null && conn.inFlight() < MAX_PENDING) {
      this.write(this.waiting.shift(), conn);
    }
  }

  // reroute sends every waiting check round again (a connection broke: its slot redials).
  reroute() {
    if (this.waiting.size === 0 || this.closed) return;
    const entries = [];
    for (let e = this.waiting.shift(); e !== null; e = this.waiting.shift()) entries.push(e);
    for (const e of entries) this.route(e);
  }

  // write encodes entry's message with conn's next id and sends it.
  write(entry, conn) {
    const msg = entry.msg;
    msg.id = conn.nextId + 1;
    let frame;
    try {
      frame = proto.encode(msg);
    } catch (e) {
      entry.done(null, e);
      return;
    }
    if (frame.length - 4 > this.maxFrame) {
      entry.done(null, new RequestTooLargeError(frame.length - 4, this.maxFrame));
      return;
    }
    conn.send(entry, frame);
  }
}

// leaseMs is how long, in ms, the lease of a check answer's rules lasts at least: the
// longest window of its concurrency entries (a concurrency rule's window is its lease). A
// rate rule's window says nothing of it: before, it counted too, and a connection retired
// for a stall while it held a lease whose release went unanswered stayed open for a day
// when the check also matched a rule of 1 per day, where the lease ended in seconds. From
// a daemon that does not flag its concurrency entries (an earlier version), the longest
// window of all.
function leaseMs(rules) {
  let conc = 0;
  let every = 0;
  if (Array.isArray(rules)) {
    for (const r of rules) {
      const w = r ? Number(r.window_ms) : 0;
      if (!(w > 0)) continue;
      if (w > every) every = w;
      if (r.concurrency === true && w > conc) conc = w;
    }
  }
  return conc > 0 ? conc : every;
}

// tooLarge is the decision of a check too large to check: rejected, whatever onUnavailable.
function tooLarge(cause) {
  return new Decision({ allowed: false, tooLarge: true, cause });
}

module.exports = { Client, backoff, monoNow, WaitQueue, MAX_PENDING, OUTAGE_LOG_INTERVAL };
