package bridge

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

var testGuard = Guard{GossipPort: 6783, DataPort: 6784, IPIPPeersOnly: true}

func (e *env) guarded() {
	e.cfg.Guard = testGuard
}

// TestGuardSetsSurviveEnsure: the guard's tables come with Ensure, their
// sets are reconciled exactly, a second Ensure changes nothing (the
// counters and elements stay), and a rebuild (another configuration)
// keeps the elements.
func TestGuardSetsSurviveEnsure(t *testing.T) {
	e := newEnv(t)
	if _, _, err := SetPeerAddrs(e.ns.Path(), nil); !errors.Is(err, ErrNoGuard) {
		t.Fatalf("SetPeerAddrs before Ensure: %v, want ErrNoGuard", err)
	}
	e.guarded()
	e.ensure(t)
	peers := []netip.Addr{netip.MustParseAddr("192.0.2.2"), netip.MustParseAddr("192.0.2.3")}
	if add, del, err := SetPeerAddrs(e.ns.Path(), peers); err != nil || add != 2 || del != 0 {
		t.Fatalf("SetPeerAddrs: +%d -%d %v", add, del, err)
	}
	if add, del, err := SetPeerAddrs(e.ns.Path(), peers[1:]); err != nil || add != 0 || del != 1 {
		t.Fatalf("SetPeerAddrs again: +%d -%d %v", add, del, err)
	}
	pods := []PodSource{{"weft0123456789a", netip.MustParseAddr("10.32.0.5")}, {"weftbbbbbbbbbbb", netip.MustParseAddr("10.32.0.6")}}
	stale := PodSource{"weftccccccccccc", netip.MustParseAddr("10.32.0.7")}
	if add, _, err := SetPodSources(e.ns.Path(), append(slices.Clone(pods), stale), nil); err != nil || len(add) != 3 {
		t.Fatalf("SetPodSources: %v %v", add, err)
	}
	// The stale one goes unless kept; a kept one stays.
	kept := PodSource{"weftddddddddddd", netip.MustParseAddr("10.32.0.8")}
	if _, _, err := SetPodSources(e.ns.Path(), []PodSource{kept}, nil); err != nil {
		t.Fatal(err)
	}
	add, del, err := SetPodSources(e.ns.Path(), pods, func(p PodSource) bool { return p.Addr == kept.Addr })
	if err != nil || len(add) != 2 || len(del) != 0 {
		t.Fatalf("SetPodSources with keep: +%v -%v %v", add, del, err)
	}
	check := func(when string) {
		t.Helper()
		if got := e.podSources(t); !slices.Equal(got, append(slices.Clone(pods), kept)) {
			t.Errorf("%s: pods set %v, want %v and %v", when, got, pods, kept)
		}
		if got := e.peerAddrs(t); !slices.Equal(got, peers[1:]) {
			t.Errorf("%s: peers set %v, want %v", when, got, peers[1:])
		}
	}
	check("after SetPodSources")
	if info := e.ensure(t); len(info.Changes) != 0 {
		t.Errorf("second Ensure changed %v", info.Changes)
	}
	check("after a second Ensure")
	e.cfg.Guard.IPIPPeersOnly = false
	if info := e.ensure(t); len(info.Changes) == 0 {
		t.Error("Ensure with another guard changed nothing")
	}
	check("after a rebuild")
	if c, err := DropCounts(e.ns.Path()); err != nil || len(c) != len(DropReasons) {
		t.Fatalf("DropCounts: %v %v", c, err)
	}
	// Without a guard the bridge table goes.
	e.cfg.Guard = Guard{}
	e.ensure(t)
	if _, _, err := SetPodSources(e.ns.Path(), pods, nil); !errors.Is(err, ErrNoGuard) {
		t.Errorf("SetPodSources without a guard: %v, want ErrNoGuard", err)
	}
	e.guarded()
	e.ensure(t)
	if err := Teardown(e.ns.Path(), e.name, e.log); err != nil {
		t.Fatal(err)
	}
	if _, _, err := SetPodSources(e.ns.Path(), pods, nil); !errors.Is(err, ErrNoGuard) {
		t.Errorf("SetPodSources after Teardown: %v, want ErrNoGuard", err)
	}
}

func (e *env) podSources(t testing.TB) []PodSource {
	t.Helper()
	n, err := openNS(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer n.close()
	c, err := n.nft()
	if err != nil {
		t.Fatal(err)
	}
	_, els, err := setElements(c, bridgeTable(), podsSet)
	if err != nil {
		t.Fatal(err)
	}
	var out []PodSource
	for _, el := range els {
		p, ok := podFromKey(el.Key)
		if !ok {
			t.Fatalf("element % x", el.Key)
		}
		out = append(out, p)
	}
	slices.SortFunc(out, comparePodSources)
	return out
}

func (e *env) peerAddrs(t testing.TB) []netip.Addr {
	t.Helper()
	n, err := openNS(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer n.close()
	c, err := n.nft()
	if err != nil {
		t.Fatal(err)
	}
	_, els, err := setElements(c, weftTable(), peersSet)
	if err != nil {
		t.Fatal(err)
	}
	var out []netip.Addr
	for _, el := range els {
		a, _ := netip.AddrFromSlice(el.Key)
		out = append(out, a)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

// pod is a pod namespace on the test bridge: eth0 with addr, the host end
// veth on the bridge.
type pod struct {
	ns   ns.NetNS
	veth string
	addr netip.Addr
}

func (e *env) addPod(t testing.TB, veth string, addr netip.Addr) *pod {
	t.Helper()
	p := &pod{veth: veth, addr: addr}
	n := newNS(t)
	p.ns = n
	host, peer := e.veth(t, veth, nil)
	br := e.link(t, e.name)
	if err := e.h.LinkSetMaster(host, br); err != nil {
		t.Fatal(err)
	}
	if err := e.h.LinkSetUp(host); err != nil {
		t.Fatal(err)
	}
	pl := e.link(t, peer)
	if err := e.h.LinkSetNsFd(pl, int(n.Fd())); err != nil {
		t.Fatal(err)
	}
	err := n.Do(func(ns.NetNS) error {
		l, err := netlink.LinkByName(peer)
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, toAddr(netip.PrefixFrom(addr, e.cfg.PodRange.Bits()))); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: e.cfg.Gateway.Addr().AsSlice()})
	})
	if err != nil {
		t.Fatalf("setting up pod %s: %v", addr, err)
	}
	return p
}

// listen opens a UDP socket in ns on port (0.0.0.0) and returns a channel
// of the sources of what it receives.
func listen(t testing.TB, n ns.NetNS, port int) <-chan string {
	t.Helper()
	var pc net.PacketConn
	err := n.Do(func(ns.NetNS) error {
		var err error
		pc, err = net.ListenPacket("udp4", fmt.Sprintf("0.0.0.0:%d", port))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	ch := make(chan string, 64)
	go func() {
		defer close(ch)
		buf := make([]byte, 2048)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			ch <- from.String() + " " + string(buf[:n])
		}
	}()
	return ch
}

// sendRaw sends one IPv4 packet of protocol proto with the given source
// (any: the attacker chooses it) from inside n, through a raw socket.
func sendRaw(n ns.NetNS, src, dst netip.Addr, proto byte, payload []byte) error {
	pkt := make([]byte, 20+len(payload))
	pkt[0], pkt[8], pkt[9] = 0x45, 64, proto
	binary.BigEndian.PutUint16(pkt[2:4], uint16(len(pkt)))
	s4, d4 := src.As4(), dst.As4()
	copy(pkt[12:16], s4[:])
	copy(pkt[16:20], d4[:])
	copy(pkt[20:], payload)
	return n.Do(func(ns.NetNS) error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: d4})
	})
}

// udpPayload is a UDP header (no checksum) to dport and data.
func udpPayload(sport, dport int, data string) []byte {
	b := make([]byte, 8+len(data))
	binary.BigEndian.PutUint16(b[0:2], uint16(sport))
	binary.BigEndian.PutUint16(b[2:4], uint16(dport))
	binary.BigEndian.PutUint16(b[4:6], uint16(len(b)))
	copy(b[8:], data)
	return b
}

// expect waits for a datagram on ch: it must be want (from its source).
func expect(t testing.TB, ch <-chan string, want string) {
	t.Helper()
	select {
	case got := <-ch:
		if got != want {
			t.Fatalf("received %q before %q: it should have been dropped", got, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("no %q within 10s", want)
	}
}

func (e *env) waitCount(t testing.TB, reason string, want uint64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := DropCounts(e.ns.Path())
		if err != nil {
			t.Fatal(err)
		}
		if c[reason] >= want {
			// Packets from one sender are counted in order: once the last
			// is, every earlier one that was dropped is too.
			if c[reason] != want {
				t.Fatalf("drops %s = %d, want %d (all: %v)", reason, c[reason], want, c)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("drops %s = %d, want %d (all: %v)", reason, c[reason], want, c)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestGuardDropsForgedPodTraffic is the attacker's side, on the real
// kernel: a pod sends packets with a forged source to another pod, and
// UDP and IPIP to the node's router ports. None arrive; each is counted;
// the same pod's genuine packets after them do arrive (so the forged ones,
// sent first on the same path, would have arrived before them).
func TestGuardDropsForgedPodTraffic(t *testing.T) {
	e := newEnv(t)
	e.guarded()
	e.cfg.Guard.VXLANPort = 4789 // the node runs --encap vxlan
	e.ensure(t)
	a := e.addPod(t, "weftaaaaaaaaaaa", netip.MustParseAddr("10.32.0.5"))
	b := e.addPod(t, "weftbbbbbbbbbbb", netip.MustParseAddr("10.32.0.6"))
	if _, _, err := SetPodSources(e.ns.Path(), []PodSource{{a.veth, a.addr}, {b.veth, b.addr}}, nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := SetPeerAddrs(e.ns.Path(), []netip.Addr{netip.MustParseAddr("192.0.2.2")}); err != nil {
		t.Fatal(err)
	}

	// Pod to pod, on the bridge: spoofed sources are dropped.
	atB := listen(t, b.ns, 9000)
	for i, src := range []string{"10.32.0.99", "10.32.0.6", "192.0.2.2", "10.32.0.1"} {
		if err := sendRaw(a.ns, netip.MustParseAddr(src), b.addr, unix.IPPROTO_UDP, udpPayload(1000, 9000, "forged")); err != nil {
			t.Fatal(err)
		}
		e.waitCount(t, DropSpoofedSource, uint64(i+1))
	}
	if err := sendRaw(a.ns, a.addr, b.addr, unix.IPPROTO_UDP, udpPayload(1000, 9000, "genuine")); err != nil {
		t.Fatal(err)
	}
	expect(t, atB, "10.32.0.5:1000 genuine")

	// Pod to the node's router ports, with its own source: dropped; to
	// another port: delivered.
	nodeNS, err := ns.GetNS(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer nodeNS.Close()
	gw := e.cfg.Gateway.Addr()
	atGossip, atData, atVXLAN, atOther := listen(t, nodeNS, 6783), listen(t, nodeNS, 6784), listen(t, nodeNS, 4789), listen(t, nodeNS, 9001)
	for i, port := range []int{6783, 6784, 4789} {
		if err := sendRaw(a.ns, a.addr, gw, unix.IPPROTO_UDP, udpPayload(1000, port, "to router")); err != nil {
			t.Fatal(err)
		}
		e.waitCount(t, DropPodToRouter, uint64(i+1))
	}
	if err := sendRaw(a.ns, a.addr, gw, unix.IPPROTO_IPIP, make([]byte, 40)); err != nil {
		t.Fatal(err)
	}
	e.waitCount(t, DropPodToRouter, 4)
	if err := sendRaw(a.ns, a.addr, gw, unix.IPPROTO_UDP, udpPayload(1000, 9001, "other port")); err != nil {
		t.Fatal(err)
	}
	expect(t, atOther, "10.32.0.5:1000 other port")
	select {
	case got := <-atGossip:
		t.Errorf("the gossip port received %q", got)
	case got := <-atData:
		t.Errorf("the data port received %q", got)
	case got := <-atVXLAN:
		t.Errorf("the VXLAN port received %q", got)
	default:
	}
	if c, _ := DropCounts(e.ns.Path()); c[DropVXLANNonPeer] != 0 {
		t.Errorf("counted %d as vxlan-non-peer: the pod's VXLAN is a pod-to-router drop", c[DropVXLANNonPeer])
	}
	if c, _ := DropCounts(e.ns.Path()); c[DropIPIPNonPeer] != 0 {
		t.Errorf("counted %d as ipip-non-peer: the pod's IPIP is a pod-to-router drop", c[DropIPIPNonPeer])
	}
}

// sendARP sends an ARP reply from inside the pod, on its interface, with
// the given sender address (gratuitous: to everyone, about spa).
func (p *pod) sendARP(t testing.TB, spa netip.Addr) {
	t.Helper()
	err := p.ns.Do(func(ns.NetNS) error {
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		var l netlink.Link
		for _, x := range links {
			if x.Type() == "veth" {
				l = x
			}
		}
		if l == nil {
			return errors.New("no veth in the pod")
		}
		mac := l.Attrs().HardwareAddr
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(htons(unix.ETH_P_ARP)))
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		f := make([]byte, 0, 42)
		f = append(f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff)
		f = append(f, mac...)
		f = binary.BigEndian.AppendUint16(f, etherARP)
		f = append(f, 0, 1, 0x08, 0, 6, 4, 0, 2) // Ethernet, IPv4, reply
		f = append(f, mac...)
		a := spa.As4()
		f = append(f, a[:]...)
		f = append(f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff)
		f = append(f, a[:]...)
		sa := &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ARP), Ifindex: l.Attrs().Index, Halen: 6}
		copy(sa.Addr[:], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
		return unix.Sendto(fd, f, 0, sa)
	})
	if err != nil {
		t.Fatalf("sending ARP from %s: %v", p.addr, err)
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// TestGuardDropsSpoofedARP: a pod cannot claim another pod's address (or
// the gateway's) in ARP; its own, and a probe from 0.0.0.0, pass.
func TestGuardDropsSpoofedARP(t *testing.T) {
	e := newEnv(t)
	e.guarded()
	e.ensure(t)
	a := e.addPod(t, "weftaaaaaaaaaaa", netip.MustParseAddr("10.32.0.5"))
	b := e.addPod(t, "weftbbbbbbbbbbb", netip.MustParseAddr("10.32.0.6"))
	if _, _, err := SetPodSources(e.ns.Path(), []PodSource{{a.veth, a.addr}, {b.veth, b.addr}}, nil); err != nil {
		t.Fatal(err)
	}
	// Genuine first: had they been dropped, they would be counted by the
	// time the spoofed ones are.
	a.sendARP(t, a.addr)
	a.sendARP(t, netip.IPv4Unspecified())
	a.sendARP(t, b.addr)
	a.sendARP(t, e.cfg.Gateway.Addr())
	e.waitCount(t, DropSpoofedARP, 2)
}

// TestGuardConnLasting: one GuardConn, as the router keeps for its life,
// adds and removes single pod sources without touching the others, and
// keeps working across what invalidates its socket or its cached set
// handle: a rebuild of the tables by Ensure (another configuration), a
// Teardown (ErrNoGuard, never an entry written to nowhere), and a new
// Ensure after it.
func TestGuardConnLasting(t *testing.T) {
	e := newEnv(t)
	g := NewGuardConn(e.ns.Path())
	t.Cleanup(func() { g.Close() })
	a := PodSource{"weftaaaaaaaaaaa", netip.MustParseAddr("10.32.0.5")}
	b := PodSource{"weftbbbbbbbbbbb", netip.MustParseAddr("10.32.0.6")}
	c := PodSource{"weftccccccccccc", netip.MustParseAddr("10.32.0.7")}
	if err := g.AddPodSources([]PodSource{a}); !errors.Is(err, ErrNoGuard) {
		t.Fatalf("AddPodSources before Ensure: %v, want ErrNoGuard", err)
	}
	if _, err := g.RemovePodSource(a); !errors.Is(err, ErrNoGuard) {
		t.Fatalf("RemovePodSource before Ensure: %v, want ErrNoGuard", err)
	}
	e.guarded()
	e.ensure(t)
	if err := g.AddPodSources([]PodSource{a, b}); err != nil {
		t.Fatal(err)
	}
	if err := g.AddPodSources([]PodSource{b, c}); err != nil { // b again: no error, no change
		t.Fatalf("AddPodSources with an element already there: %v", err)
	}
	if got := e.podSources(t); !slices.Equal(got, []PodSource{a, b, c}) {
		t.Fatalf("pods set %v, want %v %v %v", got, a, b, c)
	}
	if gone, err := g.RemovePodSource(b); err != nil || !gone {
		t.Fatalf("RemovePodSource(%v) = %v, %v; want true", b, gone, err)
	}
	if gone, err := g.RemovePodSource(b); err != nil || gone {
		t.Fatalf("RemovePodSource(%v) again = %v, %v; want false, nil", b, gone, err)
	}
	if got := e.podSources(t); !slices.Equal(got, []PodSource{a, c}) {
		t.Fatalf("pods set %v after removing %v, want %v %v", got, b, a, c)
	}
	if err := g.AddPodSources([]PodSource{{"weft-bad name!!", a.Addr}}); err == nil {
		t.Error("AddPodSources took an invalid veth name")
	}

	// A rebuild replaces the tables (their handles change); the
	// elements are carried over and the cached handle still works.
	e.cfg.Guard.IPIPPeersOnly = false
	if info := e.ensure(t); len(info.Changes) == 0 {
		t.Fatal("Ensure with another guard changed nothing")
	}
	if err := g.AddPodSources([]PodSource{b}); err != nil {
		t.Fatalf("AddPodSources after a rebuild: %v", err)
	}
	if got := e.podSources(t); !slices.Equal(got, []PodSource{a, b, c}) {
		t.Fatalf("pods set %v after a rebuild, want %v %v %v", got, a, b, c)
	}
	if add, del, err := g.SetPeerAddrs([]netip.Addr{netip.MustParseAddr("192.0.2.9")}); err != nil || add != 1 || del != 0 {
		t.Fatalf("SetPeerAddrs on the lasting connection: +%d -%d %v", add, del, err)
	}

	if err := Teardown(e.ns.Path(), e.name, e.log); err != nil {
		t.Fatal(err)
	}
	if err := g.AddPodSources([]PodSource{a}); !errors.Is(err, ErrNoGuard) {
		t.Fatalf("AddPodSources after Teardown: %v, want ErrNoGuard", err)
	}
	if _, err := g.RemovePodSource(a); !errors.Is(err, ErrNoGuard) {
		t.Fatalf("RemovePodSource after Teardown: %v, want ErrNoGuard", err)
	}
	e.ensure(t)
	if err := g.AddPodSources([]PodSource{c}); err != nil {
		t.Fatalf("AddPodSources after a new Ensure: %v", err)
	}
	if got := e.podSources(t); !slices.Equal(got, []PodSource{c}) {
		t.Fatalf("pods set %v after Teardown and Ensure, want only %v", got, c)
	}
	if counts, err := g.DropCounts(); err != nil || len(counts) != len(DropReasons) {
		t.Fatalf("DropCounts: %v %v", counts, err)
	}
	// Closed, it opens again on use.
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.AddPodSources([]PodSource{a}); err != nil {
		t.Fatalf("AddPodSources after Close: %v", err)
	}
}

// vxlanTestDev is the VXLAN device's name in the guard tests: a veth of
// that name in the node's namespace stands for it (what a VXLAN device
// decapsulates arrives on it as from a veth), its peer in a namespace of
// its own is whoever sends through the tunnel.
const vxlanTestDev = "weft-vx"

// tunnelSender makes the veth vxlanTestDev in the node's namespace and
// puts its peer into a namespace of its own, with a default route to the
// node: what is sent there to one of dsts arrives on vxlanTestDev.
func (e *env) tunnelSender(t testing.TB, dsts ...netip.Addr) ns.NetNS {
	t.Helper()
	n := newNS(t)
	dev, peer := e.veth(t, vxlanTestDev, nil)
	if err := e.h.LinkSetUp(dev); err != nil {
		t.Fatal(err)
	}
	if err := e.h.LinkSetNsFd(e.link(t, peer), int(n.Fd())); err != nil {
		t.Fatal(err)
	}
	mac := dev.Attrs().HardwareAddr
	err := n.Do(func(ns.NetNS) error {
		l, err := netlink.LinkByName(peer)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		for _, dst := range dsts {
			if err := netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.Attrs().Index, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
				IP: dst.AsSlice(), HardwareAddr: mac}); err != nil {
				return fmt.Errorf("neighbour %s: %w", dst, err)
			}
		}
		_, all, _ := net.ParseCIDR("0.0.0.0/0")
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: all, Scope: netlink.SCOPE_LINK}); err != nil {
			return fmt.Errorf("default route on %s: %w", peer, err)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("setting up the tunnel's sender: %v", err)
	}
	return n
}

// TestGuardDropsVXLANSpoofedSource is the attacker's side of the VXLAN
// device, on the real kernel: what arrives on it with a source outside
// the pod range, or in this node's own ranges (set own), is dropped and
// counted (vxlan-spoofed-source), to a pod (forward) and to the node
// (input); from another range of the pod range it arrives, and so does
// a local pod's own traffic, whose source is in the own set. Before the
// own set is filled, only the first check drops.
func TestGuardDropsVXLANSpoofedSource(t *testing.T) {
	e := newEnv(t)
	e.guarded()
	e.cfg.Guard.VXLANPort = 4789
	e.cfg.Guard.VXLANDevice = vxlanTestDev
	e.ensure(t)
	a := e.addPod(t, "weftaaaaaaaaaaa", netip.MustParseAddr("10.32.0.5"))
	b := e.addPod(t, "weftbbbbbbbbbbb", netip.MustParseAddr("10.32.0.6"))
	if _, _, err := SetPodSources(e.ns.Path(), []PodSource{{a.veth, a.addr}, {b.veth, b.addr}}, nil); err != nil {
		t.Fatal(err)
	}
	gw := e.cfg.Gateway.Addr()
	peer := e.tunnelSender(t, a.addr, gw)
	e.sysctl(t, "net/ipv4/conf/all/rp_filter", "0")
	e.sysctl(t, "net/ipv4/conf/"+vxlanTestDev+"/rp_filter", "0")
	atA := listen(t, a.ns, 9000)
	nodeNS, err := ns.GetNS(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer nodeNS.Close()
	atNode := listen(t, nodeNS, 9001)
	send := func(src string, dst netip.Addr, port int, what string) {
		t.Helper()
		if err := sendRaw(peer, netip.MustParseAddr(src), dst, unix.IPPROTO_UDP, udpPayload(1000, port, what)); err != nil {
			t.Fatal(err)
		}
	}

	// Before the ring's first sync: the own set is empty.
	send("10.32.0.40", a.addr, 9000, "before sync")
	expect(t, atA, "10.32.0.40:1000 before sync")
	send("192.0.2.7", a.addr, 9000, "outside") // outside the pod range
	e.waitCount(t, DropVXLANSpoofedSource, 1)

	own := []AddrRange{addrRange("10.32.0.0", "10.32.0.63"), addrRange("10.32.7.3", "10.32.9.200")}
	if changed, err := SetOwnRanges(e.ns.Path(), own); err != nil || !changed {
		t.Fatalf("SetOwnRanges: %v %v", changed, err)
	}
	n := uint64(1)
	for _, src := range []string{"192.0.2.7", "10.48.0.1", "10.32.0.40", "10.32.0.63", "10.32.7.3", "10.32.8.77", "10.32.9.200"} {
		send(src, a.addr, 9000, "forged")
		n++
		e.waitCount(t, DropVXLANSpoofedSource, n)
	}
	for _, src := range []string{"198.51.100.1", "10.32.0.9", "10.32.9.100"} {
		send(src, gw, 9001, "forged to the node")
		n++
		e.waitCount(t, DropVXLANSpoofedSource, n)
	}
	// Replacements of the own set, each one kernel batch: a flood from an
	// address in both contents never finds the set empty or half written.
	other := []AddrRange{addrRange("10.32.0.32", "10.32.0.47"), addrRange("10.33.0.0", "10.33.255.255")}
	stop := make(chan struct{})
	flooded := make(chan error, 1)
	go func() {
		defer close(flooded)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := sendRaw(peer, netip.MustParseAddr("10.32.0.40"), a.addr, unix.IPPROTO_UDP, udpPayload(1000, 9000, "flood")); err != nil {
				flooded <- err
				return
			}
		}
	}()
	for i := range 100 {
		want := other
		if i%2 == 1 {
			want = own
		}
		if changed, err := SetOwnRanges(e.ns.Path(), want); err != nil || !changed {
			close(stop)
			t.Fatalf("replacement %d of the own set: %v %v", i, changed, err)
		}
	}
	close(stop)
	if err := <-flooded; err != nil {
		t.Fatal(err)
	}
	c, err := DropCounts(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	n = c[DropVXLANSpoofedSource]
	t.Logf("%d packets dropped in all, through 100 replacements of the own set", n)

	// Another peer's pods, just outside the own ranges: they arrive.
	for _, src := range []string{"10.32.0.64", "10.32.7.2", "10.32.9.201", "10.47.255.254"} {
		send(src, a.addr, 9000, "genuine")
		expect(t, atA, src+":1000 genuine")
	}
	send("10.32.0.64", gw, 9001, "genuine to the node")
	expect(t, atNode, "10.32.0.64:1000 genuine to the node")
	// A local pod, whose address is in the own set, through its veth.
	if err := sendRaw(b.ns, b.addr, a.addr, unix.IPPROTO_UDP, udpPayload(1000, 9000, "local")); err != nil {
		t.Fatal(err)
	}
	expect(t, atA, "10.32.0.6:1000 local")
	if err := sendRaw(b.ns, b.addr, gw, unix.IPPROTO_UDP, udpPayload(1000, 9001, "local to the node")); err != nil {
		t.Fatal(err)
	}
	expect(t, atNode, "10.32.0.6:1000 local to the node")
	if c, _ := DropCounts(e.ns.Path()); c[DropVXLANSpoofedSource] != n {
		t.Errorf("vxlan-spoofed-source = %d after the genuine packets, want %d (all: %v)", c[DropVXLANSpoofedSource], n, c)
	}
}

// TestGuardOwnRanges: the own set takes ranges that are not aligned (one
// up to 255.255.255.255) and gives them back merged; the same ranges
// again change nothing; it replaces; the set survives a rewrite of the
// tables by Ensure, as the peers and pods sets do, and Ensure makes it
// where tables of an older weft lack it; before Ensure, and without a
// guard, it is ErrNoGuard.
func TestGuardOwnRanges(t *testing.T) {
	e := newEnv(t)
	g := NewGuardConn(e.ns.Path())
	t.Cleanup(func() { g.Close() })
	if _, err := g.SetOwnRanges(nil); !errors.Is(err, ErrNoGuard) {
		t.Fatalf("SetOwnRanges before Ensure: %v, want ErrNoGuard", err)
	}
	e.guarded()
	e.ensure(t)
	// The tables of a weft before the own set (no such set): Ensure
	// rewrites them with it.
	n, err := openNS(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	c, err := n.nft()
	if err != nil {
		t.Fatal(err)
	}
	c.DelSet(newOwnSet(weftTable()))
	if err := c.Flush(); err != nil {
		t.Fatalf("deleting the own set: %v", err)
	}
	n.close()
	if _, err := g.OwnRanges(); !errors.Is(err, ErrNoGuard) {
		t.Fatalf("OwnRanges without the set: %v, want ErrNoGuard", err)
	}
	if info := e.ensure(t); len(info.Changes) == 0 {
		t.Fatal("Ensure left the tables without the own set")
	}
	if got, err := g.OwnRanges(); err != nil || len(got) != 0 {
		t.Fatalf("own set after Ensure made it: %v %v, want empty", got, err)
	}
	e.cfg.Guard.VXLANPort = 4789
	e.cfg.Guard.VXLANDevice = vxlanTestDev
	e.ensure(t)
	if got, err := g.OwnRanges(); err != nil || len(got) != 0 {
		t.Fatalf("own set after Ensure: %v %v, want empty", got, err)
	}
	first := []AddrRange{addrRange("10.32.9.5", "10.32.9.5"), addrRange("10.32.0.0", "10.32.3.116"),
		addrRange("10.32.3.117", "10.32.7.255"), addrRange("10.40.17.3", "10.41.0.0"), addrRange("255.255.255.128", "255.255.255.255")}
	merged := []AddrRange{addrRange("10.32.0.0", "10.32.7.255"), addrRange("10.32.9.5", "10.32.9.5"),
		addrRange("10.40.17.3", "10.41.0.0"), addrRange("255.255.255.128", "255.255.255.255")}
	if changed, err := g.SetOwnRanges(first); err != nil || !changed {
		t.Fatalf("SetOwnRanges: %v %v", changed, err)
	}
	check := func(when string, want []AddrRange) {
		t.Helper()
		got, err := g.OwnRanges()
		if err != nil || !slices.Equal(got, want) {
			t.Fatalf("%s: own set %v %v, want %v", when, got, err, want)
		}
	}
	check("after SetOwnRanges", merged)
	if changed, err := g.SetOwnRanges(merged); err != nil || changed {
		t.Fatalf("SetOwnRanges with the same ranges: changed %v, %v", changed, err)
	}
	if _, err := g.SetOwnRanges([]AddrRange{addrRange("10.0.0.9", "10.0.0.1")}); err == nil {
		t.Fatal("SetOwnRanges took a range that ends before it starts")
	}
	check("after a refused SetOwnRanges", merged)

	second := []AddrRange{addrRange("10.32.8.0", "10.32.8.255"), addrRange("10.33.0.1", "10.33.1.2")}
	if changed, err := g.SetOwnRanges(second); err != nil || !changed {
		t.Fatalf("replacing the own set: %v %v", changed, err)
	}
	check("after a replacement", second)
	if changed, err := g.SetOwnRanges(first); err != nil || !changed {
		t.Fatalf("replacing the own set again: %v %v", changed, err)
	}
	check("after the replacements", merged)

	// A rewrite (another configuration) keeps the elements.
	e.cfg.Guard.IPIPPeersOnly = false
	if info := e.ensure(t); len(info.Changes) == 0 {
		t.Fatal("Ensure with another guard changed nothing")
	}
	check("after a rewrite", merged)
	if info := e.ensure(t); len(info.Changes) != 0 {
		t.Errorf("a second Ensure changed %v", info.Changes)
	}
	check("after a second Ensure", merged)
	if changed, err := g.SetOwnRanges(nil); err != nil || !changed {
		t.Fatalf("SetOwnRanges(nil): %v %v", changed, err)
	}
	check("emptied", nil)

	e.cfg.Guard = Guard{}
	e.ensure(t)
	if _, err := g.SetOwnRanges(merged); !errors.Is(err, ErrNoGuard) {
		t.Errorf("SetOwnRanges without a guard: %v, want ErrNoGuard", err)
	}
}

// TestGuardDropsVXLANNotToPods: what arrives on the VXLAN device to an
// address outside the pod range is dropped and counted
// (vxlan-not-to-pods), to the node (input) and through it (forward): the
// node is no relay for a peer, nor for whoever forges a peer's VXLAN. A
// local pod's packet to the same host outside is forwarded (the control).
// The router's checksum probes to the node are dropped uncounted.
func TestGuardDropsVXLANNotToPods(t *testing.T) {
	e := newEnv(t)
	e.guarded()
	e.cfg.Guard.VXLANPort = 4789
	e.cfg.Guard.VXLANDevice = vxlanTestDev
	e.cfg.Guard.VXLANProbePort = 6785
	e.ensure(t)
	a := e.addPod(t, "weftaaaaaaaaaaa", netip.MustParseAddr("10.32.0.5"))
	if _, _, err := SetPodSources(e.ns.Path(), []PodSource{{a.veth, a.addr}}, nil); err != nil {
		t.Fatal(err)
	}
	// A host outside, behind the node: 198.51.100.5 on a veth of its own.
	outside := newNS(t)
	out, outPeer := e.veth(t, uniqueName(t, "wo-"), nil)
	e.addAddr(t, out, "198.51.100.1/24")
	if err := e.h.LinkSetUp(out); err != nil {
		t.Fatal(err)
	}
	if err := e.h.LinkSetNsFd(e.link(t, outPeer), int(outside.Fd())); err != nil {
		t.Fatal(err)
	}
	host := netip.MustParseAddr("198.51.100.5")
	err := outside.Do(func(ns.NetNS) error {
		l, err := netlink.LinkByName(outPeer)
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, toAddr(netip.MustParsePrefix("198.51.100.5/24"))); err != nil {
			return err
		}
		return netlink.LinkSetUp(l)
	})
	if err != nil {
		t.Fatal(err)
	}
	// An address of the node outside the pod range: 203.0.113.1.
	nodeAddr := netip.MustParseAddr("203.0.113.1")
	peer := e.tunnelSender(t, host, nodeAddr, a.addr)
	e.addAddr(t, e.link(t, vxlanTestDev), "203.0.113.1/32")
	e.sysctl(t, "net/ipv4/conf/all/rp_filter", "0")
	e.sysctl(t, "net/ipv4/conf/"+vxlanTestDev+"/rp_filter", "0")
	atHost := listen(t, outside, 9002)
	nodeNS, err := ns.GetNS(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer nodeNS.Close()
	atNode := listen(t, nodeNS, 9003)

	for i, dst := range []netip.Addr{host, nodeAddr} {
		// From another peer's pod: a source the other checks take.
		if err := sendRaw(peer, netip.MustParseAddr("10.32.0.64"), dst, unix.IPPROTO_UDP, udpPayload(1000, 9002+i, "relayed")); err != nil {
			t.Fatal(err)
		}
		e.waitCount(t, DropVXLANNotToPods, uint64(i+1))
	}
	// The router's checksum probes (and their answers) to the node: dropped
	// uncounted and unanswered (the router reads them off the device).
	// One sender's packets are handled in order: once a marker to the
	// pod after them arrived, they were handled.
	const probePort = 6785
	atProbe, atA := listen(t, nodeNS, probePort), listen(t, a.ns, 9004)
	for range 3 {
		if err := sendRaw(peer, netip.MustParseAddr("10.32.0.64"), nodeAddr, unix.IPPROTO_UDP, udpPayload(probePort, probePort, "probe")); err != nil {
			t.Fatal(err)
		}
	}
	if err := sendRaw(peer, netip.MustParseAddr("10.32.0.64"), nodeAddr, unix.IPPROTO_UDP, udpPayload(1000, probePort, "not a probe")); err != nil {
		t.Fatal(err)
	}
	if err := sendRaw(peer, netip.MustParseAddr("10.32.0.64"), a.addr, unix.IPPROTO_UDP, udpPayload(1000, 9004, "marker")); err != nil {
		t.Fatal(err)
	}
	expect(t, atA, "10.32.0.64:1000 marker")
	if c, _ := DropCounts(e.ns.Path()); c[DropVXLANNotToPods] != 3 {
		t.Errorf("vxlan-not-to-pods %d after the probes and one datagram that is none, want 3 (the probes uncounted)", c[DropVXLANNotToPods])
	}
	select {
	case got := <-atProbe:
		t.Errorf("the node's probe port received %q", got)
	default:
	}
	if err := sendRaw(a.ns, a.addr, host, unix.IPPROTO_UDP, udpPayload(1000, 9002, "control")); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-atHost:
		if !strings.HasSuffix(got, " control") {
			t.Fatalf("the host outside received %q before the control: it should have been dropped", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the local pod's control did not reach the host outside")
	}
	select {
	case got := <-atNode:
		t.Errorf("the node's %s received %q", nodeAddr, got)
	default:
	}
	if c, _ := DropCounts(e.ns.Path()); c[DropVXLANSpoofedSource] != 0 {
		t.Errorf("counted %d as vxlan-spoofed-source: %v", c[DropVXLANSpoofedSource], c)
	}
}

// underlayPeer makes a namespace joined to the node's by a veth: the
// node's end, dev, has node/24, the peer's end peer/24, and the peer
// routes the pod range through the node.
func (e *env) underlayPeer(t testing.TB, dev string, node, peer netip.Prefix) ns.NetNS {
	t.Helper()
	n := newNS(t)
	l, pname := e.veth(t, dev, nil)
	e.addAddr(t, l, node.String())
	if err := e.h.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
	if err := e.h.LinkSetNsFd(e.link(t, pname), int(n.Fd())); err != nil {
		t.Fatal(err)
	}
	err := n.Do(func(ns.NetNS) error {
		l, err := netlink.LinkByName(pname)
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, toAddr(peer)); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: prefixNet(e.cfg.PodRange), Gw: node.Addr().AsSlice()})
	})
	if err != nil {
		t.Fatalf("setting up the underlay peer: %v", err)
	}
	return n
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// sendUDP sends data from a UDP socket in n to dst.
func sendUDP(t testing.TB, n ns.NetNS, dst netip.AddrPort, data string) {
	t.Helper()
	err := n.Do(func(ns.NetNS) error {
		c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(dst))
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write([]byte(data))
		return err
	})
	if err != nil {
		t.Fatalf("send to %s: %v", dst, err)
	}
}

// tracked lists the UDP flows in the conntrack table of the node's
// namespace, as "src -> dst:dport" of their original direction.
func (e *env) tracked(t testing.TB) []string {
	t.Helper()
	flows, err := e.h.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatalf("conntrack table: %v", err)
	}
	var out []string
	for _, f := range flows {
		if f.Forward.Protocol == unix.IPPROTO_UDP {
			out = append(out, fmt.Sprintf("%s -> %s:%d", f.Forward.SrcIP, f.Forward.DstIP, f.Forward.DstPort))
		}
	}
	slices.Sort(out)
	return out
}

// TestGuardVXLANUntracked, on the real kernel: VXLAN (udp to the VXLAN
// port) between the node and an address of the peers set is not tracked
// by conntrack, in either direction, while other UDP between the same
// addresses is; VXLAN that the node forwards (to a pod here: not to one
// of its own addresses) is tracked, and so is VXLAN to an address that
// has left the peers set.
func TestGuardVXLANUntracked(t *testing.T) {
	e := newEnv(t)
	e.guarded()
	e.cfg.Guard.VXLANPort = 4789
	e.ensure(t)
	nodeAddr, peerAddr := netip.MustParsePrefix("192.0.2.1/24"), netip.MustParsePrefix("192.0.2.2/24")
	node, peer := nodeAddr.Addr(), peerAddr.Addr()
	p := e.underlayPeer(t, uniqueName(t, "wu-"), nodeAddr, peerAddr)
	a := e.addPod(t, "weftaaaaaaaaaaa", netip.MustParseAddr("10.32.0.5"))
	if _, _, err := SetPodSources(e.ns.Path(), []PodSource{{a.veth, a.addr}}, nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := SetPeerAddrs(e.ns.Path(), []netip.Addr{peer}); err != nil {
		t.Fatal(err)
	}
	nodeNS, err := ns.GetNS(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer nodeNS.Close()
	atNode, atNode2 := listen(t, nodeNS, 4789), listen(t, nodeNS, 4790)
	atPeer, atPeer2 := listen(t, p, 4789), listen(t, p, 4790)
	atPod := listen(t, a.ns, 4789)
	got := func(ch <-chan string, what string) {
		t.Helper()
		select {
		case s := <-ch:
			if !strings.HasSuffix(s, " "+what) {
				t.Fatalf("received %q, want %q", s, what)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no %q within 10s", what)
		}
	}

	sendUDP(t, p, netip.AddrPortFrom(node, 4789), "vxlan in")
	got(atNode, "vxlan in")
	sendUDP(t, p, netip.AddrPortFrom(node, 4790), "other in")
	got(atNode2, "other in")
	sendUDP(t, nodeNS, netip.AddrPortFrom(peer, 4789), "vxlan out")
	got(atPeer, "vxlan out")
	sendUDP(t, nodeNS, netip.AddrPortFrom(peer, 4790), "other out")
	got(atPeer2, "other out")
	sendUDP(t, p, netip.AddrPortFrom(a.addr, 4789), "vxlan forwarded")
	got(atPod, "vxlan forwarded")
	want := []string{
		fmt.Sprintf("%s -> %s:4789", peer, a.addr), // forwarded, not to this node
		fmt.Sprintf("%s -> %s:4790", node, peer),
		fmt.Sprintf("%s -> %s:4790", peer, node),
	}
	slices.Sort(want)
	if have := e.tracked(t); !slices.Equal(have, want) {
		t.Errorf("tracked UDP flows:\n  %s\nwant:\n  %s", strings.Join(have, "\n  "), strings.Join(want, "\n  "))
	}

	// The peer leaves the set: what the node sends to it is tracked again
	// (and what it sends is dropped as from no peer).
	if _, _, err := SetPeerAddrs(e.ns.Path(), nil); err != nil {
		t.Fatal(err)
	}
	sendUDP(t, nodeNS, netip.AddrPortFrom(peer, 4789), "vxlan out, no peer")
	got(atPeer, "vxlan out, no peer")
	if have, w := e.tracked(t), fmt.Sprintf("%s -> %s:4789", node, peer); !slices.Contains(have, w) {
		t.Errorf("tracked UDP flows after the peer left the set:\n  %s\nwant among them %s", strings.Join(have, "\n  "), w)
	}
}
