package sync

import (
	"context"
	"runtime"
	gosync "sync"
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
type autoPipe struct {
	rediser
	mu    gosync.Mutex
	busy  bool
	queue []*apCall
}

// processor sends one command: *redis.Client and *redis.ClusterClient.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

type apCall struct {
	ctx  context.Context
	cmd  *redis.Cmd
	done chan bool // true: lead the next batch; false: cmd holds the reply
}

// EvalSha queues the call and returns when its batch has been answered.
func (a *autoPipe) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	cmdArgs := make([]any, 0, 3+len(keys)+len(args))
	cmdArgs = append(cmdArgs, "evalsha", sha1, len(keys))
	for _, k := range keys {
		cmdArgs = append(cmdArgs, k)
	}
	cmdArgs = append(cmdArgs, args...)
	c := &apCall{ctx: ctx, cmd: redis.NewCmd(ctx, cmdArgs...), done: make(chan bool, 1)}
	if len(keys) > 0 {
		c.cmd.SetFirstKeyPos(3)
	}
	a.mu.Lock()
	a.queue = append(a.queue, c)
	lead := !a.busy
	a.busy = true
	a.mu.Unlock()
	for {
		if lead {
			a.send()
		}
		if lead = <-c.done; !lead {
			return c.cmd
		}
	}
}

// send sends every queued call as one pipeline, answers them, and hands the next batch
// to the first caller that queued meanwhile.
func (a *autoPipe) send() {
	// Let the callers already runnable queue first: the checks of one pipelined batch
	// are started together, and without this the first would go alone, the rest a round
	// trip later. A lone call loses a scheduler pass, not a round trip.
	runtime.Gosched()
	a.mu.Lock()
	batch := a.queue
	a.queue = nil
	a.mu.Unlock()

	// The batch's context: the latest deadline among its calls (each caller's own
	// deadline bounds only its own wait in go-redis; here they share one round trip).
	var latest time.Time
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
	}
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	if bounded {
		ctx, cancel = context.WithDeadline(ctx, latest)
	}
	if p, ok := a.rediser.(processor); ok && len(batch) == 1 {
		_ = p.Process(ctx, batch[0].cmd)
	} else {
		pipe := a.rediser.Pipeline()
		for _, c := range batch {
			_ = pipe.Process(ctx, c.cmd)
		}
		_, _ = pipe.Exec(ctx) // every cmd carries its own error
	}
	cancel()

	a.mu.Lock()
	var next *apCall
	if len(a.queue) > 0 {
		next = a.queue[0]
	} else {
		a.busy = false
	}
	a.mu.Unlock()
	for _, c := range batch {
		c.done <- false
	}
	if next != nil {
		next.done <- true
	}
}
