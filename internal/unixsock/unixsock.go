// Package unixsock holds what both listeners of the daemon (the msgpack socket, package
// daemon, and the Envoy API, package envoyrls) do alike to the Unix socket files they
// create.
package unixsock

import (
	"fmt"
	"os/user"
	"strconv"
)

// LookupGroup returns the id of the group named, or numbered, name: "rlsidecar", "33".
// A number is taken as it is, whether or not a group has it.
func LookupGroup(name string) (int, error) {
	if id, err := strconv.Atoi(name); err == nil && id >= 0 {
		return id, nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return 0, fmt.Errorf("socket group: %w", err)
	}
	id, err := strconv.Atoi(g.Gid)
	if err != nil {
		return 0, fmt.Errorf("socket group %s: gid %q is not a number", name, g.Gid)
	}
	return id, nil
}
