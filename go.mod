module github.com/rlsidecar/rlsidecar

go 1.26

require (
	github.com/vmihailenco/msgpack/v5 v5.4.1
	go.uber.org/goleak v1.3.0
	go.yaml.in/yaml/v3 v3.0.6
	pgregory.net/rapid v1.3.0
)

require github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
