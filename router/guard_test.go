package router

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/weft-net/weft/bridge"
	"github.com/weft-net/weft/cni"
	"github.com/weft-net/weft/ipalloc"
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
