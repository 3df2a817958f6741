package main

import (
	"bytes"
	be "encoding/binary"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	gproto "google.golang.org/protobuf/proto"
)

// SIGTERM answers the Envoy calls of clients that connected and wrote just before it, as
// Envoy writes its preface and first call as it connects: those still in the backlog of
// the daemon's own socket, and those accepted and not yet read. Each gets its answer
// (OK) before the graceful close's GOAWAY ends the connection. Before, the listener's
// close reset the first, and the second were closed unread if accepted as the drain
// began; Envoy's failure mode decided their requests.
func TestE2EEnvoySigtermServesTheBacklog(t *testing.T) {
	f := startEnvoyDaemon(t, envoyRules)
	sock := strings.TrimPrefix(argAfter(f.d, "--envoy-rls"), "unix:")
	msg, err := gproto.MarshalOptions{}.MarshalAppend([]byte{0, 0, 0, 0, 0}, &rlsv3.RateLimitRequest{Domain: "edge",
		Descriptors: []*commonrl.RateLimitDescriptor{desc("remote_address=1.2.3.4")}})
	if err != nil {
		t.Fatal(err)
	}
	be.BigEndian.PutUint32(msg[1:], uint32(len(msg)-5))
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, kv := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"},
		{":authority", "rls"}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
		enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	// Each client's bytes in one write, as Envoy sends them.
	var out bytes.Buffer
	out.WriteString(http2.ClientPreface)
	fr := http2.NewFramer(&out, nil)
	fr.WriteSettings()
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
	fr.WriteData(1, true, msg)

	const n = 20
	cs := make([]net.Conn, n)
	for i := range cs {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if _, err := c.Write(out.Bytes()); err != nil {
			t.Fatal(err)
		}
		cs[i] = c
	}
	if err := f.d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	lost := 0
	for i, c := range cs {
		if err := awaitOK(c); err != nil {
			t.Errorf("client %d: %v", i+1, err)
			lost++
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d clients that wrote a call before SIGTERM got no answer", lost, n)
	}
	select {
	case err := <-f.d.done:
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, f.d.stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("daemon did not exit within 10s of SIGTERM")
	}
}

// awaitOK reads c's frames until stream 1's trailers, acknowledging the server's
// SETTINGS and PINGs, and reports whether the call was answered grpc-status 0 with a
// message.
func awaitOK(c net.Conn) error {
	fr := http2.NewFramer(c, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	var data []byte
	for {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		f, err := fr.ReadFrame()
		if err != nil {
			return err
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				fr.WritePing(true, f.Data)
			}
		case *http2.DataFrame:
			data = append(data, f.Data()...)
		case *http2.RSTStreamFrame:
			return io.ErrUnexpectedEOF
		case *http2.MetaHeadersFrame:
			if !f.StreamEnded() {
				continue
			}
			if st := f.PseudoValue("status"); f.Fields != nil {
				for _, hf := range f.Fields {
					if hf.Name == "grpc-status" && hf.Value == "0" && len(data) > 5 {
						return nil
					}
				}
				return &answerErr{st, f.Fields}
			}
		}
	}
}

type answerErr struct {
	status string
	fields []hpack.HeaderField
}

func (e *answerErr) Error() string {
	var b strings.Builder
	b.WriteString("answer :status " + e.status)
	for _, hf := range e.fields {
		b.WriteString(" " + hf.Name + "=" + hf.Value)
	}
	return b.String()
}
