package sync

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// autoPipe sends the script calls of concurrent checks together: while one batch is on
// the wire, the calls that arrive wait, and go as the next batch, in one pipeline (one
// write, one read, on one connection per node). Many checks in flight then cost Redis
// and the daemon a few syscalls per batch instead of a few per check; a lone check goes
// at once, as before.
//
// No goroutine of its own: the caller whose call finds no batch in flight sends one;
// when it is done, the first caller still waiting is woken to send the next. A queued
// call waits for the batch in flight (bounded by its callers' deadlines) and then its
// own. Safe for concurrent use.
//
// On a standalone Redis (merge set) the global.lua calls of one batch go further: they
// are sent as one call of global.lua's batch form (per mergeMax of them), which decides
// them one after another, each all-or-nothing, exactly as the separate calls would in
// that order, and answers each; Redis then pays one script call, one TIME and one
// command parse per batch instead of per check. Each caller still gets its own reply (or the call's error: a
// NOSCRIPT then makes each caller resend its own call with EVAL, as without merging).
//
// On a Redis Cluster with a breaker per master (Global.WithMasters) each master has its
// own queue (Master.calls): a batch holds the calls of one master, so a frozen master
// holds up only the checks that need it, not those queued behind its batch for the
// others.
type autoPipe struct {
	rediser
	merge bool    // standalone: merge a batch's global.lua calls into one
	g     *Global // its masters, read per call; nil: one queue
	calls combiner[*apCall]
}

// queue returns the queue of a call on keys: its master's on a cluster with a breaker
// per master, else the one queue.
func (a *autoPipe) queue(keys []string) *combiner[*apCall] {
	if a.g != nil && len(keys) > 0 {
		if m := a.g.masters; m.Cluster() {
			return &m.ForKey(keys[0]).calls
		}
	}
	return &a.calls
}

// processor sends one command: *redis.Client and *redis.ClusterClient.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

type apCall struct {
	ctx    context.Context
	cmd    *redis.Cmd
	done   chan bool     // see batchMember; false: cmd holds the reply
	budget time.Duration // from the call to its deadline; 0: none
	// The call, for merging: set for a global.lua call only.
	global bool
	keys   []string
	args   []any
}

// EvalSha queues the call and returns when its batch has been answered. A hook ctx
// carries (WithQueued) is called once the call is queued.
func (a *autoPipe) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	c := a.newCall(ctx, sha1, keys, args)
	queued, _ := ctx.Value(queuedKey{}).(func())
	a.queue(keys).do(c, a.send, queued)
	return c.cmd
}

type queuedKey struct{}

// WithQueued returns ctx carrying f, which a global check's script call made with it
// calls once the call is queued for Redis (auto-pipelined calls, which go in the order
// they are queued, per master): a caller that must have a later check of the same key
// decided after this one can let it go from then on, rather than once this one is
// answered, so that the two share a round trip. A check that is not queued (refused
// before Redis, or sent in a pipeline of its own: several hash slots) never calls f.
func WithQueued(ctx context.Context, f func()) context.Context {
	return context.WithValue(ctx, queuedKey{}, f)
}

func (c *apCall) wake() chan bool { return c.done }

// newCall returns the queued form of an EVALSHA call.
func (a *autoPipe) newCall(ctx context.Context, sha1 string, keys []string, args []any) *apCall {
	cmdArgs := make([]any, 0, 3+len(keys)+len(args))
	cmdArgs = append(cmdArgs, "evalsha", sha1, len(keys))
	for _, k := range keys {
		cmdArgs = append(cmdArgs, k)
	}
	cmdArgs = append(cmdArgs, args...)
	c := &apCall{ctx: ctx, cmd: redis.NewCmd(ctx, cmdArgs...), done: make(chan bool, 1)}
	if d, ok := ctx.Deadline(); ok {
		c.budget = time.Until(d)
	}
	if len(keys) > 0 {
		c.cmd.SetFirstKeyPos(3)
	}
	if a.merge && sha1 == globalScript.Hash() && len(keys) > 0 {
		c.global, c.keys, c.args = true, keys, args
	}
	return c
}

// errNotSent is the error of a call whose deadline passed while it waited for the calls
// queued before it: it was not sent, so Redis did nothing for it, and it tells nothing of
// Redis's health (a master's breaker does not count it; settle).
var errNotSent = errors.New("global call not sent to Redis: its deadline passed while the calls before it were answered")

// batchMax is the most calls one round trip carries (two merged calls on a standalone
// Redis: about 4 ms of Redis time, well within a round trip's time, a whole check's
// timeout; more would save round trips to a distant Redis only to risk that time). The
// rest of a batch go in the next round trips, each sent when the one before it is
// answered.
const batchMax = 2 * mergeMax

// send sends batch's calls, in round trips of at most batchMax, and answers them. A call
// whose deadline has passed when its round trip is due is answered errNotSent instead of
// being sent: a burst of more calls than Redis answers within their deadline then costs
// Redis only the calls still wanted, the calls answered by their policy are not also
// counted in Redis, and the round trips that go each have time to be answered.
func (a *autoPipe) send(batch []*apCall) {
	for len(batch) > 0 {
		trip := make([]*apCall, 0, min(len(batch), batchMax))
		i := 0
		for ; i < len(batch) && len(trip) < batchMax; i++ {
			c := batch[i]
			if err := c.ctx.Err(); err != nil {
				c.cmd.SetErr(fmt.Errorf("%w (%w)", errNotSent, err))
				c.done <- false
				continue
			}
			trip = append(trip, c)
		}
		batch = batch[i:]
		if len(trip) > 0 {
			a.sendTrip(trip)
		}
	}
}

// sendTrip sends batch's calls as one pipeline and answers them.
func (a *autoPipe) sendTrip(batch []*apCall) {
	// The round trip's context: the latest deadline among its calls (each caller's own
	// deadline bounds only its own wait in go-redis; here they share one round trip), and
	// at least a call's budget (its timeout) from now: calls that waited in the queue to
	// near their deadline (a burst) still give Redis the time of a whole check, so that a
	// timeout means a slow Redis, not a long queue here, and the breaker hears of Redis
	// only. Their callers then wait up to their timeout past their deadline (at most
	// twice it in all), as a caller queued behind a batch with a later deadline could.
	var latest time.Time
	var budget time.Duration
	bounded := true
	for _, c := range batch {
		d, ok := c.ctx.Deadline()
		if !ok {
			bounded = false
			break
		}
		if d.After(latest) {
			latest = d
		}
		budget = max(budget, c.budget)
	}
	if floor := time.Now().Add(budget); bounded && floor.After(latest) {
		latest = floor
	}
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	if bounded {
		ctx, cancel = context.WithDeadline(ctx, latest)
	}
	var merged []*redis.Cmd
	var groups [][]*apCall
	if a.merge {
		merged, groups = mergeGlobal(ctx, batch)
	}
	var cmds []redis.Cmder // each sent once (noRetry: see run)
	for _, m := range merged {
		cmds = append(cmds, noRetry{m})
	}
	for _, c := range batch {
		if merged == nil || !c.global {
			cmds = append(cmds, noRetry{c.cmd})
		}
	}
	if p, ok := a.rediser.(processor); ok && len(cmds) == 1 {
		_ = p.Process(ctx, cmds[0])
	} else {
		pipe := a.rediser.Pipeline()
		for _, c := range cmds {
			_ = pipe.Process(ctx, c)
		}
		_, err := pipe.Exec(ctx) // every cmd carries its own error, or this one
		for _, c := range cmds {
			if c, ok := c.(noRetry); ok {
				unanswered(err, c.Cmd)
				keepAnswered(c.Cmd) // a master that answered is not failed by another's timeout
			}
		}
	}
	cancel()
	for i, m := range merged {
		splitGlobal(m, groups[i])
	}

	for _, c := range batch {
		c.done <- false
	}
}

// mergeMax is the most requests one merged call decides: Redis runs a script without
// serving anyone else, so a call stays short (64 checks are about 2 ms of Redis time
// here) however many checks a batch holds; a batch of more goes as several calls, in one
// pipeline.
const mergeMax = 64

// mergeGlobal returns the calls of global.lua's batch form deciding the global.lua calls
// of batch, in order (at most mergeMax each), and the calls each decides; nil if batch
// has fewer than two global.lua calls.
func mergeGlobal(ctx context.Context, batch []*apCall) ([]*redis.Cmd, [][]*apCall) {
	var members []*apCall
	for _, c := range batch {
		if c.global {
			members = append(members, c)
		}
	}
	if len(members) < 2 {
		return nil, nil
	}
	var cmds []*redis.Cmd
	var groups [][]*apCall
	for lo := 0; lo < len(members); lo += mergeMax {
		group := members[lo:min(lo+mergeMax, len(members))]
		cmds = append(cmds, mergeCall(ctx, group))
		groups = append(groups, group)
	}
	return cmds, groups
}

// mergeCall returns the one call of global.lua's batch form deciding group, in order.
func mergeCall(ctx context.Context, group []*apCall) *redis.Cmd {
	nkeys, nargs := 0, 0
	for _, c := range group {
		nkeys += len(c.keys)
		nargs += len(c.args)
	}
	m := len(group)
	args := make([]any, 0, 3+nkeys+2+m+nargs)
	args = append(args, "evalsha", globalScript.Hash(), nkeys)
	for _, c := range group {
		for _, k := range c.keys {
			args = append(args, k)
		}
	}
	args = append(args, "batch", m)
	for _, c := range group {
		args = append(args, len(c.keys))
	}
	for _, c := range group {
		args = append(args, c.args...)
	}
	cmd := redis.NewCmd(ctx, args...)
	cmd.SetFirstKeyPos(3)
	return cmd
}

// splitGlobal gives each member of a merged call its own reply, or the call's error.
func splitGlobal(merged *redis.Cmd, members []*apCall) {
	if err := merged.Err(); err != nil {
		for _, c := range members {
			c.cmd.SetErr(err)
		}
		return
	}
	arr, ok := merged.Val().([]any)
	if !ok || len(arr) != len(members) {
		err := fmt.Errorf("global.lua batch of %d replied %T of %d values", len(members), merged.Val(), len(arr))
		for _, c := range members {
			c.cmd.SetErr(err)
		}
		return
	}
	for i, c := range members {
		if e, isErr := arr[i].(error); isErr {
			c.cmd.SetErr(e)
			continue
		}
		c.cmd.SetVal(arr[i])
	}
}
