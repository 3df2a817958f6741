package sync

import (
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// The policies of issue #15 in global mode, as global.lua's algorithms 3 and 4 (see its
// header): a calendar window and a token bucket with a delay. Both reuse the ARGV slots
// their algorithm has no use for, so a check keeps 7 values per key and 6 per reply.

// Script algorithm codes beyond localbucket's 0 (token bucket), 1 (sliding window) and
// 2 (fixed window).
const (
	algCalendar   = 3 // a fixed window whose bounds the daemon computed (GlobalOp.WindowLeft)
	algTokenDelay = 4 // a token bucket with a delay (localbucket.Limit.WithDelay)
	algBan        = 5 // a ban check (GlobalOp.Ban)
	algLease      = 6 // a concurrency lease's slot (GlobalOp.Lease, LeaseCheck)
)

// appendScriptArgs appends op's 7 global.lua ARGV values to args.
//
//   - a calendar window (algorithm 3): requests, its length in µs, requests, the time
//     left in it at the daemon's clock in µs (GlobalOp.WindowLeft, rounded up; at
//     least 1), cost,
//     shadow. Its key names the window, so the script needs no clock for it;
//   - a ban check (algorithm 5): 1, 1, 1, the shift of Redis TIME in ms (tests), 0, shadow;
//   - a lease slot (algorithm 6): max, the lease in ms (at least 1), the member,
//     LeaseGrace in ms, take (0/1), shadow;
//   - a token bucket with a delay (algorithm 4): as a token bucket, with the delay in µs
//     in place of the window (the token bucket's rate is its emission);
//   - anything else: algorithm, requests, window_us, burst, emission_ns, cost, shadow.
func appendScriptArgs(args []any, op *GlobalOp) []any {
	l := op.Limit
	shadow := 0
	if op.Shadow {
		shadow = 1
	}
	if op.Ban {
		return append(args, algBan, 1, 1, 1, op.BanShift.Milliseconds(), 0, shadow)
	}
	if lo := op.Lease; lo != nil {
		return append(args, algLease, lo.Max, max(lo.Lease.Milliseconds(), 1), op.member,
			LeaseGrace.Milliseconds(), b01(lo.Take), shadow)
	}
	if unit, _ := l.Calendar(); unit != localbucket.NoCalendar {
		// Rounded up: the script answers reset and retry-after as left µs, and a retry
		// must never be early (rounded down, 1 s and 1 ns left said retry in 1000 ms).
		left := max(int64((op.WindowLeft+time.Microsecond-1)/time.Microsecond), 1)
		return append(args, algCalendar, l.Requests(), l.Window().Microseconds(), l.Requests(), left, op.Cost, shadow)
	}
	alg, w := int(l.Algorithm()), l.Window().Microseconds()
	var emission int64
	if l.Algorithm() == localbucket.TokenBucket {
		emission = int64(l.Window()) / int64(l.Requests()) // as localbucket.NewLimit
		if d := l.Delay(); d > 0 {
			alg, w = algTokenDelay, max(d/int64(time.Microsecond), 1)
		}
	}
	return append(args, alg, l.Requests(), w, l.Burst(), emission, op.Cost, shadow)
}

// replyWindow reads the last value of op's global.lua reply: the start of the window the
// op counted in (for refund.lua), except for a lease slot (0: it copies the Result to its
// LeaseOp), for a token bucket with a delay, where it is the delay the request must wait
// (ns), which it writes in op.Result.Delay (a token bucket's refund needs no window), and
// for a ban check, where it is the ban's end (ms), which it writes in op.BannedUntil.
func replyWindow(op *GlobalOp, v int64) int64 {
	if lo := op.Lease; lo != nil {
		r := &op.Result
		lo.Allowed, lo.Remaining, lo.RetryAfter = r.Allowed, r.Remaining, time.Duration(r.RetryAfter)
		return 0
	}
	if op.Ban {
		op.BannedUntil = 0
		if !op.Result.Allowed {
			op.BannedUntil = v * int64(time.Millisecond)
		}
		return 0
	}
	if op.Limit.Algorithm() == localbucket.TokenBucket && op.Limit.Delay() > 0 {
		op.Result.Delay = v
		return 0
	}
	return v
}
