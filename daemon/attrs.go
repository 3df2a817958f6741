package daemon

import (
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

func rulesAttr(a proto.Attr) rules.Attr { return rules.Attr{Name: a.Name, Value: a.Value} }
