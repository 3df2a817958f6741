package redistest

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// ScriptCalls returns how many EVAL and EVALSHA calls rdb's server has served (INFO
// commandstats), summed over the masters when rdb is a Cluster client: what tests count
// to show how many script calls a piece of work cost.
func ScriptCalls(ctx context.Context, rdb redis.UniversalClient) (int64, error) {
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		var total atomic.Int64 // ForEachMaster runs fn on the masters concurrently
		err := c.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
			n, err := ScriptCalls(ctx, node)
			total.Add(n)
			return err
		})
		return total.Load(), err
	case *redis.Client:
		info, err := c.Info(ctx, "commandstats").Result()
		if err != nil {
			return 0, err
		}
		return evalCallsIn(info)
	default:
		return 0, fmt.Errorf("ScriptCalls: unsupported client %T", rdb)
	}
}

// evalCallsIn sums the calls= of the EVAL and EVALSHA lines of an INFO commandstats reply.
func evalCallsIn(info string) (int64, error) {
	var total int64
	for _, line := range strings.Split(info, "\n") {
		if !strings.HasPrefix(line, "cmdstat_evalsha:") && !strings.HasPrefix(line, "cmdstat_eval:") {
			continue
		}
		_, rest, _ := strings.Cut(line, "calls=")
		v, _, _ := strings.Cut(rest, ",")
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("commandstats line %q: %w", line, err)
		}
		total += n
	}
	return total, nil
}

// MasterOf returns the address (host:port) of the master serving slot, as CLUSTER
// SHARDS tells it (CLUSTER SLOTS is deprecated since Redis 7.0).
func MasterOf(ctx context.Context, rdb *redis.ClusterClient, slot int64) (string, error) {
	shards, err := rdb.ClusterShards(ctx).Result()
	if err != nil {
		return "", fmt.Errorf("CLUSTER SHARDS: %w", err)
	}
	for _, s := range shards {
		for _, r := range s.Slots {
			if r.Start <= slot && slot <= r.End {
				for _, n := range s.Nodes {
					if n.Role == "master" {
						return net.JoinHostPort(n.IP, strconv.FormatInt(n.Port, 10)), nil
					}
				}
			}
		}
	}
	return "", fmt.Errorf("slot %d is not served", slot)
}
