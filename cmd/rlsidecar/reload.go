package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// reload asks a running daemon to reload its rules and waits for the outcome: it sends
// SIGHUP, then reads the daemon's admin endpoint (/rules) until a reload begun after it
// started has ended. It exits 0 once the file's rules are in force (or were already),
// 1 when the reload failed (the rules in force stay; the error is printed) or did not end
// in time. systemd runs it as the unit's ExecReload=, so that `systemctl reload
// rlsidecar` returns once the rules are in force and fails when the file is broken,
// where `kill -HUP` returned at once, and succeeded, either way.
//
// The admin endpoint is the one the daemon itself was given: without --admin, reload
// reads the daemon's command line and environment (/proc/PID/cmdline and environ), so a
// drop-in that adds --admin to ExecStart= or a second daemon with its own address needs
// nothing more.
//
// Without an admin endpoint to read (--admin empty, a port the daemon picked itself,
// unreachable, or held by another daemon), it sends SIGHUP, says on stderr that it could
// not wait, and exits 0, as kill -HUP did.
func reload(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("reload", stderr)
	pid := fs.Int("pid", 0, "the daemon's process id (default: $MAINPID, which systemd sets for ExecReload=)")
	admin := fs.String("admin", defaultAdmin, "the daemon's admin endpoint (default: the daemon's own --admin or RLSIDECAR_ADMIN, read from /proc/PID; else this flag's RLSIDECAR_ADMIN or default); empty: send SIGHUP without waiting")
	timeout := fs.Duration("timeout", 30*time.Second, "how long to wait for the reload to end")
	if err := noPositional(fs, args); err != nil {
		return err
	}
	if *pid == 0 {
		if v := os.Getenv("MAINPID"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil {
				return fmt.Errorf("%w: MAINPID=%q is not a process id", errUsage, v)
			}
			*pid = n
		}
	}
	if *pid <= 0 {
		return fmt.Errorf("%w: --pid (or MAINPID) is required", errUsage)
	}
	if *timeout <= 0 {
		return fmt.Errorf("%w: --timeout must be positive", errUsage)
	}
	if _, given := flagValue(args, "admin"); !given {
		if a, ok := daemonAdmin(*pid); ok {
			*admin = a
		}
	}
	*admin = dialAddr(*admin)
	hc := &http.Client{Timeout: 2 * time.Second}
	var before reloadDoc
	why := ""
	if *admin == "" {
		why = "no --admin"
	} else if _, port, err := net.SplitHostPort(*admin); err == nil && port == "0" {
		why = fmt.Sprintf("the admin endpoint %s has a port the daemon picked itself (give it a fixed port, or give reload the one it logged)", *admin)
	} else if err := before.read(hc, *admin); err != nil {
		why = err.Error()
	} else if before.PID != *pid {
		why = fmt.Sprintf("the admin endpoint %s is process %d's, not %d's (another daemon on the default address? give each its own --admin)", *admin, before.PID, *pid)
	} else if before.ReloadsBegun == nil {
		why = fmt.Sprintf("the daemon at %s does not count its reloads (an older version)", *admin)
	}
	if err := syscall.Kill(*pid, syscall.SIGHUP); err != nil {
		return fmt.Errorf("SIGHUP to process %d: %w", *pid, err)
	}
	if why != "" {
		fmt.Fprintf(stderr, "rlsidecar reload: sent SIGHUP to process %d; not waiting for the reload's outcome: %s\n", *pid, why)
		return nil
	}
	want := *before.ReloadsBegun + 1
	deadline := time.Now().Add(*timeout)
	var now reloadDoc
	for {
		err := now.read(hc, *admin)
		switch {
		case err == nil && now.PID != *pid:
			return fmt.Errorf("sent SIGHUP to process %d; its admin endpoint %s is now process %d's (it restarted?)", *pid, *admin, now.PID)
		case err == nil && now.Reloads >= want:
			if now.ReloadError != "" {
				return fmt.Errorf("reload failed, keeping the rules in force (version %s): %s", now.Version, now.ReloadError)
			}
			fmt.Fprintf(stdout, "rules in force: %s, version %s\n", now.Source, now.Version)
			return nil
		case time.Now().After(deadline):
			if err != nil {
				return fmt.Errorf("sent SIGHUP to process %d; no reload's end seen within %v: %w", *pid, *timeout, err)
			}
			return fmt.Errorf("sent SIGHUP to process %d; no reload's end seen within %v", *pid, *timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// reloadDoc is what reload reads of /rules.
type reloadDoc struct {
	Version      string  `json:"version"`
	Source       string  `json:"source"`
	PID          int     `json:"pid"`
	ReloadsBegun *uint64 `json:"reloads_begun"` // nil: a daemon that does not count them
	Reloads      uint64  `json:"reloads"`
	ReloadError  string  `json:"reload_error"`
}

func (d *reloadDoc) read(hc *http.Client, admin string) error {
	*d = reloadDoc{}
	resp, err := hc.Get("http://" + admin + "/rules")
	if err != nil {
		return fmt.Errorf("reading the admin endpoint: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("reading the admin endpoint: GET /rules: %s", resp.Status)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(d); err != nil {
		return fmt.Errorf("reading the admin endpoint: GET /rules: %w", err)
	}
	if d.PID == 0 {
		return errors.New("reading the admin endpoint: GET /rules names no pid (an older daemon)")
	}
	return nil
}

// dialAddr returns the address to ask the admin endpoint listening on addr at: addr
// itself, but localhost for a listen address that names no host (":9464", every
// interface, as exporters are often bound for a scraper on another host). Asked at
// ":9464", the endpoint saw the Host ":9464", which names no IP address or localhost, and
// refused it (421, its guard against DNS rebinding): reload then only signalled, and
// `systemctl reload` succeeded on a broken rules file.
func dialAddr(addr string) string {
	if host, port, err := net.SplitHostPort(addr); err == nil && host == "" {
		return net.JoinHostPort("localhost", port)
	}
	return addr
}

// defaultAdmin is serve's --admin when neither the flag nor RLSIDECAR_ADMIN sets it.
const defaultAdmin = "127.0.0.1:9464"

// daemonAdmin returns the admin address process pid was given, as its serve reads it:
// --admin on its command line, else RLSIDECAR_ADMIN in its environment, else the
// default. ok is false when /proc does not show them (another user's process, no /proc).
func daemonAdmin(pid int) (addr string, ok bool) {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || len(cmdline) == 0 {
		return "", false
	}
	if v, given := flagValue(strings.Split(strings.TrimSuffix(string(cmdline), "\x00"), "\x00")[1:], "admin"); given {
		return v, true
	}
	environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	if err != nil {
		return "", false
	}
	for _, kv := range strings.Split(string(environ), "\x00") {
		if v, found := strings.CutPrefix(kv, envName("admin")+"="); found {
			return v, true
		}
	}
	return defaultAdmin, true
}

// flagValue returns the last value args give the string flag name, in any form the flag
// package takes (-name v, --name v, -name=v, --name=v), up to a "--" that ends the flags.
func flagValue(args []string, name string) (value string, given bool) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			break
		}
		a, dashed := strings.CutPrefix(a, "-")
		if !dashed {
			continue
		}
		a = strings.TrimPrefix(a, "-")
		if v, found := strings.CutPrefix(a, name+"="); found {
			value, given = v, true
		} else if a == name && i+1 < len(args) {
			value, given = args[i+1], true
			i++
		}
	}
	return value, given
}
