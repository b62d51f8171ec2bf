package tunnel

import (
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/internal/syncbuf"
	"github.com/weft-net/weft/tunnel/conn/bindtest"
)

// TestSpoofedSourceDropped is the attacker's side of source validation: a
// frame (or IPIP packet) from a peer is delivered only if its inner source
// lies in a range that peer owns; a forwarded one only if its source is a
// pod of a peer other than the receiver. Every other frame is dropped and
// counted as spoofed-source, and nothing reaches the receiver's TUN device.
func TestSpoofedSourceDropped(t *testing.T) {
	for _, mode := range []Mode{ModeUDP, ModeIPIP} {
		t.Run(string(mode), func(t *testing.T) {
			net := bindtest.NewNetwork()
			a := newTestNode(t, net, "a", nodeOpts{mode: mode})
			b := newTestNode(t, net, "b", nodeOpts{mode: mode})
			c := newTestNode(t, net, "c", nodeOpts{mode: mode})
			peers := peersOf(a, b, c)
			for _, n := range []*testNode{a, b, c} {
				n.setup(t, ring, peers)
			}
			port := uint16(DefaultDataPort)
			if mode == ModeIPIP {
				port = 0
			}
			fromA := netip.AddrPortFrom(underlayOf("a"), port)
			toB := netip.AddrPortFrom(underlayOf("b"), port)
			send := func(src string, forwarded bool) {
				t.Helper()
				inner := ipv4Packet(src, "10.36.0.7", 64, true)
				p := bindtest.Packet{From: fromA, To: toB, Data: inner, Mark: forwarded}
				if mode == ModeUDP {
					h := dataHeader
					if forwarded {
						h.Flags = FlagForwarded
					}
					p.Data, p.Mark = frame(h, inner), false
				}
				if !net.Inject(p) {
					t.Fatal("nobody listens on b's address")
				}
			}
			for _, tc := range []struct {
				name      string
				src       string
				forwarded bool
			}{
				{"source in the receiver's own range", "10.36.0.9", false},
				{"source in a third peer's range", "10.40.0.9", false},
				{"source outside the pod range", "192.0.2.2", false},
				{"source in no range", "10.99.0.1", false},
				{"forwarded, source in the receiver's own range", "10.36.0.9", true},
				{"forwarded, source in no range", "10.99.0.1", true},
			} {
				before := dropped(b.d, dropSpoofed)
				send(tc.src, tc.forwarded)
				waitFor(t, tc.name+" counted", func() bool { return dropped(b.d, dropSpoofed) == before+1 })
				expectNoPacket(t, b.tun.Outbound, tc.name)
			}
			// The sender's own pods, and (forwarded) a third peer's, pass.
			send("10.32.0.5", false)
			expectPacket(t, b.tun.Outbound, "a's pod")
			if mode == ModeUDP {
				send("10.40.0.9", true)
				expectPacket(t, b.tun.Outbound, "c's pod, forwarded by a")
			}
			expectNoPacket(t, b.tun.Outbound, "b")
		})
	}
}

// TestSourceOK is the rule on its own, against the ring of these tests.
func TestSourceOK(t *testing.T) {
	tb, err := NewTable(ring)
	if err != nil {
		t.Fatal(err)
	}
	s := &snapshot{routes: tb}
	for _, tc := range []struct {
		peer, src string
		forwarded bool
		ok        bool
	}{
		{"a", "10.32.0.1", false, true},        // a's gateway
		{"a", "10.35.255.255", false, true},    // the end of a's range
		{"a", "10.36.0.0", false, false},       // the first of b's
		{"a", "10.36.0.0", true, false},        // forwarded to b, from b's range
		{"a", "10.40.0.1", true, true},         // forwarded: c's pod
		{"a", "10.40.0.1", false, false},       // not forwarded: c's pod is not a's
		{"a", "192.0.2.1", false, false},       // a's underlay address
		{"unknown", "10.32.0.1", false, false}, // a name that owns nothing
	} {
		got := s.sourceOK(tc.peer, netip.MustParseAddr(tc.src), tc.forwarded, "b") == dropNone
		if got != tc.ok {
			t.Errorf("sourceOK(%s, %s, forwarded=%v) = %v, want %v", tc.peer, tc.src, tc.forwarded, got, tc.ok)
		}
	}
	var empty snapshot // before the first SetRing
	if empty.sourceOK("a", netip.MustParseAddr("10.32.0.1"), false, "b") == dropNone {
		t.Error("a source passed without a ring")
	}
}

// TestSpoofedSourceWarnedOnce: a flood of spoofed sources within a minute
// is one warning, which says what happened and from where; the next
// minute's drops are the next warning, with their count.
func TestSpoofedSourceWarnedOnce(t *testing.T) {
	var logs syncbuf.Buffer
	now := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{})
	b := newTestNode(t, net, "b", nodeOpts{now: clock, log: slog.New(slog.NewTextHandler(&logs, nil))})
	peers := peersOf(a, b)
	a.setup(t, ring[:2], peers)
	b.setup(t, ring[:2], peers)
	spoof := func(n int) {
		for range n {
			net.Inject(bindtest.Packet{From: netip.AddrPortFrom(underlayOf("a"), DefaultDataPort), To: netip.AddrPortFrom(underlayOf("b"), DefaultDataPort),
				Data: frame(dataHeader, ipv4Packet("10.36.0.9", "10.36.0.7", 64, true))})
		}
	}
	lines := func() []string {
		var out []string
		for l := range strings.Lines(logs.String()) {
			if strings.Contains(l, "inner source outside the ranges") {
				out = append(out, l)
			}
		}
		return out
	}
	spoof(20)
	waitFor(t, "20 drops", func() bool { return dropped(b.d, dropSpoofed) == 20 })
	if l := lines(); len(l) != 1 || !strings.Contains(l[0], "level=WARN") || !strings.Contains(l[0], "last-from=192.0.2.1") {
		t.Fatalf("warnings after 20 drops in a minute: %q", l)
	}
	mu.Lock()
	now = now.Add(time.Minute)
	mu.Unlock()
	spoof(1)
	waitFor(t, "the next minute's warning", func() bool { return len(lines()) == 2 })
	if l := lines()[1]; !strings.Contains(l, "count=") {
		t.Errorf("second warning: %q", l)
	}
}
