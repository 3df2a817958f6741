package main

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// The Redis password is kept out of the logs wherever a record carries it: a server's
// error quoting AUTH's arguments, a message, a string attribute; text and JSON alike.
func TestLogScrubsPassword(t *testing.T) {
	for _, format := range []string{"text", "json"} {
		var buf bytes.Buffer
		secrets := &scrubber{}
		log, err := newLogger(&buf, format, "debug", secrets)
		if err != nil {
			t.Fatal(err)
		}
		secrets.set("S3cr3tPW")
		log.Warn("redis sync failed", "err", errors.New("heartbeat: ERR unknown command 'auth', with args beginning with: 'S3cr3tPW'"))
		log.Info("connecting with S3cr3tPW", "url", "redis://:S3cr3tPW@h:1", "group", "g")
		log.Debug("nothing secret", "n", 3)
		out := buf.String()
		if strings.Contains(out, "S3cr3tPW") {
			t.Fatalf("%s: the password is in the log:\n%s", format, out)
		}
		if strings.Count(out, "xxxxx") != 3 || !strings.Contains(out, "nothing secret") {
			t.Fatalf("%s: want the password replaced three times and the rest kept:\n%s", format, out)
		}
	}
}
