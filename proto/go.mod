module github.com/rlsidecar/rlsidecar/proto

go 1.24

require github.com/vmihailenco/msgpack/v5 v5.4.1

require github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
