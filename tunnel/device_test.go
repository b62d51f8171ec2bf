package tunnel

import (
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/weft-net/weft/tunnel/conn/bindtest"
	"github.com/weft-net/weft/tunnel/crypt"
	"github.com/weft-net/weft/tunnel/tun/tuntest"
)

// The cluster of these tests: three nodes on the fake underlay
// 192.0.2.0/24, each owning part of 10.32.0.0/12 in the ring.
var (
	rangeA = OwnedRange{mustAddr("10.32.0.0"), mustAddr("10.35.255.255"), "a"}
	rangeB = OwnedRange{mustAddr("10.36.0.0"), mustAddr("10.39.255.255"), "b"}
	rangeC = OwnedRange{mustAddr("10.40.0.0"), mustAddr("10.47.255.255"), "c"}
	ring   = []OwnedRange{rangeA, rangeB, rangeC}
)

func underlayOf(name string) netip.Addr {
	return netip.AddrFrom4([4]byte{192, 0, 2, name[0] - 'a' + 1})
}

type testNode struct {
	name string
	d    *Device
	tun  *tuntest.Device
	udp  *bindtest.Bind
	ipip *bindtest.Bind
	rt   *fakeRouting
}

type nodeOpts struct {
	mode        Mode
	noUDP       bool
	noIPIP      bool
	mtu         int
	underlayMTU int
	psk         []byte         // encryption on
	trusted     []netip.Prefix // --trusted-subnets
	now         func() time.Time
	rekey       crypt.Limits
	log         *slog.Logger // testLogger if nil
	vteps       VTEPApplier  // vxlan (its device taken to exist) if set
}

func newTestNode(t *testing.T, net *bindtest.Network, name string, o nodeOpts) *testNode {
	t.Helper()
	if o.mode == "" {
		o.mode = ModeUDP
	}
	if o.mtu == 0 {
		o.mtu = 1440
	}
	if o.log == nil {
		o.log = testLogger(t, name)
	}
	n := &testNode{name: name, tun: tuntest.New("weft-tun", o.mtu), rt: &fakeRouting{}}
	cfg := Config{
		Self: name, Mode: o.mode, MTU: o.mtu, UnderlayMTU: o.underlayMTU,
		Logger: o.log, TUN: n.tun, Routing: n.rt,
		PSK: o.psk, TrustedSubnets: o.trusted, Now: o.now, Rekey: o.rekey,
	}
	if !o.noUDP {
		n.udp = net.Bind(netip.AddrPortFrom(underlayOf(name), DefaultDataPort))
		cfg.UDP = n.udp
	}
	if !o.noIPIP {
		n.ipip = net.Bind(netip.AddrPortFrom(underlayOf(name), 0))
		cfg.IPIP = n.ipip
	}
	if o.vteps != nil {
		cfg.VTEPs, cfg.Underlay = o.vteps, underlayOf(name)
	}
	d, err := New(cfg)
	if err != nil {
		t.Fatalf("New(%s): %v", name, err)
	}
	n.d = d
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run(%s): %v", name, err)
		}
	})
	return n
}

// peersOf describes the nodes to each other as the mesh would.
func peersOf(nodes ...*testNode) []Peer {
	var ps []Peer
	for _, n := range nodes {
		ps = append(ps, Peer{Name: n.name, Underlay: underlayOf(n.name), DataPort: DefaultDataPort, Encaps: n.d.Encaps(), PublicKey: n.d.PublicKey()})
	}
	return ps
}

func (n *testNode) setup(t *testing.T, ranges []OwnedRange, peers []Peer) {
	t.Helper()
	if err := n.d.SetPeers(peers); err != nil {
		t.Fatal(err)
	}
	if err := n.d.SetRing(ranges, gatewayOf(n.name)); err != nil {
		t.Fatal(err)
	}
}

func gatewayOf(name string) netip.Addr {
	for _, r := range ring {
		if r.Peer == name {
			return r.First.Next()
		}
	}
	return netip.Addr{}
}

// expectPacket waits for a packet on ch and checks it.
func expectPacket(t *testing.T, ch <-chan []byte, what string) []byte {
	t.Helper()
	select {
	case p := <-ch:
		return p
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: no packet within 5s", what)
		return nil
	}
}

func expectNoPacket(t *testing.T, ch <-chan []byte, what string) {
	t.Helper()
	select {
	case p := <-ch:
		t.Fatalf("%s: unexpected packet of %d bytes (% x...)", what, len(p), p[:min(len(p), 24)])
	default:
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func dropped(d *Device, r dropReason) float64 { return value(d.metrics.drop[r]) }
func packets(d *Device, dir int, m Mode) float64 {
	return value(d.metrics.pkt[dir][modeIndex(m)])
}

func TestTwoNodesExchangePackets(t *testing.T) {
	for _, mode := range []Mode{ModeUDP, ModeIPIP, ModeAuto} {
		t.Run(string(mode), func(t *testing.T) {
			net := bindtest.NewNetwork()
			a := newTestNode(t, net, "a", nodeOpts{mode: mode})
			b := newTestNode(t, net, "b", nodeOpts{mode: mode})
			peers := peersOf(a, b)
			a.setup(t, ring[:2], peers)
			b.setup(t, ring[:2], peers)
			want := ModeUDP
			if mode == ModeIPIP {
				want = ModeIPIP
			}
			if got := a.d.ModeFor("b"); got != want {
				t.Errorf("ModeFor(b) = %q, want %q", got, want)
			}
			for range 3 {
				ping := ipv4Packet("10.32.0.5", "10.36.0.7", 64, true)
				a.tun.Inbound <- ping
				got := expectPacket(t, b.tun.Outbound, "a to b")
				if string(got) != string(ping) {
					t.Fatalf("b got % x\nwant % x", got, ping)
				}
				pong := ipv4Packet("10.36.0.7", "10.32.0.5", 64, true)
				b.tun.Inbound <- pong
				if got := expectPacket(t, a.tun.Outbound, "b to a"); string(got) != string(pong) {
					t.Fatalf("a got % x\nwant % x", got, pong)
				}
			}
			waitFor(t, "counters", func() bool {
				return packets(a.d, dirOut, want) == 3 && packets(b.d, dirIn, want) == 3 && packets(a.d, dirIn, want) == 3
			})
		})
	}
}

func TestUDPFrameOnTheWire(t *testing.T) {
	net := bindtest.NewNetwork()
	var mu sync.Mutex
	var seen []bindtest.Packet
	net.Tap(func(p bindtest.Packet) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, p)
	})
	a := newTestNode(t, net, "a", nodeOpts{})
	b := newTestNode(t, net, "b", nodeOpts{})
	a.setup(t, ring[:2], peersOf(a, b))
	b.setup(t, ring[:2], peersOf(a, b))
	inner := ipv4Packet("10.32.0.5", "10.36.0.7", 100, true)
	for range 2 {
		a.tun.Inbound <- inner
		expectPacket(t, b.tun.Outbound, "a to b")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 2 {
		t.Fatalf("%d datagrams on the wire, want 2", len(seen))
	}
	var counters []uint64
	for _, p := range seen {
		if p.From != netip.AddrPortFrom(underlayOf("a"), DefaultDataPort) || p.To != netip.AddrPortFrom(underlayOf("b"), DefaultDataPort) {
			t.Errorf("datagram %s -> %s", p.From, p.To)
		}
		h, got, err := DecodeFrame(p.Data)
		if err != nil || h.Flags != 0 || string(got) != string(inner) || len(p.Data) != FrameHeaderLen+len(inner) {
			t.Errorf("frame %+v, %v", h, err)
		}
		counters = append(counters, h.Counter)
	}
	if counters[1] <= counters[0] {
		t.Errorf("frame counters %v do not increase", counters)
	}
}

// TestForwardOnceForMovedRange: a still thinks b owns 10.36.0.0/14, but b
// has donated it to c. b forwards a's packet once more, marked, with the
// TTL one lower; c delivers it.
func TestForwardOnceForMovedRange(t *testing.T) {
	for _, mode := range []Mode{ModeUDP, ModeIPIP} {
		t.Run(string(mode), func(t *testing.T) {
			net := bindtest.NewNetwork()
			var mu sync.Mutex
			var marked []bool
			net.Tap(func(p bindtest.Packet) {
				if p.From.Addr() != underlayOf("b") {
					return
				}
				mu.Lock()
				defer mu.Unlock()
				if mode == ModeUDP {
					h, _, _ := DecodeFrame(p.Data)
					marked = append(marked, h.Flags&FlagForwarded != 0)
				} else {
					marked = append(marked, p.Mark)
				}
			})
			a := newTestNode(t, net, "a", nodeOpts{mode: mode})
			b := newTestNode(t, net, "b", nodeOpts{mode: mode})
			c := newTestNode(t, net, "c", nodeOpts{mode: mode})
			peers := peersOf(a, b, c)
			old := []OwnedRange{rangeA, rangeB, rangeC}
			moved := []OwnedRange{rangeA, {rangeB.First, rangeB.Last, "c"}, rangeC}
			a.setup(t, old, peers)
			b.setup(t, moved, peers)
			c.setup(t, moved, peers)

			pkt := ipv4Packet("10.32.0.5", "10.36.0.7", 64, true)
			a.tun.Inbound <- pkt
			got := expectPacket(t, c.tun.Outbound, "a to c via b")
			if got[8] != pkt[8]-1 || checksum(got[:20], 0) != 0 || string(got[20:]) != string(pkt[20:]) {
				t.Errorf("forwarded packet: ttl %d (sent %d), checksum ok %v", got[8], pkt[8], checksum(got[:20], 0) == 0)
			}
			expectNoPacket(t, b.tun.Outbound, "b")
			waitFor(t, "forward counter", func() bool { return packets(b.d, dirForward, mode) == 1 })
			mu.Lock()
			defer mu.Unlock()
			if !slices.Equal(marked, []bool{true}) {
				t.Errorf("b sent %v marked, want one marked packet", marked)
			}
		})
	}
}

// TestForwardedNeverTwice: b and c disagree about who owns 10.36.0.0/14
// (each thinks the other does). b forwards a's packet to c once; c drops
// it instead of sending it back.
func TestForwardedNeverTwice(t *testing.T) {
	for _, mode := range []Mode{ModeUDP, ModeIPIP} {
		t.Run(string(mode), func(t *testing.T) {
			net := bindtest.NewNetwork()
			a := newTestNode(t, net, "a", nodeOpts{mode: mode})
			b := newTestNode(t, net, "b", nodeOpts{mode: mode})
			c := newTestNode(t, net, "c", nodeOpts{mode: mode})
			peers := peersOf(a, b, c)
			a.setup(t, ring, peers)
			b.setup(t, []OwnedRange{rangeA, {rangeB.First, rangeB.Last, "c"}, rangeC}, peers)
			c.setup(t, ring, peers)

			a.tun.Inbound <- ipv4Packet("10.32.0.5", "10.36.0.7", 64, true)
			waitFor(t, "c to drop the forwarded packet", func() bool { return dropped(c.d, dropForwardLoop) == 1 })
			if n := packets(b.d, dirForward, mode); n != 1 {
				t.Errorf("b forwarded %v packets, want 1", n)
			}
			if n := packets(c.d, dirForward, mode); n != 0 {
				t.Errorf("c forwarded %v packets, want 0", n)
			}
			for _, n := range []*testNode{a, b, c} {
				expectNoPacket(t, n.tun.Outbound, n.name)
			}
		})
	}
}

func TestForwardTTLExpired(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{})
	b := newTestNode(t, net, "b", nodeOpts{})
	c := newTestNode(t, net, "c", nodeOpts{})
	peers := peersOf(a, b, c)
	a.setup(t, ring, peers)
	b.setup(t, []OwnedRange{rangeA, {rangeB.First, rangeB.Last, "c"}, rangeC}, peers)
	c.setup(t, ring, peers)
	pkt := ipv4Packet("10.32.0.5", "10.36.0.7", 64, true)
	pkt[8] = 1
	binary.BigEndian.PutUint16(pkt[10:12], 0)
	binary.BigEndian.PutUint16(pkt[10:12], checksum(pkt[:20], 0))
	a.tun.Inbound <- pkt
	waitFor(t, "b to drop on TTL", func() bool { return dropped(b.d, dropTTL) == 1 })
}

// TestBadFramesDroppedAndCounted: frames that are truncated, of an unknown
// version or type, encrypted, or from an address that is no peer are
// dropped, counted by reason, and neither delivered nor forwarded.
func TestBadFramesDroppedAndCounted(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{})
	b := newTestNode(t, net, "b", nodeOpts{})
	c := newTestNode(t, net, "c", nodeOpts{})
	peers := peersOf(a, b, c)
	for _, n := range []*testNode{a, b, c} {
		n.setup(t, ring, peers)
	}
	// Frames "from a" to b for a range that c owns, so that a bad frame
	// that slipped through would be forwarded.
	good := frame(dataHeader, ipv4Packet("10.32.0.5", "10.40.0.7", 64, true))
	mutate := func(f func([]byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	fromA := netip.AddrPortFrom(underlayOf("a"), DefaultDataPort)
	toB := netip.AddrPortFrom(underlayOf("b"), DefaultDataPort)
	for _, tc := range []struct {
		name   string
		from   netip.AddrPort
		data   []byte
		reason dropReason
	}{
		{"empty", fromA, nil, dropTruncated},
		{"short header", fromA, good[:7], dropTruncated},
		{"truncated inner", fromA, good[:FrameHeaderLen+30], dropTruncated},
		{"version 2", fromA, mutate(func(b []byte) []byte { b[0] = 2; return b }), dropVersion},
		{"version 0", fromA, mutate(func(b []byte) []byte { b[0] = 0; return b }), dropVersion},
		{"unknown type", fromA, mutate(func(b []byte) []byte { b[1] = 200; return b }), dropType},
		{"unknown flag", fromA, mutate(func(b []byte) []byte { b[2] = 0x40; return b }), dropType},
		{"encrypted", fromA, mutate(func(b []byte) []byte { b[2] = byte(FlagEncrypted); b[7] = 1; return b }), dropEncrypted},
		{"inner not IPv4", fromA, mutate(func(b []byte) []byte { b[FrameHeaderLen] = 0x60; return b }), dropNotIPv4},
		{"unknown peer", netip.MustParseAddrPort("192.0.2.99:6784"), good, dropUnknownPeer},
		{"unknown peer, same port as a peer's address", netip.MustParseAddrPort("198.51.100.1:6784"), good, dropUnknownPeer},
		{"no route", fromA, frame(dataHeader, ipv4Packet("10.32.0.5", "10.99.0.7", 64, true)), dropNoRoute},
	} {
		before := dropped(b.d, tc.reason)
		if !net.Inject(bindtest.Packet{From: tc.from, To: toB, Data: tc.data}) {
			t.Fatal("nobody listens on b's address")
		}
		waitFor(t, tc.name+" counted", func() bool { return dropped(b.d, tc.reason) == before+1 })
	}
	if n := packets(b.d, dirForward, ModeUDP); n != 0 {
		t.Errorf("b forwarded %v bad frames", n)
	}
	// A good frame after them all goes through: c receives exactly it.
	net.Inject(bindtest.Packet{From: fromA, To: toB, Data: good})
	expectPacket(t, c.tun.Outbound, "good frame forwarded to c")
	expectNoPacket(t, c.tun.Outbound, "c")
	expectNoPacket(t, b.tun.Outbound, "b")
}

func TestIPIPFromUnknownAddressDropped(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{mode: ModeIPIP})
	b := newTestNode(t, net, "b", nodeOpts{mode: ModeIPIP})
	a.setup(t, ring[:2], peersOf(a, b))
	b.setup(t, ring[:2], peersOf(a, b))
	net.Inject(bindtest.Packet{From: netip.MustParseAddrPort("203.0.113.9:0"), To: netip.AddrPortFrom(underlayOf("b"), 0),
		Data: ipv4Packet("10.32.0.5", "10.36.0.7", 64, true)})
	net.Inject(bindtest.Packet{From: netip.AddrPortFrom(underlayOf("a"), 0), To: netip.AddrPortFrom(underlayOf("b"), 0),
		Data: ipv4Packet("10.32.0.5", "10.36.0.7", 64, true)[:30]})
	waitFor(t, "drops", func() bool {
		return dropped(b.d, dropUnknownPeer) == 1 && dropped(b.d, dropTruncated) == 1
	})
	expectNoPacket(t, b.tun.Outbound, "b")
}

// TestTooBigGetsICMP: with a TUN MTU above what the path allows, a DF
// packet that does not fit gets an ICMP "fragmentation needed" with the
// path's MTU written back into the TUN device; one without DF is sent.
func TestTooBigGetsICMP(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{mtu: 1500, underlayMTU: 1500})
	b := newTestNode(t, net, "b", nodeOpts{mtu: 1500, underlayMTU: 1500})
	a.setup(t, ring[:2], peersOf(a, b))
	b.setup(t, ring[:2], peersOf(a, b))
	maxInner := 1500 - Overhead(ModeUDP)

	fits := ipv4Packet("10.32.0.5", "10.36.0.7", maxInner-IPv4HeaderLen, true)
	a.tun.Inbound <- fits
	expectPacket(t, b.tun.Outbound, "a packet of the path MTU")

	big := ipv4Packet("10.32.0.5", "10.36.0.7", maxInner-IPv4HeaderLen+1, true)
	a.tun.Inbound <- big
	icmp := expectPacket(t, a.tun.Outbound, "ICMP back into a's TUN")
	if icmp[9] != 1 || icmp[20] != 3 || icmp[21] != 4 {
		t.Fatalf("not an ICMP fragmentation needed: proto %d type %d code %d", icmp[9], icmp[20], icmp[21])
	}
	if mtu := binary.BigEndian.Uint16(icmp[26:28]); int(mtu) != maxInner {
		t.Errorf("next-hop MTU %d, want %d", mtu, maxInner)
	}
	if ipv4Dst(icmp) != mustAddr("10.32.0.5") || ipv4Src(icmp) != mustAddr("10.36.0.7") {
		t.Errorf("ICMP %s -> %s, want from the packet's destination to its source", ipv4Src(icmp), ipv4Dst(icmp))
	}
	if checksum(icmp[:20], 0) != 0 || checksum(icmp[20:], 0) != 0 {
		t.Error("bad checksums")
	}
	expectNoPacket(t, b.tun.Outbound, "b (too big)")

	noDF := ipv4Packet("10.32.0.5", "10.36.0.7", maxInner-IPv4HeaderLen+1, false)
	a.tun.Inbound <- noDF
	expectPacket(t, b.tun.Outbound, "a too-big packet without DF")
	waitFor(t, "counters", func() bool {
		return dropped(a.d, dropTooBig) == 1 && value(a.d.metrics.icmp) == 1
	})
}

func TestTUNDrops(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{})
	b := newTestNode(t, net, "b", nodeOpts{})
	a.setup(t, []OwnedRange{rangeA, rangeB, rangeC}, peersOf(a, b)) // c is no known peer
	v6 := make([]byte, 48)
	v6[0] = 0x60
	for _, tc := range []struct {
		name   string
		pkt    []byte
		reason dropReason
	}{
		{"IPv6", v6, dropNotIPv4},
		{"own range", ipv4Packet("10.32.0.5", "10.32.0.9", 8, true), dropLocal},
		{"no owner", ipv4Packet("10.32.0.5", "10.99.0.9", 8, true), dropNoRoute},
		{"owner unknown", ipv4Packet("10.32.0.5", "10.40.0.9", 8, true), dropNoPeer},
	} {
		before := dropped(a.d, tc.reason)
		a.tun.Inbound <- tc.pkt
		waitFor(t, tc.name, func() bool { return dropped(a.d, tc.reason) == before+1 })
	}
}

// TestAutoModeChoice: each node picks, per peer, the first of its modes
// that the peer advertises, logs it, and drops traffic to a peer it
// shares no mode with.
func TestAutoModeChoice(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{mode: ModeAuto})
	if got := a.d.Encaps(); !slices.Equal(got, []Mode{ModeUDP, ModeIPIP}) {
		t.Errorf("auto advertises %v", got)
	}
	b := newTestNode(t, net, "b", nodeOpts{mode: ModeIPIP, noUDP: true})
	c := newTestNode(t, net, "c", nodeOpts{mode: ModeUDP, noIPIP: true})
	d := newTestNode(t, net, "d", nodeOpts{mode: ModeAuto})
	if got := b.d.Encaps(); !slices.Equal(got, []Mode{ModeIPIP}) {
		t.Errorf("ipip advertises %v", got)
	}
	peers := peersOf(a, b, c, d)
	ranges := []OwnedRange{rangeA, rangeB, rangeC, {mustAddr("10.48.0.0"), mustAddr("10.48.255.255"), "d"}}
	for _, n := range []*testNode{a, b, c, d} {
		n.setup(t, ranges, peers)
	}
	for _, tc := range []struct {
		from *testNode
		peer string
		want Mode
	}{
		{a, "b", ModeIPIP}, {a, "c", ModeUDP}, {a, "d", ModeUDP},
		{b, "a", ModeIPIP}, {b, "c", ""}, {b, "d", ModeIPIP},
		{c, "a", ModeUDP}, {c, "b", ""}, {c, "d", ModeUDP},
	} {
		if got := tc.from.d.ModeFor(tc.peer); got != tc.want {
			t.Errorf("%s.ModeFor(%s) = %q, want %q", tc.from.name, tc.peer, got, tc.want)
		}
	}
	conns := b.d.Connections()
	if len(conns) != 3 || conns[1].Peer != "c" || conns[1].Mode != "" || !strings.Contains(conns[1].Error, "no encapsulation mode in common") {
		t.Errorf("b's connections: %+v", conns)
	}
	// Packets over every compatible pair arrive; b to c is dropped.
	a.tun.Inbound <- ipv4Packet("10.32.0.5", "10.36.0.7", 8, true)
	expectPacket(t, b.tun.Outbound, "a to b (ipip)")
	b.tun.Inbound <- ipv4Packet("10.36.0.7", "10.48.0.7", 8, true)
	expectPacket(t, d.tun.Outbound, "b to d (ipip)")
	b.tun.Inbound <- ipv4Packet("10.36.0.7", "10.40.0.7", 8, true)
	waitFor(t, "b to c dropped", func() bool { return dropped(b.d, dropIncompatible) == 1 })
	if got := value(b.d.metrics.peerMode.WithLabelValues("c", "none")); got != 1 {
		t.Errorf("peer mode metric for c: %v", got)
	}
	// A peer that changes what it advertises is re-evaluated.
	peers[2].Encaps = []Mode{ModeUDP, ModeIPIP}
	if err := b.d.SetPeers(peers); err != nil {
		t.Fatal(err)
	}
	if got := b.d.ModeFor("c"); got != ModeIPIP {
		t.Errorf("after c advertises ipip: %q", got)
	}
	if n := countSeries(b.d.metrics.peerMode); n != 3 {
		t.Errorf("%d peer mode series, want 3 (stale ones removed)", n)
	}
}

func TestNewErrors(t *testing.T) {
	net := bindtest.NewNetwork()
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no name", Config{Mode: ModeUDP, MTU: 1440}, "Self"},
		{"bad mode", Config{Self: "a", Mode: "sleeve", MTU: 1440, TUN: tuntest.New("t", 1440)}, "unknown --encap"},
		{"bad mtu", Config{Self: "a", Mode: ModeUDP, MTU: 20}, "MTU"},
		{"ipip without ipip", Config{Self: "a", Mode: ModeIPIP, MTU: 1440, TUN: tuntest.New("t", 1440), UDP: net.Bind(netip.MustParseAddrPort("192.0.2.50:1"))},
			"cannot do --encap ipip: use --encap udp"},
		{"nothing", Config{Self: "a", Mode: ModeAuto, MTU: 1440, TUN: tuntest.New("t", 1440)}, "no encapsulation"},
	} {
		_, err := New(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: New error %v, want one containing %q", tc.name, err, tc.want)
		}
	}
}

// TestRoutesReconciled: SetRing asks the applier for the routes of every
// range owned by another peer, with the bridge address as source, and
// again when the ring changes.
func TestRoutesReconciled(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{})
	b := newTestNode(t, net, "b", nodeOpts{})
	a.setup(t, ring, peersOf(a, b))
	src := gatewayOf("a")
	want := []Route{{Dst: pfx("10.36.0.0/14"), Dev: "weft-tun", Src: src}, {Dst: pfx("10.40.0.0/13"), Dev: "weft-tun", Src: src}}
	if got := a.rt.current(); !slices.Equal(got, want) {
		t.Errorf("routes %v, want %v", got, want)
	}
	// c donates half of its range to a.
	donated := []OwnedRange{rangeA, rangeB, {mustAddr("10.40.0.0"), mustAddr("10.43.255.255"), "a"}, {mustAddr("10.44.0.0"), mustAddr("10.47.255.255"), "c"}}
	if err := a.d.SetRing(donated, src); err != nil {
		t.Fatal(err)
	}
	want = []Route{{Dst: pfx("10.36.0.0/14"), Dev: "weft-tun", Src: src}, {Dst: pfx("10.44.0.0/14"), Dev: "weft-tun", Src: src}}
	if got := a.rt.current(); !slices.Equal(got, want) {
		t.Errorf("after the donation: routes %v, want %v", got, want)
	}
	if !slices.Equal(a.d.WantedRoutes(), want) {
		t.Errorf("WantedRoutes = %v", a.d.WantedRoutes())
	}
	if err := a.d.SetRing([]OwnedRange{rangeA, {rangeA.First, rangeA.Last, "b"}}, src); err == nil {
		t.Error("overlapping ring accepted")
	}
}

// TestRunEndsCleanly: Close ends every goroutine, and Run returns nil.
func TestRunEndsCleanly(t *testing.T) {
	before := runtime.NumGoroutine()
	net := bindtest.NewNetwork()
	reg := prometheus.NewRegistry()
	tn := tuntest.New("t", 1440)
	d, err := New(Config{Self: "a", Mode: ModeAuto, MTU: 1440, TUN: tn, Registerer: reg,
		UDP: net.Bind(netip.MustParseAddrPort("192.0.2.1:6784")), IPIP: net.Bind(netip.MustParseAddrPort("192.0.2.1:0"))})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{Self: "a", Mode: ModeUDP, MTU: 1440, TUN: tuntest.New("t", 1440), Registerer: reg,
		UDP: net.Bind(netip.MustParseAddrPort("192.0.2.2:6784"))}); err == nil {
		t.Error("a second device registered the same metrics")
	}
	done := make(chan error)
	go func() { done <- d.Run(context.Background()) }()
	tn.Inbound <- []byte{0x60, 0}
	waitFor(t, "the device to run", func() bool { return dropped(d, dropNotIPv4) == 1 })
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
	if err := d.Run(context.Background()); err == nil {
		t.Error("second Run accepted")
	}
	waitFor(t, "goroutines to end", func() bool { return runtime.NumGoroutine() <= before })
	if n, _ := reg.Gather(); len(n) != 0 {
		t.Errorf("%d metric families left registered after Close", len(n))
	}
}

// fakeRouting is a RouteApplier over an in-memory table.
type fakeRouting struct {
	mu     sync.Mutex
	routes []Route
	err    error
}

func (f *fakeRouting) Apply(want []Route) (added, removed []Route, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return nil, nil, f.err
	}
	add, del := DiffRoutes(want, f.routes)
	f.routes = slices.Clone(want)
	return add, del, nil
}

func (f *fakeRouting) Close() error { return nil }

func (f *fakeRouting) current() []Route {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.routes)
}

func TestRouteErrorReported(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{})
	a.rt.err = errors.New("netlink says no")
	if err := a.d.SetRing(ring, gatewayOf("a")); err == nil || !strings.Contains(err.Error(), "netlink says no") {
		t.Errorf("SetRing error %v", err)
	}
	// Forwarding uses the new ring all the same.
	if owner, _ := a.d.snap.Load().routes.Owner(mustAddr("10.40.0.1")); owner != "c" {
		t.Errorf("owner %q", owner)
	}
}

func testLogger(t *testing.T, name string) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})).With("node", name)
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// value reads a counter or gauge.
func value(c prometheus.Metric) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	if m.Counter != nil {
		return m.Counter.GetValue()
	}
	return m.Gauge.GetValue()
}

func countSeries(c prometheus.Collector) int {
	ch := make(chan prometheus.Metric, 100)
	c.Collect(ch)
	close(ch)
	return len(ch)
}
