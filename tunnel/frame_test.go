package tunnel

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"
)

// ipv4Packet builds an IPv4 packet from src to dst with proto 17 and a
// payload of n bytes, header checksum set, DF as asked.
func ipv4Packet(src, dst string, n int, df bool) []byte {
	p := make([]byte, IPv4HeaderLen+n)
	p[0] = 0x45
	binary.BigEndian.PutUint16(p[2:4], uint16(len(p)))
	binary.BigEndian.PutUint16(p[4:6], 0x1234)
	if df {
		p[6] = 0x40
	}
	p[8], p[9] = 64, 17
	s, d := mustAddr(src).As4(), mustAddr(dst).As4()
	copy(p[12:16], s[:])
	copy(p[16:20], d[:])
	binary.BigEndian.PutUint16(p[10:12], checksum(p[:IPv4HeaderLen], 0))
	for i := IPv4HeaderLen; i < len(p); i++ {
		p[i] = byte(i)
	}
	return p
}

func frame(h FrameHeader, inner []byte) []byte {
	b := make([]byte, FrameHeaderLen+len(inner))
	PutFrameHeader(b, h)
	copy(b[FrameHeaderLen:], inner)
	return b
}

var dataHeader = FrameHeader{Version: FrameVersion, Type: FrameData}

func TestFrameRoundTrip(t *testing.T) {
	inner := ipv4Packet("10.32.0.1", "10.32.64.1", 100, true)
	for _, h := range []FrameHeader{
		dataHeader,
		{Version: FrameVersion, Type: FrameData, Flags: FlagForwarded, Counter: 1<<64 - 1},
	} {
		b := frame(h, inner)
		got, gotInner, err := DecodeFrame(b)
		if err != nil {
			t.Fatalf("DecodeFrame(%+v): %v", h, err)
		}
		if got != h || !bytes.Equal(gotInner, inner) {
			t.Errorf("DecodeFrame = %+v, %d bytes; want %+v, %d bytes", got, len(gotInner), h, len(inner))
		}
	}
	// Padding after the inner packet (its total length says where it ends)
	// is cut off.
	b := append(frame(dataHeader, inner), 0, 0, 0)
	if _, got, err := DecodeFrame(b); err != nil || len(got) != len(inner) {
		t.Errorf("padded frame: %d bytes, %v; want %d", len(got), err, len(inner))
	}
}

func TestDecodeFrameErrors(t *testing.T) {
	inner := ipv4Packet("10.32.0.1", "10.32.64.1", 40, false)
	set := func(i int, v byte) []byte {
		b := frame(dataHeader, inner)
		b[i] = v
		return b
	}
	for _, tc := range []struct {
		name   string
		b      []byte
		want   error
		reason dropReason
	}{
		{"empty", nil, ErrTruncated, dropTruncated},
		{"short header", frame(dataHeader, nil)[:10], ErrTruncated, dropTruncated},
		{"header only", frame(dataHeader, nil), ErrTruncated, dropTruncated},
		{"inner truncated", frame(dataHeader, inner)[:FrameHeaderLen+30], ErrTruncated, dropTruncated},
		{"version 0", set(0, 0), ErrVersion, dropVersion},
		{"version 2", set(0, 2), ErrVersion, dropVersion},
		{"type", set(1, 9), ErrFrameType, dropType},
		{"unknown flag", set(2, 0x80), ErrFlags, dropType},
		{"encrypted flag", set(2, byte(FlagEncrypted)), ErrEncrypted, dropEncrypted},
		{"key id", set(7, 1), ErrEncrypted, dropEncrypted},
		{"IPv6 inner", set(FrameHeaderLen, 0x60), ErrInnerPacket, dropNotIPv4},
		{"header length 4", set(FrameHeaderLen, 0x41), ErrInnerPacket, dropMalformed},
		{"total < header", func() []byte {
			b := frame(dataHeader, inner)
			b[FrameHeaderLen+2], b[FrameHeaderLen+3] = 0, 10
			return b
		}(), ErrInnerPacket, dropMalformed},
	} {
		_, _, err := DecodeFrame(tc.b)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: DecodeFrame error %v, want %v", tc.name, err, tc.want)
		}
		if _, _, r := decodeFrame(tc.b); r != tc.reason {
			t.Errorf("%s: decodeFrame reason %s, want %s", tc.name, dropReasonNames[r], dropReasonNames[tc.reason])
		}
	}
}

func TestReservedByteIgnored(t *testing.T) {
	b := frame(dataHeader, ipv4Packet("10.32.0.1", "10.32.64.1", 8, false))
	b[3] = 0xff
	if _, _, err := DecodeFrame(b); err != nil {
		t.Errorf("reserved byte set: %v", err)
	}
}

// FuzzDecodeFrame: any bytes from the underlay decode without a panic;
// what decodes re-encodes to the same header, the inner packet lies
// within the frame, and the error and the drop reason agree.
func FuzzDecodeFrame(f *testing.F) {
	inner := ipv4Packet("10.32.0.1", "10.32.64.1", 40, true)
	f.Add(frame(dataHeader, inner))
	f.Add(frame(FrameHeader{Version: FrameVersion, Type: FrameData, Flags: FlagForwarded, Counter: 7}, inner))
	f.Add(frame(dataHeader, inner)[:20])
	f.Add([]byte{})
	f.Add([]byte{2, 1, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, got, err := DecodeFrame(b)
		_, got2, r := decodeFrame(b)
		if (err == nil) != (r == dropNone) {
			t.Fatalf("DecodeFrame error %v but decodeFrame reason %d", err, r)
		}
		if err != nil {
			if got != nil {
				t.Fatalf("error %v with an inner packet", err)
			}
			return
		}
		if !bytes.Equal(got, got2) {
			t.Fatal("DecodeFrame and decodeFrame disagree on the inner packet")
		}
		if len(got) < IPv4HeaderLen || len(got) > len(b)-FrameHeaderLen {
			t.Fatalf("inner packet of %d bytes from a frame of %d", len(got), len(b))
		}
		if !bytes.Equal(got, b[FrameHeaderLen:FrameHeaderLen+len(got)]) {
			t.Fatal("inner packet is not the frame's payload")
		}
		var re [FrameHeaderLen]byte
		PutFrameHeader(re[:], h)
		want := append([]byte(nil), b[:FrameHeaderLen]...)
		want[3] = 0 // reserved, ignored
		if !bytes.Equal(re[:], want) {
			t.Fatalf("header %x re-encodes as %x", want, re)
		}
		_ = ipv4Dst(got)
		_ = ipv4DF(got)
	})
}
