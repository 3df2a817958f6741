package sync

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	gosync "sync"

	"github.com/redis/go-redis/v9"
)

// MinRedisVersion is the oldest Redis all of the daemon's commands run on: the shared
// bans' index takes its expiry with PEXPIREAT NX and GT (Redis 7.0) and is read with ZRANGE
// BYSCORE REV (6.2). On an older Redis these fail, and the first failure is not seen
// where it happens (the ZADD beside it succeeds): the index kept no TTL.
var MinRedisVersion = [2]int{7, 0}

// CheckVersion asks each Redis the client reaches (every master of a Cluster) for its
// version, and returns a sentence for each one older than MinRedisVersion, naming it
// and what fails there; none when all are recent enough. The error is the first of
// those that did not answer; the sentences are of those that did. Valkey reports in
// redis_version the Redis version it is compatible with, which is what counts here.
func CheckVersion(ctx context.Context, rdb redis.UniversalClient) ([]string, error) {
	var (
		mu  gosync.Mutex // a Cluster's masters are asked at once
		old []string
	)
	check := func(ctx context.Context, c *redis.Client) error {
		info, err := c.Info(ctx, "server").Result()
		if err != nil {
			return err
		}
		v := infoField(info, "redis_version")
		if !versionAtLeast(v, MinRedisVersion) {
			mu.Lock()
			old = append(old, fmt.Sprintf("Redis %s at %s is older than %d.%d, which rlsidecar needs: penalty rules' shared bans fail there, or leave their index in Redis without a TTL",
				v, c.Options().Addr, MinRedisVersion[0], MinRedisVersion[1]))
			mu.Unlock()
		}
		return nil
	}
	var err error
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, check)
	case *redis.Client:
		err = check(ctx, c)
	}
	return old, err
}

// infoField is the value of field in an INFO reply ("" when it is absent).
func infoField(info, field string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), field+":"); ok {
			return v
		}
	}
	return ""
}

// versionAtLeast reports whether v ("7.0.15", "6.2.14", "255.255.255" for a build from
// source) is min or later. A version it cannot read counts as recent enough: the
// check is a warning, not a guess.
func versionAtLeast(v string, min [2]int) bool {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return true
	}
	major, err1 := strconv.Atoi(parts[0])
	minor, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return true
	}
	return major > min[0] || major == min[0] && minor >= min[1]
}
