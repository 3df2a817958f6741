// Package unixsocktest helps tests of socket files given to a group (--socket-group).
package unixsocktest

import (
	"os"
	"testing"
)

// OtherGroup returns a group this process may give a file to, other than its own: any
// group for root (54321), else a supplementary group. It skips tb when there is none.
func OtherGroup(tb testing.TB) int {
	tb.Helper()
	if os.Geteuid() == 0 {
		return 54321 // root may give a file to any group
	}
	groups, _ := os.Getgroups()
	for _, g := range groups {
		if g != os.Getgid() {
			return g
		}
	}
	tb.Skip("needs root or a supplementary group")
	return -1
}
