package sync

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

func TestVersionAtLeast(t *testing.T) {
	for v, want := range map[string]bool{
		"7.0.15": true, "7.0.0": true, "7.2.4": true, "8.0.2": true, "10.0.0": true, "255.255.255": true,
		"6.2.14": false, "6.0.20": false, "5.0.7": false, "6.9.9": false,
		"": true, "unknown": true, "7": true,
	} {
		if got := versionAtLeast(v, [2]int{7, 0}); got != want {
			t.Errorf("versionAtLeast(%q, 7.0) = %v, want %v", v, got, want)
		}
	}
}

func TestInfoField(t *testing.T) {
	info := "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\nredis_mode:standalone\r\n"
	if got := infoField(info, "redis_version"); got != "7.0.15" {
		t.Fatalf("redis_version %q", got)
	}
	if got := infoField(info, "redis"); got != "" {
		t.Fatalf("a field that is a prefix of another's name: %q", got)
	}
}

// The real redis-server, standalone and each master of a Cluster, answers its version
// and passes; a minimum above it names the server and what fails there.
func TestCheckVersion(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	srv := redistest.StartStandalone(t)
	cl := redistest.StartCluster(t)
	for name, rdb := range map[string]redis.UniversalClient{
		"standalone": redis.NewClient(&redis.Options{Addr: srv.Addr}),
		"cluster":    redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs}),
	} {
		defer rdb.Close()
		old, err := CheckVersion(ctx, rdb)
		if err != nil || len(old) != 0 {
			t.Fatalf("%s: %v, %q; want none older than %v", name, err, old, MinRedisVersion)
		}
		saved := MinRedisVersion
		MinRedisVersion = [2]int{255, 255}
		old, err = CheckVersion(ctx, rdb)
		MinRedisVersion = saved
		want := 1
		if name == "cluster" {
			want = 3
		}
		if err != nil || len(old) != want || !strings.Contains(old[0], "older than 255.255") || !strings.Contains(old[0], "shared bans") {
			t.Fatalf("%s: %v, %q; want %d sentences naming the version needed", name, err, old, want)
		}
	}
}
