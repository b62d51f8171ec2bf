package router

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/weft-net/weft/bridge"
	"github.com/weft-net/weft/cni"
	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/tunnel"
)

// TestPodSources: the guard lets each pod attachment send from its own
// address on its own host veth; the gateway is no pod, and addresses held
// as re-claimed from the bridge are reported apart, to keep.
func TestPodSources(t *testing.T) {
	addr := func(s string) ipalloc.Address {
		a, err := ipalloc.AddressFrom(netip.MustParseAddr(s))
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	held := []ipalloc.Held{
		{Allocation: ipalloc.Allocation{Key: ipalloc.Key{ContainerID: "c1", IfName: "eth0"}, Address: addr("10.32.0.5")}},
		{Allocation: ipalloc.Allocation{Key: ipalloc.Key{ContainerID: "c1", IfName: "net1"}, Address: addr("10.32.0.6")}},
		{Allocation: ipalloc.Allocation{Key: ipalloc.GatewayKey("weft"), Address: addr("10.32.0.1")}},
		{Allocation: ipalloc.Allocation{Key: ipalloc.ReclaimedKey("weft", addr("10.32.0.9")), Address: addr("10.32.0.9")}},
	}
	want, reclaimed := podSources(held)
	if exp := []bridge.PodSource{
		{Veth: cni.HostVethName("c1", "eth0"), Addr: netip.MustParseAddr("10.32.0.5")},
		{Veth: cni.HostVethName("c1", "net1"), Addr: netip.MustParseAddr("10.32.0.6")},
	}; !slices.Equal(want, exp) {
		t.Errorf("pod sources %v, want %v", want, exp)
	}
	if len(reclaimed) != 1 || !reclaimed[netip.MustParseAddr("10.32.0.9")] {
		t.Errorf("reclaimed %v, want 10.32.0.9", reclaimed)
	}
}

// TestGuardPeerAddrs: IPIP and VXLAN (unsealed) are accepted from every
// peer without a password; with one, only from the peers inside the
// trusted subnets: a peer outside them sends sealed udp only, so plaintext
// from its address is forged.
func TestGuardPeerAddrs(t *testing.T) {
	a := netip.MustParseAddr
	peers := []tunnel.Peer{
		{Name: "b", Underlay: a("192.0.2.2")},
		{Name: "c", Underlay: a("198.51.100.3")},
		{Name: "b2", Underlay: a("192.0.2.2")}, // the same host: once
		{Name: "v6", Underlay: a("fd00::1")},
		{Name: "none"},
	}
	trusted := []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}
	for _, tc := range []struct {
		name     string
		password bool
		trusted  []netip.Prefix
		want     []netip.Addr
	}{
		{"no password", false, nil, []netip.Addr{a("192.0.2.2"), a("198.51.100.3")}},
		{"no password, trusted subnets", false, trusted, []netip.Addr{a("192.0.2.2"), a("198.51.100.3")}},
		{"password, trusted subnets", true, trusted, []netip.Addr{a("192.0.2.2")}},
		{"password, no trusted subnets", true, nil, nil},
	} {
		if got := guardPeerAddrs(peers, tc.password, tc.trusted); !slices.Equal(got, tc.want) {
			t.Errorf("%s: guardPeerAddrs = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestGuardOwnRanges: the guard's own set is this peer's ranges of the
// ring and no other peer's.
func TestGuardOwnRanges(t *testing.T) {
	a := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	ring := []tunnel.OwnedRange{
		{First: a("10.32.0.0"), Last: a("10.32.3.116"), Peer: "me"},
		{First: a("10.32.3.117"), Last: a("10.32.9.0"), Peer: "other"},
		{First: a("10.32.9.1"), Last: a("10.32.9.1"), Peer: "me"},
		{First: a("10.32.9.2"), Last: a("10.47.255.255"), Peer: "third"},
	}
	want := []bridge.AddrRange{{First: a("10.32.0.0"), Last: a("10.32.3.116")}, {First: a("10.32.9.1"), Last: a("10.32.9.1")}}
	if got := guardOwnRanges(ring, "me"); !slices.Equal(got, want) {
		t.Errorf("guardOwnRanges(me) = %v, want %v", got, want)
	}
	if got := guardOwnRanges(ring, "nobody"); len(got) != 0 {
		t.Errorf("guardOwnRanges(nobody) = %v, want none", got)
	}
}
