package tunnel

import (
	"encoding/binary"
	"net/netip"
	"testing"
)

// completeChecksum does what a device asked to complete a checksum does
// (CHECKSUM_PARTIAL): sums from start to the end, the field's pseudo-
// header sum included, and stores the complement at start+offset.
func completeChecksum(frame []byte, start, offset int) {
	at := start + offset
	initial := uint32(binary.BigEndian.Uint16(frame[at:]))
	frame[at], frame[at+1] = 0, 0
	c := checksum(frame[start:], initial)
	if c == 0 {
		c = 0xffff
	}
	binary.BigEndian.PutUint16(frame[at:], c)
}

// TestCsumFrame: a probe completed as a device would (or in software)
// adds up; one byte changed, or left unfinished, does not; answers and
// controls carry no checksum; the kind and nonce come back.
func TestCsumFrame(t *testing.T) {
	src, dst := netip.MustParseAddr("10.32.0.1"), netip.MustParseAddr("192.0.2.2")
	mine, peer := VTEPMAC("a"), VTEPMAC("b")
	const nonce = 0x0123456789abcdef
	probe := appendCsumFrame(nil, peer, mine, src, dst, csumKindProbe, nonce, false)
	if len(probe) != csumFrameLen {
		t.Fatalf("probe of %d bytes, want %d", len(probe), csumFrameLen)
	}
	if f, ok := parseCsumFrame(probe); !ok || f.sumOK || !f.hasSum {
		t.Fatalf("an unfinished probe: %+v %v, want parsed with a wrong sum", f, ok)
	}
	completeChecksum(probe, csumStart, csumOffset)
	f, ok := parseCsumFrame(probe)
	if !ok || !f.sumOK || f.kind != csumKindProbe || f.nonce != nonce || f.src != src || f.dst != dst || f.srcMAC != mine || f.dstMAC != peer {
		t.Fatalf("a completed probe: %+v %v", f, ok)
	}
	if sw := appendCsumFrame(nil, peer, mine, src, dst, csumKindProbe, nonce, true); string(sw) != string(probe) {
		t.Errorf("the software checksum differs from the device's:\n% x\n% x", sw, probe)
	}
	for i := csumStart + UDPHeaderLen + len(csumMagic) + 12; i < len(probe); i += 7 {
		bad := append([]byte(nil), probe...)
		bad[i] ^= 0x40
		if f, ok := parseCsumFrame(bad); !ok || f.sumOK {
			t.Fatalf("byte %d changed: %+v %v, want a wrong sum", i, f, ok)
		}
	}
	for _, kind := range []byte{csumKindGood, csumKindBad, csumKindControl} {
		f, ok := parseCsumFrame(appendCsumFrame(nil, mine, peer, dst, src, kind, nonce, true))
		if !ok || f.kind != kind || f.nonce != nonce || f.hasSum {
			t.Errorf("kind %d: %+v %v, want parsed, without a checksum", kind, f, ok)
		}
	}
	// Not a probe: another port, a fragment, too short, an unknown kind.
	for name, mutate := range map[string]func(b []byte) []byte{
		"port":     func(b []byte) []byte { b[csumStart+2]++; return b },
		"fragment": func(b []byte) []byte { b[EthernetHeaderLen+7] = 8; return b },
		"short":    func(b []byte) []byte { return b[:csumStart+UDPHeaderLen+4] },
		"kind":     func(b []byte) []byte { b[csumStart+UDPHeaderLen+len(csumMagic)] = 9; return b },
		"magic":    func(b []byte) []byte { b[csumStart+UDPHeaderLen]++; return b },
	} {
		if f, ok := parseCsumFrame(mutate(append([]byte(nil), probe...))); ok {
			t.Errorf("%s: parsed as %+v", name, f)
		}
	}
}

// FuzzCsumFrame: whatever the VXLAN device brings, from any peer or pod
// of another node, the parser never panics and takes only frames of the
// probes' port with the magic.
func FuzzCsumFrame(f *testing.F) {
	src, dst := netip.MustParseAddr("10.32.0.1"), netip.MustParseAddr("192.0.2.2")
	for _, kind := range []byte{csumKindProbe, csumKindGood, csumKindBad, csumKindControl} {
		f.Add(appendCsumFrame(nil, VTEPMAC("b"), VTEPMAC("a"), src, dst, kind, 7, true))
	}
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		fr, ok := parseCsumFrame(b)
		if !ok {
			return
		}
		ihl := int(b[EthernetHeaderLen]&0x0f) * 4
		if fr.kind < csumKindProbe || fr.kind > csumKindControl || binary.BigEndian.Uint16(b[EthernetHeaderLen+ihl+2:]) != ChecksumProbePort {
			t.Fatalf("parsed %+v from % x", fr, b)
		}
	})
}
