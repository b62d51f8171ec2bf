package tunnel

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/weft-net/weft/tunnel/internal/netnstest"
	"github.com/weft-net/weft/tunnel/tun"
)

// Everything here runs in namespaces the test makes (netnstest, names
// with a per-run prefix) and removes in t.Cleanup: the test's own
// namespace is never changed.

func skipUnlessRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root to make network namespaces, TUN devices and raw sockets")
	}
}

func newPair(t testing.TB, podMTU int) *netnstest.Pair {
	t.Helper()
	skipUnlessRoot(t)
	prefix := netnstest.Prefix(t)
	p, err := netnstest.NewPair(prefix, podMTU)
	if err != nil {
		t.Fatalf("building the namespaces: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("removing the namespaces: %v", err)
		}
		if left := netnstest.Leftovers(prefix); len(left) > 0 {
			t.Errorf("namespaces left behind: %v", left)
		}
	})
	return p
}

// pairRing is the ring of a pair: a and b own their ranges.
func pairRing(p *netnstest.Pair) []OwnedRange {
	var out []OwnedRange
	for _, n := range p.Nodes {
		out = append(out, OwnedRange{First: n.Range.Addr(), Last: lastOf(n.Range), Peer: n.Name})
	}
	return out
}

func lastOf(p netip.Prefix) netip.Addr {
	return addrOf(u32(p.Addr()) | (1<<(32-p.Bits()) - 1))
}

// startDevices opens a real Device (TUN via water, UDP and raw sockets)
// in each node namespace, runs it, and gives it the pair's peers and
// ring.
func startDevices(t *testing.T, p *netnstest.Pair, mode Mode, mtu, underlayMTU int) [2]*Device {
	t.Helper()
	return startDevicesWith(t, p, Config{Mode: mode, MTU: mtu, UnderlayMTU: underlayMTU})
}

func startDevicesWith(t *testing.T, p *netnstest.Pair, cfg Config) [2]*Device {
	t.Helper()
	var ds [2]*Device
	for i, n := range p.Nodes {
		c := cfg
		c.Self, c.Underlay, c.Queues, c.Logger = n.Name, n.Underlay, 2, testLogger(t, n.Name)
		err := n.NS.Do(func() error {
			d, err := New(c)
			ds[i] = d
			return err
		})
		if err != nil {
			t.Fatalf("New in %s: %v", n.NS.Name, err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- ds[i].Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run in %s: %v", n.Name, err)
			}
		})
	}
	var peers []Peer
	for i, n := range p.Nodes {
		peers = append(peers, Peer{Name: n.Name, Underlay: n.Underlay, DataPort: DefaultDataPort, Encaps: ds[i].Encaps(), PublicKey: ds[i].PublicKey()})
	}
	for i, n := range p.Nodes {
		if err := ds[i].SetPeers(peers); err != nil {
			t.Fatal(err)
		}
		if err := ds[i].SetRing(pairRing(p), n.Gateway); err != nil {
			t.Fatalf("SetRing on %s: %v", n.Name, err)
		}
	}
	return ds
}

func ping(t *testing.T, from *netnstest.NS, to netip.Addr, ds []*Device, args ...string) string {
	t.Helper()
	argv := append([]string{"ping", "-c", "3", "-i", "0.2", "-W", "2"}, args...)
	out, err := from.Exec(context.Background(), append(argv, to.String())...)
	if err != nil {
		for _, d := range ds {
			t.Logf("%s: %s", d.cfg.Self, counters(d))
		}
		t.Fatalf("ping %s from %s: %v", to, from.Name, err)
	}
	return string(out)
}

// counters lists a device's non-zero counters, to explain a failure.
func counters(d *Device) string {
	var s []string
	for dir := range numDirs {
		for i, m := range wireModes {
			if n := value(d.metrics.pkt[dir][i]); n > 0 {
				s = append(s, fmt.Sprintf("%s/%s=%v", dirNames[dir], m, n))
			}
		}
	}
	for r := range numDropReasons {
		if n := value(d.metrics.drop[r]); n > 0 {
			s = append(s, fmt.Sprintf("dropped/%s=%v", dropReasonNames[r], n))
		}
	}
	return strings.Join(s, " ")
}

// TestKernelPing: pods on two nodes ping each other through real TUN
// devices, over UDP and over userspace IPIP (this kernel has no ipip link
// type; where it has one, ipip goes through the kernel device instead),
// and a node pings the other node's pod with the bridge address as the
// source that the routes set.
func TestKernelPing(t *testing.T) {
	for _, mode := range []Mode{ModeUDP, ModeIPIP, ModeAuto} {
		t.Run(string(mode), func(t *testing.T) {
			p := newPair(t, 1500-Overhead(mode))
			mtu := 1500 - Overhead(mode)
			ds := startDevices(t, p, mode, mtu, 0)
			a, b := p.Nodes[0], p.Nodes[1]
			ping(t, a.Pod, b.PodAddr, ds[:])
			ping(t, b.Pod, a.PodAddr, ds[:])
			ping(t, a.NS, b.PodAddr, ds[:])
			// Big packets with DF, up to the pod MTU, go through.
			ping(t, a.Pod, b.PodAddr, ds[:], "-M", "do", "-s", strconv.Itoa(mtu-28))

			out, err := a.NS.Exec(context.Background(), "ip", "route", "show", "dev", DefaultTUNName)
			if err != nil {
				t.Fatal(err)
			}
			if want := b.Range.String() + " proto static scope link src " + a.Gateway.String(); !strings.Contains(string(out), want) {
				t.Errorf("routes on %s in a:\n%s\nwant %q", DefaultTUNName, out, want)
			}
			// The TUN device holds the bridge address as a /32 (what a
			// masquerade of the node's own traffic picks); removed by
			// hand, the ring's next apply gives it back.
			tunAddr := func() string {
				out, err := a.NS.Exec(context.Background(), "ip", "-4", "-o", "addr", "show", "dev", DefaultTUNName)
				if err != nil {
					t.Fatal(err)
				}
				return string(out)
			}
			if want := " " + a.Gateway.String() + "/32 "; !strings.Contains(tunAddr(), want) {
				t.Errorf("%s in a has %q, want %q", DefaultTUNName, tunAddr(), want)
			}
			if _, err := a.NS.Exec(context.Background(), "ip", "addr", "flush", "dev", DefaultTUNName); err != nil {
				t.Fatal(err)
			}
			if err := ds[0].SetRing(pairRing(p), a.Gateway); err != nil {
				t.Fatal(err)
			}
			if want := " " + a.Gateway.String() + "/32 "; !strings.Contains(tunAddr(), want) {
				t.Errorf("after the address was removed and the ring applied again, %s in a has %q, want %q", DefaultTUNName, tunAddr(), want)
			}
			wire := ModeUDP
			if mode == ModeIPIP {
				wire = ModeIPIP
			}
			if got := ds[0].ModeFor("b"); got != wire {
				t.Errorf("ModeFor(b) = %q, want %q", got, wire)
			}
			if ds[0].KernelIPIP() {
				t.Log("this kernel has the ipip link type: ipip went through it")
				return
			}
			if n := packets(ds[0], dirOut, wire); n < 9 {
				t.Errorf("a sent %v packets with %s, want at least 9", n, wire)
			}
			if n := packets(ds[1], dirIn, wire); n < 9 {
				t.Errorf("b received %v packets with %s, want at least 9", n, wire)
			}
		})
	}
}

// TestKernelPathMTU: with a TUN MTU (1500) above what the mode leaves on
// a 1500 underlay (udp 1440, userspace ipip 1480), a DF packet that does
// not fit gets an ICMP "fragmentation needed" with that MTU from the
// tunnel, the pod's kernel learns the path MTU, and packets of that size
// then go through. (vxlan: TestKernelVXLANPathMTU.)
func TestKernelPathMTU(t *testing.T) {
	for _, mode := range []Mode{ModeUDP, ModeIPIP} {
		t.Run(string(mode), func(t *testing.T) {
			p := newPair(t, 1500)
			ds := startDevices(t, p, mode, 1500, 1500)
			a, b := p.Nodes[0], p.Nodes[1]
			mtu := strconv.Itoa(1500 - overheads[mode])
			out, _ := a.Pod.Exec(context.Background(), "ping", "-c", "2", "-i", "0.2", "-W", "1", "-M", "do", "-s", "1460", b.PodAddr.String())
			if !strings.Contains(string(out), "mtu = "+mtu) && !strings.Contains(string(out), "mtu="+mtu) {
				t.Errorf("ping of 1488 bytes with DF: no word of mtu %s:\n%s", mtu, out)
			}
			route, err := a.Pod.Exec(context.Background(), "ip", "route", "get", b.PodAddr.String())
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(route), "mtu "+mtu) {
				t.Errorf("the pod did not learn the path MTU %s:\n%s", mtu, route)
			}
			ping(t, a.Pod, b.PodAddr, ds[:], "-M", "do", "-s", strconv.Itoa(1500-overheads[mode]-28))
			if n := value(ds[0].metrics.icmp); n < 1 {
				t.Errorf("%v ICMP sent", n)
			}
		})
	}
}

// TestKernelRouteApplier: routes on the tunnel devices converge to the
// wanted ones: added, replaced, stale ones removed, routes on other
// devices untouched. A veth stands in for the kernel IPIP device to check
// the "via <owner> onlink" form.
func TestKernelRouteApplier(t *testing.T) {
	skipUnlessRoot(t)
	prefix := netnstest.Prefix(t)
	n, err := netnstest.Add(prefix + "-r")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Del(); err != nil {
			t.Error(err)
		}
	})
	var dev tun.Device
	if err := n.Do(func() error {
		var err error
		dev, err = tun.Open("weft-tun", 1440, 1)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	h, err := n.Handle()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range [][]string{
		{"ip", "link", "add", "ipipish", "type", "veth", "peer", "name", "other"},
		{"ip", "link", "set", "ipipish", "up"},
		{"ip", "link", "set", "other", "up"},
		{"ip", "addr", "add", "10.32.0.1/32", "dev", "lo"},
		{"ip", "addr", "add", "192.0.2.1/24", "dev", "other"},
		{"ip", "route", "add", "10.99.0.0/16", "dev", "weft-tun"},                // stale, from an earlier run
		{"ip", "route", "add", "10.98.0.0/16", "dev", "other"},                   // not ours
		{"ip", "route", "add", "10.40.0.0/14", "dev", "weft-tun", "metric", "5"}, // stale, odd metric
	} {
		if _, err := n.Exec(context.Background(), c...); err != nil {
			t.Fatal(err)
		}
	}
	a := NewRouteApplier(h, "weft-tun", "ipipish", "absent-dev")
	defer a.Close()
	src := mustAddr("10.32.0.1")
	want := []Route{
		{Dst: pfx("10.36.0.0/14"), Dev: "weft-tun", Src: src},
		{Dst: pfx("10.44.0.0/14"), Dev: "ipipish", Via: mustAddr("192.0.2.3"), Src: src},
	}
	check := func(step string, want []Route) {
		t.Helper()
		have, err := a.Routes()
		if err != nil {
			t.Fatal(err)
		}
		slices.SortFunc(have, compareRoutes)
		if !slices.Equal(have, want) {
			t.Errorf("%s: routes %v, want %v", step, have, want)
		}
	}
	added, removed, err := a.Apply(want)
	if err != nil {
		t.Fatalf("first Apply: %v", err)
	}
	if len(added) != 2 || len(removed) != 2 {
		t.Errorf("first Apply added %v, removed %v", added, removed)
	}
	check("first apply", want)
	if added, removed, err := a.Apply(want); err != nil || len(added)+len(removed) != 0 {
		t.Errorf("second Apply changed %v %v (%v)", added, removed, err)
	}
	// The owner of 10.44.0.0/14 moves, 10.36.0.0/14 is split by a
	// donation.
	want2 := []Route{
		{Dst: pfx("10.36.0.0/15"), Dev: "weft-tun", Src: src},
		{Dst: pfx("10.44.0.0/14"), Dev: "ipipish", Via: mustAddr("192.0.2.4"), Src: src},
	}
	if _, _, err := a.Apply(want2); err != nil {
		t.Fatal(err)
	}
	check("after a move", want2)
	if _, _, err := a.Apply(nil); err != nil {
		t.Fatal(err)
	}
	check("all withdrawn", nil)
	out, _ := n.Exec(context.Background(), "ip", "route", "show", "10.98.0.0/16")
	if !strings.Contains(string(out), "dev other") {
		t.Errorf("a route on another device was touched: %q", out)
	}
	if _, _, err := a.Apply([]Route{{Dst: pfx("10.50.0.0/16"), Dev: "absent-dev"}}); err == nil {
		t.Error("a route on a missing device applied")
	}
	if _, _, err := a.Apply([]Route{{Dst: pfx("10.50.0.0/16"), Dev: "weft-tun"}, {Dst: pfx("10.50.0.0/16"), Dev: "ipipish"}}); err == nil {
		t.Error("two targets for one destination applied")
	}
}

// TestKernelIPIPDetection: where the kernel has no ipip link type (this
// machine), EnsureKernelIPIP says so and New falls back to userspace
// IPIP; where it has one, the device is made with the underlay address
// as its local end, and made again compatible when adopted.
func TestKernelIPIPDetection(t *testing.T) {
	skipUnlessRoot(t)
	n, err := netnstest.Add(netnstest.Prefix(t) + "-k")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Del() })
	h, err := n.Handle()
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	err = EnsureKernelIPIP(h, "weft-ipip", mustAddr("192.0.2.1"), 1480)
	if errors.Is(err, ErrNoKernelIPIP) {
		t.Logf("no kernel IPIP here: %v", err)
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	l, err := h.LinkByName("weft-ipip")
	if err != nil {
		t.Fatal(err)
	}
	ip, ok := l.(*netlink.Iptun)
	if !ok || !ip.Local.Equal(net.ParseIP("192.0.2.1")) || l.Attrs().MTU != 1480 || l.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("weft-ipip: %+v", l)
	}
	if err := EnsureKernelIPIP(h, "weft-ipip", mustAddr("192.0.2.9"), 1480); err != nil {
		t.Fatalf("re-ensure with another address: %v", err)
	}
	l, _ = h.LinkByName("weft-ipip")
	if ip, ok := l.(*netlink.Iptun); !ok || !ip.Local.Equal(net.ParseIP("192.0.2.9")) {
		t.Errorf("weft-ipip not replaced: %+v", l)
	}
}

// TestKernelTCPTransfer: 32 MB over TCP from one pod to the other arrive
// intact, with the offloads (TSO super-packets cut on one side, segments
// joined on the other, UDP GSO/GRO) and without them, and encrypted
// (every datagram of a GSO send sealed on its own).
func TestKernelTCPTransfer(t *testing.T) {
	for _, tc := range []struct {
		name      string
		mode      Mode
		noOffload bool
		psk       []byte
	}{
		{"udp", ModeUDP, false, nil}, {"udp-no-offload", ModeUDP, true, nil}, {"ipip", ModeIPIP, false, nil},
		{"udp-encrypted", ModeUDP, false, pskOne}, {"udp-encrypted-no-offload", ModeUDP, true, pskOne},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mtu := 1500 - Overhead(tc.mode)
			p := newPair(t, mtu)
			ds := startDevicesWith(t, p, Config{Mode: tc.mode, MTU: mtu, NoOffload: tc.noOffload, PSK: tc.psk})
			if c := ds[0].Connections(); len(c) != 1 || c[0].Encrypted != (tc.psk != nil) {
				t.Errorf("connections %+v", c)
			}
			if got := ds[0].offloads(); (got == "none") != tc.noOffload {
				t.Errorf("offloads %q", got)
			}
			a, b := p.Nodes[0], p.Nodes[1]
			var ln net.Listener
			if err := b.Pod.Do(func() error {
				var err error
				ln, err = net.Listen("tcp4", netip.AddrPortFrom(b.PodAddr, 5001).String())
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			const size = 32 << 20
			data := make([]byte, size)
			rng := rand.New(rand.NewPCG(1, 2))
			for i := 0; i < len(data); i += 8 {
				binary.LittleEndian.PutUint64(data[i:], rng.Uint64())
			}
			want := sha256.Sum256(data)
			got := make(chan [32]byte, 1)
			go func() {
				c, err := ln.Accept()
				if err != nil {
					close(got)
					return
				}
				defer c.Close()
				h := sha256.New()
				n, _ := io.Copy(h, c)
				var sum [32]byte
				copy(sum[:], h.Sum(nil))
				if n != size {
					sum = [32]byte{}
				}
				got <- sum
			}()
			var c net.Conn
			if err := a.Pod.Do(func() error {
				var err error
				c, err = net.DialTimeout("tcp4", netip.AddrPortFrom(b.PodAddr, 5001).String(), 5*time.Second)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			_ = c.SetDeadline(time.Now().Add(60 * time.Second))
			if _, err := c.Write(data); err != nil {
				t.Fatalf("sending: %v (%s)", err, counters(ds[0]))
			}
			c.Close()
			select {
			case sum := <-got:
				if sum != want {
					t.Fatalf("the data arrived damaged or short; a: %s; b: %s", counters(ds[0]), counters(ds[1]))
				}
			case <-time.After(60 * time.Second):
				t.Fatal("transfer did not finish")
			}
			t.Logf("a: %s; b: %s", counters(ds[0]), counters(ds[1]))
			for _, d := range ds {
				for _, r := range []dropReason{dropAuth, dropReplay, dropPlaintext, dropNoKey} {
					if n := value(d.metrics.drop[r]); n > 0 {
						t.Errorf("%s dropped %v frames as %s", d.cfg.Self, n, dropReasonNames[r])
					}
				}
			}
		})
	}
}
