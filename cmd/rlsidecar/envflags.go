package main

import (
	"flag"
	"fmt"
	"slices"
	"strings"
)

// envPrefix starts the name of the environment variable every flag also reads.
const envPrefix = "RLSIDECAR_"

// envUsage ends every command's --help.
const envUsage = `Every flag can also be set in the environment as RLSIDECAR_<FLAG>, upper-case with
dashes turned into underscores (--redis-timeout: RLSIDECAR_REDIS_TIMEOUT=20ms). A flag on
the command line wins over the environment. A malformed value in the environment is an
error, never silently replaced by the default.`

// passwordUsage follows envUsage in the --help of serve, the one command that talks to
// Redis.
const passwordUsage = `The Redis password is read from --redis-password-file or $RLSIDECAR_REDIS_PASSWORD
(one of them, or the URL: two is an error); it never appears in ps or logs.`

// envName returns the environment variable that sets the flag called name:
// "redis-timeout" → "RLSIDECAR_REDIS_TIMEOUT".
func envName(name string) string {
	return envPrefix + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// applyEnv sets every flag of fs that the command line did not set from its environment
// variable (envName), when lookup finds one. fs must already be parsed. A value the flag
// refuses is a usage error naming the variable; an empty value is a value like any other
// (RLSIDECAR_ADMIN= turns the admin endpoint off), not an absence.
func applyEnv(fs *flag.FlagSet, lookup func(string) (string, bool)) error {
	onCommandLine := make(map[string]bool)
	fs.Visit(func(f *flag.Flag) { onCommandLine[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if err != nil || onCommandLine[f.Name] {
			return
		}
		name := envName(f.Name)
		v, ok := lookup(name)
		if !ok {
			return
		}
		if serr := fs.Set(f.Name, v); serr != nil {
			// String flags never fail, so a value echoed here is never a Redis URL.
			err = fmt.Errorf("%w: $%s=%q: invalid value for --%s: %v", errUsage, name, v, f.Name, serr)
		}
	})
	return err
}

// envNotFlags are RLSIDECAR_ variables that are read but are not flags.
var envNotFlags = []string{"RLSIDECAR_REDIS_PASSWORD"}

// unknownEnv returns the names of the RLSIDECAR_ variables in environ (os.Environ's form)
// that set no flag of fs and are not otherwise read: likely typos in a settings file,
// worth a warning (by name only: a value may be secret).
func unknownEnv(fs *flag.FlagSet, environ []string) []string {
	known := map[string]bool{}
	fs.VisitAll(func(f *flag.Flag) { known[envName(f.Name)] = true })
	var out []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, envPrefix) && !known[name] && !slices.Contains(envNotFlags, name) {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}
