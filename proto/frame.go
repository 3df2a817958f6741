package proto

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
)

// FrameTooLargeError reports a frame whose announced length exceeds the reader's maximum.
type FrameTooLargeError struct {
	Length uint32
	Max    int
}

func (e *FrameTooLargeError) Error() string {
	return fmt.Sprintf("frame of %d bytes exceeds the maximum of %d", e.Length, e.Max)
}

// FrameLength returns the body length announced by a 4-byte header.
func FrameLength(hdr []byte) uint32 { return binary.BigEndian.Uint32(hdr) }

// ReadFrame reads one frame from r and returns its body. The body aliases buf when it
// fits (buf is grown otherwise; pass the returned slice back in to reuse it). A length
// above max returns *FrameTooLargeError without reading the body.
func ReadFrame(r *bufio.Reader, buf []byte, max int) ([]byte, error) {
	hdr, err := r.Peek(HeaderSize)
	if err != nil {
		if err == io.EOF && r.Buffered() > 0 {
			err = io.ErrUnexpectedEOF
		}
		return buf, err
	}
	n := FrameLength(hdr)
	_, _ = r.Discard(HeaderSize)
	if int64(n) > int64(max) {
		return buf, &FrameTooLargeError{Length: n, Max: max}
	}
	if cap(buf) < int(n) {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(r, buf); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return buf, err
	}
	return buf, nil
}
