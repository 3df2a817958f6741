package rules

// DefaultYAML is the built-in rule set that `rlsidecar serve` uses without --config. It is
// a small demonstration of the schema: try `rlsidecar check ip=1.2.3.4` (per-ip applies),
// then add method=POST path=/login (or /login/), user=ann plan=partner or api_key=k1.
const DefaultYAML = `# rlsidecar built-in rules (used when no --config is given).
rules:
  # Every request, per client IP: 20 per 10 seconds, bursts of up to 20.
  # (Add ip_prefix: { ipv6: 64 } to count each IPv6 /64 as one client.)
  - name: per-ip
    key: ip
    limit: { requests: 20, per: 10s }

  # Logins, per IP: 5 per minute; when the store is unreachable, refuse rather than allow.
  # /login/ too: some servers (Express) run the /login handler for it.
  - name: login
    match: { method: POST, path: [/login, /login/] }
    key: ip
    limit: { requests: 5, per: 1m }
    on_store_failure: closed

  # Per user: 100 per minute, 1000 for partners, no limit for internal users.
  - name: per-user
    key: user
    limit: { requests: 100, per: 1m }
    plans: { partner: 1000, internal: unlimited }

  # Per API key: 1000 per hour, counted with a sliding window.
  - name: per-api-key
    key: api_key
    algorithm: sliding_window
    limit: { requests: 1000, per: 1h }
`

// Default returns the built-in rule set ([DefaultYAML]), with Source "built-in". Each call
// returns a new Set.
func Default() *Set {
	s, err := Parse("built-in", []byte(DefaultYAML))
	if err != nil {
		panic("BUG: rules: the built-in rules do not parse: " + err.Error())
	}
	return s
}
