package tunnel

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/weft-net/weft/tunnel/conn/bindtest"
	"github.com/weft-net/weft/tunnel/crypt"
	"github.com/weft-net/weft/tunnel/tun/tuntest"
)

// newAutoNode is a Device of node a with --encap auto over the fakes: a
// udp socket and, if vxlan, a VXLAN device (its entries kept by a fake).
func newAutoNode(t *testing.T, psk []byte, trusted []netip.Prefix, vxlan bool) (*Device, *fakeVTEPs, *fakeRouting) {
	t.Helper()
	v, rt := &fakeVTEPs{}, &fakeRouting{}
	cfg := Config{Self: "a", Mode: ModeAuto, MTU: 1440, Underlay: underlayOf("a"), TUN: tuntest.New("weft-tun", 1440),
		UDP: bindtest.NewNetwork().Bind(netip.AddrPortFrom(underlayOf("a"), DefaultDataPort)), Routing: rt,
		PSK: psk, TrustedSubnets: trusted, Logger: testLogger(t, "a")}
	if vxlan {
		cfg.VTEPs = v
	}
	d, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	return d, v, rt
}

// autoPeer is peer name as an auto node publishes it: udp and vxlan, its
// VTEP, and a public key.
func autoPeer(t *testing.T, name string) Peer {
	t.Helper()
	kp, err := crypt.GenerateKeyPair()
	if err != nil {
		t.Fatal(err)
	}
	pub := kp.Public()
	p := vtepPeer(name)
	p.Encaps, p.PublicKey = []Mode{ModeVXLAN, ModeUDP}, pub[:]
	return p
}

// TestAutoChoosesPerPeer: with --encap auto, each peer gets vxlan where
// its traffic may be plaintext (no password, or this node and the peer
// inside --trusted-subnets) and it advertises a VTEP that fits (the same
// port and VNI, no clash), and udp otherwise (sealed where it must be
// encrypted); the reason is in Connections, and the peer's ranges are
// routed through the device of its mode.
func TestAutoChoosesPerPeer(t *testing.T) {
	psk := make([]byte, crypt.KeySize)
	all := []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}
	onlyB := []netip.Prefix{netip.MustParsePrefix("192.0.2.1/32"), netip.MustParsePrefix("192.0.2.2/32")}
	notSelf := []netip.Prefix{netip.MustParsePrefix("192.0.2.2/32")}
	mod := func(f func(*Peer)) func(*Peer) { return f }
	for _, tc := range []struct {
		name      string
		psk       []byte
		trusted   []netip.Prefix
		noDevice  bool // this node could not make weft-vx
		peer      func(*Peer)
		mode      Mode
		encrypted bool
		reason    string
	}{
		{name: "no password, peer has vxlan", mode: ModeVXLAN, reason: "no password"},
		{name: "no password, peer without vxlan (older weft)", peer: mod(func(p *Peer) { p.Encaps, p.VTEP = nil, nil }), mode: ModeUDP, reason: "the peer has no vxlan"},
		{name: "no password, peer with --encap udp", peer: mod(func(p *Peer) { p.Encaps, p.VTEP = []Mode{ModeUDP}, nil }), mode: ModeUDP, reason: "the peer has no vxlan"},
		{name: "no password, peer advertises vxlan without a VTEP", peer: mod(func(p *Peer) { p.VTEP = nil }), mode: ModeUDP, reason: "without its VTEP"},
		{name: "no password, peer's vxlan port differs", peer: mod(func(p *Peer) { p.VTEP.Port = 8472 }), mode: ModeUDP, reason: "--vxlan-port"},
		{name: "no password, peer's VNI differs", peer: mod(func(p *Peer) { p.VTEP.VNI = 1 }), mode: ModeUDP, reason: "--vxlan-vni"},
		{name: "no password, peer has this node's VTEP MAC", peer: mod(func(p *Peer) { p.VTEP.MAC = VTEPMAC("a") }), mode: ModeUDP, reason: "this node's VTEP MAC"},
		{name: "no password, this node has no VXLAN device", noDevice: true, mode: ModeUDP, reason: "this node has no vxlan"},
		{name: "password, no trusted subnets", psk: psk, mode: ModeUDP, encrypted: true, reason: "encrypted: outside trusted subnets"},
		{name: "password, both trusted", psk: psk, trusted: all, mode: ModeVXLAN, reason: "trusted subnet"},
		{name: "password, both trusted, peer without vxlan", psk: psk, trusted: all, peer: mod(func(p *Peer) { p.Encaps, p.VTEP = []Mode{ModeUDP}, nil }), mode: ModeUDP, reason: "the peer has no vxlan"},
		{name: "password, both trusted, port differs", psk: psk, trusted: onlyB, peer: mod(func(p *Peer) { p.VTEP.Port = 4790 }), mode: ModeUDP, reason: "--vxlan-port"},
		{name: "password, peer outside trusted subnets", psk: psk, trusted: onlyB, peer: mod(func(p *Peer) {
			p.Name, p.Underlay = "c", underlayOf("c")
			p.VTEP.Addr, p.VTEP.MAC = underlayOf("c"), VTEPMAC("c")
		}), mode: ModeUDP, encrypted: true, reason: "encrypted: outside trusted subnets"},
		{name: "password, this node outside trusted subnets", psk: psk, trusted: notSelf, mode: ModeUDP, reason: "this node has no vxlan: a password is set and this node's address 192.0.2.1 is outside --trusted-subnets"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, v, rt := newAutoNode(t, tc.psk, tc.trusted, !tc.noDevice)
			p := autoPeer(t, "b")
			if tc.peer != nil {
				tc.peer(&p)
			}
			if err := d.SetPeers([]Peer{p}); err != nil {
				t.Fatal(err)
			}
			if err := d.SetRing(ring, gatewayOf("a")); err != nil {
				t.Fatal(err)
			}
			cs := d.Connections()
			if len(cs) != 1 {
				t.Fatalf("Connections = %+v, want one", cs)
			}
			c := cs[0]
			if c.Mode != tc.mode || c.Encrypted != tc.encrypted || !strings.Contains(c.Reason, tc.reason) || c.Error != "" {
				t.Errorf("%s: mode %q, encrypted %v, reason %q, error %q; want %q, %v, a reason with %q", c.Peer, c.Mode, c.Encrypted, c.Reason, c.Error, tc.mode, tc.encrypted, tc.reason)
			}
			wantDev, wantEntries := "weft-tun", []VTEPEntry(nil)
			if tc.mode == ModeVXLAN {
				wantDev, wantEntries = DefaultVXLANName, []VTEPEntry{entryOf(p.Name)}
			}
			if got := v.entries(); !slices.Equal(got, wantEntries) {
				t.Errorf("vxlan entries = %v, want %v", got, wantEntries)
			}
			routed := 0
			for _, r := range rt.current() {
				for _, o := range ring {
					if o.Peer == p.Name && !r.Dst.Addr().Less(o.First) && !o.Last.Less(r.Dst.Addr()) {
						routed++
						if r.Dev != wantDev {
							t.Errorf("route %s, want it on %s", r, wantDev)
						}
					}
				}
			}
			if routed == 0 {
				t.Errorf("no route to %s's range in %v", p.Name, rt.current())
			}
			// What a peer learns of this node: vxlan (and its VTEP) only
			// where it may be used.
			_, hasVTEP := d.LocalVTEP()
			wantVX := !tc.noDevice && !strings.HasPrefix(tc.reason, "this node has no vxlan") && !(tc.psk != nil && len(tc.trusted) == 0)
			if got := d.Encaps(); slices.Contains(got, ModeVXLAN) != wantVX || hasVTEP != wantVX || (d.VXLANDevice() != "") != wantVX {
				t.Errorf("advertises %v (VTEP %v, device %q), want vxlan: %v", got, hasVTEP, d.VXLANDevice(), wantVX)
			}
		})
	}
}

// TestAutoVXLANClashFallsBack: two peers that claim one VTEP address get
// udp from an auto node (with --encap vxlan they get nothing), the
// others vxlan; the reason names the clash.
func TestAutoVXLANClashFallsBack(t *testing.T) {
	d, v, _ := newAutoNode(t, nil, nil, true)
	e, f, g := autoPeer(t, "e"), autoPeer(t, "f"), autoPeer(t, "g")
	f.VTEP.Addr = e.VTEP.Addr
	if err := d.SetPeers([]Peer{e, f, g}); err != nil {
		t.Fatal(err)
	}
	for _, c := range d.Connections() {
		want, reason := ModeUDP, "same VTEP address"
		if c.Peer == "g" {
			want, reason = ModeVXLAN, "no password"
		}
		if c.Mode != want || !strings.Contains(c.Reason, reason) {
			t.Errorf("%s: mode %q, reason %q; want %q with %q", c.Peer, c.Mode, c.Reason, want, reason)
		}
	}
	if got := v.entries(); !slices.Equal(got, []VTEPEntry{entryOf("g")}) {
		t.Errorf("entries = %v, want g's only", got)
	}
}

// TestAutoReceivesUDPFromAVXLANPeer: the receive side takes what the
// other end picks. a (auto, with vxlan) sends to b with vxlan, as b
// advertises it; b, with --encap udp here, sends to a with udp, and a's
// udp socket delivers it to a's pods: a peer sent to with vxlan is still
// received on udp.
func TestAutoReceivesUDPFromAVXLANPeer(t *testing.T) {
	net := bindtest.NewNetwork()
	a := newTestNode(t, net, "a", nodeOpts{mode: ModeAuto, noIPIP: true, vteps: &fakeVTEPs{}})
	b := newTestNode(t, net, "b", nodeOpts{mode: ModeUDP, noIPIP: true})
	pb := vtepPeer("b")
	pb.Encaps = []Mode{ModeVXLAN, ModeUDP}
	a.setup(t, ring[:2], []Peer{pb})
	b.setup(t, ring[:2], peersOf(a))
	if got := a.d.ModeFor("b"); got != ModeVXLAN {
		t.Fatalf("a sends to b with %q, want vxlan", got)
	}
	if got := b.d.ModeFor("a"); got != ModeUDP {
		t.Fatalf("b sends to a with %q, want udp", got)
	}
	pong := ipv4Packet("10.36.0.7", "10.32.0.5", 64, true)
	b.tun.Inbound <- pong
	if got := expectPacket(t, a.tun.Outbound, "b to a by udp"); string(got) != string(pong) {
		t.Fatalf("a got % x\nwant % x", got, pong)
	}
	waitFor(t, "a's udp counter", func() bool { return packets(a.d, dirIn, ModeUDP) == 1 })
}
