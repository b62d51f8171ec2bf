package bridge

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
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

func newPolEnv(t *testing.T) *polEnv {
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

func (p *polEnv) newTable(t *testing.T) *PolicyTable {
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
func readRootSysctl(t *testing.T) string {
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
func (p *polEnv) addFar(t *testing.T) ns.NetNS {
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
func (p *polEnv) listen(t *testing.T, n ns.NetNS) {
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

func (p *polEnv) blocked(t *testing.T) uint64 {
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
func (p *polEnv) try(t *testing.T, src, dst netip.Addr, proto corev1.Protocol, port uint16) bool {
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
			cancel()
			if done != nil {
				<-done
			}
			return false
		}
	}
}

func (p *polEnv) sync(t *testing.T, nr *policy.NodeRules) {
	t.Helper()
	if err := p.pt.Sync(nr); err != nil {
		t.Fatalf("Sync: %v", err)
	}
}

// expectConns checks each connection against want.
func (p *polEnv) expectConns(t *testing.T, want map[policy.Conn]bool) {
	t.Helper()
	for c, w := range want {
		if got := p.try(t, c.Src, c.Dst, c.Protocol, c.Port); got != w {
			t.Errorf("%s: passed=%v, want %v\n%s", c, got, w, p.listing(t))
		}
	}
}

// listing is the table as nft shows it, for failure messages (only when
// the nft binary is there: weft itself never runs it).
func (p *polEnv) listing(t *testing.T) string {
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
		tcpConn(podA, podC, 80): true, tcpConn(podB, podA, 8080): true, udpConn(podB, farOut, 53): true,
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
