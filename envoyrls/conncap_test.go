package envoyrls

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// The Envoy listener holds at most 1,024 connections at once, on either transport: one
// past that is closed as it is accepted. Each connection holds one of the daemon's
// descriptors, which its msgpack socket needs too, and an --envoy-rls HOST:PORT listener
// answers any local user. Before, connections were held without bound (an idle HTTP/2
// connection forever): a process holding as many as the daemon's descriptor limit made
// every accept fail with EMFILE, on the msgpack socket as well.
func TestConnectionsCapped(t *testing.T) {
	const cap, extra = 1024, 40
	for _, tr := range []string{TransportNative, TransportGRPCGo} {
		t.Run(tr, func(t *testing.T) {
			sv := serveTest(t, testServer(t), tr)
			var conns []net.Conn
			defer func() {
				for _, c := range conns {
					c.Close()
				}
			}()
			for i := range cap + extra {
				c, err := net.Dial("unix", sv.sock)
				if err != nil {
					t.Fatalf("dial %d: %v", i, err)
				}
				conns = append(conns, c)
				io.WriteString(c, http2.ClientPreface)
			}
			held := 0
			time.Sleep(time.Second) // the server has accepted every one by then
			for _, c := range conns {
				c.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
				var b [64 << 10]byte
				got := 0
				for {
					n, err := c.Read(b[:])
					got += n
					if errors.Is(err, os.ErrDeadlineExceeded) {
						// Held open if the server wrote its SETTINGS: accepted and kept.
						// Nothing yet is one the server has not accepted (a busy machine,
						// under -race): not held by it.
						if got > 0 {
							held++
						}
						break
					}
					if err != nil {
						break // closed by the server
					}
				}
			}
			if held > cap {
				t.Fatalf("%d of %d connections held open at once; want at most %d", held, cap+extra, cap)
			}
		})
	}
}
