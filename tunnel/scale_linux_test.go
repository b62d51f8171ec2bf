package tunnel

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weft-net/weft/tunnel/internal/netnstest"
)

// BenchmarkVXLANPeers: one node's kernel data plane at n peers (issue 16),
// in the real kernel: the vxlan Device as the router opens it (TUN and
// VXLAN devices, netlink appliers) in node a's namespace of a pair, n
// peers on vxlan (198.18.0.0/15 underlays, onlink: nothing is sent) and a
// ring of 3 ranges per owner. Reported per n: the first SetPeers (the
// neighbours and FDB entries of n peers) and SetRing (the routes) of a
// router that starts into the cluster, what the kernel then holds, and
// the cost of one event (ns/op):
//
//	unchanged     a mesh event that changes nothing (SetPeers, same peers)
//	leave-rejoin  the last peer leaves (its entry goes, its routes move
//	              to the TUN device), then comes back
//	donation      one range changes owner between two peers (SetRing)
//	resync        the ring again, unchanged (SetRing: the router's resync
//	              every 30 s, which reads the kernel's routes, neighbours
//	              and FDB back and repairs them)
func BenchmarkVXLANPeers(b *testing.B) {
	for _, n := range []int{10, 100, 1000} {
		for _, ev := range []string{"unchanged", "leave-rejoin", "donation", "resync"} {
			b.Run(fmt.Sprintf("peers=%d/event=%s", n, ev), func(b *testing.B) { benchVXLANPeers(b, n, ev) })
		}
	}
}

// scaleNode is a vxlan Device in node a's namespace of a fresh pair, with
// appliers of its own to read what the kernel holds, and n peers on vxlan.
type scaleNode struct {
	d      *Device
	gw     netip.Addr
	routes *NetlinkRoutes
	vteps  *NetlinkVTEPs
	peers  []Peer
}

func newScaleNode(tb testing.TB, n int, now func() time.Time) *scaleNode {
	tb.Helper()
	mtu := netnstest.UnderlayMTU - Overhead(ModeVXLAN)
	p := newPair(tb, mtu)
	a := p.Nodes[0]
	sn := &scaleNode{gw: a.Gateway}
	err := a.NS.Do(func() error {
		var err error
		sn.d, err = New(Config{Self: "a", Mode: ModeVXLAN, MTU: mtu, Underlay: a.Underlay, Queues: 1, Logger: slog.New(slog.DiscardHandler), Now: now})
		if err != nil {
			return err
		}
		h1, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return err
		}
		h2, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			h1.Close()
			return err
		}
		sn.routes, sn.vteps = NewRouteApplier(h1, DefaultTUNName, DefaultVXLANName), NewVTEPApplier(h2, DefaultVXLANName)
		return nil
	})
	if err != nil {
		tb.Fatalf("New in %s: %v", a.NS.Name, err)
	}
	tb.Cleanup(func() {
		sn.d.Close()
		sn.routes.Close()
		sn.vteps.Close()
	})
	local, ok := sn.d.LocalVTEP()
	if !ok {
		tb.Fatal("the vxlan Device has no VTEP")
	}
	sn.peers = make([]Peer, n)
	for i := range sn.peers {
		name := fmt.Sprintf("p%d", i)
		ul := scaleUnderlay(i)
		sn.peers[i] = Peer{Name: name, Underlay: ul, DataPort: DefaultDataPort, Encaps: []Mode{ModeVXLAN, ModeUDP},
			VTEP: &VTEP{MAC: VTEPMAC(name), Addr: ul, Port: local.Port, VNI: local.VNI}}
	}
	return sn
}

// kernel is what the kernel holds on the VXLAN device: its routes and
// vxlan entries, sorted.
func (sn *scaleNode) kernel(tb testing.TB) ([]Route, []VTEPEntry) {
	tb.Helper()
	routes, err := sn.routes.Routes()
	if err != nil {
		tb.Fatal(err)
	}
	entries, _, err := sn.vteps.Entries()
	if err != nil {
		tb.Fatal(err)
	}
	slices.SortFunc(routes, compareRoutes)
	slices.SortFunc(entries, compareVTEPEntries)
	return routes, entries
}

func benchVXLANPeers(b *testing.B, n int, event string) {
	sn := newScaleNode(b, n, nil)
	d, peers := sn.d, sn.peers
	ring, _ := scaleRing("a", n, 3, 1)
	fillPeers := measure(func() {
		if err := d.SetPeers(peers); err != nil {
			b.Fatal(err)
		}
	})
	fillRing := measure(func() {
		if err := d.SetRing(ring, sn.gw); err != nil {
			b.Fatal(err)
		}
	})
	if err := d.Settle(); err != nil {
		b.Fatal(err)
	}

	// What the kernel holds: a route per range block of the peers, all
	// on the VXLAN device, and an entry (neighbour and FDB) per peer.
	have, entries := sn.kernel(b)
	if want := d.WantedRoutes(); len(have) != len(want) {
		b.Fatalf("the kernel has %d tunnel routes, want %d", len(have), len(want))
	}
	if len(entries) != n {
		b.Fatalf("the kernel has %d vxlan entries, want %d (one per peer)", len(entries), n)
	}

	// The donation: a range of a peer, between two ranges of peers (so
	// that only that range's routes change), to its right neighbour.
	donated := ring
	for i := 1; i+1 < len(ring); i++ {
		if ring[i-1].Peer != "a" && ring[i].Peer != "a" && ring[i+1].Peer != "a" && ring[i].Peer != ring[i+1].Peer {
			donated = donate(ring, i)
			break
		}
	}
	i := 0
	for b.Loop() {
		var err error
		switch event {
		case "unchanged":
			err = d.SetPeers(peers)
		case "leave-rejoin":
			err = d.SetPeers(scalePeersFor(event, i, peers))
		case "donation":
			r := ring
			if i%2 == 0 {
				r = donated
			}
			err = d.SetRing(r, sn.gw)
		case "resync":
			err = d.SetRing(ring, sn.gw)
		}
		if err != nil {
			b.Fatal(err)
		}
		i++
	}
	b.ReportMetric(fillPeers.Seconds()*1e3, "first-SetPeers-ms")
	b.ReportMetric(fillRing.Seconds()*1e3, "first-SetRing-ms")
	b.ReportMetric(float64(len(have)), "routes")
	b.ReportMetric(float64(len(entries)), "vxlan-entries")
}

// TestKernelStateFollowsChanges: the routes and vxlan entries that
// SetRing and SetPeers apply as a diff against what the last apply left
// (not read back from the kernel) are exactly what the ring and the peers
// want, after every one of random changes: donations between peers, to
// this node and from it, peers that leave and come back. A route removed
// behind weft's back is repaired by the resync (the same ring again).
func TestKernelStateFollowsChanges(t *testing.T) {
	const n = 30
	var clock atomic.Int64 // seconds after t0
	t0 := time.Now()
	sn := newScaleNode(t, n, func() time.Time { return t0.Add(time.Duration(clock.Load()) * time.Second) })
	d := sn.d
	ring, _ := scaleRing("a", n, 3, 7)
	if err := d.SetPeers(sn.peers); err != nil {
		t.Fatal(err)
	}
	if err := d.SetRing(ring, sn.gw); err != nil {
		t.Fatal(err)
	}
	if err := d.Settle(); err != nil {
		t.Fatal(err)
	}
	check := func(step string) {
		t.Helper()
		routes, entries := sn.kernel(t)
		want := d.WantedRoutes()
		slices.SortFunc(want, compareRoutes)
		if !slices.Equal(routes, want) {
			add, del := DiffRoutes(want, routes)
			t.Fatalf("after %s: the kernel's routes differ from the wanted ones: missing or wrong %v, extra %v", step, add, del)
		}
		wantEntries, _ := vtepEntries(d.snap.Load().peers)
		slices.SortFunc(wantEntries, compareVTEPEntries)
		if !slices.Equal(entries, wantEntries) {
			t.Fatalf("after %s: the kernel's vxlan entries %v, want %v", step, entries, wantEntries)
		}
	}
	check("the first apply")
	rnd := rand.New(rand.NewPCG(7, 0))
	present := slices.Clone(sn.peers)
	gone := []Peer{}
	for step := range 60 {
		switch rnd.IntN(4) {
		case 0, 1: // a range changes owner: to a neighbour's owner, this node included
			i := rnd.IntN(len(ring))
			ring = donate(ring, i)
			if err := d.SetRing(ring, sn.gw); err != nil {
				t.Fatal(err)
			}
			check(fmt.Sprintf("step %d: range %d to %s", step, i, ring[i].Peer))
		case 2: // a peer leaves
			if len(present) < 2 {
				continue
			}
			i := rnd.IntN(len(present))
			gone = append(gone, present[i])
			present = slices.Delete(present, i, i+1)
			if err := d.SetPeers(present); err != nil {
				t.Fatal(err)
			}
			check(fmt.Sprintf("step %d: %s left", step, gone[len(gone)-1].Name))
		case 3: // one comes back
			if len(gone) == 0 {
				continue
			}
			present = append(present, gone[0])
			gone = gone[1:]
			if err := d.SetPeers(present); err != nil {
				t.Fatal(err)
			}
			check(fmt.Sprintf("step %d: %s came back", step, present[len(present)-1].Name))
		}
	}

	// A route removed by hand: the resync (the same ring) puts it back.
	want := d.WantedRoutes()
	var onVXLAN *Route
	for i := range want {
		if want[i].Dev == DefaultVXLANName {
			onVXLAN = &want[i]
			break
		}
	}
	if onVXLAN == nil {
		t.Fatal("no route on the VXLAN device to remove")
	}
	if _, _, err := sn.routes.ApplyDiff(nil, []Route{*onVXLAN}); err != nil {
		t.Fatal(err)
	}
	if err := d.SetRing(ring, sn.gw); err != nil {
		t.Fatal(err)
	}
	check("the resync after a route was removed by hand")

	// A ring that changes on every call is read back too, checkEvery
	// after the last time: a change applies its diff only, the next one
	// after checkEvery repairs.
	if _, _, err := sn.routes.ApplyDiff(nil, []Route{*onVXLAN}); err != nil {
		t.Fatal(err)
	}
	next := func() {
		t.Helper()
		for i := range len(ring) - 1 {
			if ring[i].Peer != ring[i+1].Peer && !routeIn(ring[i], *onVXLAN) {
				ring = donate(ring, i)
				break
			}
		}
		if err := d.SetRing(ring, sn.gw); err != nil {
			t.Fatal(err)
		}
	}
	next()
	if routes, _ := sn.kernel(t); slices.Contains(routes, *onVXLAN) {
		t.Fatalf("a ring change within checkEvery read the kernel back: %s is there again", onVXLAN)
	}
	clock.Add(int64(checkEvery / time.Second))
	next()
	check("a ring change checkEvery after the last check, with a route removed by hand")
}

// routeIn reports whether route r's destination lies in range o.
func routeIn(o OwnedRange, r Route) bool {
	return !r.Dst.Addr().Less(o.First) && !o.Last.Less(r.Dst.Addr())
}
