package mesh

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/weft-net/weft/mesh/meshtest"
)

// The decoders of bytes from peers never panic, and what they accept
// encodes back to an equivalent frame.

func FuzzDecodeMessage(f *testing.F) {
	f.Add(encodeMessage(kindBroadcast, "ipalloc", "ab:cd:ef:01:02:03", []byte("delta")))
	f.Add(encodeMessage(kindUnicast, "_topology", "node1", nil))
	f.Add([]byte{wireVersion, kindBroadcast, 1, 'a', 1, 'b', 0x80})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMessage(b)
		if err != nil {
			return
		}
		again := encodeMessage(m.kind, m.channel, m.from, m.payload)
		if !bytes.Equal(again, b) {
			t.Fatalf("re-encoding %x gave %x", b, again)
		}
	})
}

func FuzzDecodeState(f *testing.F) {
	f.Add(encodeState([]channelState{{"_topology", encodeReports([]report{{Origin: "n1", Version: 9}})}, {"ipalloc", []byte("ring")}}))
	f.Add(encodeState(nil))
	f.Add([]byte{wireVersion, kindState, 1, 1, 'a', 0x80})
	f.Fuzz(func(t *testing.T, b []byte) {
		parts, err := decodeState(b)
		if err != nil {
			return
		}
		got, err := decodeState(encodeState(parts))
		if err != nil || len(got) != len(parts) {
			t.Fatalf("re-decoding %x: %v", b, err)
		}
	})
}

func FuzzDecodeReports(f *testing.F) {
	f.Add(encodeReports([]report{{Origin: "node1", Version: 3, Leaving: true}, {Origin: "node2", Unreachable: []PeerName{"node3"}}}))
	f.Add(encodeReport(report{Origin: "x", Version: 1}))
	f.Fuzz(func(t *testing.T, b []byte) {
		if reps, err := decodeReports(b); err == nil {
			if again, err := decodeReports(encodeReports(reps)); err != nil || !reflect.DeepEqual(again, reps) {
				t.Fatalf("round trip of %+v: %+v, %v", reps, again, err)
			}
		}
		if rep, err := decodeReport(b); err == nil {
			if again, err := decodeReport(encodeReport(rep)); err != nil || !reflect.DeepEqual(again, rep) {
				t.Fatalf("round trip of %+v: %+v, %v", rep, again, err)
			}
		}
	})
}

// FuzzGuardPacket: the guard never panics on a packet, and passes one only
// if it is sealed with the key; a sealed packet always passes.
func FuzzGuardPacket(f *testing.F) {
	block, _ := aes.NewCipher(keyOne)
	aead, _ := cipher.NewGCM(block)
	var refused int
	g := &guard{aead: aead, refuse: func(string, netip.Addr, error) { refused++ }, authFn: func(string) {}, scratch: make([]byte, 0, 64<<10)}
	f.Add([]byte{})
	f.Add([]byte{mlHasLabelMsg, 1, 'x'})
	f.Add([]byte{1, 2, 3})
	f.Add(sealPacket(f, keyOne, []byte("ping"), nil))
	f.Add(sealPacket(f, keyTwo, []byte("ping"), nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		from := &net.UDPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 6783}
		ok := g.packetOK(&memberlist.Packet{Buf: b, From: from})
		opens := len(b) >= mlMinSealed && b[0] <= mlMaxVsn
		if opens {
			_, err := aead.Open(nil, b[1:1+mlNonceSize], b[1+mlNonceSize:], nil)
			opens = err == nil
		}
		if ok != opens {
			t.Fatalf("packet %x: passed %v, opens with the key %v", b, ok, opens)
		}
		if !ok {
			sealed := sealPacket(t, keyOne, b, nil)
			if !g.packetOK(&memberlist.Packet{Buf: sealed, From: from}) {
				t.Fatalf("sealed %x did not pass", b)
			}
		}
	})
}

// FuzzGuardStream: the guard reads an incoming stream within its limits,
// never panics, and hands over only a stream whose message opens with the
// key, replaying exactly the bytes it read.
func FuzzGuardStream(f *testing.F) {
	block, _ := aes.NewCipher(keyOne)
	aead, _ := cipher.NewGCM(block)
	lim := PreAuthLimits{MaxStreamSize: 1 << 16, Budget: 1 << 20, Timeout: time.Second}
	f.Add([]byte{})
	f.Add([]byte{mlEncryptMsg, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{mlHasLabelMsg, 2, 'a', 'b'})
	f.Add([]byte{6, 0x80})
	hdr := []byte{mlEncryptMsg, 0, 0, 0, 1 + mlNonceSize + 5 + mlTagSize}
	f.Add(append(bytes.Clone(hdr), sealPacket(f, keyOne, []byte("state"), hdr)...))
	f.Fuzz(func(t *testing.T, b []byte) {
		g := &guard{aead: aead, lim: lim, now: time.Now}
		a, z := net.Pipe()
		defer a.Close()
		go func() { z.Write(b); z.Close() }()
		c, reserved, reason, err := g.verifyStream(a)
		if g.held != reserved || reserved > lim.MaxStreamSize {
			t.Fatalf("held %d, reserved %d, limit %d", g.held, reserved, lim.MaxStreamSize)
		}
		if err != nil {
			if reason == "" {
				t.Fatalf("refused %x without a reason: %v", b, err)
			}
			return
		}
		got, _ := io.ReadAll(c)
		size := int(binary.BigEndian.Uint32(b[1:5]))
		if !bytes.Equal(got, b[:5+size]) {
			t.Fatalf("replayed %x, read %x", got, b[:5+size])
		}
		if _, err := aead.Open(nil, b[6:6+mlNonceSize], b[6+mlNonceSize:5+size], b[:5]); err != nil {
			t.Fatalf("handed over %x, which does not open: %v", b, err)
		}
	})
}

// FuzzRememberedPeers: a persisted known-peers entry (the router's state
// file, read at start) is either refused or a host without control
// characters; New never fails or panics on them.
func FuzzRememberedPeers(f *testing.F) {
	f.Add("10.0.0.2:6783")
	f.Add("[fd00::1]:7000")
	f.Add("node\x1b[31m:1")
	f.Add(":0")
	f.Fuzz(func(t *testing.T, s string) {
		host, port, err := splitTarget(s, DefaultPort)
		if err == nil {
			if host == "" || port < 1 || port > 65535 || strings.ContainsFunc(host, func(r rune) bool { return r <= ' ' || r > '~' }) {
				t.Fatalf("accepted %q as %q port %d", s, host, port)
			}
		}
		tr, err := meshtest.NewNetwork().NewTransport("10.0.0.1:6783")
		if err != nil {
			t.Fatal(err)
		}
		m, err := New(Config{Name: "a", Remembered: []string{s}, Transport: tr})
		if err != nil {
			t.Fatalf("New with remembered %q: %v", s, err)
		}
		m.Close()
	})
}
