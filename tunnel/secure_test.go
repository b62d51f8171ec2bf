package tunnel

import (
	"bytes"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/tunnel/conn/bindtest"
	"github.com/weft-net/weft/tunnel/crypt"
	"github.com/weft-net/weft/tunnel/tun/tuntest"
)

// Test PSKs: what crypt.DeriveKeys would give for two passwords (fixed
// bytes here, so that tests need not pay for Argon2id).
var (
	pskOne = bytes.Repeat([]byte{1}, crypt.KeySize)
	pskTwo = bytes.Repeat([]byte{2}, crypt.KeySize)
)

const marker = "WEFT-SECRET-MARKER-0123456789"

// markerPacket is an IPv4 packet whose payload carries marker.
func markerPacket(src, dst string) []byte {
	p := ipv4Packet(src, dst, 100, true)
	copy(p[IPv4HeaderLen+8:], marker)
	return p
}

// wire records every datagram on a fake network.
type wire struct {
	mu   sync.Mutex
	seen []bindtest.Packet
}

func tap(net *bindtest.Network) *wire {
	w := &wire{}
	net.Tap(func(p bindtest.Packet) {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.seen = append(w.seen, p)
	})
	return w
}

func (w *wire) packets() []bindtest.Packet {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]bindtest.Packet(nil), w.seen...)
}

// exchange sends a marker packet from a to b and back, and checks both arrive
// intact.
func exchange(t *testing.T, a, b *testNode) {
	t.Helper()
	out := markerPacket("10.32.0.5", "10.36.0.7")
	a.tun.Inbound <- out
	if got := expectPacket(t, b.tun.Outbound, "a to b"); !bytes.Equal(got, out) {
		t.Fatalf("b got % x\nwant % x", got, out)
	}
	back := markerPacket("10.36.0.7", "10.32.0.5")
	b.tun.Inbound <- back
	if got := expectPacket(t, a.tun.Outbound, "b to a"); !bytes.Equal(got, back) {
		t.Fatalf("a got % x\nwant % x", got, back)
	}
}

func pair(t *testing.T, net *bindtest.Network, oa, ob nodeOpts) (a, b *testNode) {
	t.Helper()
	a = newTestNode(t, net, "a", oa)
	b = newTestNode(t, net, "b", ob)
	peers := peersOf(a, b)
	a.setup(t, ring[:2], peers)
	b.setup(t, ring[:2], peers)
	return a, b
}

// TestEncryptedExchange: two nodes with the same password exchange
// packets; on the wire every frame is sealed and the payload's marker
// is nowhere to be seen. Without a password, the marker is visible.
func TestEncryptedExchange(t *testing.T) {
	for _, tc := range []struct {
		name      string
		psk       []byte
		encrypted bool
	}{{"password", pskOne, true}, {"no password", nil, false}} {
		t.Run(tc.name, func(t *testing.T) {
			net := bindtest.NewNetwork()
			w := tap(net)
			a, b := pair(t, net, nodeOpts{psk: tc.psk}, nodeOpts{psk: tc.psk})
			for range 3 {
				exchange(t, a, b)
			}
			if got := a.d.Encryption(); got.Enabled != tc.encrypted || got.String() != map[bool]string{true: "enabled", false: "disabled"}[tc.encrypted] {
				t.Errorf("Encryption() = %+v", got)
			}
			if c := a.d.Connections(); len(c) != 1 || c[0].Encrypted != tc.encrypted || c[0].Trusted {
				t.Errorf("connections %+v", c)
			}
			ps := w.packets()
			if len(ps) != 6 {
				t.Fatalf("%d datagrams on the wire, want 6", len(ps))
			}
			counters := map[netip.AddrPort][]uint64{}
			for _, p := range ps {
				visible := bytes.Contains(p.Data, []byte(marker))
				h, err := DecodeFrameHeader(p.Data)
				if tc.encrypted {
					if visible || !strings.Contains(err.Error(), "encrypted") || h.Flags&FlagEncrypted == 0 || h.KeyID == 0 {
						t.Errorf("frame %+v (%v): marker visible %v", h, err, visible)
					}
					if len(p.Data) != FrameHeaderLen+100+IPv4HeaderLen+AEADTagLen {
						t.Errorf("sealed frame of %d bytes", len(p.Data))
					}
				} else if !visible || err != nil || h.Flags != 0 {
					t.Errorf("plaintext frame %+v (%v): marker visible %v", h, err, visible)
				}
				counters[p.From] = append(counters[p.From], h.Counter)
			}
			if tc.encrypted {
				// Each direction counts from 0: the nonces.
				for from, cs := range counters {
					if len(cs) != 3 || cs[0] != 0 || cs[1] != 1 || cs[2] != 2 {
						t.Errorf("counters from %s: %v", from, cs)
					}
				}
			}
			for _, r := range []dropReason{dropAuth, dropReplay, dropPlaintext, dropNoKey} {
				if n := dropped(a.d, r) + dropped(b.d, r); n != 0 {
					t.Errorf("%v frames dropped as %s", n, dropReasonNames[r])
				}
			}
		})
	}
}

// TestWrongPassword: nodes with different passwords (which the mesh would
// not even let in) get nothing through; the receiver counts auth failures.
func TestWrongPassword(t *testing.T) {
	net := bindtest.NewNetwork()
	a, b := pair(t, net, nodeOpts{psk: pskOne}, nodeOpts{psk: pskTwo})
	a.tun.Inbound <- markerPacket("10.32.0.5", "10.36.0.7")
	b.tun.Inbound <- markerPacket("10.36.0.7", "10.32.0.5")
	waitFor(t, "auth failures on both", func() bool {
		return dropped(a.d, dropAuth) == 1 && dropped(b.d, dropAuth) == 1
	})
	expectNoPacket(t, a.tun.Outbound, "a")
	expectNoPacket(t, b.tun.Outbound, "b")
}

// TestReplayedFrameDropped: a captured frame injected again is dropped and
// counted; so is one injected again after newer frames moved on.
func TestReplayedFrameDropped(t *testing.T) {
	net := bindtest.NewNetwork()
	w := tap(net)
	a, b := pair(t, net, nodeOpts{psk: pskOne}, nodeOpts{psk: pskOne})
	exchange(t, a, b)
	captured := w.packets()[0] // a to b
	if captured.From.Addr() != underlayOf("a") {
		t.Fatalf("first datagram from %s", captured.From)
	}
	net.Inject(captured)
	waitFor(t, "the replay to be counted", func() bool { return dropped(b.d, dropReplay) == 1 })
	for range 3 {
		exchange(t, a, b)
	}
	net.Inject(captured)
	waitFor(t, "the late replay to be counted", func() bool { return dropped(b.d, dropReplay) == 2 })
	expectNoPacket(t, b.tun.Outbound, "b")
	// A tampered copy is an auth failure, not a replay.
	bad := captured
	bad.Data = bytes.Clone(captured.Data)
	bad.Data[len(bad.Data)-1] ^= 1
	net.Inject(bad)
	waitFor(t, "the forgery to be counted", func() bool { return dropped(b.d, dropAuth) == 1 })
	expectNoPacket(t, b.tun.Outbound, "b")
}

// TestTrustedSubnets: peers inside a trusted subnet get plaintext and may
// send it, although encryption is on; a peer that trusts only one way
// sees its plaintext refused by the other.
func TestTrustedSubnets(t *testing.T) {
	underlay := []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}
	t.Run("both", func(t *testing.T) {
		net := bindtest.NewNetwork()
		w := tap(net)
		a, b := pair(t, net, nodeOpts{psk: pskOne, trusted: underlay}, nodeOpts{psk: pskOne, trusted: underlay})
		exchange(t, a, b)
		for _, p := range w.packets() {
			if !bytes.Contains(p.Data, []byte(marker)) || sealed(p.Data) {
				t.Errorf("frame to a trusted peer sealed: % x", p.Data[:FrameHeaderLen])
			}
		}
		if c := a.d.Connections(); len(c) != 1 || c[0].Encrypted || !c[0].Trusted {
			t.Errorf("connections %+v", c)
		}
	})
	t.Run("one way", func(t *testing.T) {
		net := bindtest.NewNetwork()
		a, b := pair(t, net, nodeOpts{psk: pskOne, trusted: underlay}, nodeOpts{psk: pskOne})
		// b seals; a, which trusts b, still opens sealed frames.
		b.tun.Inbound <- markerPacket("10.36.0.7", "10.32.0.5")
		expectPacket(t, a.tun.Outbound, "b to a, sealed")
		// a sends plaintext; b does not trust a and drops it.
		a.tun.Inbound <- markerPacket("10.32.0.5", "10.36.0.7")
		waitFor(t, "plaintext drop", func() bool { return dropped(b.d, dropPlaintext) == 1 })
		expectNoPacket(t, b.tun.Outbound, "b")
	})
}

// TestPeerWithoutPassword: with encryption on, a peer that publishes no
// key gets nothing (dropped and counted, with an error in Connections),
// and its plaintext is refused.
func TestPeerWithoutPassword(t *testing.T) {
	net := bindtest.NewNetwork()
	a, b := pair(t, net, nodeOpts{psk: pskOne}, nodeOpts{})
	c := a.d.Connections()
	if len(c) != 1 || c[0].Mode != "" || !strings.Contains(c[0].Error, "publishes no public key") {
		t.Errorf("a's connections: %+v", c)
	}
	a.tun.Inbound <- markerPacket("10.32.0.5", "10.36.0.7")
	waitFor(t, "no-key drop", func() bool { return dropped(a.d, dropNoKey) == 1 })
	b.tun.Inbound <- markerPacket("10.36.0.7", "10.32.0.5")
	waitFor(t, "plaintext drop", func() bool { return dropped(a.d, dropPlaintext) == 1 })
	expectNoPacket(t, a.tun.Outbound, "a")
	expectNoPacket(t, b.tun.Outbound, "b")
}

// TestRestartedPeerAccepted: b restarts (a new Device, so a new key pair,
// counters from 0 again); once the mesh tells a its new key, traffic
// flows both ways, and a's replay windows of the old key do not get in
// the way.
func TestRestartedPeerAccepted(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{psk: pskOne})
	b := newTestNode(t, net, "b", nodeOpts{psk: pskOne})
	a.setup(t, ring[:2], peersOf(a, b))
	b.setup(t, ring[:2], peersOf(a, b))
	for range 3 {
		exchange(t, a, b)
	}
	oldKey := b.d.PublicKey()
	if err := b.d.Close(); err != nil {
		t.Fatal(err)
	}
	b2 := newTestNode(t, net, "b", nodeOpts{psk: pskOne})
	if bytes.Equal(b2.d.PublicKey(), oldKey) {
		t.Fatal("the restarted node has the same key")
	}
	a.setup(t, ring[:2], peersOf(a, b2))
	b2.setup(t, ring[:2], peersOf(a, b2))
	exchange(t, a, b2)
	if n := dropped(a.d, dropReplay) + dropped(a.d, dropAuth); n != 0 {
		t.Errorf("a dropped %v frames of the restarted peer", n)
	}
}

// TestKeysKeptAcrossPeerUpdates: SetPeers with the same keys keeps the
// sessions (counters go on, no nonce is reused); a peer that leaves the
// list and comes back keeps them too.
func TestKeysKeptAcrossPeerUpdates(t *testing.T) {
	net := bindtest.NewNetwork()
	w := tap(net)
	a, b := pair(t, net, nodeOpts{psk: pskOne}, nodeOpts{psk: pskOne})
	exchange(t, a, b)
	a.setup(t, ring[:2], peersOf(a, b))
	exchange(t, a, b)
	a.setup(t, ring[:2], peersOf(a)) // b gone from a's list
	a.setup(t, ring[:2], peersOf(a, b))
	exchange(t, a, b)
	type nonce struct {
		key uint32
		c   uint64
	}
	seen := map[nonce]bool{}
	for _, p := range w.packets() {
		if p.From.Addr() != underlayOf("a") {
			continue
		}
		h, _ := DecodeFrameHeader(p.Data)
		if seen[nonce{h.KeyID, h.Counter}] {
			t.Errorf("a reused key %d counter %d", h.KeyID, h.Counter)
		}
		seen[nonce{h.KeyID, h.Counter}] = true
	}
	if len(seen) != 3 {
		t.Errorf("%d frames from a, want 3", len(seen))
	}
}

// TestRekeyOnTime: after the rekey time the sender's key id changes and
// traffic goes on.
func TestRekeyOnTime(t *testing.T) {
	var mu sync.Mutex
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	net := bindtest.NewNetwork()
	w := tap(net)
	a, b := pair(t, net, nodeOpts{psk: pskOne, now: clock}, nodeOpts{psk: pskOne, now: clock})
	exchange(t, a, b)
	mu.Lock()
	now = now.Add(crypt.DefaultRekeyAfterTime + time.Second)
	mu.Unlock()
	exchange(t, a, b)
	var keys []uint32
	for _, p := range w.packets() {
		if p.From.Addr() == underlayOf("a") {
			h, _ := DecodeFrameHeader(p.Data)
			keys = append(keys, h.KeyID)
		}
	}
	if len(keys) != 2 || keys[0] == keys[1] {
		t.Errorf("a's key ids %v: want a new one after the rekey time", keys)
	}
}

// TestEncryptedForward: b forwards a's sealed packet for a range that
// moved on to c, sealed again for c; a plaintext frame from a trusted
// peer is sealed for an untrusted one.
func TestEncryptedForward(t *testing.T) {
	for _, tc := range []struct {
		name    string
		trusted []netip.Prefix // b's
	}{{"sealed to sealed", nil}, {"plaintext to sealed", []netip.Prefix{netip.MustParsePrefix("192.0.2.1/32")}}} {
		t.Run(tc.name, func(t *testing.T) {
			net := bindtest.NewNetwork()
			w := tap(net)
			aTrusted := []netip.Prefix{netip.MustParsePrefix("192.0.2.2/32")} // a trusts b if b trusts a
			if tc.trusted == nil {
				aTrusted = nil
			}
			a := newTestNode(t, net, "a", nodeOpts{psk: pskOne, trusted: aTrusted})
			b := newTestNode(t, net, "b", nodeOpts{psk: pskOne, trusted: tc.trusted})
			c := newTestNode(t, net, "c", nodeOpts{psk: pskOne})
			peers := peersOf(a, b, c)
			moved := []OwnedRange{rangeA, {rangeB.First, rangeB.Last, "c"}, rangeC}
			a.setup(t, ring, peers)
			b.setup(t, moved, peers)
			c.setup(t, moved, peers)
			pkt := markerPacket("10.32.0.5", "10.36.0.7")
			a.tun.Inbound <- pkt
			got := expectPacket(t, c.tun.Outbound, "a to c via b")
			if !bytes.Equal(got[IPv4HeaderLen:], pkt[IPv4HeaderLen:]) || got[8] != pkt[8]-1 {
				t.Errorf("forwarded packet differs")
			}
			for _, p := range w.packets() {
				if p.From.Addr() == underlayOf("b") && (!sealed(p.Data) || bytes.Contains(p.Data, []byte(marker))) {
					t.Errorf("b forwarded unsealed")
				}
			}
		})
	}
}

// TestIPIPWithPassword: ipip cannot be encrypted. With a password and no
// trusted subnets, --encap ipip is refused and auto never offers ipip;
// with trusted subnets, ipip is used only for the peers inside them.
func TestIPIPWithPassword(t *testing.T) {
	net := bindtest.NewNetwork()
	_, err := New(Config{Self: "x", Mode: ModeIPIP, MTU: 1440, PSK: pskOne, TUN: tuntest.New("t", 1440),
		IPIP: net.Bind(netip.MustParseAddrPort("192.0.2.50:0"))})
	if err == nil || !strings.Contains(err.Error(), "ipip cannot be encrypted: with a password set, use --encap udp, or list the peers' subnets in --trusted-subnets") {
		t.Errorf("New(ipip with a password) error %v", err)
	}
	a := newTestNode(t, net, "a", nodeOpts{mode: ModeAuto, psk: pskOne})
	if got := a.d.Encaps(); len(got) != 1 || got[0] != ModeUDP {
		t.Errorf("auto with a password advertises %v, want udp only", got)
	}
	// Trusted subnets: b (192.0.2.2) is trusted, c (192.0.2.3) is not.
	trusted := []netip.Prefix{netip.MustParsePrefix("192.0.2.2/32")}
	d := newTestNode(t, net, "d", nodeOpts{mode: ModeAuto, psk: pskOne, trusted: trusted})
	b := newTestNode(t, net, "b", nodeOpts{mode: ModeIPIP, noUDP: true})
	c := newTestNode(t, net, "c", nodeOpts{mode: ModeAuto, psk: pskOne})
	e := newTestNode(t, net, "e", nodeOpts{mode: ModeIPIP, psk: pskOne, trusted: trusted})
	peers := peersOf(d, b, c, e)
	for _, n := range []*testNode{d, e} {
		if err := n.d.SetPeers(peers); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		from      *testNode
		peer      string
		mode      Mode
		encrypted bool
		err       string
	}{
		{d, "b", ModeIPIP, false, ""},
		{d, "c", ModeUDP, true, ""},
		{d, "e", "", false, "ipip is not used with a password"}, // e does only ipip
		{e, "b", ModeIPIP, false, ""},
		{e, "c", "", false, "ipip cannot be encrypted"},
		{e, "d", "", false, "ipip cannot be encrypted"},
	} {
		var conn Connection
		for _, cn := range tc.from.d.Connections() {
			if cn.Peer == tc.peer {
				conn = cn
			}
		}
		if conn.Mode != tc.mode || conn.Encrypted != tc.encrypted || !strings.Contains(conn.Error, tc.err) {
			t.Errorf("%s to %s: %+v, want mode %q encrypted %v error %q", tc.from.name, tc.peer, conn, tc.mode, tc.encrypted, tc.err)
		}
	}
}

func TestParseTrustedSubnets(t *testing.T) {
	got, err := ParseTrustedSubnets(" 10.0.0.5/16, 192.168.1.0/24,,")
	if err != nil || len(got) != 2 || got[0] != netip.MustParsePrefix("10.0.0.0/16") || got[1] != netip.MustParsePrefix("192.168.1.0/24") {
		t.Errorf("ParseTrustedSubnets = %v, %v", got, err)
	}
	if got, err := ParseTrustedSubnets(""); err != nil || got != nil {
		t.Errorf("empty: %v, %v", got, err)
	}
	for _, bad := range []string{"10.0.0.0", "fd00::/8", "10.0.0.0/33", "x"} {
		if _, err := ParseTrustedSubnets(bad); err == nil || !strings.Contains(err.Error(), "--trusted-subnets") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

func TestNewCryptoErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"short psk", Config{Self: "a", Mode: ModeUDP, MTU: 1440, PSK: []byte("short"), TUN: tuntest.New("t", 1440)}, "PSK of 5 bytes"},
		{"ipv6 trusted", Config{Self: "a", Mode: ModeUDP, MTU: 1440, PSK: pskOne, TUN: tuntest.New("t", 1440),
			TrustedSubnets: []netip.Prefix{netip.MustParsePrefix("fd00::/8")}}, "IPv4"},
	} {
		if _, err := New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}

// FuzzOpenFrame: no bytes from the underlay make the receive path's frame
// check panic, and with encryption on, nothing but the genuine sealed
// frame (once) and plaintext from a trusted peer gets through.
func FuzzOpenFrame(f *testing.F) {
	ka, _ := crypt.NewKeyPair(bytes.Repeat([]byte{1}, 32))
	kb, _ := crypt.NewKeyPair(bytes.Repeat([]byte{2}, 32))
	la := crypt.NewLocal(ka, [crypt.KeySize]byte(pskOne), crypt.Limits{})
	lb := crypt.NewLocal(kb, [crypt.KeySize]byte(pskOne), crypt.Limits{})
	ab, _ := la.Session(kb.Public())
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	inner := ipv4Packet("10.32.0.5", "10.36.0.7", 40, true)
	buf := make([]byte, FrameHeaderLen+len(inner)+AEADTagLen)
	copy(buf[FrameHeaderLen:], inner)
	var sc crypt.Scratch
	genuine, _ := sealFrame(buf[:FrameHeaderLen+len(inner)], 0, &peerPath{sess: ab}, &sc, now)
	genuine = bytes.Clone(genuine)
	f.Add(genuine, false)
	f.Add(frame(dataHeader, inner), false)
	f.Add(frame(dataHeader, inner), true)
	f.Add(genuine[:30], false)
	f.Add([]byte{}, true)
	f.Fuzz(func(t *testing.T, b []byte, trusted bool) {
		ba, err := lb.Session(ka.Public())
		if err != nil {
			t.Fatal(err)
		}
		p := &peerPath{sess: ba, plain: trusted, trusted: trusted}
		data := bytes.Clone(b)
		h, got, r := openFrame(data, p, true, &sc, now)
		if r != dropNone {
			return
		}
		if len(got) < IPv4HeaderLen || len(got) > len(b) {
			t.Fatalf("inner packet of %d bytes from %d", len(got), len(b))
		}
		if h.encrypted() && (!bytes.Equal(b, genuine) || !bytes.Equal(got, inner)) {
			t.Fatalf("a sealed frame that a never sealed opened: %x", b)
		}
		if !h.encrypted() && !trusted {
			t.Fatalf("plaintext accepted from a peer that must encrypt: %x", b)
		}
		// Once more: a replay.
		if _, _, r := openFrame(bytes.Clone(b), p, true, &sc, now); h.encrypted() && r != dropReplay {
			t.Fatalf("the same sealed frame again: reason %d", r)
		}
	})
}
