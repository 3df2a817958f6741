package daemon

import (
	"unsafe"

	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// This conversion compiles only while proto.Attr and rules.Attr are the same struct,
// which rulesAttrs relies on.
var _ = rules.Attr(proto.Attr{})

// rulesAttrs returns attrs as rules.Attrs, sharing its backing array: the two types are
// the same struct, so the
// limiter reads the decoded attributes where they are instead of a copy per request.
func rulesAttrs(attrs []proto.Attr) []rules.Attr {
	if len(attrs) == 0 {
		return nil
	}
	return unsafe.Slice((*rules.Attr)(unsafe.Pointer(unsafe.SliceData(attrs))), len(attrs))
}
