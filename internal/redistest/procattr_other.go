//go:build !linux

package redistest

import "syscall"

// sysProcAttr: only Linux can tie the server's life to ours (Pdeathsig); elsewhere a
// server whose test binary dies without cleanup keeps running.
func sysProcAttr() *syscall.SysProcAttr { return nil }
