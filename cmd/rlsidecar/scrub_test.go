package main

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
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

// Redis quotes at most 128 bytes of a command's arguments in an error, so a longer
// password reaches the log cut short, and is hidden all the same; a short secret is
// hidden only whole (a few bytes that begin it are not it).
func TestLogScrubsPasswordCutShort(t *testing.T) {
	long := "K" + strings.Repeat("x7Q", 50) // 151 bytes
	for _, tc := range []struct{ secret, logged, leak string }{
		{long, "ERR unknown command 'auth', with args beginning with: '" + long[:128] + "' ", long[:8]},
		{long, "ERR unknown command 'hello', with args beginning with: '3' 'AUTH' 'default' '" + long[:106] + "' ", long[:8]},
		{long, "twice: " + long + " and " + long[:20], long[:8]},
		// Redis maps '\r' and '\n' to spaces in such errors: before, a password
		// holding them reached the log with spaces for them, unhidden.
		{"pa\r\nss\nword-9", "ERR unknown command 'auth', with args beginning with: 'pa  ss word-9' ", "ss word"},
		{"line1\nline2-long-enough", "... with args beginning with: 'line1 line2-lo' ", "line2"},
	} {
		var buf bytes.Buffer
		secrets := &scrubber{}
		log, err := newLogger(&buf, "text", "info", secrets)
		if err != nil {
			t.Fatal(err)
		}
		secrets.set(tc.secret)
		log.Warn("redis sync failed", "err", errors.New(tc.logged))
		if out := buf.String(); strings.Contains(out, tc.leak) || !strings.Contains(out, "xxxxx") {
			t.Fatalf("the password, cut short, is in the log:\n%s", out)
		}
	}
	var buf bytes.Buffer
	secrets := &scrubber{}
	log, err := newLogger(&buf, "text", "info", secrets)
	if err != nil {
		t.Fatal(err)
	}
	secrets.set("Hunter22")
	log.Info("kept", "a", "Hunter2 is not Hunter22")
	if out := buf.String(); !strings.Contains(out, "Hunter2 is not xxxxx") {
		t.Fatalf("want only the whole short secret hidden:\n%s", out)
	}
}

// A socket path longer than a Unix address holds is named as the cause, for check as for
// serve (the system's error was "connect: invalid argument").
func TestCheckSocketPathTooLong(t *testing.T) {
	long := "/tmp/" + strings.Repeat("x", 120)
	_, err := roundTrip(long, &proto.Request{Op: proto.OpPing}, time.Second)
	if err == nil || !strings.Contains(err.Error(), "holds at most 107") {
		t.Fatalf("check on a %d-byte socket path: %v", len(long), err)
	}
}

// A password file read again at each new connection may hold a new password: each one
// it has held is hidden, the one before it too (an error about a connection made with
// it may still be logged).
func TestLogScrubsEveryPasswordSet(t *testing.T) {
	var buf bytes.Buffer
	secrets := &scrubber{}
	log, err := newLogger(&buf, "text", "info", secrets)
	if err != nil {
		t.Fatal(err)
	}
	secrets.set("Old-PW-4471")
	secrets.set("New-PW-8820")
	secrets.set("Old-PW-4471")
	log.Warn("auth", "err", errors.New("ERR with args beginning with: 'Old-PW-4471' then 'New-PW-8820'"))
	if out := buf.String(); strings.Contains(out, "PW-") || strings.Count(out, "xxxxx") != 2 {
		t.Fatalf("want both passwords hidden:\n%s", out)
	}
}
