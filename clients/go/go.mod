module github.com/rlsidecar/rlsidecar/clients/go

go 1.24

require (
	github.com/rlsidecar/rlsidecar/proto v0.0.0-00010101000000-000000000000
	go.uber.org/goleak v1.3.0
)

require (
	github.com/vmihailenco/msgpack/v5 v5.4.1 // indirect
	github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
)

// The wire format lives in the proto module beside this one; released versions are
// tagged proto/vX.Y.Z and clients/go/vX.Y.Z, and this replace only applies inside the repo.
replace github.com/rlsidecar/rlsidecar/proto => ../../proto
