package redistest

import "syscall"

// sysProcAttr makes the kernel kill redis-server if the test process dies without running
// its cleanups (a panic, a -timeout), so no server outlives its test binary.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
