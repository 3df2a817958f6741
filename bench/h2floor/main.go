// Command h2floor is a second baseline of BenchmarkEnvoyRLS, not a server to deploy: the
// least an HTTP/2 gRPC server for unary calls can do. One goroutine per connection reads
// frames, and answers each call whose request has ended with a canned response (HEADERS,
// DATA and trailers in one write, once no input is buffered), as the msgpack socket's
// floor (bench/floorserver) answers frames. It implements only what the benchmark's
// client needs (SETTINGS, PING, WINDOW_UPDATE, HPACK), nothing of HTTP/2's error
// handling; its figure is what a hand-written transport could reach, beside grpc-go's
// (bench/grpcfloor).
package main

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/rlsidecar/rlsidecar/bench/internal/cannedrls"
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
	// The answer rlsidecar gives an admitted one-descriptor call of the benchmark, the
	// same as bench/grpcfloor's; sent with gRPC's 5-byte message prefix.
	answer, err := cannedrls.Answer()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	msg := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(answer)))
	msg = append(msg, answer...)
	fmt.Println("h2floor listening on", *socket)
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
		go serve(c, msg)
	}
}

func serve(c net.Conn, msg []byte) {
	defer c.Close()
	br := bufio.NewReaderSize(c, 16<<10)
	bw := bufio.NewWriterSize(c, 16<<10)
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(br, preface); err != nil || string(preface) != http2.ClientPreface {
		return
	}
	fr := http2.NewFramer(bw, br)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	var hbuf bytes.Buffer
	henc := hpack.NewEncoder(&hbuf)
	if fr.WriteSettings() != nil {
		return
	}
	var unacked uint32
	for {
		if br.Buffered() == 0 && bw.Buffered() > 0 {
			if bw.Flush() != nil {
				return
			}
		}
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		ended := uint32(0)
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				err = fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				err = fr.WritePing(true, f.Data)
			}
		case *http2.MetaHeadersFrame:
			if f.StreamEnded() {
				ended = f.StreamID
			}
		case *http2.DataFrame:
			unacked += uint32(len(f.Data()))
			if unacked > 16<<10 {
				err = fr.WriteWindowUpdate(0, unacked)
				unacked = 0
			}
			if f.StreamEnded() {
				ended = f.StreamID
			}
		}
		if err != nil {
			return
		}
		if ended == 0 {
			continue
		}
		hbuf.Reset()
		henc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
		henc.WriteField(hpack.HeaderField{Name: "content-type", Value: "application/grpc"})
		if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: ended, BlockFragment: hbuf.Bytes(), EndHeaders: true}) != nil {
			return
		}
		if fr.WriteData(ended, false, msg) != nil {
			return
		}
		hbuf.Reset()
		henc.WriteField(hpack.HeaderField{Name: "grpc-status", Value: "0"})
		if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: ended, BlockFragment: hbuf.Bytes(), EndHeaders: true, EndStream: true}) != nil {
			return
		}
	}
}
