// Command floorserver is the baseline of the socket benchmarks: a do-nothing server that
// speaks rlsidecar's framing with the same connection loop shape (read every buffered
// frame, answer each, one write per batch) and answers every frame with the same canned
// check response, without decoding or deciding anything. The difference between it and
// rlsidecar, measured in the same run, is what rlsidecar's work costs.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/rlsidecar/rlsidecar/proto"
)

func main() {
	socket := flag.String("socket", "", "Unix socket path")
	flag.Parse()
	os.Remove(*socket)
	ln, err := net.Listen("unix", *socket)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// A canned answer with the fields and the size of rlsidecar's answer to the benchmark's
	// frames under bench/rules.yaml (two rules of 1,000,000,000 an hour, both matched),
	// so a load generator reads as many bytes from either server (the benchmarks check
	// it: sameAnswerSize).
	enc := proto.NewEncoder()
	enc.EncodeCheck(&proto.Response{ID: 1, Allowed: true, Rule: "per-ip", Limit: 1e9, Remaining: 1e9 - 1, ResetMs: 1,
		Rules: []proto.RuleResult{
			{Name: "per-ip", Limit: 1e9, WindowMs: 3_600_000, Remaining: 1e9 - 1, ResetMs: 1, Allowed: true},
			{Name: "holds", Limit: 1e9, WindowMs: 3_600_000, Remaining: 1e9 - 1, ResetMs: 1, Allowed: true},
		}})
	answer := append([]byte(nil), enc.Bytes()...)
	// answer = header, map header, "id" key (4 bytes: 0x8X a2 'i' 'd'), id value 0x01, rest.
	// The server echoes each request's id by splicing its id value in place of 0x01.
	head, tail := answer[proto.HeaderSize:proto.HeaderSize+4], answer[proto.HeaderSize+5:]
	fmt.Println("floorserver listening on", *socket)
	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		<-sig
		ln.Close()
		os.Exit(0)
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go serve(c, head, tail)
	}
}

// idValue returns the msgpack bytes of the id in a canonical request body (map header,
// then "id"), or a fixint 0 when the body does not start that way.
func idValue(body []byte) []byte {
	if len(body) < 5 || body[1] != 0xa2 || body[2] != 'i' || body[3] != 'd' {
		return []byte{0}
	}
	n := 1
	switch body[4] {
	case 0xcc:
		n = 2
	case 0xcd:
		n = 3
	case 0xce:
		n = 5
	case 0xcf:
		n = 9
	}
	if len(body) < 4+n {
		return []byte{0}
	}
	return body[4 : 4+n]
}

func serve(c net.Conn, head, tail []byte) {
	defer c.Close()
	br := bufio.NewReaderSize(c, 16<<10)
	out := make([]byte, 0, 64<<10)
	for {
		if br.Buffered() == 0 && len(out) > 0 {
			if _, err := c.Write(out); err != nil {
				return
			}
			out = out[:0]
		}
		hdr, err := br.Peek(proto.HeaderSize)
		if err != nil {
			return
		}
		n := int(proto.FrameLength(hdr))
		frame, err := br.Peek(proto.HeaderSize + min(n, 16))
		if err != nil {
			return
		}
		id := idValue(frame[proto.HeaderSize:])
		size := len(head) + len(id) + len(tail)
		out = append(out, byte(size>>24), byte(size>>16), byte(size>>8), byte(size))
		out = append(out, head...)
		out = append(out, id...)
		out = append(out, tail...)
		if _, err := br.Discard(proto.HeaderSize + n); err != nil {
			return
		}
	}
}
