package tunnel

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/weft-net/weft/tunnel/internal/netnstest"
)

// Everything here runs in the namespaces of newPair (removed in
// t.Cleanup); the test's own namespace is never changed.

// vxlanDevice is one node's running vxlan Device, with a way to stop it
// (the router's exit) while the kernel objects stay.
type vxlanDevice struct {
	*Device
	stop func()
}

// startVXLAN opens a vxlan Device in node n's namespace and runs it.
func startVXLAN(t *testing.T, n *netnstest.Node, mtu int) *vxlanDevice {
	t.Helper()
	var d *Device
	err := n.NS.Do(func() error {
		var err error
		d, err = New(Config{Self: n.Name, Mode: ModeVXLAN, MTU: mtu, Underlay: n.Underlay, Queues: 1, Logger: testLogger(t, n.Name)})
		return err
	})
	if err != nil {
		t.Fatalf("New in %s: %v", n.NS.Name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run in %s: %v", n.Name, err)
		}
	}
	t.Cleanup(stop)
	return &vxlanDevice{Device: d, stop: stop}
}

// vxlanPeer is node n as the mesh would describe it to the others.
func vxlanPeer(t *testing.T, n *netnstest.Node, d *Device) Peer {
	t.Helper()
	v, ok := d.LocalVTEP()
	if !ok {
		t.Fatalf("%s has no VTEP", n.Name)
	}
	return Peer{Name: n.Name, Underlay: n.Underlay, DataPort: DefaultDataPort, Encaps: d.Encaps(), VTEP: &v}
}

func wireVXLAN(t *testing.T, p *netnstest.Pair, ds ...*vxlanDevice) {
	t.Helper()
	var peers []Peer
	for i, n := range p.Nodes {
		peers = append(peers, vxlanPeer(t, n, ds[i].Device))
	}
	for i, n := range p.Nodes {
		if err := ds[i].SetPeers(peers); err != nil {
			t.Fatalf("SetPeers on %s: %v", n.Name, err)
		}
		if err := ds[i].SetRing(pairRing(p), n.Gateway); err != nil {
			t.Fatalf("SetRing on %s: %v", n.Name, err)
		}
	}
}

func show(t *testing.T, ns *netnstest.NS, argv ...string) string {
	t.Helper()
	out, err := ns.Exec(context.Background(), argv...)
	if err != nil {
		t.Fatalf("%v in %s: %v\n%s", argv, ns.Name, err, out)
	}
	return string(out)
}

// vxlanState is what node n's kernel has on the VXLAN device: its routes,
// neighbours and FDB, as ip(8) and bridge(8) print them.
func vxlanState(t *testing.T, n *netnstest.Node) string {
	t.Helper()
	return show(t, n.NS, "ip", "route", "show", "dev", DefaultVXLANName) +
		show(t, n.NS, "ip", "neigh", "show", "dev", DefaultVXLANName) +
		show(t, n.NS, "bridge", "fdb", "show", "dev", DefaultVXLANName)
}

// wantVXLANState checks that node n sends to peer o through the VXLAN
// device: the route via o's underlay onlink, the permanent neighbour with
// o's VTEP MAC, the FDB entry to o's underlay.
func wantVXLANState(t *testing.T, n, o *netnstest.Node) {
	t.Helper()
	st := vxlanState(t, n)
	mac := net.HardwareAddr(func() []byte { m := VTEPMAC(o.Name); return m[:] }()).String()
	route := show(t, n.NS, "ip", "route", "show", o.Range.String())
	if !strings.Contains(route, "via "+o.Underlay.String()+" dev "+DefaultVXLANName) || !strings.Contains(route, "onlink") {
		t.Errorf("%s's route to %s is not via %s dev %s onlink: %s", n.Name, o.Range, o.Underlay, DefaultVXLANName, route)
	}
	for _, want := range []string{
		o.Underlay.String() + " lladdr " + mac + " PERMANENT",
		mac + " dst " + o.Underlay.String() + " self permanent",
	} {
		if !strings.Contains(st, want) {
			t.Errorf("%s's VXLAN device lacks %q:\n%s", n.Name, want, st)
		}
	}
}

// TestKernelVXLAN: two nodes with --encap vxlan reach each other's pods
// through the kernel's VXLAN device (no packet crosses the TUN device or
// the udp socket), with learning off, no group, the pod MTU, weft's VNI
// and port, and a route, neighbour and FDB entry per peer.
func TestKernelVXLAN(t *testing.T) {
	mtu := netnstest.UnderlayMTU - Overhead(ModeVXLAN)
	p := newPair(t, mtu)
	a, b := p.Nodes[0], p.Nodes[1]
	da, db := startVXLAN(t, a, mtu), startVXLAN(t, b, mtu)
	wireVXLAN(t, p, da, db)
	ds := []*Device{da.Device, db.Device}

	ping(t, a.Pod, b.PodAddr, ds)
	ping(t, b.Pod, a.PodAddr, ds)
	ping(t, a.NS, b.PodAddr, ds)
	// Full-size packets with DF fit the underlay: the overhead is 50.
	ping(t, a.Pod, b.PodAddr, ds, "-M", "do", "-s", strconv.Itoa(mtu-28))

	wantVXLANState(t, a, b)
	wantVXLANState(t, b, a)
	if got := da.ModeFor("b"); got != ModeVXLAN {
		t.Errorf("ModeFor(b) = %q, want vxlan", got)
	}
	if c := da.Connections(); len(c) != 1 || c[0].Mode != ModeVXLAN || !c[0].Kernel || c[0].Address != netip.AddrPortFrom(b.Underlay, DefaultVXLANPort) {
		t.Errorf("Connections = %+v, want b by kernel vxlan at %s:%d", c, b.Underlay, DefaultVXLANPort)
	}
	for _, d := range ds {
		if n := packets(d, dirOut, ModeUDP) + packets(d, dirIn, ModeUDP); n != 0 {
			t.Errorf("%s moved %v packets through the userspace tunnel, want 0 (the kernel carries vxlan)", d.cfg.Self, n)
		}
	}
	err := a.NS.Do(func() error {
		l, err := netlink.LinkByName(DefaultVXLANName)
		if err != nil {
			return err
		}
		v, ok := l.(*netlink.Vxlan)
		switch {
		case !ok:
			return fmt.Errorf("%s is a %s link", DefaultVXLANName, l.Type())
		case v.VxlanId != DefaultVNI || v.Port != DefaultVXLANPort || v.Learning || (v.Group != nil && !v.Group.IsUnspecified()) || v.MTU != mtu:
			return fmt.Errorf("%s: vni %d port %d learning %v group %v mtu %d; want vni %d port %d, no learning, no group, mtu %d",
				DefaultVXLANName, v.VxlanId, v.Port, v.Learning, v.Group, v.MTU, DefaultVNI, DefaultVXLANPort, mtu)
		case !v.SrcAddr.Equal(net.IP(a.Underlay.AsSlice())):
			return fmt.Errorf("%s has local %v, want %v", DefaultVXLANName, v.SrcAddr, a.Underlay)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestKernelVXLANOutlivesTheDevice: once both Devices are stopped (the
// routers exit), the pods still reach each other through what the kernel
// kept; a new Device adopts the VXLAN device, repairs what was changed by
// hand (its MTU, a lost neighbour), keeps the MAC its peers know, keeps
// the entries of peers it has not heard of until Settle, and then removes
// the entries of a peer that is gone.
func TestKernelVXLANOutlivesTheDevice(t *testing.T) {
	mtu := netnstest.UnderlayMTU - Overhead(ModeVXLAN)
	p := newPair(t, mtu)
	a, b := p.Nodes[0], p.Nodes[1]
	da, db := startVXLAN(t, a, mtu), startVXLAN(t, b, mtu)
	wireVXLAN(t, p, da, db)
	ping(t, a.Pod, b.PodAddr, []*Device{da.Device, db.Device})

	da.stop()
	db.stop()
	ping(t, a.Pod, b.PodAddr, nil)
	ping(t, b.Pod, a.PodAddr, nil)
	wantVXLANState(t, a, b)

	// Damage a's side by hand: the MTU, and b's neighbour.
	show(t, a.NS, "ip", "link", "set", DefaultVXLANName, "mtu", "1300")
	show(t, a.NS, "ip", "neigh", "del", b.Underlay.String(), "dev", DefaultVXLANName)

	// A new Device on a: adopted, repaired by the first SetPeers. Before
	// it hears of b (an empty peer list, as right after a start), b's
	// route stays on the VXLAN device.
	da2 := startVXLAN(t, a, mtu)
	if err := da2.SetPeers(nil); err != nil {
		t.Fatal(err)
	}
	if err := da2.SetRing(pairRing(p), a.Gateway); err != nil {
		t.Fatal(err)
	}
	if st := vxlanState(t, a); !strings.Contains(st, b.Range.String()+" via "+b.Underlay.String()) {
		t.Fatalf("before Settle, the new Device dropped b's route:\n%s", st)
	}
	if err := da2.SetPeers([]Peer{vxlanPeer(t, b, db.Device)}); err != nil {
		t.Fatal(err)
	}
	wantVXLANState(t, a, b)
	if out := show(t, a.NS, "ip", "-o", "link", "show", DefaultVXLANName); !strings.Contains(out, "mtu "+strconv.Itoa(mtu)) {
		t.Errorf("the MTU was not repaired: %s", out)
	}
	ping(t, a.Pod, b.PodAddr, nil)

	// Held: a peer list without b keeps b's entries.
	if err := da2.SetPeers(nil); err != nil {
		t.Fatal(err)
	}
	wantVXLANState(t, a, b)
	// Settled: b is gone, and so are its neighbour, FDB entry and route
	// on the VXLAN device.
	if err := da2.Settle(); err != nil {
		t.Fatal(err)
	}
	st := vxlanState(t, a)
	if strings.Contains(st, b.Underlay.String()) {
		t.Errorf("after Settle without b, a's VXLAN device still has b:\n%s", st)
	}
	if out := show(t, a.NS, "ip", "route", "show", b.Range.String()); !strings.Contains(out, "dev "+DefaultTUNName) {
		t.Errorf("b's range is not back on %s: %s", DefaultTUNName, out)
	}
}

// TestKernelVXLANReplacesIncompatible: a device named weft-vx of another
// VNI, another port, or another kind is replaced at start; a vxlan Device
// then carries traffic. A start in another mode removes a VXLAN device
// left by an earlier vxlan run (it would take plaintext from anyone), and
// RemoveKernelVXLAN (weft reset) removes it.
func TestKernelVXLANReplacesIncompatible(t *testing.T) {
	mtu := netnstest.UnderlayMTU - Overhead(ModeVXLAN)
	p := newPair(t, mtu)
	a, b := p.Nodes[0], p.Nodes[1]
	for _, argv := range [][]string{
		{"ip", "link", "add", DefaultVXLANName, "type", "vxlan", "id", "42", "dstport", strconv.Itoa(DefaultVXLANPort), "local", a.Underlay.String()},
		{"ip", "link", "add", DefaultVXLANName, "type", "vxlan", "id", strconv.Itoa(DefaultVNI), "dstport", "8472", "local", a.Underlay.String()},
		{"ip", "link", "add", DefaultVXLANName, "type", "vxlan", "id", strconv.Itoa(DefaultVNI), "dstport", strconv.Itoa(DefaultVXLANPort), "local", a.Underlay.String(), "learning"},
		{"ip", "link", "add", DefaultVXLANName, "type", "bridge"},
	} {
		show(t, a.NS, argv...)
		err := a.NS.Do(func() error {
			h, err := netlink.NewHandle()
			if err != nil {
				return err
			}
			defer h.Close()
			_, err = EnsureKernelVXLAN(h, VXLANLink{Name: DefaultVXLANName, VNI: DefaultVNI, Port: DefaultVXLANPort, Local: a.Underlay, MTU: mtu, MAC: VTEPMAC("a")})
			return err
		})
		if err != nil {
			t.Fatalf("after %v: %v", argv, err)
		}
		out := show(t, a.NS, "ip", "-d", "link", "show", DefaultVXLANName)
		if !strings.Contains(out, "vxlan id "+strconv.Itoa(DefaultVNI)) || !strings.Contains(out, "dstport "+strconv.Itoa(DefaultVXLANPort)) || !strings.Contains(out, "nolearning") {
			t.Fatalf("after %v, %s was not replaced:\n%s", argv, DefaultVXLANName, out)
		}
		show(t, a.NS, "ip", "link", "del", DefaultVXLANName)
	}

	da, db := startVXLAN(t, a, mtu), startVXLAN(t, b, mtu)
	wireVXLAN(t, p, da, db)
	ping(t, a.Pod, b.PodAddr, []*Device{da.Device, db.Device})
	da.stop()

	// a starts again with udp: the VXLAN device goes.
	err := a.NS.Do(func() error {
		d, err := New(Config{Self: "a", Mode: ModeUDP, MTU: mtu, Underlay: a.Underlay, Queues: 1, Logger: testLogger(t, "a")})
		if err != nil {
			return err
		}
		return d.Close()
	})
	if err != nil {
		t.Fatal(err)
	}
	if out, err := a.NS.Exec(context.Background(), "ip", "link", "show", DefaultVXLANName); err == nil {
		t.Errorf("a udp start kept %s:\n%s", DefaultVXLANName, out)
	}
	db.stop()
	if err := b.NS.Do(func() error { return RemoveKernelVXLAN(DefaultVXLANName) }); err != nil {
		t.Fatal(err)
	}
	if out, err := b.NS.Exec(context.Background(), "ip", "link", "show", DefaultVXLANName); err == nil {
		t.Errorf("RemoveKernelVXLAN kept %s:\n%s", DefaultVXLANName, out)
	}
	if err := b.NS.Do(func() error { return RemoveKernelVXLAN(DefaultVXLANName) }); err != nil {
		t.Errorf("RemoveKernelVXLAN of no device: %v", err)
	}
}

// TestKernelVXLANPathMTU: PMTU on the vxlan path. With pods whose MTU
// (1500) is above the VXLAN device's (1450, what a 1500 underlay leaves),
// a DF packet that does not fit gets an ICMP "fragmentation needed" with
// 1450 from the node's kernel (the route through weft-vx has its MTU),
// the pod learns the path MTU, and packets of that size then go through:
// TCP between pods never stalls on it.
func TestKernelVXLANPathMTU(t *testing.T) {
	mtu := netnstest.UnderlayMTU - Overhead(ModeVXLAN)
	p := newPair(t, netnstest.UnderlayMTU)
	a, b := p.Nodes[0], p.Nodes[1]
	da, db := startVXLAN(t, a, mtu), startVXLAN(t, b, mtu)
	wireVXLAN(t, p, da, db)
	ds := []*Device{da.Device, db.Device}
	ping(t, a.Pod, b.PodAddr, ds)
	out, _ := a.Pod.Exec(context.Background(), "ping", "-c", "2", "-i", "0.2", "-W", "1", "-M", "do", "-s", "1460", b.PodAddr.String())
	want := strconv.Itoa(mtu)
	if !strings.Contains(string(out), "mtu = "+want) && !strings.Contains(string(out), "mtu="+want) {
		t.Errorf("ping of 1488 bytes with DF over vxlan: no word of mtu %s:\n%s", want, out)
	}
	route := show(t, a.Pod, "ip", "route", "get", b.PodAddr.String())
	if !strings.Contains(route, "mtu "+want) {
		t.Errorf("the pod did not learn the path MTU %s:\n%s", want, route)
	}
	ping(t, a.Pod, b.PodAddr, ds, "-M", "do", "-s", strconv.Itoa(mtu-28))
}
