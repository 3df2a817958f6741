package main

import (
	"fmt"
	"io"
	"os"

	"github.com/rlsidecar/rlsidecar/envoyrls"
	"github.com/rlsidecar/rlsidecar/rules"
)

// importEnvoy converts envoyproxy/ratelimit configuration files to an rlsidecar rules
// file on stdout. The output is validated before it is written: a conversion that would
// not load is a bug, reported as such.
func importEnvoy(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("import-envoy", stderr)
	alg := fs.String("algorithm", "fixed_window", "algorithm of the rules written: fixed_window (Envoy's windows, aligned to the epoch), sliding_window or token_bucket")
	mode := fs.String("mode", "", "mode of the rules written: local, hybrid or global (exact across daemons, as envoyproxy/ratelimit's Redis counters are); empty: none, the daemon's default (hybrid with Redis)")
	wild := fs.String("wildcards", envoyrls.WildcardsAnywhere, "how a '*' in a descriptor value matches: anywhere (each '*' any run of characters, wherever it is: envoyproxy/ratelimit since #1085, March 2026) or trailing (only a '*' ending the value, a prefix; one before the end a literal character: its builds before)")
	paths, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(paths) == 0 {
		return fmt.Errorf("%w: give one or more envoyproxy/ratelimit config files", errUsage)
	}
	switch *alg {
	case "fixed_window", "sliding_window", "token_bucket":
	default:
		return fmt.Errorf("%w: --algorithm %q: use fixed_window (Envoy's), sliding_window or token_bucket", errUsage, *alg)
	}
	if *mode != "" {
		if _, err := rules.ParseMode(*mode); err != nil {
			return fmt.Errorf("%w: --mode %q: use local, hybrid or global", errUsage, *mode)
		}
	}
	switch *wild {
	case envoyrls.WildcardsAnywhere, envoyrls.WildcardsTrailing:
	default:
		return fmt.Errorf("%w: --wildcards %q: use anywhere (envoyproxy/ratelimit since #1085) or trailing (its builds before)", errUsage, *wild)
	}
	files := make([]envoyrls.File, len(paths))
	for i, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		files[i] = envoyrls.File{Name: p, Data: data}
	}
	out, err := envoyrls.ConvertWith(files, envoyrls.ConvertOptions{Algorithm: *alg, Mode: *mode, Wildcards: *wild})
	if err != nil {
		return err
	}
	if _, err := rules.Parse("import-envoy output", out); err != nil {
		return fmt.Errorf("BUG: the converted rules do not load:\n%v", err)
	}
	_, err = stdout.Write(out)
	return err
}
