//go:build !rlsidecar_nostore

package limiter

import "github.com/rlsidecar/rlsidecar/localbucket"

// NoStore reports a measurement build (-tags rlsidecar_nostore, applylocal_nostore.go):
// false in every real one.
const NoStore = false

// applyLocal is the local store's Apply.
func applyLocal(st *localbucket.Store, now int64, ops []localbucket.Op) bool {
	return st.Apply(now, ops)
}
