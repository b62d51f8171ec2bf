package tunnel

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// The udp frame is a 16-byte header followed by the inner IP packet:
//
//	0       version   (FrameVersion)
//	1       type      (FrameData)
//	2       flags     (FlagForwarded, FlagEncrypted)
//	3       reserved  (sent as 0, ignored)
//	4..7    key id    (big endian; 0 = not encrypted)
//	8..15   counter   (big endian; the sender's per-frame sequence number,
//	                   the AEAD nonce once frames are encrypted)
//
// An encrypted frame (Config.PSK set; see tunnel/crypt and
// docs/security.md) has FlagEncrypted and a nonzero key id (the sender's
// epoch), uses the counter as its nonce and the whole header as
// associated data, and carries the inner packet sealed, followed by an
// AEADTagLen tag, for which the pod MTU always leaves room. A plaintext
// frame has neither the flag nor a key id. A receiver that does not know
// a version, a type or a key drops the frame.
const (
	FrameVersion = 1
)

// FrameType says what a frame carries.
type FrameType uint8

// Frame types.
const (
	FrameData FrameType = 1 // an inner IP packet
)

// FrameFlags are the frame's flag bits.
type FrameFlags uint8

// Frame flags. Receivers reject frames with bits they do not know, so that
// a future flag that changes the meaning of the payload is never misread.
const (
	// FlagForwarded marks a frame that a node which does not own the
	// destination forwards once more to the owner; it is never
	// forwarded again.
	FlagForwarded FrameFlags = 1 << 0
	// FlagEncrypted marks a sealed payload, opened with the key of the
	// frame's key id.
	FlagEncrypted FrameFlags = 1 << 1

	knownFlags = FlagForwarded | FlagEncrypted
)

// FrameHeader is the decoded header of a udp frame.
type FrameHeader struct {
	Version uint8
	Type    FrameType
	Flags   FrameFlags
	KeyID   uint32
	Counter uint64
}

// Errors of DecodeFrame; each is a reason that a frame is dropped.
var (
	ErrTruncated   = errors.New("truncated frame")
	ErrVersion     = errors.New("unknown frame version")
	ErrFrameType   = errors.New("unknown frame type")
	ErrFlags       = errors.New("unknown frame flags")
	ErrEncrypted   = errors.New("encrypted frame: it needs the sender's session keys to open")
	ErrInnerPacket = errors.New("malformed inner packet")
)

// PutFrameHeader writes h into b[:FrameHeaderLen].
func PutFrameHeader(b []byte, h FrameHeader) {
	_ = b[FrameHeaderLen-1]
	b[0], b[1], b[2], b[3] = h.Version, byte(h.Type), byte(h.Flags), 0
	binary.BigEndian.PutUint32(b[4:8], h.KeyID)
	binary.BigEndian.PutUint64(b[8:16], h.Counter)
}

// DecodeFrameHeader decodes and checks the header of frame b.
func DecodeFrameHeader(b []byte) (FrameHeader, error) {
	h, r := decodeHeader(b)
	if r != dropNone {
		return h, headerError(b, h, r)
	}
	return h, nil
}

// DecodeFrame decodes a udp frame: its header and the inner IPv4 packet,
// cut to the length its header gives. It never panics on any input.
func DecodeFrame(b []byte) (FrameHeader, []byte, error) {
	h, err := DecodeFrameHeader(b)
	if err != nil {
		return h, nil, err
	}
	inner, err := checkIPv4(b[FrameHeaderLen:])
	if err != nil {
		return h, nil, err
	}
	return h, inner, nil
}

// decodeFrame is DecodeFrame for the packet path: it says why a frame is
// bad with a drop reason instead of an error, so that a flood of bad
// frames allocates nothing.
func decodeFrame(b []byte) (FrameHeader, []byte, dropReason) {
	h, r := decodeHeader(b)
	if r != dropNone {
		return h, nil, r
	}
	inner, r := ipv4Check(b[FrameHeaderLen:])
	return h, inner, r
}

// decodeHeader checks a plaintext frame's header.
func decodeHeader(b []byte) (FrameHeader, dropReason) {
	h, r := decodeAnyHeader(b)
	if r == dropNone && h.encrypted() {
		return h, dropEncrypted
	}
	return h, r
}

// encrypted reports whether the header claims a sealed payload: the flag
// or a key id (both are needed to open it).
func (h FrameHeader) encrypted() bool { return h.Flags&FlagEncrypted != 0 || h.KeyID != 0 }

// decodeAnyHeader checks the version, type and flags of a frame's header,
// plaintext or encrypted.
func decodeAnyHeader(b []byte) (FrameHeader, dropReason) {
	if len(b) < FrameHeaderLen {
		return FrameHeader{}, dropTruncated
	}
	h := FrameHeader{
		Version: b[0], Type: FrameType(b[1]), Flags: FrameFlags(b[2]),
		KeyID:   binary.BigEndian.Uint32(b[4:8]),
		Counter: binary.BigEndian.Uint64(b[8:16]),
	}
	switch {
	case h.Version != FrameVersion:
		return h, dropVersion
	case h.Type != FrameData || h.Flags&^knownFlags != 0:
		return h, dropType
	}
	return h, dropNone
}

func headerError(b []byte, h FrameHeader, r dropReason) error {
	switch r {
	case dropTruncated:
		return fmt.Errorf("%w: %d bytes, the header alone is %d", ErrTruncated, len(b), FrameHeaderLen)
	case dropVersion:
		return fmt.Errorf("%w %d (this node speaks %d)", ErrVersion, h.Version, FrameVersion)
	case dropType:
		if h.Type != FrameData {
			return fmt.Errorf("%w %d", ErrFrameType, h.Type)
		}
		return fmt.Errorf("%w %#02x", ErrFlags, uint8(h.Flags&^knownFlags))
	case dropEncrypted:
		return ErrEncrypted
	}
	return fmt.Errorf("bad frame: %s", dropReasonNames[r])
}

// putCounter sets the counter of the frame header at the start of b.
func putCounter(b []byte, c uint64) { binary.BigEndian.PutUint64(b[8:16], c) }
