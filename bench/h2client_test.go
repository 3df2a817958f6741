package bench

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"testing"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	gproto "google.golang.org/protobuf/proto"
)

// h2Client is a minimal gRPC client for the benchmark: one HTTP/2 connection, one call at
// a time, each written in one syscall and read in the caller's goroutine — what the
// msgpack benchmark client is to the socket protocol, and closer to Envoy's C++ client
// than grpc-go's (whose own goroutine handoffs would dominate a p50 on a busy machine).
type h2Client struct {
	c       net.Conn
	bw      *bufio.Writer
	fr      *http2.Framer
	henc    *hpack.Encoder
	hdec    *hpack.Decoder
	hbuf    bytes.Buffer
	stream  uint32
	path    string
	unacked uint32 // connection-level bytes received and not yet given back
}

func dialH2(tb testing.TB, socket, path string) *h2Client {
	tb.Helper()
	c, err := net.Dial("unix", socket)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close() })
	h := &h2Client{c: c, bw: bufio.NewWriterSize(c, 16<<10), stream: 1, path: path}
	h.fr = http2.NewFramer(h.bw, bufio.NewReaderSize(c, 64<<10))
	h.henc = hpack.NewEncoder(&h.hbuf)
	h.hdec = hpack.NewDecoder(4096, nil)
	if _, err := h.bw.WriteString(http2.ClientPreface); err != nil {
		tb.Fatal(err)
	}
	if err := h.fr.WriteSettings(); err != nil {
		tb.Fatal(err)
	}
	if err := h.bw.Flush(); err != nil {
		tb.Fatal(err)
	}
	return h
}

// grpcMessage returns req as a gRPC length-prefixed message, to send with call (the
// benchmark pre-encodes its requests, as it does msgpack frames).
func grpcMessage(req gproto.Message) []byte {
	msg, err := gproto.MarshalOptions{}.MarshalAppend([]byte{0, 0, 0, 0, 0}, req)
	if err != nil {
		panic("BUG: marshaling a request: " + err.Error())
	}
	binary.BigEndian.PutUint32(msg[1:5], uint32(len(msg)-5))
	return msg
}

// call sends msg (from grpcMessage) and waits for the answer's trailers; it returns the
// gRPC status.
func (h *h2Client) call(msg []byte) (string, error) {
	h.hbuf.Reset()
	for _, f := range [...]hpack.HeaderField{
		{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"}, {Name: ":path", Value: h.path},
		{Name: ":authority", Value: "localhost"}, {Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"},
	} {
		if err := h.henc.WriteField(f); err != nil {
			return "", err
		}
	}
	id := h.stream
	h.stream += 2
	if err := h.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: h.hbuf.Bytes(), EndHeaders: true}); err != nil {
		return "", err
	}
	if err := h.fr.WriteData(id, true, msg); err != nil {
		return "", err
	}
	if err := h.bw.Flush(); err != nil {
		return "", err
	}
	for {
		f, err := h.fr.ReadFrame()
		if err != nil {
			return "", err
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				if err := h.fr.WriteSettingsAck(); err != nil {
					return "", err
				}
				if err := h.bw.Flush(); err != nil {
					return "", err
				}
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				if err := h.fr.WritePing(true, f.Data); err != nil {
					return "", err
				}
				if err := h.bw.Flush(); err != nil {
					return "", err
				}
			}
		case *http2.DataFrame:
			h.unacked += uint32(len(f.Data()))
			if h.unacked > 32<<10 {
				if err := h.fr.WriteWindowUpdate(0, h.unacked); err != nil {
					return "", err
				}
				h.unacked = 0
				if err := h.bw.Flush(); err != nil {
					return "", err
				}
			}
		case *http2.HeadersFrame:
			// Every header block goes through the decoder: it keeps the server's table.
			fields, err := h.hdec.DecodeFull(f.HeaderBlockFragment())
			if err != nil {
				return "", err
			}
			if f.StreamID == id && f.StreamEnded() {
				for _, hf := range fields {
					if hf.Name == "grpc-status" {
						return hf.Value, nil
					}
				}
				return "", fmt.Errorf("no grpc-status in trailers %v", fields)
			}
		case *http2.GoAwayFrame:
			return "", fmt.Errorf("GOAWAY %v", f.ErrCode)
		case *http2.RSTStreamFrame:
			return "", fmt.Errorf("RST_STREAM %v", f.ErrCode)
		}
	}
}
