package mesh

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
)

// The attacker's side of the gossip port: someone who reaches it without
// the password can make it buffer only within the limits, and cannot make
// it log more than a bounded number of lines.

// startGuarded starts a peer with keyOne on 127.0.0.1 with the limits.
func startGuarded(t *testing.T, lim PreAuthLimits) (*Mesh, *logBuf) {
	t.Helper()
	log, lb := newLogger(t, "a")
	m, err := New(Config{Name: "a", BindAddr: "127.0.0.1", Components: []Component{testTunnel(6784, "udp")}, Logger: log, Timings: testTimings(), SecretKey: keyOne, PreAuth: lim})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if err := m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	return m, lb
}

func refusedCount(m *Mesh, reason string) float64 {
	return counterValue(nil, m.metrics.preAuthRefused.WithLabelValues(reason))
}

// waitClosed reads c until the peer closes it (EOF or reset) and returns
// what it read; it fails the test if that takes longer than d.
func waitClosed(t *testing.T, c net.Conn, d time.Duration) []byte {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(d))
	b, err := io.ReadAll(c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the stream was not closed within %s", d)
	}
	return b
}

// TestGuardStreamTooLarge: a stream announcing 20 MB (memberlist's own
// limit, which it would buffer) is closed after its 5-byte header, before
// anything of it is read into memory; so is one with a label header, and
// a plaintext one is answered with the sealed error and closed.
func TestGuardStreamTooLarge(t *testing.T) {
	m, _ := startGuarded(t, PreAuthLimits{})
	addr := m.Addr().String()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	hdr := []byte{mlEncryptMsg, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(hdr[1:], 20<<20)
	if _, err := c.Write(hdr); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, c, 5*time.Second)
	waitFor(t, converge, "the too-large refusal to be counted", func() bool { return refusedCount(m, refusedTooLarge) == 1 })

	lc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close()
	lc.Write([]byte{mlHasLabelMsg, 4, 'e', 'v', 'i', 'l'})
	waitClosed(t, lc, 5*time.Second)
	waitFor(t, converge, "the label refusal to be counted", func() bool { return refusedCount(m, refusedLabel) == 1 })

	pc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	pc.Write([]byte{6, 0x80}) // a plaintext push-pull
	got := waitClosed(t, pc, 5*time.Second)
	if len(got) == 0 || got[0] != mlEncryptMsg {
		t.Errorf("a plaintext stream got %x back, want the sealed error (first byte %d)", got, mlEncryptMsg)
	}
	waitFor(t, converge, "the plaintext refusal to be counted", func() bool { return refusedCount(m, refusedPlain) == 1 })
}

// TestGuardStreamSlots: streams that announce a size but never send it
// hold at most MaxStreamsPerSource slots from one address and at most
// Budget bytes; the next is closed at once; once they time out, a stream
// is admitted again.
func TestGuardStreamSlots(t *testing.T) {
	lim := PreAuthLimits{MaxStreamSize: 1 << 20, Budget: 2 << 20, MaxStreams: 8, MaxStreamsPerSource: 3, Timeout: 6 * time.Second}
	m, _ := startGuarded(t, lim)
	addr := m.Addr().String()
	announce := func(size uint32) net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		hdr := []byte{mlEncryptMsg, 0, 0, 0, 0}
		binary.BigEndian.PutUint32(hdr[1:], size)
		if _, err := c.Write(hdr); err != nil {
			t.Fatal(err)
		}
		return c
	}
	// Two streams of 1 MiB fill the 2 MiB budget; a third is refused.
	announce(1 << 20)
	announce(1 << 20)
	waitFor(t, converge, "two streams to hold the budget", func() bool {
		m.transport.(*guard).mu.Lock()
		defer m.transport.(*guard).mu.Unlock()
		return m.transport.(*guard).held == 2<<20
	})
	third := announce(1 << 20)
	waitClosed(t, third, 2*time.Second)
	if n := refusedCount(m, refusedBusy); n != 1 {
		t.Errorf("busy refusals: %v, want 1", n)
	}
	// The third slot of this source is taken by a stream that sends
	// nothing yet; the fourth is refused without being read.
	silent, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	waitFor(t, converge, "three streams from 127.0.0.1", func() bool {
		g := m.transport.(*guard)
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.perSrc) == 1 && g.streams == 3
	})
	// The fourth sends nothing: only the per-source cap closes it before
	// the timeout.
	fourth, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer fourth.Close()
	waitClosed(t, fourth, lim.Timeout/2)
	if n := refusedCount(m, refusedBusy); n != 2 {
		t.Errorf("busy refusals: %v, want 2", n)
	}
	// After Timeout the held streams are closed and their state is gone.
	waitFor(t, 3*lim.Timeout, "the slow streams to time out", func() bool {
		g := m.transport.(*guard)
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.streams == 0 && g.held == 0 && len(g.perSrc) == 0 && len(g.open) == 0
	})
	if n := refusedCount(m, refusedTruncated); n < 2 {
		t.Errorf("truncated refusals: %v, want at least 2", n)
	}
}

// sealPacket seals b as memberlist does a packet ([1][nonce][ct+tag]).
func sealPacket(t testing.TB, key, b, aad []byte) []byte {
	block, err := aes.NewCipher(key)
	if err != nil {
		t.Fatal(err)
	}
	aead, _ := cipher.NewGCM(block)
	out := append([]byte{1}, bytes.Repeat([]byte{9}, mlNonceSize)...)
	return aead.Seal(out, out[1:], b, aad)
}

// TestGuardPackets: over UDP, packets that are empty, carry a label, are
// plaintext or sealed with another key never reach memberlist (which
// would log each at error); each is counted; the log stays bounded.
func TestGuardPackets(t *testing.T) {
	m, lb := startGuarded(t, PreAuthLimits{})
	c, err := net.Dial("udp", m.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const n = 500
	for i := range n {
		c.Write([]byte{mlHasLabelMsg, 3, 'x', '\x1b', 'y', 0})
		c.Write([]byte{0, 1, 2, 3})
		c.Write(sealPacket(t, keyTwo, []byte(fmt.Sprintf("ping %d", i)), nil))
	}
	waitFor(t, converge, "the packets to be refused", func() bool {
		return refusedCount(m, refusedLabel) > 0 && refusedCount(m, refusedAuth) > 0
	})
	if s := lb.String(); strings.Contains(s, "unacceptable label") || strings.Contains(s, "Decrypt packet failed") {
		t.Errorf("memberlist saw a refused packet:\n%s", s)
	}
	var above int
	for _, l := range strings.Split(lb.String(), "\n") {
		if strings.Contains(l, "level=INFO") && strings.Contains(l, "refused") || strings.Contains(l, "level=WARN") || strings.Contains(l, "level=ERROR") {
			above++
		}
	}
	if above > len(refusedReasons)+maxAuthLines+1 {
		t.Errorf("%d lines above debug for %d bad packets, want a bounded few:\n%s", above, 3*n, lb.String())
	}
}

// TestGuardStreamVerified: a stream sealed with the key passes with its
// bytes intact (the in-place open and re-seal restore them); the same
// stream with one bit flipped, or sealed with another key, does not.
func TestGuardStreamVerified(t *testing.T) {
	block, _ := aes.NewCipher(keyOne)
	aead, _ := cipher.NewGCM(block)
	g := &guard{aead: aead, lim: DefaultPreAuthLimits(), now: time.Now}
	g.lim.Budget = 1 << 30
	stream := func(key []byte, plain []byte) []byte {
		size := 1 + mlNonceSize + len(plain) + mlTagSize
		hdr := []byte{mlEncryptMsg, 0, 0, 0, 0}
		binary.BigEndian.PutUint32(hdr[1:], uint32(size))
		return append(hdr, sealPacket(t, key, plain, hdr)...)
	}
	check := func(b []byte) ([]byte, string, error) {
		a, z := net.Pipe()
		defer a.Close()
		go func() { z.Write(b); z.Close() }()
		c, _, reason, err := g.verifyStream(a)
		if err != nil {
			return nil, reason, err
		}
		got, _ := io.ReadAll(c)
		return got, "", nil
	}
	good := stream(keyOne, bytes.Repeat([]byte("state"), 10000))
	got, _, err := check(bytes.Clone(good))
	if err != nil || !bytes.Equal(got, good) {
		t.Fatalf("a sealed stream: %v, %d bytes back, equal %v", err, len(got), bytes.Equal(got, good))
	}
	flipped := bytes.Clone(good)
	flipped[len(flipped)/2] ^= 1
	if _, reason, err := check(flipped); err == nil || reason != refusedAuth {
		t.Errorf("a flipped bit: %v (%s)", err, reason)
	}
	if _, reason, err := check(stream(keyTwo, []byte("x"))); err == nil || reason != refusedAuth {
		t.Errorf("another key: %v (%s)", err, reason)
	}
	if _, reason, err := check(good[:len(good)-1]); err == nil || reason != refusedTruncated {
		t.Errorf("a short stream: %v (%s)", err, reason)
	}
}

// TestAuthFailuresBounded: 50,000 sources failing within a minute keep at
// most maxAuthSources entries and make at most maxAuthLines+1 lines; a
// minute later the entries have expired.
func TestAuthFailuresBounded(t *testing.T) {
	var buf logBuf
	var mu sync.Mutex
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
	a := &authFailures{log: slog.New(slog.NewTextHandler(&buf, nil)), count: c, now: func() time.Time { mu.Lock(); defer mu.Unlock(); return now }}
	a.limit.every, a.limit.maxKeys = time.Minute, maxAuthSources
	for i := range 50000 {
		a.failed(fmt.Sprintf("10.%d.%d.%d:6783", i>>16, i>>8&255, i&255))
		if i%1000 == 0 {
			mu.Lock()
			now = now.Add(time.Millisecond)
			mu.Unlock()
		}
	}
	if n := a.limit.size(); n > maxAuthSources {
		t.Errorf("%d sources tracked, want at most %d", n, maxAuthSources)
	}
	lines := strings.Count(buf.String(), "\n")
	if lines > maxAuthLines+1 || lines < 2 {
		t.Errorf("%d lines for 50,000 sources, want 2 to %d:\n%s", lines, maxAuthLines+1, buf.String())
	}
	if got := counterValue(t, c); got != 50000 {
		t.Errorf("counted %v, want 50000", got)
	}
	mu.Lock()
	now = now.Add(3 * time.Minute)
	mu.Unlock()
	a.failed("192.0.2.1:6783")
	if n := a.limit.size(); n != 1 {
		t.Errorf("%d sources tracked a while after the flood, want 1", n)
	}
}

// TestMemberlistLineFlood: memberlist's per-packet error lines, with text
// the sender chose, come out sanitised, demoted to a warning, and at most
// once a minute per kind.
func TestMemberlistLineFlood(t *testing.T) {
	var buf logBuf
	l := memberlistLogger(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo})), nil, nil)
	evil := "\x1b[31m" + strings.Repeat("A", 5000) + "\n"
	for i := range 2000 {
		l.Printf("[ERR] memberlist: discarding packet with unacceptable label %q: from=10.0.%d.%d:6783", evil, i>>8&255, i&255)
		l.Printf("[ERR] memberlist: Failed to decode ping: %s from=10.0.0.1:1", evil)
	}
	out := buf.String()
	if n := strings.Count(out, "\n"); n != 2 {
		t.Fatalf("%d lines for 4,000, want 2:\n%.2000s", n, out)
	}
	if strings.Contains(out, "level=ERROR") || strings.Contains(out, "\x1b") || len(out) > 2*(maxLineLen+200) {
		t.Errorf("not demoted or not sanitised (%d bytes):\n%q", len(out), out)
	}
}

// TestReportFromNoPeer: a topology report whose origin memberlist never
// announced is not kept and not part of the push-pull state; once the
// origin has joined, its report is.
func TestReportFromNoPeer(t *testing.T) {
	m, err := New(Config{Name: "a", BindAddr: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	tg := (*topologyGossiper)(m)
	m.publishReport(false) // as Start does
	rep := encodeReport(report{Origin: "ghost", Version: 7, Leaving: true, Unreachable: []PeerName{"a"}})
	if news, err := tg.OnBroadcast("ghost", rep); err != nil || news != nil {
		t.Errorf("a report from no peer: news %x, %v; want none (not relayed)", news, err)
	}
	if err := tg.MergeRemoteState(encodeReports([]report{{Origin: "ghost2", Version: 1}})); err != nil {
		t.Fatal(err)
	}
	reps, err := decodeReports(tg.LocalState())
	if err != nil {
		t.Fatal(err)
	}
	if len(reps) != 1 || reps[0].Origin != "a" {
		t.Errorf("state after reports from no peers: %+v, want only a's own", reps)
	}
	meta, _ := encodeMeta("", "", []Component{testTunnel(6784)})
	m.onAlive("ghost", m.Addr(), meta)
	if news, err := tg.OnBroadcast("ghost", rep); err != nil || news == nil {
		t.Errorf("a goodbye from a peer: news %x, %v; want it relayed", news, err)
	}
	if reps, _ := decodeReports(tg.LocalState()); len(reps) != 2 {
		t.Errorf("state: %+v, want a's and ghost's reports", reps)
	}
}

// TestGuardPlaintextLimit: without a password nothing authenticates, but
// memberlist reads at most MaxStreamSize of a stream: a push-pull that
// announces 1 MiB of state is cut at 64 KiB and counted, and a stream with
// a label header is refused before memberlist sees it.
func TestGuardPlaintextLimit(t *testing.T) {
	log, lb := newLogger(t, "a")
	m, err := New(Config{Name: "a", BindAddr: "127.0.0.1", Components: []Component{testTunnel(6784, "udp")}, Logger: log, Timings: testTimings(), PreAuth: PreAuthLimits{MaxStreamSize: 64 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", m.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// pushPullMsg, then memberlist's msgpack header {Nodes: 0,
	// UserStateLen: 1 MiB, Join: false}, then the state.
	hdr := []byte{6, 0x83, 0xa5}
	hdr = append(hdr, "Nodes"...)
	hdr = append(hdr, 0x00, 0xac)
	hdr = append(hdr, "UserStateLen"...)
	hdr = append(hdr, 0xce, 0, 0x10, 0, 0, 0xa4)
	hdr = append(hdr, "Join"...)
	hdr = append(hdr, 0xc2)
	go func() {
		c.Write(hdr)
		c.Write(make([]byte, 1<<20))
	}()
	waitClosed(t, c, 5*time.Second)
	waitFor(t, converge, "the over-limit refusal to be counted", func() bool { return refusedCount(m, refusedOverLimit) == 1 })

	lc, err := net.Dial("tcp", m.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close()
	lc.Write([]byte{mlHasLabelMsg, 4, 'e', 'v', 'i', 'l'})
	waitClosed(t, lc, 5*time.Second)
	waitFor(t, converge, "the label refusal to be counted", func() bool { return refusedCount(m, refusedLabel) == 1 })
	if lb.contains("unacceptable label") {
		t.Errorf("memberlist saw the label stream:\n%s", lb.String())
	}
}

// TestLimitsFit: the largest push-pull a peer sends (memberlist's node
// states for 1000 peers with full metadata, plus MaxStateSize) fits in what
// another peer accepts, and the budget holds at least one such stream.
func TestLimitsFit(t *testing.T) {
	lim := DefaultPreAuthLimits()
	const nodeStates = 1000 * (MaxNameLen + memberlist.MetaMaxSize + 64)
	if need := MaxStateSize + nodeStates + 64; need > lim.MaxStreamSize {
		t.Errorf("a push-pull may be %d bytes, more than the %d a stream may carry", need, lim.MaxStreamSize)
	}
	if lim.Budget < lim.MaxStreamSize {
		t.Errorf("budget %d below the stream size %d", lim.Budget, lim.MaxStreamSize)
	}
}

// TestGuardDialedLimit: whoever answers a stream this peer opened can make
// memberlist read at most MaxStreamSize (and a little) of it.
func TestGuardDialedLimit(t *testing.T) {
	g := &guard{lim: PreAuthLimits{MaxStreamSize: 1 << 20}}
	a, z := net.Pipe()
	defer z.Close()
	go func() {
		junk := make([]byte, 64<<10)
		for range 160 { // 10 MiB
			if _, err := z.Write(junk); err != nil {
				return
			}
		}
	}()
	c, err := g.limitDialed(a, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	n, err := io.Copy(io.Discard, c)
	if err == nil || n > 1<<20+64<<10 {
		t.Errorf("read %d bytes of a 10 MiB answer (%v), want at most %d and an error", n, err, 1<<20+64<<10)
	}
}

// BenchmarkGuardForgedPacket: what a forged 1200-byte packet from a
// spoofed source costs the router before it is refused (one AES-GCM open,
// the count, the bounded auth-failure bookkeeping).
func BenchmarkGuardForgedPacket(b *testing.B) {
	log := slog.New(slog.DiscardHandler)
	m, err := New(Config{Name: "a", BindAddr: "127.0.0.1", Logger: log, SecretKey: keyOne})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	g := m.transport.(*guard)
	pkt := sealPacket(b, keyTwo, make([]byte, 1200-mlMinSealed), nil)
	from := &net.UDPAddr{IP: net.IPv4(172, 16, 0, 1), Port: 6783}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		from.IP[15] = byte(i)
		if g.packetOK(&memberlist.Packet{Buf: pkt, From: from}) {
			b.Fatal("a forged packet passed")
		}
	}
}
