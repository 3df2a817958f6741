// Command rlsidecar is the rate-limiting sidecar: a daemon that gateways ask "may this
// request pass?" over a Unix socket, and the tools around it.
//
//	rlsidecar serve    [--config F] [--socket P] [flags]   run the daemon
//	rlsidecar check    [--socket P] attr=value… [--cost N]  ask a running daemon; prints JSON
//	rlsidecar validate --config F                           check a rules file
//	rlsidecar reload   [--pid N] [--admin A]                reload a running daemon's rules; wait for the outcome
//	rlsidecar replay   --config F --trace T                 run a recorded trace through rules
//	rlsidecar import-envoy [--algorithm A] [--mode M] FILE… convert envoyproxy/ratelimit configs to rules
//	rlsidecar version
//
// Signals (serve): SIGTERM and SIGINT drain — stop accepting, answer what is in flight,
// remove the socket file (unless systemd passed it), exit 0; a second SIGINT exits at
// once with status 1. SIGHUP reloads the rules file; a broken file never replaces the
// rules in force.
//
// Under systemd (systemd/rlsidecar.socket and .service), serve takes its listening socket
// from LISTEN_FDS, and the Envoy API's from the socket named "envoy"
// (systemd/rlsidecar-envoy.socket) in place of --envoy-rls; it leaves those sockets in
// place when it exits (systemd holds them across restarts), and reports READY=1, RELOADING=1, STOPPING=1, STATUS= and WATCHDOG=1 to
// NOTIFY_SOCKET.
//
// Every flag of every command also reads RLSIDECAR_<FLAG> from the environment
// (--redis-timeout: RLSIDECAR_REDIS_TIMEOUT); the command line wins; a malformed value is
// a usage error.
//
// Exit codes: 0 success; 1 failure (a bad rules file, a daemon that could not start, a
// check that got no answer); 2 usage error.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
)

// version is set at build time with -ldflags "-X main.version=…".
var version = "0.1.0-dev"

const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// errUsage marks an error whose remedy is reading the usage text.
var errUsage = errors.New("usage")

const usage = `rlsidecar — a rate-limiting sidecar for API gateways

Usage:
  rlsidecar serve    [--config FILE] [--socket PATH] [flags]   run the daemon (built-in example rules without --config)
  rlsidecar check    [--socket PATH] attr=value... [--cost N]   ask a running daemon; prints the decision as JSON
  rlsidecar validate --config FILE                             check a rules file; exit 1 with file:line errors
  rlsidecar reload   [--pid N] [--admin ADDR]                  reload a running daemon's rules (SIGHUP) and wait: exit 1 if they failed
  rlsidecar replay   --config FILE --trace FILE                run a JSON-lines trace through the rules in local mode
  rlsidecar import-envoy [--algorithm A] [--mode M] FILE...    convert envoyproxy/ratelimit config files to rules YAML on stdout
  rlsidecar version

Run "rlsidecar COMMAND --help" for a command's flags.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	var err error
	switch args[0] {
	case "serve":
		err = serve(args[1:], stdout, stderr)
	case "check":
		err = check(args[1:], stdout, stderr)
	case "validate":
		err = validate(args[1:], stdout, stderr)
	case "reload":
		err = reload(args[1:], stdout, stderr)
	case "replay":
		err = replay(args[1:], stdout, stderr)
	case "import-envoy":
		err = importEnvoy(args[1:], stdout, stderr)
	case "version", "--version", "-version":
		if len(args) == 2 && (args[1] == "--help" || args[1] == "-h" || args[1] == "-help") {
			// The usage says to run "rlsidecar COMMAND --help": version has no flags.
			fmt.Fprint(stdout, "Usage of rlsidecar version:\n  rlsidecar version\tprints the version and the protocol version; takes no flags\n")
			return exitOK
		}
		if len(args) > 1 {
			fmt.Fprintf(stderr, "rlsidecar version: takes no arguments, got %q\n", args[1:])
			return exitUsage
		}
		fmt.Fprintf(stdout, "rlsidecar %s (protocol 1)\n", version)
	case "help", "--help", "-h", "-help":
		fmt.Fprint(stdout, usage)
	default:
		fmt.Fprintf(stderr, "rlsidecar: unknown command %q\n\n%s", args[0], usage)
		return exitUsage
	}
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.Is(err, errUsage):
		printErr(stderr, args[0], err)
		return exitUsage
	default:
		printErr(stderr, args[0], err)
		return exitFailure
	}
}

// printErr prints the error a command ended with. In the journal (a daemon that could
// not start, a failed ExecReload=), each of its lines is filed at priority err, where
// `journalctl -p err` finds it (a rules file's errors are one a line).
func printErr(stderr io.Writer, command string, err error) {
	msg := fmt.Sprintf("rlsidecar %s: %v", command, err)
	if toJournal(stderr) {
		prio := journalPriority(slog.LevelError)
		msg = prio + strings.ReplaceAll(msg, "\n", "\n"+prio)
	}
	fmt.Fprintln(stderr, msg)
}

// newFlags returns a FlagSet that reports errors instead of exiting. Its flags also read
// the environment (see applyEnv); its usage text says so.
func newFlags(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("rlsidecar "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage of rlsidecar %s:\n", name)
		fs.PrintDefaults()
		fmt.Fprintf(fs.Output(), "\n%s\n", envUsage)
		if name == "serve" {
			fmt.Fprintln(fs.Output(), passwordUsage)
		}
	}
	return fs
}

// parseInterspersed parses flags that may come before, between or after positional
// arguments, and returns the positional ones.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		// The flag package prints a bad value's error, then the usage; run prints the
		// error again as the last line. Parsed silently, the usage is printed here once,
		// and the error once, last.
		out := fs.Output()
		fs.SetOutput(io.Discard)
		err := fs.Parse(args)
		fs.SetOutput(out)
		if err != nil {
			fs.Usage()
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, fmt.Errorf("%w: %v", errUsage, err)
		}
		if fs.NArg() == 0 {
			if err := applyEnv(fs, os.LookupEnv); err != nil {
				return nil, err
			}
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

func noPositional(fs *flag.FlagSet, args []string) error {
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, strings.Join(pos, " "))
	}
	return nil
}
