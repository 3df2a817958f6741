//go:build race || !amd64

package localbucket

// prefetching is off under the race detector, which would report a prefetch's read of
// a slot without its shard's lock (see PrefetchRecord), and where prefetch is not written.
const prefetching = false
