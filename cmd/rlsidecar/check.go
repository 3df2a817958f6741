package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/rlsidecar/rlsidecar/daemon"
	"github.com/rlsidecar/rlsidecar/proto"
)

// ruleJSON and decisionJSON are the decision as check prints it: the protocol's names.
type ruleJSON struct {
	Name         string `json:"name"`
	Limit        uint64 `json:"limit"`
	WindowMs     uint64 `json:"window_ms"`
	Remaining    uint64 `json:"remaining"`
	ResetMs      uint64 `json:"reset_ms"`
	RetryAfterMs uint64 `json:"retry_after_ms"`
	Allowed      bool   `json:"allowed"`
	Shadow       bool   `json:"shadow"`
	Reason       string `json:"reason,omitempty"`
	Warning      bool   `json:"warning,omitempty"`
	DelayMs      uint64 `json:"delay_ms,omitempty"`
	Banned       bool   `json:"banned,omitempty"`
	Unasked      bool   `json:"unasked,omitempty"`
	Concurrency  bool   `json:"concurrency,omitempty"`
	Degraded     bool   `json:"degraded,omitempty"`
}

type decisionJSON struct {
	Allowed      bool       `json:"allowed"`
	Rule         string     `json:"rule"`
	Limit        uint64     `json:"limit"`
	Remaining    uint64     `json:"remaining"`
	ResetMs      uint64     `json:"reset_ms"`
	RetryAfterMs uint64     `json:"retry_after_ms"`
	Degraded     bool       `json:"degraded"`
	Reason       string     `json:"reason,omitempty"`
	Warning      bool       `json:"warning,omitempty"`
	DelayMs      uint64     `json:"delay_ms,omitempty"`
	Banned       bool       `json:"banned,omitempty"`
	Rules        []ruleJSON `json:"rules"`
}

func check(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("check", stderr)
	socket := fs.String("socket", daemon.DefaultSocketPath(), "Unix socket of the daemon")
	cost := fs.Uint64("cost", 1, "how much the request consumes; 0 asks without consuming")
	timeout := fs.Duration("timeout", 2*time.Second, "how long to wait for the answer")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	req := proto.Request{ID: 1, Op: proto.OpCheck, Cost: *cost}
	for _, p := range pos {
		name, value, ok := strings.Cut(p, "=")
		if !ok || name == "" {
			return fmt.Errorf("%w: %q is not attr=value", errUsage, p)
		}
		req.Attrs = append(req.Attrs, proto.Attr{Name: name, Value: value})
	}
	resp, err := roundTrip(*socket, &req, *timeout)
	if err != nil {
		return err
	}
	out := decisionJSON{Allowed: resp.Allowed, Rule: resp.Rule, Limit: resp.Limit, Remaining: resp.Remaining,
		ResetMs: resp.ResetMs, RetryAfterMs: resp.RetryAfterMs, Degraded: resp.Degraded, Reason: resp.Reason,
		Warning: resp.Warning, DelayMs: resp.DelayMs, Banned: resp.Banned, Rules: []ruleJSON{}}
	for _, r := range resp.Rules {
		out.Rules = append(out.Rules, ruleJSON(r))
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

// roundTrip sends one request on a fresh connection and returns the answer; an error
// response becomes an error.
func roundTrip(socket string, req *proto.Request, timeout time.Duration) (*proto.Response, error) {
	if max := len(syscall.RawSockaddrUnix{}.Path) - 1; len(socket) > max { // less its NUL
		return nil, fmt.Errorf("connecting to the daemon at %s: the path is %d bytes, and a Unix socket's holds at most %d (connect: invalid argument)", socket, len(socket), max)
	}
	c, err := net.DialTimeout("unix", socket, timeout)
	if err != nil {
		return nil, fmt.Errorf("connecting to the daemon at %s (is it running? see --socket): %w", socket, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	enc := proto.NewEncoder()
	enc.EncodeRequest(req)
	if _, err := c.Write(enc.Bytes()); err != nil {
		return nil, fmt.Errorf("sending to %s: %w", socket, err)
	}
	body, err := proto.ReadFrame(bufio.NewReader(c), nil, 1<<20)
	if err != nil {
		return nil, fmt.Errorf("reading the answer from %s: %w", socket, err)
	}
	var resp proto.Response
	if err := proto.NewDecoder().DecodeResponse(body, &resp); err != nil {
		return nil, fmt.Errorf("decoding the answer: %w", err)
	}
	if resp.IsError() {
		return nil, fmt.Errorf("the daemon answered %s: %s", resp.Err.Code, resp.Err.Message)
	}
	return &resp, nil
}
