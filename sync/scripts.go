package sync

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// scriptSources are the sources of every script the daemon runs.
func scriptSources() []string {
	return []string{globalSrc, refundSrc, hybridLua, heartbeatLua, banSrc, banKnownSrc, banLiftSrc, leaseSrc}
}

// LoadScripts loads every script the daemon runs into Redis's script cache (SCRIPT
// LOAD): on each master of a Cluster, or into the one Redis. The daemon calls it when
// it starts, and ProbeOpen when a master answers again after its breaker opened (it may
// have restarted, its cache empty). Without it, the first calls to a Redis that has not
// seen the scripts come back NOSCRIPT and go again with EVAL and the script's body: two
// round trips and a compile per script and connection, and on a fresh or restarted
// Redis an audit saw 8 to 31 of the first 32 pipelined global checks miss the 20 ms
// --global-timeout (degraded, and the breaker opened) where a Redis that knew the
// scripts missed none.
//
// On a Cluster it then sends one PING through the cluster client: go-redis fetches
// Redis's command table (COMMAND, about 90 KB from Redis 7, on a connection of its
// own) on a cluster client's first command not sent in a pipeline, and the first global
// check decided alone waited for it (5–13 ms on a 3-master Cluster, against 0.5 ms
// after, of a 20 ms --global-timeout).
func LoadScripts(ctx context.Context, rdb redis.UniversalClient) error {
	if c, ok := rdb.(*redis.ClusterClient); ok {
		if err := c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error { return loadScripts(ctx, m) }); err != nil {
			return err
		}
		return c.Ping(ctx).Err()
	}
	return loadScripts(ctx, rdb)
}

// loadScripts loads the scripts into c's Redis, in one pipeline.
func loadScripts(ctx context.Context, c redis.Cmdable) error {
	p := c.Pipeline()
	for _, src := range scriptSources() {
		p.ScriptLoad(ctx, src)
	}
	if _, err := p.Exec(ctx); err != nil {
		// A connection that has not authenticated may not send a bulk string as long
		// as a script: Redis closes it, and the pipeline reads only EOF. What the
		// connection may not do is what a PING is told (NOAUTH, WRONGPASS).
		if perr := c.Ping(ctx).Err(); perr != nil {
			return perr
		}
		return err
	}
	return nil
}

// loadScriptsFor loads the scripts into the master of key (the one Redis when rdb is not
// a Cluster client), as ping reaches it.
func loadScriptsFor(ctx context.Context, rdb rediser, key string) error {
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		m, err := c.MasterForKey(ctx, key)
		if err != nil {
			return err
		}
		return loadScripts(ctx, m)
	case redis.Cmdable:
		return loadScripts(ctx, c)
	}
	return nil
}
