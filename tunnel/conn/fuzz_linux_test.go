package conn

import (
	"bytes"
	"encoding/binary"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// FuzzParseIPIP: no datagram from the raw socket makes parseIPIP panic; an
// accepted one is IPv4 protocol 4, and its inner packet is the bytes the
// outer header's lengths say, inside the datagram.
func FuzzParseIPIP(f *testing.F) {
	good := make([]byte, 20+28)
	good[0], good[1], good[9] = 0x45, MarkDSCP<<2, 4
	binary.BigEndian.PutUint16(good[2:4], uint16(len(good)))
	copy(good[12:16], []byte{192, 0, 2, 1})
	good[20] = 0x45
	f.Add(good)
	f.Add(good[:19])
	opts := bytes.Clone(good)
	opts[0] = 0x4f
	f.Add(opts)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, p []byte) {
		src, inner, _, ok := parseIPIP(p)
		if !ok {
			if inner != nil {
				t.Fatal("an inner packet from a refused datagram")
			}
			return
		}
		ihl, total := int(p[0]&0x0f)*4, int(binary.BigEndian.Uint16(p[2:4]))
		switch {
		case p[0]>>4 != 4 || p[9] != 4:
			t.Fatalf("accepted version %d protocol %d", p[0]>>4, p[9])
		case ihl < 20 || total > len(p) || len(inner) != total-ihl:
			t.Fatalf("inner of %d bytes from ihl %d total %d of %d", len(inner), ihl, total, len(p))
		case len(inner) > 0 && &inner[0] != &p[ihl]:
			t.Fatal("the inner packet is not where the header says")
		case src.Addr().As4() != [4]byte(p[12:16]) || src.Port() != 0:
			t.Fatalf("source %v from % x", src, p[12:16])
		}
	})
}

// FuzzGROSize: no control messages make groSize panic or loop; the segment
// size it returns is the default or a positive size from a UDP_GRO message.
func FuzzGROSize(f *testing.F) {
	one := func(level, typ int32, data []byte) []byte {
		b := make([]byte, unix.CmsgSpace(len(data)))
		h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
		h.Level, h.Type = level, typ
		h.SetLen(unix.CmsgLen(len(data)))
		copy(b[unix.CmsgLen(0):], data)
		return b
	}
	u16 := binary.NativeEndian.AppendUint16(nil, 1400)
	u32 := binary.NativeEndian.AppendUint32(nil, 1400)
	f.Add(one(unix.IPPROTO_UDP, unix.UDP_GRO, u16), 9000)
	f.Add(one(unix.IPPROTO_UDP, unix.UDP_GRO, u32), 9000)
	f.Add(append(one(unix.SOL_SOCKET, 1, u32), one(unix.IPPROTO_UDP, unix.UDP_GRO, u16)...), 9000)
	f.Add(one(unix.IPPROTO_UDP, unix.UDP_GRO, nil), 100)
	f.Add([]byte{}, 1)
	f.Fuzz(func(t *testing.T, oob []byte, def int) {
		if def <= 0 {
			return // the caller passes the datagram's length, never 0
		}
		// The kernel's buffer is aligned; so is this copy of the input.
		buf := make([]uint64, (len(oob)+7)/8+1)
		aligned := unsafe.Slice((*byte)(unsafe.Pointer(&buf[0])), 8*len(buf))[:len(oob)]
		copy(aligned, oob)
		got := groSize(aligned, def)
		if got <= 0 {
			t.Fatalf("segment size %d", got)
		}
		if got != def && len(oob) < unix.CmsgLen(2) {
			t.Fatalf("segment size %d from %d bytes of control messages", got, len(oob))
		}
	})
}
