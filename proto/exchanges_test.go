package proto

import (
	"encoding/hex"
	"fmt"
	"strings"
)

// exchanges are request/response pairs that a daemon started with testdata/rules.yaml
// answers byte for byte, on fresh state, in this order on one connection. Only first
// requests on fresh keys are used, so no answer depends on the time between requests.
func exchanges() []exchange {
	type ex struct {
		name, meaning string
		req           Request
		resp          Response
		kind          string
	}
	list := []ex{
		{"first-check", "a fresh user: per-user admits and has 4 of 5 left; the bucket refills one request per 12 s",
			Request{ID: 1, Op: OpCheck, Attrs: []Attr{{"user", "vec-alice"}}, Cost: 1},
			Response{ID: 1, Allowed: true, Rule: "per-user", Limit: 5, Remaining: 4, ResetMs: 12000,
				Rules: []RuleResult{{Name: "per-user", Limit: 5, WindowMs: 60000, Remaining: 4, ResetMs: 12000, Allowed: true}}}, "check"},
		{"two-rules", "POST /login matches login-per-ip and per-user; the deciding rule is the one with least remaining",
			Request{ID: 2, Op: OpCheck, Attrs: []Attr{{"method", "POST"}, {"path", "/login"}, {"ip", "198.51.100.1"}, {"user", "vec-bob"}}, Cost: 1},
			Response{ID: 2, Allowed: true, Rule: "login-per-ip", Limit: 3, Remaining: 2, ResetMs: 20000,
				Rules: []RuleResult{
					{Name: "per-user", Limit: 5, WindowMs: 60000, Remaining: 4, ResetMs: 12000, Allowed: true},
					{Name: "login-per-ip", Limit: 3, WindowMs: 60000, Remaining: 2, ResetMs: 20000, Allowed: true},
				}}, "check"},
		{"peek", "cost 0 on a fresh user: allowed, nothing consumed",
			Request{ID: 3, Op: OpCheck, Attrs: []Attr{{"user", "vec-carol"}}, Cost: 0},
			Response{ID: 3, Allowed: true, Rule: "per-user", Limit: 5, Remaining: 5, ResetMs: 0,
				Rules: []RuleResult{{Name: "per-user", Limit: 5, WindowMs: 60000, Remaining: 5, ResetMs: 0, Allowed: true}}}, "check"},
		{"cost-exceeds-capacity", "cost 6 against a rule of capacity 5: rejected for good, nothing consumed",
			Request{ID: 4, Op: OpCheck, Attrs: []Attr{{"user", "vec-dave"}}, Cost: 6},
			Response{ID: 4, Allowed: false, Rule: "per-user", Limit: 5, Remaining: 5, Reason: ReasonCostExceedsCapacity,
				Rules: []RuleResult{{Name: "per-user", Limit: 5, WindowMs: 60000, Remaining: 5, Allowed: false, Reason: ReasonCostExceedsCapacity}}}, "check"},
		{"shadow", "a shadow rule that would reject (cost 2 > its capacity 1) is reported but neither rejects nor decides",
			Request{ID: 5, Op: OpCheck, Attrs: []Attr{{"path", "/shadow"}, {"user", "vec-erin"}}, Cost: 2},
			Response{ID: 5, Allowed: true, Rule: "per-user", Limit: 5, Remaining: 3, ResetMs: 24000,
				Rules: []RuleResult{
					{Name: "per-user", Limit: 5, WindowMs: 60000, Remaining: 3, ResetMs: 24000, Allowed: true},
					{Name: "shadow-tight", Limit: 1, WindowMs: 1000, Remaining: 1, Allowed: false, Shadow: true, Reason: ReasonCostExceedsCapacity},
				}}, "check"},
		{"inline-limit", "an inline limit beside a rule; its name defaults to its key",
			Request{ID: 6, Op: OpCheck, Attrs: []Attr{{"user", "vec-frank"}}, Limits: []InlineLimit{{Key: "vec-tenant", Limit: 2, WindowMs: 1000}}, Cost: 1},
			Response{ID: 6, Allowed: true, Rule: "vec-tenant", Limit: 2, Remaining: 1, ResetMs: 500,
				Rules: []RuleResult{
					{Name: "per-user", Limit: 5, WindowMs: 60000, Remaining: 4, ResetMs: 12000, Allowed: true},
					{Name: "vec-tenant", Limit: 2, WindowMs: 1000, Remaining: 1, ResetMs: 500, Allowed: true},
				}}, "check"},
		{"nothing-matched", "no rule applies (no user attribute): allowed, no deciding rule",
			Request{ID: 7, Op: OpCheck, Attrs: []Attr{{"path", "/health"}}, Cost: 1},
			Response{ID: 7, Allowed: true}, "check"},
		{"unknown-op", "an op the server does not know",
			Request{ID: 8, Op: "frobnicate", Cost: 1},
			Response{ID: 8, Err: Error{Code: CodeUnknownOp, Message: `unknown op "frobnicate"; this server knows "check", "ping", "release" and "renew"`}}, "error"},
		{"invalid-inline-limit", "an inline limit with limit 0",
			Request{ID: 9, Op: OpCheck, Limits: []InlineLimit{{Key: "k", Limit: 0, WindowMs: 1000}}, Cost: 1},
			Response{ID: 9, Err: Error{Code: CodeInvalidLimit, Message: `limits[0]: "limit" must be at least 1`}}, "error"},
		{"unknown-op-long", "an op of 65 bytes is an op the server does not know, however long; the message quotes its first 64 bytes",
			Request{ID: 10, Op: strings.Repeat("x", 65), Cost: 1},
			Response{ID: 10, Err: Error{Code: CodeUnknownOp, Message: `unknown op "` + strings.Repeat("x", 64) + `"… (65 bytes); this server knows "check", "ping", "release" and "renew"`}}, "error"},
	}
	var out []exchange
	for _, e := range list {
		enc := NewEncoder()
		enc.EncodeRequest(&e.req)
		reqHex := hex.EncodeToString(enc.Bytes())
		r := e.resp
		out = append(out, exchange{Name: e.name, Meaning: e.meaning, RequestHex: reqHex, ResponseHex: hex.EncodeToString(encodeResponse(&r, e.kind))})
	}
	_ = fmt.Sprint
	return out
}
