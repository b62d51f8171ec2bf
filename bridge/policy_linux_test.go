package bridge

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"

	"github.com/weft-net/weft/policy"
)

// Everything here runs in namespaces the tests make: a node (bridge,
// weft's tables, the policy table), pods on its bridge, and "far", a
// namespace routed from the node that holds the addresses of a remote
// node's pods (10.32.1.0/24) and of the outside (192.0.2.9, 198.51.100.7),
// as the tunnel and the underlay would deliver them: routed, not bridged.

var (
	podA = netip.MustParseAddr("10.32.0.2")
	podB = netip.MustParseAddr("10.32.0.3")
	podC = netip.MustParseAddr("10.32.0.4")
	podD = netip.MustParseAddr("10.32.0.5")

	farPod1  = netip.MustParseAddr("10.32.1.5")
	farPod2  = netip.MustParseAddr("10.32.1.6")
	farOut   = netip.MustParseAddr("192.0.2.9")
	farOut2  = netip.MustParseAddr("198.51.100.7")
	farAddrs = []netip.Addr{farPod1, farPod2, farOut, farOut2}

	testPorts = []uint16{53, 55, 80, 8080}
)

// polEnv is a node with four pods on its bridge and the far namespace.
type polEnv struct {
	*env
	pods   map[netip.Addr]ns.NetNS
	far    ns.NetNS
	pt     *PolicyTable
	tokens chan string // what the UDP listeners receive
}

func newPolEnv(t testing.TB) *polEnv {
	t.Helper()
	e := newEnv(t)
	rootBefore := readRootSysctl(t)
	t.Cleanup(func() {
		if got := readRootSysctl(t); got != rootBefore {
			t.Errorf("root namespace: %s changed from %q to %q", brNetfilterSysctl, rootBefore, got)
		}
		c, err := nftables.New()
		if err != nil {
			t.Errorf("nftables in root namespace: %v", err)
			return
		}
		if _, err := c.ListTableOfFamily(PolicyTableName, nftables.TableFamilyIPv4); err == nil {
			t.Errorf("root namespace has an nftables table ip %s", PolicyTableName)
		}
	})
	e.ensure(t)
	p := &polEnv{env: e, pods: map[netip.Addr]ns.NetNS{}, tokens: make(chan string, 1024)}
	for i, a := range []netip.Addr{podA, podB, podC, podD} {
		p.pods[a] = e.addPod(t, fmt.Sprintf("weftpod%d", i), a).ns
	}
	p.far = p.addFar(t)
	for _, n := range append(p.podNSs(), p.far) {
		p.listen(t, n)
	}
	p.pt = p.newTable(t)
	return p
}

func (p *polEnv) podNSs() []ns.NetNS {
	return []ns.NetNS{p.pods[podA], p.pods[podB], p.pods[podC], p.pods[podD]}
}

func (p *polEnv) newTable(t testing.TB) *PolicyTable {
	t.Helper()
	pt, err := NewPolicyTable(PolicyConfig{NSPath: p.ns.Path(), Log: p.log})
	if err != nil {
		t.Fatalf("NewPolicyTable: %v", err)
	}
	t.Cleanup(func() { pt.Close() })
	return pt
}

// readRootSysctl reads br_netfilter's switch in the root namespace (read
// only: the test never writes there).
func readRootSysctl(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/" + brNetfilterSysctl)
	if err != nil {
		return "missing: " + err.Error()
	}
	return strings.TrimSpace(string(b))
}

// addFar makes the far namespace: a veth from the node (192.0.2.1) to it
// (192.0.2.9, and the other far addresses), routes on the node for the
// remote pods and the outside through it, and its default route back.
func (p *polEnv) addFar(t testing.TB) ns.NetNS {
	t.Helper()
	n := newNS(t)
	dev, peer := p.veth(t, "weft-far", nil)
	p.addAddr(t, dev, "192.0.2.1/24")
	if err := p.h.LinkSetUp(dev); err != nil {
		t.Fatal(err)
	}
	for _, dst := range []string{"10.32.1.0/24", "198.51.100.0/24"} {
		_, d, _ := net.ParseCIDR(dst)
		if err := p.h.RouteAdd(&netlink.Route{LinkIndex: dev.Attrs().Index, Dst: d, Gw: farOut.AsSlice()}); err != nil {
			t.Fatalf("route %s on the node: %v", dst, err)
		}
	}
	if err := p.h.LinkSetNsFd(p.link(t, peer), int(n.Fd())); err != nil {
		t.Fatal(err)
	}
	err := n.Do(func(ns.NetNS) error {
		l, err := netlink.LinkByName(peer)
		if err != nil {
			return err
		}
		for _, a := range []string{"192.0.2.9/24", "10.32.1.5/32", "10.32.1.6/32", "198.51.100.7/32"} {
			if err := netlink.AddrAdd(l, toAddr(netip.MustParsePrefix(a))); err != nil {
				return err
			}
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: net.ParseIP("192.0.2.1")})
	})
	if err != nil {
		t.Fatalf("setting up the far namespace: %v", err)
	}
	return n
}

// listen opens, in n, a TCP listener (accepting and closing) and a UDP
// socket (passing what it receives to p.tokens) on every test port.
func (p *polEnv) listen(t testing.TB, n ns.NetNS) {
	t.Helper()
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	for _, port := range testPorts {
		var l net.Listener
		var pc net.PacketConn
		err := n.Do(func(ns.NetNS) (err error) {
			if l, err = net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port)); err != nil {
				return err
			}
			pc, err = net.ListenPacket("udp4", fmt.Sprintf("0.0.0.0:%d", port))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close(); pc.Close() })
		wg.Add(2)
		go func() {
			defer wg.Done()
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		go func() {
			defer wg.Done()
			buf := make([]byte, 256)
			for {
				k, _, err := pc.ReadFrom(buf)
				if err != nil {
					return
				}
				select {
				case p.tokens <- string(buf[:k]):
				default:
				}
			}
		}()
	}
}

// nsOf is the namespace that holds src: a pod's, the far one, or the
// node's own (for the node's address, the bridge's gateway).
func (p *polEnv) nsOf(src netip.Addr) ns.NetNS {
	if n, ok := p.pods[src]; ok {
		return n
	}
	for _, a := range farAddrs {
		if a == src {
			return p.far
		}
	}
	return p.ns
}

func (p *polEnv) blocked(t testing.TB) uint64 {
	t.Helper()
	in, eg, err := p.pt.Blocked()
	if err != nil {
		t.Fatalf("Blocked: %v", err)
	}
	return in + eg
}

var tokenSeq atomic.Uint64

// try opens a connection (TCP) or sends a datagram (UDP) from src to
// dst:port and reports whether it passed: it waits until the connection
// is established or the datagram received, or until the policy table's
// drop counters grow (the first packet was dropped). Tries run one at a
// time, so the counters grow only for the try under way.
func (p *polEnv) try(t testing.TB, src, dst netip.Addr, proto corev1.Protocol, port uint16) bool {
	t.Helper()
	before := p.blocked(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	token := fmt.Sprintf("try-%d %s->%s:%d", tokenSeq.Add(1), src, dst, port)
	local := src
	if p.nsOf(src) == p.ns {
		local = netip.Addr{} // the node picks its source
	}
	go func() {
		done <- p.nsOf(src).Do(func(ns.NetNS) error {
			if proto == corev1.ProtocolUDP {
				la := &net.UDPAddr{}
				if local.IsValid() {
					la.IP = local.AsSlice()
				}
				c, err := net.ListenUDP("udp4", la)
				if err != nil {
					return err
				}
				defer c.Close()
				_, err = c.WriteTo([]byte(token), net.UDPAddrFromAddrPort(netip.AddrPortFrom(dst, port)))
				return err
			}
			d := net.Dialer{}
			if local.IsValid() {
				d.LocalAddr = &net.TCPAddr{IP: local.AsSlice()}
			}
			c, err := d.DialContext(ctx, "tcp4", netip.AddrPortFrom(dst, port).String())
			if err == nil {
				c.Close()
			}
			return err
		})
	}()
	defer func() { // the sender is done with its namespace before the try is
		cancel()
		if done != nil {
			<-done
		}
	}()
	deadline := time.After(20 * time.Second)
	sent := proto != corev1.ProtocolUDP
	for {
		select {
		case err := <-done:
			done = nil
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Fatalf("%s %s -> %s:%d: %v", proto, src, dst, port, err)
			}
			if proto == corev1.ProtocolTCP && err == nil {
				return true
			}
			sent = true
		case tok := <-p.tokens:
			if tok == token {
				return true
			}
			continue // a datagram of an earlier try that was counted as passed
		case <-deadline:
			t.Fatalf("%s %s -> %s:%d: neither through nor counted as blocked within 20s", proto, src, dst, port)
		case <-time.After(2 * time.Millisecond):
		}
		if sent && p.blocked(t) > before {
			return false
		}
	}
}

func (p *polEnv) sync(t testing.TB, nr *policy.NodeRules) {
	t.Helper()
	if err := p.pt.Sync(nr); err != nil {
		t.Fatalf("Sync: %v", err)
	}
}

// expectConns checks each connection against want.
func (p *polEnv) expectConns(t testing.TB, want map[policy.Conn]bool) {
	t.Helper()
	for c, w := range want {
		if got := p.try(t, c.Src, c.Dst, c.Protocol, c.Port); got != w {
			t.Errorf("%s: passed=%v, want %v\n%s", c, got, w, p.listing(t))
		}
	}
}

// listing is the table as nft shows it, for failure messages (only when
// the nft binary is there: weft itself never runs it).
func (p *polEnv) listing(t testing.TB) string {
	t.Helper()
	if _, err := exec.LookPath("nft"); err != nil {
		return "(no nft binary to list the table)"
	}
	var out []byte
	_ = p.ns.Do(func(ns.NetNS) error {
		out, _ = exec.Command("nft", "list", "table", "ip", PolicyTableName).CombinedOutput()
		return nil
	})
	return string(out)
}

func tcpConn(src, dst netip.Addr, port uint16) policy.Conn {
	return policy.Conn{Src: src, Dst: dst, Protocol: corev1.ProtocolTCP, Port: port}
}

func udpConn(src, dst netip.Addr, port uint16) policy.Conn {
	return policy.Conn{Src: src, Dst: dst, Protocol: corev1.ProtocolUDP, Port: port}
}

func iv(lo, hi string) policy.Interval {
	return policy.Interval{Lo: netip.MustParseAddr(lo), Hi: netip.MustParseAddr(hi)}
}

func rulesOf(pods ...*policy.PodRules) *policy.NodeRules {
	nr := &policy.NodeRules{Node: "n0", Pods: map[netip.Addr]*policy.PodRules{}}
	for _, pr := range pods {
		nr.Pods[pr.IP] = pr
	}
	return nr
}

// TestPolicyDefaultDenyAndAllow: default deny ingress blocks TCP and UDP
// from pods and from far away, and is counted as ingress; an allow from
// one pod's address on one port lets exactly that pass; the node's own
// connections (kubelet probes) pass; other pods are untouched.
func TestPolicyDefaultDenyAndAllow(t *testing.T) {
	p := newPolEnv(t)
	all := map[policy.Conn]bool{
		tcpConn(podA, podB, 80): true, udpConn(podA, podB, 53): true, tcpConn(farPod1, podB, 80): true,
		tcpConn(podA, podC, 80): true, tcpConn(podB, podA, 8080): true,
	}
	p.expectConns(t, all) // no table yet
	p.sync(t, rulesOf(&policy.PodRules{IP: podB, Ingress: policy.Direction{Isolated: true}}))
	p.expectConns(t, map[policy.Conn]bool{
		tcpConn(podA, podB, 80): false, udpConn(podA, podB, 53): false, tcpConn(farPod1, podB, 80): false,
		udpConn(farOut, podB, 55): false,
		tcpConn(podA, podC, 80):   true, tcpConn(podB, podA, 8080): true, udpConn(podB, farOut, 53): true,
	})
	in, eg, err := p.pt.Blocked()
	if err != nil || in < 4 || eg != 0 {
		t.Errorf("Blocked = %d ingress, %d egress, %v; want at least 4 ingress (one per blocked try), no egress", in, eg, err)
	}
	// The node itself (its gateway address on the bridge) reaches B.
	if !p.try(t, e0(p), podB, corev1.ProtocolTCP, 8080) {
		t.Errorf("the node's own connection to an isolated pod was blocked")
	}

	allowA80 := rulesOf(&policy.PodRules{IP: podB, Ingress: policy.Direction{Isolated: true, Rules: []policy.Rule{{
		Peers: []policy.Interval{{Lo: podA, Hi: podA}},
		Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: 80, Hi: 80}},
	}}}})
	p.sync(t, allowA80)
	p.expectConns(t, map[policy.Conn]bool{
		tcpConn(podA, podB, 80): true, tcpConn(podA, podB, 8080): false, udpConn(podA, podB, 80): false,
		tcpConn(podC, podB, 80): false, tcpConn(farPod1, podB, 80): false,
	})
}

// e0 is the node's own address on the bridge.
func e0(p *polEnv) netip.Addr { return p.cfg.Gateway.Addr() }

// TestPolicyEgressBlocksAndPorts: an egress deny blocks a pod's
// connections to pods and far away (counted as egress) but not those to
// it; an ipBlock with an except; port ranges (endPort) for TCP and UDP.
func TestPolicyEgressBlocksAndPorts(t *testing.T) {
	p := newPolEnv(t)
	p.sync(t, rulesOf(
		&policy.PodRules{IP: podA, Egress: policy.Direction{Isolated: true}},
		// C: ingress from 10.32.0.0/16 except 10.32.0.4/30 (C and D).
		&policy.PodRules{IP: podC, Ingress: policy.Direction{Isolated: true, Rules: []policy.Rule{{
			Peers: []policy.Interval{iv("10.32.0.0", "10.32.0.3"), iv("10.32.0.8", "10.32.255.255")}, AnyPort: true}}}},
		// B: egress to anywhere on TCP 50-60 and UDP 8080 only.
		&policy.PodRules{IP: podB, Egress: policy.Direction{Isolated: true, Rules: []policy.Rule{{
			AnyPeer: true, Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: 50, Hi: 60}, {Protocol: corev1.ProtocolUDP, Lo: 8080, Hi: 8080}}}}}},
	))
	in0, eg0, _ := p.pt.Blocked()
	p.expectConns(t, map[policy.Conn]bool{
		tcpConn(podA, podD, 80): false, udpConn(podA, farOut, 53): false, tcpConn(podA, farPod1, 8080): false,
		tcpConn(podD, podA, 80): true, udpConn(farPod2, podA, 55): true,
	})
	in1, eg1, _ := p.pt.Blocked()
	if eg1-eg0 < 3 || in1 != in0 {
		t.Errorf("Blocked: egress %d -> %d, ingress %d -> %d; want 3 more egress, no more ingress", eg0, eg1, in0, in1)
	}
	p.expectConns(t, map[policy.Conn]bool{
		tcpConn(podB, podC, 55): true, tcpConn(farPod1, podC, 80): true, udpConn(farPod2, podC, 53): true,
		tcpConn(podD, podC, 80): false, tcpConn(farOut, podC, 80): false, udpConn(farOut2, podC, 53): false,
	})
	p.expectConns(t, map[policy.Conn]bool{
		tcpConn(podB, farOut, 53): true, tcpConn(podB, farOut, 55): true, tcpConn(podB, podD, 53): true,
		tcpConn(podB, farOut, 80): false, tcpConn(podB, podD, 8080): false,
		udpConn(podB, farOut2, 8080): true, udpConn(podB, farOut2, 53): false, udpConn(podB, podD, 55): false,
	})
}

// echo listens on TCP port in n and echoes every connection.
func echo(t testing.TB, n ns.NetNS, port int) {
	t.Helper()
	var l net.Listener
	if err := n.Do(func(ns.NetNS) (err error) {
		l, err = net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				buf := make([]byte, 64)
				for {
					k, err := c.Read(buf)
					if err != nil {
						return
					}
					if _, err := c.Write(buf[:k]); err != nil {
						return
					}
				}
			}()
		}
	}()
}

func dialFrom(t testing.TB, n ns.NetNS, dst netip.Addr, port int) net.Conn {
	t.Helper()
	var c net.Conn
	if err := n.Do(func(ns.NetNS) (err error) {
		c, err = net.DialTimeout("tcp4", fmt.Sprintf("%s:%d", dst, port), 10*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func roundTrip(t testing.TB, c net.Conn, msg string) {
	t.Helper()
	if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatalf("write %q: %v", msg, err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
		t.Fatalf("echo of %q: %q %v", msg, buf, err)
	}
}

// TestPolicyEstablished: with B isolated (deny all ingress), the replies
// to B's own connections pass, and so do both directions of a connection
// to B opened before B was isolated; a new connection to B is blocked.
func TestPolicyEstablished(t *testing.T) {
	p := newPolEnv(t)
	echo(t, p.pods[podA], 9000)
	echo(t, p.pods[podB], 9000)
	before := dialFrom(t, p.pods[podA], podB, 9000) // A -> B, before the policy
	roundTrip(t, before, "hello")
	p.sync(t, rulesOf(&policy.PodRules{IP: podB, Ingress: policy.Direction{Isolated: true}}))
	out := dialFrom(t, p.pods[podB], podA, 9000) // B -> A: A's replies come in to B
	roundTrip(t, out, "reply to B")
	roundTrip(t, before, "still open")
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podA, podB, 80): false, tcpConn(podB, podA, 80): true})
	// Replies to B's connections far away come back routed: they pass too.
	echo(t, p.far, 9000)
	roundTrip(t, dialFrom(t, p.pods[podB], farPod1, 9000), "far")
}

// nftIn is an nftables connection into the node's namespace.
func (p *polEnv) nftIn(t testing.TB) *nftables.Conn {
	t.Helper()
	n, err := openNS(p.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.close)
	c, err := n.nft()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// handles lists the rule handles of every chain of the policy table.
func (p *polEnv) handles(t testing.TB) map[string][]uint64 {
	t.Helper()
	c := p.nftIn(t)
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyIPv4)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]uint64{}
	for _, ch := range chains {
		if ch.Table.Name != PolicyTableName {
			continue
		}
		rs, err := c.GetRules(policyNFTable(), ch)
		if err != nil {
			t.Fatal(err)
		}
		out[ch.Name] = []uint64{}
		for _, r := range rs {
			out[ch.Name] = append(out[ch.Name], r.Handle)
		}
	}
	return out
}

// kernelState reads the table back as Sync sees it.
func (p *polEnv) kernelState(t testing.TB) *policyRead {
	t.Helper()
	r, err := readPolicy(p.nftIn(t))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestPolicySyncIncremental: a Sync that changes the peers of one pod
// changes one set and no rule; one that changes the rules of one pod
// moves it to another chain, and the others' rules keep their handles;
// the counters keep counting. A Sync of the same rules writes nothing.
func TestPolicySyncIncremental(t *testing.T) {
	p := newPolEnv(t)
	bFrom := func(peers ...policy.Interval) *policy.PodRules {
		return &policy.PodRules{IP: podB, Ingress: policy.Direction{Isolated: true, Rules: []policy.Rule{{Peers: peers, AnyPort: true,
			From: policy.Origin{Policy: "default/b"}}}}}
	}
	cRules := &policy.PodRules{IP: podC, Ingress: policy.Direction{Isolated: true, Rules: []policy.Rule{{
		Peers: []policy.Interval{{Lo: podA, Hi: podA}}, Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: 80, Hi: 80}},
		From: policy.Origin{Policy: "default/c"}}}},
		Egress: policy.Direction{Isolated: true, Rules: []policy.Rule{{AnyPeer: true, AnyPort: true, From: policy.Origin{Policy: "default/c", Egress: true}}}}}
	p.sync(t, rulesOf(bFrom(iv("10.32.0.2", "10.32.0.2")), cRules))
	if p.try(t, podD, podC, corev1.ProtocolTCP, 80) {
		t.Fatal("D reached C")
	}
	in0, _, _ := p.pt.Blocked()
	h0 := p.handles(t)
	chainB := p.kernelState(t).state.ingress[podB]
	writes := p.pt.writes

	p.sync(t, rulesOf(bFrom(iv("10.32.0.2", "10.32.0.2")), cRules))
	if p.pt.writes != writes {
		t.Errorf("a Sync of the same rules wrote a batch")
	}

	// D joins B's peers: one set changes, no chain.
	p.sync(t, rulesOf(bFrom(iv("10.32.0.2", "10.32.0.2"), iv("10.32.0.5", "10.32.0.5")), cRules))
	if h := p.handles(t); fmt.Sprint(h) != fmt.Sprint(h0) {
		t.Errorf("a change of B's peers changed rules:\nbefore %v\nafter  %v", h0, h)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podD, podB, 80): true, tcpConn(podC, podB, 80): false})

	// B gets another rule: B gets another chain, its old one goes (no
	// other pod has those rules), the other chains keep their rules.
	b2 := bFrom(iv("10.32.0.2", "10.32.0.2"))
	b2.Ingress.Rules = append(b2.Ingress.Rules, policy.Rule{AnyPeer: true, Ports: []policy.PortRange{{Protocol: corev1.ProtocolUDP, Lo: 53, Hi: 53}},
		From: policy.Origin{Policy: "default/b2"}})
	p.sync(t, rulesOf(b2, cRules))
	h1 := p.handles(t)
	chainB2 := p.kernelState(t).state.ingress[podB]
	if _, ok := h1[chainB]; ok || chainB2 == chainB || len(h1[chainB2]) != 4 { // two allow rules, the sample, the drop
		t.Errorf("B's rules changed: chain %s -> %s, chains now %v", chainB, chainB2, h1)
	}
	for name, hs := range h0 {
		if name == chainB {
			continue
		}
		if fmt.Sprint(h1[name]) != fmt.Sprint(hs) {
			t.Errorf("chain %s: rules %v became %v, but its pod's rules did not change", name, hs, h1[name])
		}
	}
	p.expectConns(t, map[policy.Conn]bool{udpConn(podC, podB, 53): true, tcpConn(podD, podB, 80): false, tcpConn(podA, podC, 80): true})
	if in1, _, _ := p.pt.Blocked(); in1 <= in0 {
		t.Errorf("blocked ingress %d -> %d: the counter did not keep counting", in0, in1)
	}

	// B leaves: its chain, sets and map element go; C stays as it was.
	p.sync(t, rulesOf(cRules))
	h2 := p.handles(t)
	if _, ok := h2[chainB2]; ok {
		t.Errorf("B's chain is still there: %v", h2)
	}
	for name := range h2 {
		if fmt.Sprint(h2[name]) != fmt.Sprint(h0[name]) {
			t.Errorf("chain %s: rules %v became %v", name, h0[name], h2[name])
		}
	}
	r := p.kernelState(t)
	if !r.intact || len(r.state.peerSets) != 1 || len(r.state.portSets) != 1 || len(r.state.ingress) != 1 || len(r.state.egress) != 1 {
		t.Errorf("after B left: %+v", r.state)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podD, podB, 80): true})
}

// TestPolicySharedInTheKernel: the pods one policy selects (sharedWorld:
// A, B and C take TCP 80 from client pods) share one chain and its sets
// in the kernel; D joining the clients changes one set's elements and no
// rule; D selected too jumps to the same chain, and no rule changes; the
// policy selecting nobody any more takes the chain and the sets with it.
func TestPolicySharedInTheKernel(t *testing.T) {
	p := newPolEnv(t)
	w := sharedWorld()
	p.sync(t, policy.Compile(w, "n0"))
	k := p.kernelState(t).state
	chain := k.ingress[podA]
	if len(k.chains) != 1 || len(k.peerSets) != 1 || len(k.portSets) != 1 || len(k.ingress) != 3 || k.ingress[podB] != chain || k.ingress[podC] != chain {
		t.Fatalf("three pods of one policy: the kernel holds %+v, want one chain and one set of each kind", k)
	}
	p.expectConns(t, map[policy.Conn]bool{
		tcpConn(farPod1, podB, 80): true, tcpConn(farPod1, podC, 8080): false, tcpConn(podD, podA, 80): false, tcpConn(podA, podD, 80): true,
	})
	h0, writes := p.handles(t), p.pt.writes

	w.Pods[3].Labels = map[string]string{"app": "client"} // D joins the peers
	p.sync(t, policy.Compile(w, "n0"))
	if h := p.handles(t); fmt.Sprint(h) != fmt.Sprint(h0) || p.pt.writes != writes+1 {
		t.Errorf("D joining the peers: rules %v became %v (%d batches)", h0, h, p.pt.writes-writes)
	}
	k = p.kernelState(t).state
	for name, rs := range k.peerSets {
		if len(rs) != 2 {
			t.Errorf("set %s holds %v, want the two clients", name, rs)
		}
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podD, podA, 80): true, tcpConn(podD, podC, 80): true, tcpConn(podD, podC, 53): false})

	w.Pods[3].Labels = map[string]string{"app": "web"} // D is selected
	p.sync(t, policy.Compile(w, "n0"))
	if h := p.handles(t); fmt.Sprint(h) != fmt.Sprint(h0) {
		t.Errorf("D selected: rules %v became %v", h0, h)
	}
	if k = p.kernelState(t).state; k.ingress[podD] != chain || len(k.chains) != 1 {
		t.Errorf("D selected: %+v, want its ingress on chain %s", k, chain)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podA, podD, 80): false, tcpConn(farPod1, podD, 80): true, tcpConn(podD, podA, 80): false})

	w.Policies[0].Spec.PodSelector.MatchLabels = map[string]string{"app": "none"}
	p.sync(t, policy.Compile(w, "n0"))
	if r := p.kernelState(t); !r.intact || !r.state.equal(newPolState()) {
		t.Errorf("no pod selected: the kernel holds %+v, want no chain, set or map element", r.state)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podA, podD, 80): true, tcpConn(podD, podA, 8080): true})
}

// TestPolicyAdoptPerPodLayout: a table as weft wrote it before sets and
// chains were shared (a chain and sets for each pod) is adopted without
// a rebuild: the next Sync replaces those chains and sets in one batch,
// and the counters go on.
func TestPolicyAdoptPerPodLayout(t *testing.T) {
	p := newPolEnv(t)
	nr := policy.Compile(sharedWorld(), "n0")
	old := &polWant{state: newPolState(), chains: map[string]polChain{}}
	for _, a := range []netip.Addr{podA, podB, podC} {
		name := "ingress-" + a.String()
		peers, ports := name+"-0-peers", name+"-0-ports"
		old.state.peerSets[peers] = []AddrRange{{First: farPod1, Last: farPod1}}
		old.state.portSets[ports] = []portRange{{6, 80, 80}}
		ch := polChain{rules: []polRule{{peers: peers, ports: ports}}}
		old.chains[name] = ch
		old.state.chains[name] = ch.comments()
		old.state.ingress[a] = name
	}
	if err := writePolicy(p.nftIn(t), old, diffPolicy(old.state, newPolState()), true); err != nil {
		t.Fatalf("writing the per-pod layout: %v", err)
	}
	if r := p.kernelState(t); !r.intact || !r.state.equal(old.state) {
		t.Fatalf("the per-pod layout reads back as %+v (intact %v)", r.state, r.intact)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podD, podB, 80): false, tcpConn(farPod1, podB, 80): true})
	in0, _, _ := p.pt.Blocked()
	p.sync(t, nr)
	if r := p.kernelState(t); !r.intact || !r.state.equal(mustWant(t, nr).state) || len(r.state.chains) != 1 {
		t.Fatalf("after the Sync: %+v", r.state)
	}
	if in, _, _ := p.pt.Blocked(); in < in0 || in0 == 0 {
		t.Errorf("blocked ingress %d -> %d: the table was rebuilt", in0, in)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podD, podB, 80): false, tcpConn(farPod1, podB, 80): true, tcpConn(farPod1, podC, 53): false})
}

// TestPolicyAdopt: a second PolicyTable (a router restarted) adopts the
// table: its first Sync of the same rules writes nothing, the rules keep
// their handles and the counters their counts, and it goes on enforcing
// and changing only what changes. A table changed under it (deleted by
// hand) is written again at the next Sync.
func TestPolicyAdopt(t *testing.T) {
	p := newPolEnv(t)
	nr := rulesOf(
		&policy.PodRules{IP: podB, Ingress: policy.Direction{Isolated: true, Rules: []policy.Rule{{
			Peers: []policy.Interval{{Lo: podA, Hi: podA}}, Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: 80, Hi: 80}}}}}},
		&policy.PodRules{IP: podD, Egress: policy.Direction{Isolated: true}})
	p.sync(t, nr)
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podC, podB, 80): false, tcpConn(podD, podA, 80): false})
	in0, eg0, _ := p.pt.Blocked()
	h0 := p.handles(t)
	p.pt.Close()

	p.pt = p.newTable(t) // the restarted router
	if in, eg, err := p.pt.Blocked(); err != nil || in != in0 || eg != eg0 {
		t.Errorf("restarted: Blocked = %d, %d, %v; want %d, %d", in, eg, err, in0, eg0)
	}
	p.sync(t, nr)
	if p.pt.writes != 0 {
		t.Errorf("the adopting Sync wrote %d batches, want none", p.pt.writes)
	}
	if h := p.handles(t); fmt.Sprint(h) != fmt.Sprint(h0) {
		t.Errorf("adopting changed rules:\nbefore %v\nafter  %v", h0, h)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podA, podB, 80): true, tcpConn(podC, podB, 80): false, tcpConn(podD, podA, 80): false})

	delete(nr.Pods, podD)
	p.sync(t, nr)
	if h, chainB := p.handles(t), p.kernelState(t).state.ingress[podB]; fmt.Sprint(h[chainB]) != fmt.Sprint(h0[chainB]) {
		t.Errorf("B's chain changed when only D's rules went")
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podD, podA, 80): true})

	// Deleted by hand: the next Sync writes it again.
	if err := deletePolicyTable(p.nftIn(t)); err != nil {
		t.Fatal(err)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podC, podB, 80): true})
	p.sync(t, nr)
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podC, podB, 80): false, tcpConn(podA, podB, 80): true})
}

// TestPolicyTeardown: Teardown removes the table and everything passes;
// twice is fine; a Sync after it writes the table again; bridge.Teardown
// (weft reset) removes it too.
func TestPolicyTeardown(t *testing.T) {
	p := newPolEnv(t)
	nr := rulesOf(&policy.PodRules{IP: podB, Ingress: policy.Direction{Isolated: true}})
	p.sync(t, nr)
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podA, podB, 80): false})
	for range 2 {
		if err := p.pt.Teardown(); err != nil {
			t.Fatalf("Teardown: %v", err)
		}
	}
	if r := p.kernelState(t); r.exists {
		t.Fatalf("the table is still there after Teardown")
	}
	if in, eg, err := p.pt.Blocked(); err != nil || in != 0 || eg != 0 {
		t.Errorf("Blocked without a table: %d %d %v", in, eg, err)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podA, podB, 80): true})
	p.sync(t, nr)
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podA, podB, 80): false})
	if err := Teardown(p.ns.Path(), p.name, p.log); err != nil {
		t.Fatal(err)
	}
	if r := p.kernelState(t); r.exists {
		t.Fatalf("the table is still there after bridge.Teardown")
	}
}

// TestPolicyBrNetfilter: bridge-nf-call-iptables is per network
// namespace; NewPolicyTable turns it on in its own (the root namespace's
// value stays as it was: newPolEnv checks it); without it, traffic
// between pods of the bridge would bypass the table while routed traffic
// would not.
func TestPolicyBrNetfilter(t *testing.T) {
	p := newPolEnv(t)
	p.sync(t, rulesOf(&policy.PodRules{IP: podB, Ingress: policy.Direction{Isolated: true}}))
	root := readRootSysctl(t)
	p.sysctl(t, brNetfilterSysctl, "0")
	if got := readRootSysctl(t); got != root {
		t.Fatalf("setting %s in the test namespace changed the root namespace's from %s to %s", brNetfilterSysctl, root, got)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podA, podB, 80): true, tcpConn(farPod1, podB, 80): false})
	p.pt = p.newTable(t)
	if got := p.sysctl(t, brNetfilterSysctl); got != "1" {
		t.Fatalf("after NewPolicyTable: %s = %s, want 1", brNetfilterSysctl, got)
	}
	p.expectConns(t, map[policy.Conn]bool{tcpConn(podA, podB, 80): false, tcpConn(farPod1, podB, 80): false})
}

var (
	policyWorlds = flag.Int("bridge.policy-worlds", 300, "random worlds TestPolicyKernelMatchesRules syncs to the kernel")
	policySeed   = flag.Uint64("bridge.policy-seed", 0, "first seed of TestPolicyKernelMatchesRules (replay with -bridge.policy-seed=N -bridge.policy-worlds=1)")
)

// TestPolicyKernelMatchesRules: random worlds (as package policy's tests
// make them) compiled for this node and synced one after the other to the
// same table, so that every Sync after the first is a diff (two in three
// with names that collide). After each, real connections between the
// pods and far away, TCP and UDP, on the ports the policies name: each
// passes exactly when the node's rules say
// (NodeRules.Egress and Ingress); the node's own connections always do.
func TestPolicyKernelMatchesRules(t *testing.T) {
	p := newPolEnv(t)
	local := []netip.Addr{podA, podB, podC, podD}
	ends := append(slices.Clone(local), farAddrs...)
	var checked, passed, setSwaps, rewrites int
	prev := newPolState()
	for seed := *policySeed; seed < *policySeed+uint64(*policyWorlds); seed++ {
		r := rand.New(rand.NewPCG(seed, 0xbeef))
		w := randPolicyWorld(r, local, []netip.Addr{farPod1, farPod2})
		nr := policy.Compile(w, "n0")
		// Two worlds in three with names that collide (one hex digit):
		// fallback names, and chains and sets of one name that hold
		// another content than in the last world.
		p.pt.hash = hashName
		if seed%3 != 0 {
			p.pt.hash = weakHashes["1 digit"]
		}
		want, err := wantPolicyNamed(nr, p.pt.hash)
		if err != nil {
			t.Fatal(err)
		}
		o := diffPolicy(want.state, prev)
		if len(o.writeChains) > len(o.newChains) {
			rewrites++
		}
		for _, d := range o.peerDiffs {
			if len(d.add) > 0 && len(d.del) > 0 {
				setSwaps++
			}
		}
		prev = want.state
		p.sync(t, nr)
		if k := p.kernelState(t); !k.intact || !k.state.equal(want.state) {
			t.Fatalf("seed %d: the kernel's table after Sync: %+v\nwant %+v", seed, k.state, want.state)
		}
		for range 24 {
			src, dst := ends[r.IntN(len(ends))], ends[r.IntN(len(ends))]
			if src == dst || (!slices.Contains(local, src) && !slices.Contains(local, dst)) {
				continue // not through this node
			}
			proto := []corev1.Protocol{corev1.ProtocolTCP, corev1.ProtocolUDP}[r.IntN(2)]
			c := policy.Conn{Src: src, Dst: dst, Protocol: proto, Port: testPorts[r.IntN(len(testPorts))]}
			want := nr.Egress(c) && nr.Ingress(c)
			if got := p.try(t, c.Src, c.Dst, c.Protocol, c.Port); got != want {
				t.Fatalf("seed %d: %s: the kernel let it pass=%v, the rules %v\nrules: %s\n%s", seed, c, got, want, dumpRules(nr), p.listing(t))
			}
			checked++
			if want {
				passed++
			}
		}
		dst := local[r.IntN(len(local))]
		if !p.try(t, e0(p), dst, corev1.ProtocolTCP, testPorts[r.IntN(len(testPorts))]) {
			t.Fatalf("seed %d: the node's own connection to %s was blocked", seed, dst)
		}
	}
	t.Logf("%d worlds, %d connections, %d passed; %d peer sets changed in place with ranges both deleted and added; %d Syncs rewrote a chain", *policyWorlds, checked, passed, setSwaps, rewrites)
	if passed == 0 || passed == checked {
		t.Fatalf("degenerate worlds: %d of %d passed", passed, checked)
	}
}

func dumpRules(nr *policy.NodeRules) string {
	var b strings.Builder
	for _, a := range slices.SortedFunc(maps.Keys(nr.Pods), netip.Addr.Compare) {
		pr := nr.Pods[a]
		fmt.Fprintf(&b, "\n  %s ingress %+v egress %+v", a, pr.Ingress, pr.Egress)
	}
	return b.String()
}

// scaleRules are the rules of pods pods, each isolated both ways with two
// rules: peers from a selector (every 7th pod) on TCP 80 and UDP 53, and
// an ipBlock with an except on any port. Pod i is selected by policy
// i % policies, each with these rules, as policy.Compile gives them
// (Rule.From). With extra, one pod more matches the selector.
func scaleRules(pods, policies int, extra bool) *policy.NodeRules {
	addr := func(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 32, byte(i / 250), byte(2 + i%250)}) }
	var sel []policy.Interval
	for i := 0; i < pods; i += 7 {
		sel = append(sel, policy.Interval{Lo: addr(i), Hi: addr(i)})
	}
	if extra {
		sel = append(sel, policy.Interval{Lo: addr(pods + 1), Hi: addr(pods + 1)})
	}
	rules := func(pol int, egress bool) []policy.Rule {
		from := policy.Origin{Policy: fmt.Sprintf("default/scale-%d", pol), Egress: egress}
		r := []policy.Rule{
			{Peers: sel, Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: 80, Hi: 80}, {Protocol: corev1.ProtocolUDP, Lo: 53, Hi: 53}}, From: from},
			{Peers: []policy.Interval{iv("0.0.0.0", "9.255.255.255"), iv("11.0.0.0", "255.255.255.255")}, AnyPort: true, From: from},
		}
		r[1].From.Index = 1
		return r
	}
	nr := &policy.NodeRules{Pods: map[netip.Addr]*policy.PodRules{}}
	for i := range pods {
		a := addr(i)
		nr.Pods[a] = &policy.PodRules{IP: a, Ingress: policy.Direction{Isolated: true, Rules: rules(i%policies, false)},
			Egress: policy.Direction{Isolated: true, Rules: rules(i%policies, true)}}
	}
	return nr
}

var (
	scalePods     = flag.Int("bridge.policy-scale-pods", 1000, "pods of BenchmarkPolicySync")
	scalePolicies = flag.Int("bridge.policy-scale-policies", 1, "policies that select the pods of BenchmarkPolicySync (pod i: policy i % N); as many as pods: nothing is shared")
)

// BenchmarkPolicySync: a node with 1,000 pods (-bridge.policy-scale-pods),
// each isolated both ways by one policy (-bridge.policy-scale-policies),
// so with 1 policy 2 chains and 5 sets (the ports set is the same for all
// rules), with 1,000 policies 2,000 chains and 4,001 sets; the first Sync
// and an adopting one are logged; each iteration is a Sync in which one
// pod joins a selector that every policy's rules name (2 sets per policy
// change by one element).
func BenchmarkPolicySync(b *testing.B) {
	skipUnlessRootB(b)
	n := newNSB(b)
	pt, err := NewPolicyTable(PolicyConfig{NSPath: n.Path()})
	if err != nil {
		b.Fatal(err)
	}
	defer pt.Close()
	base, more := scaleRules(*scalePods, *scalePolicies, false), scaleRules(*scalePods, *scalePolicies, true)
	start := time.Now()
	if err := pt.Sync(base); err != nil {
		b.Fatal(err)
	}
	b.Logf("first Sync of %d pods (%d policies, %d chains, %d sets): %v", *scalePods, *scalePolicies,
		len(pt.have.chains), len(pt.have.peerSets)+len(pt.have.portSets), time.Since(start))
	pt2, err := NewPolicyTable(PolicyConfig{NSPath: n.Path()})
	if err != nil {
		b.Fatal(err)
	}
	defer pt2.Close()
	start = time.Now()
	if err := pt2.Sync(base); err != nil || pt2.writes != 0 {
		b.Fatal(err, pt2.writes)
	}
	b.Logf("adopting Sync (reads the table, writes nothing): %v", time.Since(start))
	b.ResetTimer()
	for i := range b.N {
		nr := base
		if i%2 == 0 {
			nr = more
		}
		if err := pt2.Sync(nr); err != nil {
			b.Fatal(err)
		}
	}
}

func skipUnlessRootB(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
}

func newNSB(b *testing.B) ns.NetNS {
	n, err := testutils.NewNS()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = n.Close()
		if err := testutils.UnmountNS(n); err != nil {
			b.Errorf("remove test namespace: %v", err)
		}
	})
	return n
}

// TestPolicyEgressToNode: what an egress-isolated pod sends to its own
// node's addresses arrives on the input hook and is judged by its egress
// rules like anything else it sends (an ipBlock allows it); pods that are
// not isolated, and the node's own connections to its pods, pass. A table
// that a router without the input chain wrote is completed in place: its
// counters and rules stay.
func TestPolicyEgressToNode(t *testing.T) {
	p := newPolEnv(t)
	p.listen(t, p.ns)
	gw := e0(p)
	nr := rulesOf(
		&policy.PodRules{IP: podA, Egress: policy.Direction{Isolated: true}},
		&policy.PodRules{IP: podB, Egress: policy.Direction{Isolated: true, Rules: []policy.Rule{{
			Peers: []policy.Interval{{Lo: gw, Hi: gw}}, Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: 80, Hi: 80}}}}}},
	)
	p.sync(t, nr)
	want := map[policy.Conn]bool{
		tcpConn(podA, gw, 80): false, udpConn(podA, gw, 53): false,
		tcpConn(podB, gw, 80): true, tcpConn(podB, gw, 8080): false, udpConn(podB, gw, 80): false,
		tcpConn(podC, gw, 80): true, udpConn(podC, gw, 53): true,
		tcpConn(gw, podA, 80): true, // the node to a pod: not the pod's egress
	}
	_, eg0, _ := p.pt.Blocked()
	p.expectConns(t, want)
	_, eg1, _ := p.pt.Blocked()
	if eg1-eg0 < 4 {
		t.Errorf("Blocked: egress %d -> %d; want at least 4 more (one per blocked try)", eg0, eg1)
	}

	// An older router's table: no input chain. A restarted router adds
	// it, in one batch, and keeps the rest.
	c := p.nftIn(t)
	c.DelChain(&nftables.Chain{Name: policyInputChain, Table: policyNFTable()})
	if err := c.Flush(); err != nil {
		t.Fatalf("deleting the input chain: %v", err)
	}
	if !p.try(t, podA, gw, corev1.ProtocolTCP, 80) {
		t.Fatalf("without the input chain the try did not pass: the test cannot tell the chain's effect")
	}
	h0 := p.handles(t)
	p.pt.Close()
	p.pt = p.newTable(t)
	p.sync(t, nr)
	if p.pt.writes != 1 {
		t.Errorf("completing the table took %d batches, want 1", p.pt.writes)
	}
	h := p.handles(t)
	for name, hs := range h0 {
		if fmt.Sprint(h[name]) != fmt.Sprint(hs) {
			t.Errorf("chain %s changed when the input chain was added: %v -> %v", name, hs, h[name])
		}
	}
	if _, eg, _ := p.pt.Blocked(); eg < eg1 {
		t.Errorf("the egress counter went from %d to %d: the table was rebuilt", eg1, eg)
	}
	p.expectConns(t, want)
	if r := p.kernelState(t); !r.intact || r.noInput {
		t.Errorf("after the Sync the table reads intact=%v noInput=%v, want intact", r.intact, r.noInput)
	}
}
