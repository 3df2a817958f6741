//go:build !race && amd64

package localbucket

const prefetching = true
