package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/weft-net/weft/internal/ethtool"
	"github.com/weft-net/weft/internal/netstat"
	"github.com/weft-net/weft/tunnel"
)

// txPackets is what the kernel sent through device dev of node n so far:
// for weft-vx, packets wrapped in VXLAN; for weft-tun, packets handed to
// the router (the userspace udp path).
func txPackets(t *testing.T, n *Node, dev string) uint64 {
	t.Helper()
	var tx uint64
	err := n.NS.WithHandle(func(h *netlink.Handle) error {
		l, err := h.LinkByName(dev)
		if err != nil {
			return err
		}
		if s := l.Attrs().Statistics; s != nil {
			tx = s.TxPackets
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s: reading the counters of %s: %v", n.Name, dev, err)
	}
	return tx
}

// routeDev is the device node n's kernel routes dst through.
func routeDev(ctx context.Context, n *Node, dst netip.Addr) string {
	out, err := n.NS.Exec(ctx, "ip", "-o", "route", "get", dst.String())
	if err != nil {
		return fmt.Sprintf("ip route get %s: %v", dst, err)
	}
	f := strings.Fields(string(out))
	for i, w := range f {
		if w == "dev" && i+1 < len(f) {
			return f[i+1]
		}
	}
	return string(out)
}

// overVXLAN sends 4 MB of TCP from one pod to the other and shows that
// it went through the kernel's VXLAN device: the sender's route to the
// pod is on weft-vx, weft-vx's counters grow by the transfer, and
// weft-tun's (the userspace path) hardly at all.
func overVXLAN(t *testing.T, ctx context.Context, c *Cluster, from, to *Pod) {
	t.Helper()
	n := from.Node
	if dev := routeDev(ctx, n, to.IP); dev != vxlanDev {
		t.Errorf("%s routes %s through %q, want %s", n.Name, to.IP, dev, vxlanDev)
	}
	vx0, tun0 := txPackets(t, n, vxlanDev), txPackets(t, n, "weft-tun")
	tctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if err := transfer(tctx, from, to, 4<<20); err != nil {
		t.Fatalf("4 MB from %s to %s: %v\n%s", from, to, err, routerLogs(c))
	}
	vx, tun := txPackets(t, n, vxlanDev)-vx0, txPackets(t, n, "weft-tun")-tun0
	t.Logf("4 MB %s -> %s: %s sent %d packets on %s, %d on weft-tun", from, to, n.Name, vx, vxlanDev, tun)
	// 4 MB are at least 64 segments of 64 KB (GSO) on the VXLAN device.
	if vx < 64 || tun*20 > vx {
		t.Errorf("%s -> %s did not go over vxlan: %d packets on %s, %d on weft-tun", from, to, vx, vxlanDev, tun)
	}
}

// connLines is node n's `weft status connections`, by peer name.
func connLines(t *testing.T, ctx context.Context, n *Node) map[string]string {
	t.Helper()
	out, err := n.Weft(ctx, "status", "connections")
	if err != nil {
		t.Fatalf("%s: weft status connections: %s (%v)", n.Name, out, err)
	}
	lines := map[string]string{}
	for _, l := range strings.Split(string(out), "\n") {
		for _, f := range strings.Fields(l) {
			if i := strings.IndexByte(f, '('); i > 0 && strings.HasSuffix(f, ")") {
				lines[f[:i]] = l
			}
		}
	}
	return lines
}

// wantStatus checks that node n's status says, for peer o, each of want.
func wantStatus(t *testing.T, ctx context.Context, n, o *Node, want ...string) {
	t.Helper()
	l := connLines(t, ctx, n)[o.PeerName]
	for _, w := range want {
		if !strings.Contains(l, w) {
			t.Errorf("%s's status for %s: %q, want %q in it", n.Name, o.Name, l, w)
		}
	}
}

// vxlanIndex is the interface index of node n's weft-vx: a device made
// again gets another.
func vxlanIndex(t *testing.T, n *Node) int {
	t.Helper()
	var idx int
	err := n.NS.WithHandle(func(h *netlink.Handle) error {
		l, err := h.LinkByName(vxlanDev)
		if err == nil {
			idx = l.Attrs().Index
		}
		return err
	})
	if err != nil {
		t.Fatalf("%s: %s: %v", n.Name, vxlanDev, err)
	}
	return idx
}

func hasVXLANDevice(n *Node) bool {
	err := n.NS.WithHandle(func(h *netlink.Handle) error {
		_, err := h.LinkByName(vxlanDev)
		return err
	})
	return err == nil
}

// TestAutoVXLAN: three nodes with the default --encap auto and no
// password send to each other with the kernel's VXLAN device: every pod
// reaches every other pod, TCP between every pair of nodes goes through
// weft-vx (its counters, and the routes) and not weft-tun, and the status
// says vxlan with the reason. A router killed and restarted adopts
// weft-vx without cutting a pod-to-pod ping; weft reset removes it.
func TestAutoVXLAN(t *testing.T) {
	c, ctx := startMeshCluster(t, 3)
	waitModes(t, ctx, c, "vxlan")
	var pods []*Pod
	for _, n := range c.Nodes {
		p, err := n.AddPod(ctx, "p")
		if err != nil {
			t.Fatal(err)
		}
		pods = append(pods, p)
	}
	pingAll(t, ctx, c, pods)
	for i := range pods {
		for j := range pods {
			if i != j {
				overVXLAN(t, ctx, c, pods[i], pods[j])
			}
		}
	}
	for _, n := range c.Nodes {
		for _, o := range c.Nodes {
			if o != n {
				wantStatus(t, ctx, n, o, "vxlan (kernel)", "unencrypted", "no password")
			}
		}
	}
	if out, err := c.Nodes[0].Weft(ctx, "status", "connections"); err == nil {
		t.Logf("n0: weft status connections:\n%s", out)
	}

	// kill -9 of n2's router under a ping from n0 to n2: the kernel goes
	// on, the new router adopts weft-vx and its entries.
	n2 := c.Nodes[2]
	f := startFlow(t, pods[0], pods[2])
	f.waitReplies(t, ctx, "the ping to answer", 20)
	before := vxlanIndex(t, n2)
	if err := n2.Router().Kill(); err != nil {
		t.Fatal(err)
	}
	f.waitReplies(t, ctx, "the ping to go on while n2 has no router", 20)
	restartVXLANRouter(t, ctx, c, n2)
	f.waitReplies(t, ctx, "the ping to go on after n2's router is back", 20)
	sent, got := f.stop(t)
	t.Logf("kill -9 of n2's router (auto): %d sent, %d received", sent, got)
	if lost := sent - got; lost > 5 {
		t.Errorf("kill -9 of an auto router lost %d of %d packets, want at most a few\n%s", lost, sent, routerLogs(c))
	}
	if idx := vxlanIndex(t, n2); idx != before {
		t.Errorf("n2's restarted router made %s again (index %d, was %d) instead of adopting it", vxlanDev, idx, before)
	}
	overVXLAN(t, ctx, c, pods[2], pods[0])

	if err := n2.RemovePod(ctx, pods[2]); err != nil {
		t.Fatal(err)
	}
	if out, err := n2.Weft(ctx, "reset"); err != nil {
		t.Fatalf("weft reset: %s (%v)", out, err)
	}
	if err := n2.Router().Proc().Wait(); err != nil {
		t.Errorf("the router exited with %v after reset", err)
	}
	if hasVXLANDevice(n2) {
		t.Errorf("%s is still there after weft reset:\n%s", vxlanDev, vxlanEntries(ctx, n2))
	}
}

// TestAutoMixed: n2 runs --encap udp, n0 and n1 the default auto. The
// pairs with n2 use udp (both ways: n2 advertises no vxlan, and has no
// weft-vx), n0 and n1 vxlan; every pod reaches every other, and the
// status says why.
func TestAutoMixed(t *testing.T) {
	c, ctx := startSecCluster(t, 3, 3, func(n *Node) []string {
		if n.Name == "n2" {
			return []string{"--encap", "udp"}
		}
		return nil
	})
	n0, n1, n2 := c.Nodes[0], c.Nodes[1], c.Nodes[2]
	if n2.Name != "n2" {
		t.Fatalf("the third node is %s, want n2", n2.Name)
	}
	want := map[[2]*Node]string{{n0, n1}: "vxlan", {n1, n0}: "vxlan", {n0, n2}: "udp", {n2, n0}: "udp", {n1, n2}: "udp", {n2, n1}: "udp"}
	waitUntil(t, ctx, "n0 and n1 to use vxlan, and udp with n2", func() (bool, string) {
		var seen []string
		ok := true
		for _, n := range c.Nodes {
			m, err := dataModes(ctx, n)
			seen = append(seen, fmt.Sprintf("%s:%v %v", n.Name, m, err))
			for _, o := range c.Nodes {
				if o != n && m[o.PeerName] != want[[2]*Node{n, o}] {
					ok = false
				}
			}
		}
		return ok, strings.Join(seen, " ")
	})
	var pods []*Pod
	for _, n := range c.Nodes {
		p, err := n.AddPod(ctx, "p")
		if err != nil {
			t.Fatal(err)
		}
		pods = append(pods, p)
	}
	pingAll(t, ctx, c, pods)
	overVXLAN(t, ctx, c, pods[0], pods[1])
	overVXLAN(t, ctx, c, pods[1], pods[0])
	for _, pair := range [][2]*Pod{{pods[0], pods[2]}, {pods[2], pods[1]}} {
		if dev := routeDev(ctx, pair[0].Node, pair[1].IP); dev != "weft-tun" {
			t.Errorf("%s routes %s through %q, want weft-tun (udp)", pair[0].Node.Name, pair[1].IP, dev)
		}
		tctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		err := transfer(tctx, pair[0], pair[1], 4<<20)
		cancel()
		if err != nil {
			t.Fatalf("4 MB from %s to %s: %v\n%s", pair[0], pair[1], err, routerLogs(c))
		}
	}
	if hasVXLANDevice(n2) {
		t.Errorf("n2 (--encap udp) has %s", vxlanDev)
	}
	wantStatus(t, ctx, n0, n1, "vxlan (kernel)", "no password")
	wantStatus(t, ctx, n0, n2, "udp", "the peer has no vxlan")
	wantStatus(t, ctx, n2, n0, "udp", "--encap udp")
	if out, err := n0.Weft(ctx, "status", "connections"); err == nil {
		t.Logf("n0: weft status connections:\n%s", out)
	}
}

// TestAutoPassword: with a password and no --trusted-subnets, auto uses
// only the sealed udp path: no node has weft-vx, a capture of the
// underlay during a marker run (UDP and TCP, every marker received) holds
// no datagram to the VXLAN port and no marker, and the status says
// "encrypted: outside trusted subnets".
func TestAutoPassword(t *testing.T) {
	pw := writePassword(t, "pw", "a shared secret for the auto password test")
	r := runMarker(t, "--password-file", pw)
	for _, d := range r.dgs {
		if d.Dst.Port() == tunnel.DefaultVXLANPort || d.Src.Port() == tunnel.DefaultVXLANPort {
			t.Fatalf("the capture holds a VXLAN datagram %v -> %v with a password and no trusted subnets", d.Src, d.Dst)
		}
	}
	if n := r.markerFrames(); n != 0 {
		t.Errorf("%d captured datagrams hold the marker with a password", n)
	}
	n0, n1 := r.c.Nodes[0], r.c.Nodes[1]
	for _, n := range []*Node{n0, n1} {
		if hasVXLANDevice(n) {
			t.Errorf("%s has %s with a password and no trusted subnets", n.Name, vxlanDev)
		}
		m, err := dataModes(r.ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		for peer, mode := range m {
			if peer != n.PeerName && mode != "udp" {
				t.Errorf("%s sends to %s with %q, want udp", n.Name, peer, mode)
			}
		}
	}
	wantStatus(t, r.ctx, n0, n1, "udp", "encrypted", "encrypted: outside trusted subnets")
}

// TestAutoTrustedSubnets: with a password and --trusted-subnets covering
// the underlay, auto uses vxlan (plaintext on purpose) between the nodes,
// and the status says "trusted subnet".
func TestAutoTrustedSubnets(t *testing.T) {
	pw := writePassword(t, "pw", "a shared secret for the auto trusted test")
	c, ctx := startSecCluster(t, 2, 2, func(n *Node) []string {
		return []string{"--password-file", pw, "--trusted-subnets", netip.PrefixFrom(n.UnderlayIP, 24).Masked().String()}
	})
	waitModes(t, ctx, c, "vxlan")
	n0, n1 := c.Nodes[0], c.Nodes[1]
	a, err := n0.AddPod(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := n1.AddPod(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	pingAll(t, ctx, c, []*Pod{a, b})
	overVXLAN(t, ctx, c, a, b)
	overVXLAN(t, ctx, c, b, a)
	wantStatus(t, ctx, n0, n1, "vxlan (kernel)", "trusted", "trusted subnet")
}

// blockUnderlayVXLAN makes the underlay drop every VXLAN datagram between
// the nodes (a firewall that does not know the port), or those that also
// match more (e.g. "ip length > 1000": an MTU black hole), or lets them
// pass again: a bridge-family rule on the underlay bridge, in the underlay
// namespace.
func blockUnderlayVXLAN(t *testing.T, ctx context.Context, c *Cluster, on bool, more ...string) {
	t.Helper()
	const table = "weftvxlanblock"
	_, _ = c.Underlay.Exec(ctx, "nft", "delete", "table", "bridge", table)
	if !on {
		return
	}
	for _, cmd := range [][]string{
		{"nft", "add", "table", "bridge", table},
		{"nft", "add", "chain", "bridge", table, "vxdrop", "{ type filter hook forward priority 0 ; policy accept ; }"},
		append(append([]string{"nft", "add", "rule", "bridge", table, "vxdrop", "udp", "dport", fmt.Sprint(tunnel.DefaultVXLANPort)}, more...), "drop"),
	} {
		if out, err := c.Underlay.Exec(ctx, cmd...); err != nil {
			t.Fatalf("%v in the underlay: %s (%v)", cmd, out, err)
		}
	}
}

// vxlanPodPair starts two auto nodes, each with a pod, and waits until
// they send each other vxlan and both paths' probes are answered.
func vxlanPodPair(t *testing.T) (*Cluster, context.Context, *Pod, *Pod) {
	t.Helper()
	c, ctx := startMeshCluster(t, 2)
	waitModes(t, ctx, c, "vxlan")
	n0, n1 := c.Nodes[0], c.Nodes[1]
	p0, err := n0.AddPod(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	p1, err := n1.AddPod(ctx, "p")
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, "both vxlan paths probed and answered", func() (bool, string) {
		a, b := connLines(t, ctx, n0)[n1.PeerName], connLines(t, ctx, n1)[n0.PeerName]
		return strings.Contains(a, "vxlan (kernel)") && strings.Contains(b, "vxlan (kernel)") && pathOK(ctx, n0, n1) && pathOK(ctx, n1, n0), a + " | " + b
	})
	return c, ctx, p0, p1
}

// TestAutoVXLANFallback: the underlay starts dropping the VXLAN port
// under a continuous ping between pods of two auto nodes: both nodes'
// probes go unanswered, each falls back to udp for the other (the
// routes move to weft-tun), the ping goes on, the status says why and
// the change is counted. Once the port passes again both go back to
// vxlan after the hold.
func TestAutoVXLANFallback(t *testing.T) {
	c, ctx, p0, p1 := vxlanPodPair(t)
	n0, n1 := p0.Node, p1.Node
	f := startFlow(t, p0, p1)
	f.waitReplies(t, ctx, "the ping over vxlan", 20)

	blockUnderlayVXLAN(t, ctx, c, true)
	t.Cleanup(func() { blockUnderlayVXLAN(t, context.Background(), c, false) })
	blocked := time.Now()
	waitPairMode(t, ctx, n0, n1, "udp")
	t.Logf("both nodes on udp %s after the underlay began to drop UDP %d", time.Since(blocked).Round(100*time.Millisecond), tunnel.DefaultVXLANPort)
	f.waitReplies(t, ctx, "the ping to go on over udp", 20)
	if dev := routeDev(ctx, n0, p1.IP); dev != "weft-tun" {
		t.Errorf("n0 routes %s through %q after the fallback, want weft-tun", p1.IP, dev)
	}
	wantStatus(t, ctx, n0, n1, "udp", "vxlan path down since", "no answer to 4 probes")
	wantStatus(t, ctx, n1, n0, "udp", "vxlan path down since")
	if out, err := n0.Weft(ctx, "status", "connections"); err == nil {
		t.Logf("n0: weft status connections:\n%s", out)
	}
	if v, err := metricSamples(ctx, n0, "weft_tunnel_vxlan_path_changes_total"); err != nil || v[`to="down"`] < 1 {
		t.Errorf("n0's weft_tunnel_vxlan_path_changes_total: %v (%v), want to=\"down\" counted", v, err)
	}

	blockUnderlayVXLAN(t, ctx, c, false)
	waitPairMode(t, ctx, n0, n1, "vxlan")
	f.waitReplies(t, ctx, "the ping back on vxlan", 20)
	sent, got := f.stop(t)
	t.Logf("ping across the fallback and back: %d sent, %d received", sent, got)
	if dev := routeDev(ctx, n0, p1.IP); dev != vxlanDev {
		t.Errorf("n0 routes %s through %q after the recovery, want %s", p1.IP, dev, vxlanDev)
	}
	overVXLAN(t, ctx, c, p0, p1)

	// An MTU black hole: the underlay drops the large VXLAN datagrams
	// only, without an ICMP. The full-size probes go unanswered, the small
	// ones are answered: down, and the reason says so.
	blockUnderlayVXLAN(t, ctx, c, true, "ip", "length", ">", "1000")
	waitUntil(t, ctx, "n0 to fall back to udp for the black hole", func() (bool, string) {
		m0, err := dataModes(ctx, n0)
		return m0[n1.PeerName] == "udp", fmt.Sprintf("n0: %v %v", m0, err)
	})
	wantStatus(t, ctx, n0, n1, "udp", "vxlan path down since", "bytes are lost while small ones pass")
	blockUnderlayVXLAN(t, ctx, c, false)
}

// spoilInnerChecksums models, on the way from node from to node to, a
// network device that completes the inner checksums of VXLAN wrongly (the
// checksum-offload fault flannel and Calico users met on some virtual
// NICs): from's underlay computes every checksum in software (tx offload
// off: across veths a checksum otherwise travels unfinished and trusted),
// and to's underlay ingress overwrites the inner UDP (non-zero: one
// without a checksum passes) and TCP checksums of the VXLAN datagrams
// from from. The outer UDP checksum then no longer adds up either, and
// to's kernel drops the datagram, as on real hardware. off removes the
// rule (the offload stays off).
func spoilInnerChecksums(t *testing.T, ctx context.Context, from, to *Node, on bool) {
	t.Helper()
	const table = "weftcsumfault"
	_, _ = to.NS.Exec(ctx, "nft", "delete", "table", "netdev", table)
	if !on {
		return
	}
	if err := from.NS.Do(func() error { return ethtool.SetTxChecksum("eth0", false) }); err != nil {
		t.Fatalf("%s: %v", from.Name, err)
	}
	// Without IP options inside, the inner IPv4 header starts 50 bytes
	// into the outer one: its protocol at byte 59, the UDP checksum at
	// 76, the TCP checksum at 86.
	match := []string{"ip", "saddr", from.UnderlayIP.String(), "udp", "dport", fmt.Sprint(tunnel.DefaultVXLANPort)}
	for _, cmd := range [][]string{
		{"nft", "add", "table", "netdev", table},
		{"nft", "add", "chain", "netdev", table, "in", "{ type filter hook ingress device \"eth0\" priority 0 ; policy accept ; }"},
		append(append([]string{"nft", "add", "rule", "netdev", table, "in"}, match...), "@nh,472,8", "17", "@nh,608,16", "!=", "0", "@nh,608,16", "set", "0x0bad"),
		append(append([]string{"nft", "add", "rule", "netdev", table, "in"}, match...), "@nh,472,8", "6", "@nh,688,16", "set", "0x0bad"),
	} {
		if out, err := to.NS.Exec(ctx, cmd...); err != nil {
			t.Fatalf("%v in %s: %s (%v)", cmd, to.Name, out, err)
		}
	}
}

// udpCsumErrors is node n's kernel's count of UDP datagrams dropped for
// their checksum (Udp InCsumErrors, /proc/net/snmp).
func udpCsumErrors(t *testing.T, n *Node) int64 {
	t.Helper()
	var v int64
	if err := n.NS.Do(func() (err error) { v, err = netstat.SNMP("Udp", "InCsumErrors"); return err }); err != nil {
		t.Fatalf("%s: %v", n.Name, err)
	}
	return v
}

// TestAutoVXLANChecksumFault: a TCP connection between pods of two auto
// nodes on vxlan; the way from n0 to n1 starts to spoil inner checksums
// (spoilInnerChecksums). n1's kernel drops n0's VXLAN for its checksum,
// while ARP and ping would pass; n0's checksum probes are lost while
// their controls are answered, so n0 falls back to udp for n1, says why,
// counts it, and the connection goes on (TCP retransmits across the gap).
// n1's path to n0 is sound and stays vxlan. Once the checksums arrive
// right again n0 goes back to vxlan after the hold, the connection still
// up.
func TestAutoVXLANChecksumFault(t *testing.T) {
	_, ctx, p0, p1 := vxlanPodPair(t)
	n0, n1 := p0.Node, p1.Node
	f := startTCPFlow(t, ctx, p0, p1)
	f.waitTrips(t, ctx, "messages over vxlan", 20)

	errs := udpCsumErrors(t, n1)
	spoilInnerChecksums(t, ctx, n0, n1, true)
	t.Cleanup(func() { spoilInnerChecksums(t, context.Background(), n0, n1, false) })
	spoiled := time.Now()
	waitUntil(t, ctx, "n0 to fall back to udp for n1", func() (bool, string) {
		m0, err := dataModes(ctx, n0)
		return m0[n1.PeerName] == "udp", fmt.Sprintf("n0: %v %v", m0, err)
	})
	t.Logf("n0 on udp for n1 %s after the checksums began to go wrong", time.Since(spoiled).Round(100*time.Millisecond))
	wantStatus(t, ctx, n0, n1, "udp", "vxlan path down since", "checksum-offload fault")
	if m1, err := dataModes(ctx, n1); err != nil || m1[n0.PeerName] != "vxlan" {
		t.Errorf("n1 sends n0 %q (%v), want vxlan: only n0's checksums are spoiled", m1[n0.PeerName], err)
	}
	if n := udpCsumErrors(t, n1); n <= errs {
		t.Errorf("n1's kernel dropped no datagram for its checksum (%d, was %d): the modelled fault did not happen", n, errs)
	}
	if v, err := metricSamples(ctx, n0, "weft_tunnel_vxlan_checksum_probes_total"); err != nil || v[`outcome="lost"`] < 3 {
		t.Errorf("n0's weft_tunnel_vxlan_checksum_probes_total: %v (%v), want outcome=\"lost\" counted at least 3 times", v, err)
	}
	f.waitTrips(t, ctx, "the connection to go on over udp", 20)
	if out, err := n0.Weft(ctx, "status", "connections"); err == nil {
		t.Logf("n0: weft status connections:\n%s", out)
	}

	spoilInnerChecksums(t, ctx, n0, n1, false)
	waitPairMode(t, ctx, n0, n1, "vxlan")
	f.waitTrips(t, ctx, "the connection back on vxlan", 20)
	f.stop(t)
}

// waitPairMode waits until a and b send to each other with mode.
func waitPairMode(t *testing.T, ctx context.Context, a, b *Node, mode string) {
	t.Helper()
	waitUntil(t, ctx, a.Name+" and "+b.Name+" to send each other "+mode, func() (bool, string) {
		ma, erra := dataModes(ctx, a)
		mb, errb := dataModes(ctx, b)
		return ma[b.PeerName] == mode && mb[a.PeerName] == mode, fmt.Sprintf("%s: %v %v, %s: %v %v", a.Name, ma, erra, b.Name, mb, errb)
	})
}

// pathOK reports whether n's probes of o's vxlan path were answered.
func pathOK(ctx context.Context, n, o *Node) bool {
	data, err := n.HTTPGet(ctx, "/report")
	if err != nil {
		return false
	}
	var rep connReport
	if err := json.Unmarshal(data, &rep); err != nil {
		return false
	}
	for _, c := range rep.Router.Connections {
		if c.Peer == o.PeerName {
			return c.Path == "ok"
		}
	}
	return false
}
