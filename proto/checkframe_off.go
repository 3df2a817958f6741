//go:build !rlsidecar_checkframe

package proto

// checkFrame is false in the default build: the fast request decoder's reads are
// unchecked (see frame).
const checkFrame = false
