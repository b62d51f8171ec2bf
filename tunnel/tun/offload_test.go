package tun

import (
	"bytes"
	"encoding/binary"
	"testing"
)

// tcpPacket builds a TCP/IPv4 packet with checksums, from 10.32.0.2:40000
// to 10.36.0.2:5201 (sport changes the flow), with payload bytes from
// byte(seq+i).
func tcpPacket(seq uint32, payload int, flags byte, sport uint16) []byte {
	p := make([]byte, 20+32+payload) // TCP header with 12 bytes of options (timestamps)
	p[0], p[1] = 0x45, 0
	binary.BigEndian.PutUint16(p[2:], uint16(len(p)))
	binary.BigEndian.PutUint16(p[4:], 0x100)
	p[6] = 0x40
	p[8], p[9] = 64, protoTCP
	copy(p[12:], []byte{10, 32, 0, 2, 10, 36, 0, 2})
	ipv4HeaderChecksum(p[:20])
	tcp := p[20:]
	binary.BigEndian.PutUint16(tcp[0:], sport)
	binary.BigEndian.PutUint16(tcp[2:], 5201)
	binary.BigEndian.PutUint32(tcp[4:], seq)
	binary.BigEndian.PutUint32(tcp[8:], 777)
	tcp[12] = 8 << 4
	tcp[13] = flags
	binary.BigEndian.PutUint16(tcp[14:], 500)
	copy(tcp[20:32], []byte{1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2})
	for i := range payload {
		tcp[32+i] = byte(seq + uint32(i))
	}
	binary.BigEndian.PutUint16(tcp[16:], ^fold(sum32(tcp, pseudoSum(p, protoTCP, len(tcp)))))
	return p
}

// superPacket is what the kernel hands an offloading TUN device: one TCP
// packet with payload bytes, checksum partial, behind its header.
func superPacket(payload, mss int, flags byte) (virtioNetHdr, []byte) {
	p := tcpPacket(1000, payload, flags, 40000)
	tcp := p[20:]
	binary.BigEndian.PutUint16(tcp[16:], fold(pseudoSum(p, protoTCP, len(tcp))))
	return virtioNetHdr{flags: vnetFlagNeedsCsum, gsoType: vnetGSOTCPv4, hdrLen: 52, gsoSize: uint16(mss), csumStart: 20, csumOffset: 16}, p
}

func split(t *testing.T, h virtioNetHdr, p []byte, offset int) [][]byte {
	t.Helper()
	var s splitter
	if err := s.start(p, &h); err != nil {
		t.Fatalf("start: %v", err)
	}
	var out [][]byte
	for !s.done() {
		buf := make([]byte, offset+1500)
		n, err := s.cut(buf[offset:])
		if err != nil {
			t.Fatalf("cut: %v", err)
		}
		out = append(out, buf[:offset+n])
	}
	return out
}

func TestSplit(t *testing.T) {
	h, super := superPacket(10000, 1388, tcpFlagACK|tcpFlagPSH|tcpFlagFIN)
	orig := append([]byte(nil), super...)
	segs := split(t, h, super, 0)
	if len(segs) != 8 { // 7 x 1388 + 284
		t.Fatalf("%d segments, want 8", len(segs))
	}
	var payload []byte
	for i, s := range segs {
		want := 1388
		if i == 7 {
			want = 10000 - 7*1388
		}
		if got := len(s) - 52; got != want {
			t.Errorf("segment %d: payload %d, want %d", i, got, want)
		}
		if binary.BigEndian.Uint16(s[2:]) != uint16(len(s)) || fold(sum32(s[:20], 0)) != 0xffff {
			t.Errorf("segment %d: IP length or checksum wrong", i)
		}
		if id := binary.BigEndian.Uint16(s[4:]); id != 0x100+uint16(i) {
			t.Errorf("segment %d: IP id %#x", i, id)
		}
		if !tcpChecksumOK(s, 20) {
			t.Errorf("segment %d: TCP checksum wrong", i)
		}
		if seq := binary.BigEndian.Uint32(s[24:]); seq != 1000+uint32(i*1388) {
			t.Errorf("segment %d: seq %d", i, seq)
		}
		flags := s[33]
		if last := i == 7; (flags&(tcpFlagPSH|tcpFlagFIN) != 0) != last {
			t.Errorf("segment %d: flags %#x", i, flags)
		}
		if !bytes.Equal(s[20+20:52], orig[40:52]) {
			t.Errorf("segment %d: options changed", i)
		}
		payload = append(payload, s[52:]...)
	}
	if !bytes.Equal(payload, orig[52:]) {
		t.Error("payloads do not add up to the super-packet's")
	}
}

func TestSplitErrors(t *testing.T) {
	good, p := superPacket(3000, 1000, tcpFlagACK)
	for _, tc := range []struct {
		name string
		h    func(h virtioNetHdr) virtioNetHdr
		p    []byte
	}{
		{"udp gso", func(h virtioNetHdr) virtioNetHdr { h.gsoType = 5; return h }, p},
		{"tcpv6 gso", func(h virtioNetHdr) virtioNetHdr { h.gsoType = 4; return h }, p},
		{"csum start", func(h virtioNetHdr) virtioNetHdr { h.csumStart = 24; return h }, p},
		{"zero size", func(h virtioNetHdr) virtioNetHdr { h.gsoSize = 0; return h }, p},
		{"short", func(h virtioNetHdr) virtioNetHdr { return h }, p[:30]},
		{"no payload", func(h virtioNetHdr) virtioNetHdr { return h }, p[:52]},
	} {
		var s splitter
		h := tc.h(good)
		if err := s.start(tc.p, &h); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
	// A segment larger than the buffer ends the super-packet.
	var s splitter
	if err := s.start(p, &good); err != nil {
		t.Fatal(err)
	}
	if _, err := s.cut(make([]byte, 500)); err == nil || !s.done() {
		t.Errorf("cut into a small buffer: %v, done %v", err, s.done())
	}
}

func TestCoalesceInvertsSplit(t *testing.T) {
	const offset = 16
	h, super := superPacket(20000, 1388, tcpFlagACK|tcpFlagPSH)
	orig := append([]byte(nil), super...)
	segs := split(t, h, super, offset)
	if n := runLength(segs, 0, offset); n != len(segs) {
		t.Fatalf("runLength = %d, want %d", n, len(segs))
	}
	out := make([]byte, VirtioNetHdrLen+maxIPv4Len)
	n := coalesce(out, segs, offset)
	var got virtioNetHdr
	got.decode(out)
	want := virtioNetHdr{flags: vnetFlagNeedsCsum, gsoType: vnetGSOTCPv4, hdrLen: 52, gsoSize: 1388, csumStart: 20, csumOffset: 16}
	if got != want {
		t.Errorf("header %+v, want %+v", got, want)
	}
	p := out[VirtioNetHdrLen:n]
	if len(p) != len(orig) || !bytes.Equal(p[52:], orig[52:]) {
		t.Fatalf("coalesced %d bytes, want %d", len(p), len(orig))
	}
	if fold(sum32(p[:20], 0)) != 0xffff || p[33] != tcpFlagACK|tcpFlagPSH {
		t.Error("IP checksum or flags wrong")
	}
	// What the kernel does with CHECKSUM_PARTIAL gives a valid checksum.
	if err := finishChecksum(p, &got); err != nil || !tcpChecksumOK(p, 20) {
		t.Errorf("finished checksum invalid (%v)", err)
	}
}

func TestRunLength(t *testing.T) {
	const offset = 16
	at := func(p []byte) []byte { return append(make([]byte, offset), p...) }
	seg := func(seq uint32, n int, flags byte, sport uint16) []byte { return at(tcpPacket(seq, n, flags, sport)) }
	ack := byte(tcpFlagACK)
	psh := byte(tcpFlagACK | tcpFlagPSH)
	badSum := seg(2000, 1000, ack, 1)
	badSum[offset+60]++
	otherTTL := seg(2000, 1000, ack, 1)
	otherTTL[offset+8] = 3
	ipv4HeaderChecksum(otherTTL[offset : offset+20])
	for _, tc := range []struct {
		name string
		bufs [][]byte
		want []int // run lengths in order
	}{
		{"one flow", [][]byte{seg(0, 1000, ack, 1), seg(1000, 1000, ack, 1), seg(2000, 1000, psh, 1)}, []int{3}},
		{"short last", [][]byte{seg(0, 1000, ack, 1), seg(1000, 500, ack, 1), seg(1500, 1000, ack, 1)}, []int{2, 1}},
		{"psh ends a run", [][]byte{seg(0, 1000, ack, 1), seg(1000, 1000, psh, 1), seg(2000, 1000, ack, 1), seg(3000, 1000, ack, 1)}, []int{2, 2}},
		{"psh first is alone", [][]byte{seg(0, 1000, psh, 1), seg(1000, 1000, ack, 1)}, []int{1, 1}},
		{"two flows interleaved", [][]byte{seg(0, 1000, ack, 1), seg(0, 1000, ack, 2), seg(1000, 1000, ack, 1)}, []int{1, 1, 1}},
		{"two flows in runs", [][]byte{seg(0, 1000, ack, 1), seg(1000, 1000, ack, 1), seg(0, 1000, ack, 2), seg(1000, 1000, ack, 2)}, []int{2, 2}},
		{"gap in seq", [][]byte{seg(0, 1000, ack, 1), seg(1500, 1000, ack, 1)}, []int{1, 1}},
		{"bigger after", [][]byte{seg(0, 1000, ack, 1), seg(1000, 1200, ack, 1)}, []int{1, 1}},
		{"pure ack", [][]byte{seg(0, 0, ack, 1), seg(0, 0, ack, 1)}, []int{1, 1}},
		{"syn", [][]byte{seg(0, 10, 0x02, 1), seg(10, 10, ack, 1)}, []int{1, 1}},
		{"bad checksum", [][]byte{seg(0, 1000, ack, 1), seg(1000, 1000, ack, 1), badSum}, []int{2, 1}},
		{"other ttl", [][]byte{seg(0, 1000, ack, 1), seg(1000, 1000, ack, 1), otherTTL}, []int{2, 1}},
		{"not tcp", [][]byte{at([]byte{0x45, 0, 0, 20, 0, 0, 0, 0, 64, 17, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8})}, []int{1}},
	} {
		var got []int
		for i := 0; i < len(tc.bufs); {
			n := runLength(tc.bufs, i, offset)
			got = append(got, n)
			i += n
		}
		if !equalInts(got, tc.want) {
			t.Errorf("%s: runs %v, want %v", tc.name, got, tc.want)
		}
	}
	// 64 KiB at most.
	var bufs [][]byte
	for i := range 60 {
		bufs = append(bufs, seg(uint32(i*1400), 1400, ack, 1))
	}
	n := runLength(bufs, 0, offset)
	if total := 52 + n*1400; total > maxIPv4Len || total+1400 <= maxIPv4Len {
		t.Errorf("run of %d segments: %d bytes", n, total)
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestFinishChecksumUDP(t *testing.T) {
	p := make([]byte, 20+8+33)
	p[0] = 0x45
	binary.BigEndian.PutUint16(p[2:], uint16(len(p)))
	p[8], p[9] = 64, 17
	copy(p[12:], []byte{10, 0, 0, 1, 10, 0, 0, 2})
	binary.BigEndian.PutUint16(p[24:], uint16(len(p)-20))
	for i := 28; i < len(p); i++ {
		p[i] = byte(i * 7)
	}
	binary.BigEndian.PutUint16(p[26:], fold(pseudoSum(p, 17, len(p)-20)))
	h := virtioNetHdr{flags: vnetFlagNeedsCsum, csumStart: 20, csumOffset: 6}
	if err := finishChecksum(p, &h); err != nil {
		t.Fatal(err)
	}
	if ^fold(sum32(p[20:], pseudoSum(p, 17, len(p)-20))) != 0 {
		t.Error("UDP checksum does not verify")
	}
	h.csumOffset = 100
	if err := finishChecksum(p, &h); err == nil {
		t.Error("checksum offset beyond the packet accepted")
	}
}

func TestSum32MatchesNaive(t *testing.T) {
	b := make([]byte, 1501)
	for i := range b {
		b[i] = byte(i*131 + 7)
	}
	ones := make([]byte, 70000)
	for i := range ones {
		ones[i] = 0xff
	}
	for _, tc := range []struct {
		b    []byte
		init uint64
	}{{ones, 0}, {ones, 0xffffffffffff}, {ones[:65535], 0xffff}, {b, 1 << 40}} {
		var naive uint64 = tc.init
		for i := 0; i+1 < len(tc.b); i += 2 {
			naive += uint64(tc.b[i])<<8 | uint64(tc.b[i+1])
		}
		if len(tc.b)%2 == 1 {
			naive += uint64(tc.b[len(tc.b)-1]) << 8
		}
		if got, want := fold(sum32(tc.b, tc.init)), fold(naive); got != want {
			t.Errorf("%d bytes from %#x: %#x, want %#x", len(tc.b), tc.init, got, want)
		}
	}
	for n := range len(b) {
		var naive uint32
		for i := 0; i+1 < n; i += 2 {
			naive += uint32(b[i])<<8 | uint32(b[i+1])
		}
		if n%2 == 1 {
			naive += uint32(b[n-1]) << 8
		}
		for naive>>16 != 0 {
			naive = naive&0xffff + naive>>16
		}
		if got := fold(sum32(b[:n], 0)); got != uint16(naive) {
			t.Fatalf("length %d: %#x, want %#x", n, got, naive)
		}
	}
}

// FuzzSplit: whatever the kernel (or a bug) puts in the header and the
// packet, splitting never panics and every segment fits its buffer.
func FuzzSplit(f *testing.F) {
	h, p := superPacket(3000, 1000, tcpFlagACK)
	hb := make([]byte, VirtioNetHdrLen)
	h.encode(hb)
	f.Add(hb, p)
	f.Fuzz(func(t *testing.T, hb, p []byte) {
		if len(hb) < VirtioNetHdrLen {
			return
		}
		var h virtioNetHdr
		h.decode(hb)
		if h.gsoType == vnetGSONone {
			_ = finishChecksum(p, &h)
			return
		}
		var s splitter
		if s.start(p, &h) != nil {
			return
		}
		for i := 0; !s.done() && i < 70000; i++ {
			if _, err := s.cut(make([]byte, 1500)); err != nil {
				return
			}
		}
	})
}

// FuzzCoalesce: any packets handed to Write are split into runs without a
// panic, and a run coalesces into at most 64 KiB.
func FuzzCoalesce(f *testing.F) {
	f.Add(tcpPacket(0, 100, tcpFlagACK, 1), tcpPacket(100, 100, tcpFlagACK, 1), tcpPacket(200, 50, tcpFlagACK|tcpFlagPSH, 1))
	f.Fuzz(func(t *testing.T, a, b, c []byte) {
		const offset = 16
		bufs := [][]byte{append(make([]byte, offset), a...), append(make([]byte, offset), b...), append(make([]byte, offset), c...)}
		out := make([]byte, VirtioNetHdrLen+maxIPv4Len)
		for i := 0; i < len(bufs); {
			n := runLength(bufs, i, offset)
			if n < 1 || i+n > len(bufs) {
				t.Fatalf("run of %d at %d", n, i)
			}
			if n > 1 {
				if w := coalesce(out, bufs[i:i+n], offset); w > len(out) {
					t.Fatalf("coalesced %d bytes", w)
				}
			}
			i += n
		}
	})
}

func BenchmarkSum(b *testing.B) {
	buf := make([]byte, 1440)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		sum32(buf, 0)
	}
}
