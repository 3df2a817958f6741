package sync

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A reply of the bans' index in a shape Known does not expect (a Redis-compatible
// server that answers Redis TIME as a string, say) fails the read, and its error, which
// the daemon logs at warn every 10 s while it lasts, names no client: the reply holds
// the client keys of every ban in force (API keys, IPs), which the logs never show at
// info level. Before, the error held the whole reply.
func TestBansKnownBadReplyNamesNoClient(t *testing.T) {
	const member = "1|rl:login:{api_key=s3cr3t}"
	addr, _ := fakeNodeReplying(t, func(int32) string {
		return "*2\r\n$16\r\n1733390000000000\r\n*2\r\n$" + strconv.Itoa(len(member)) + "\r\n" + member + "\r\n$13\r\n1733390600000\r\n"
	})
	rdb, err := Open(Config{Cluster: []string{addr}, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	b, err := NewBans(rdb, DefaultPrefix)
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.Known(context.Background(), time.Now().UnixNano(), 10)
	if err == nil {
		t.Fatal("Known took a reply whose time is a string")
	}
	if strings.Contains(err.Error(), "s3cr3t") {
		t.Fatalf("Known's error names a banned client: %v", err)
	}
	t.Logf("Known: %v", err)
}
