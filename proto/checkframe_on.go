//go:build rlsidecar_checkframe

package proto

// checkFrame makes every read of the fast request decoder checked (see frame).
const checkFrame = true
