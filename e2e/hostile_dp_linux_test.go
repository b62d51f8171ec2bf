package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The data-plane attacker tests of issue 12: a hostile pod, in a cluster
// whose data frames are plaintext (no password, or trusted subnets),
// sends forged data frames, raw IPIP and spoofed-source packets at
// another node and at pods on its own node. Nothing reaches a pod, and
// every drop is counted: by the node's nftables guard
// (weft_guard_dropped_packets_total) or by the data plane
// (weft_tunnel_dropped_packets_total).
//
// Receipt is checked by a listener in each victim pod that waits for a
// control datagram sent after the forged ones along the same path: the
// first datagram it gets must be the control.

const hostilePort = 7100

// guardDrops returns n's weft_guard_dropped_packets_total by reason.
func guardDrops(ctx context.Context, n *Node) (map[string]float64, error) {
	m, err := metricSamples(ctx, n, "weft_guard_dropped_packets_total")
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for labels, v := range m {
		if r, ok := strings.CutPrefix(labels, `reason="`); ok {
			out[strings.TrimSuffix(r, `"`)] = v
		}
	}
	return out, nil
}

// ipv4IPIP is an IPIP packet: an outer IPv4 header of protocol 4 around
// inner.
func ipv4IPIP(src, dst netip.Addr, inner []byte) []byte {
	b := ipv4UDP(netip.AddrPortFrom(src, 0), netip.AddrPortFrom(dst, 0), nil)[:20]
	b = append(bytes.Clone(b), inner...)
	b[9] = unix.IPPROTO_IPIP
	b[2], b[3] = byte(len(b)>>8), byte(len(b))
	b[10], b[11] = 0, 0 // the kernel fills in the checksum of a raw IPv4 packet
	return b
}

// waitGrown waits until every counter of want has grown by at least its
// value since before.
func waitGrown(t *testing.T, ctx context.Context, what string, read func() (map[string]float64, error), before, want map[string]float64) map[string]float64 {
	t.Helper()
	var diff map[string]float64
	waitUntil(t, ctx, what, func() (bool, string) {
		after, err := read()
		if err != nil {
			return false, err.Error()
		}
		diff = grown(before, after)
		for r, v := range want {
			if diff[r] < v {
				return false, fmt.Sprintf("grown: %v, want at least %v", diff, want)
			}
		}
		return true, ""
	})
	return diff
}

// expectControl sends a control datagram from ns to the pod's sink and
// checks that it is the first datagram the sink gets: the forged ones,
// sent before it on the same path, never arrived.
func expectControl(t *testing.T, ctx context.Context, send func(payload []byte) error, sink *udpSink, to *Pod) {
	t.Helper()
	marker := newMarker("control")
	if err := send(markerDatagram(marker, 0)); err != nil {
		t.Fatal(err)
	}
	b, ok := sink.next(20 * time.Second)
	switch {
	case !ok:
		t.Fatalf("the control datagram did not reach %s", to)
	case markerSeq(b, marker) != 0:
		t.Fatalf("pod %s received a forged datagram: %q", to, b[:min(len(b), 64)])
	}
}

func TestHostilePod(t *testing.T) {
	pw := writePassword(t, "pw", "a shared secret for the hostile pod test")
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"no password", nil},
		{"trusted subnets", []string{"--password-file", pw, "--trusted-subnets", "10.250.0.0/24"}},
	} {
		t.Run(tc.name, func(t *testing.T) { hostilePod(t, tc.args) })
	}
}

func hostilePod(t *testing.T, args []string) {
	c, ctx := startSecCluster(t, 2, 2, func(*Node) []string { return args })
	n0, n1 := c.Nodes[0], c.Nodes[1]
	attacker, err := n0.AddPod(ctx, "attacker")
	if err != nil {
		t.Fatal(err)
	}
	local, err := n0.AddPod(ctx, "local")
	if err != nil {
		t.Fatal(err)
	}
	remote, err := n1.AddPod(ctx, "remote")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []*Pod{local, remote} {
		if err := Ping(ctx, attacker.NS, p.IP); err != nil {
			t.Fatalf("%v\n%s", err, routerLogs(c))
		}
	}
	atLocal, atRemote := listenUDP(t, local, hostilePort), listenUDP(t, remote, hostilePort)
	toLocal := netip.AddrPortFrom(local.IP, hostilePort)
	toRemote := netip.AddrPortFrom(remote.IP, hostilePort)
	forged := func(src netip.Addr, dst netip.AddrPort) []byte {
		return ipv4UDP(netip.AddrPortFrom(src, 40000), dst, []byte(newMarker("forged")))
	}
	guard0 := func() (map[string]float64, error) { return guardDrops(ctx, n0) }
	before0, err := guard0()
	if err != nil {
		t.Fatal(err)
	}

	// 1. Forged data frames, with any inner source, to the data port of
	// the other node and of its own (by underlay address and gateway).
	frames := []struct {
		to    netip.AddrPort
		inner []byte
	}{
		{netip.AddrPortFrom(n1.UnderlayIP, dataPort), forged(local.IP, toRemote)},
		{netip.AddrPortFrom(n1.UnderlayIP, dataPort), forged(attacker.IP, toRemote)},
		{netip.AddrPortFrom(n0.UnderlayIP, dataPort), forged(remote.IP, toLocal)},
		{netip.AddrPortFrom(attacker.Gateway, dataPort), forged(remote.IP, toLocal)},
	}
	for _, f := range frames {
		if err := sendUDP(attacker.NS, f.to, weftFrame(0, 0, 1, f.inner)); err != nil {
			t.Fatal(err)
		}
	}
	// 2. Raw IPIP to both nodes.
	for _, ipip := range [][]byte{
		ipv4IPIP(attacker.IP, n1.UnderlayIP, forged(local.IP, toRemote)),
		ipv4IPIP(attacker.IP, n0.UnderlayIP, forged(remote.IP, toLocal)),
	} {
		if err := sendRaw(attacker.NS, ipip); err != nil {
			t.Fatal(err)
		}
	}
	// 3. The gossip port of the other node.
	if err := sendUDP(attacker.NS, netip.AddrPortFrom(n1.UnderlayIP, 6783), []byte("not gossip")); err != nil {
		t.Fatal(err)
	}
	// 4. Spoofed sources: to pods on both nodes, and a frame that claims
	// to come from the other node's data port.
	for _, pkt := range [][]byte{
		forged(local.IP, toRemote),
		forged(remote.IP, toLocal),
		forged(netip.MustParseAddr("10.40.0.9"), toLocal),
		ipv4UDP(netip.AddrPortFrom(n1.UnderlayIP, dataPort), netip.AddrPortFrom(n0.UnderlayIP, dataPort),
			weftFrame(0, 0, 1, forged(remote.IP, toLocal))),
	} {
		if err := sendRaw(attacker.NS, pkt); err != nil {
			t.Fatal(err)
		}
	}
	diff := waitGrown(t, ctx, "n0's guard counting the pod's packets", guard0, before0,
		map[string]float64{"pod-to-router": 7, "pod-spoofed-source": 4})
	t.Logf("n0's guard dropped the hostile pod's packets: %v", diff)

	// Nothing reached a pod: the first datagram each gets is a control
	// sent after the forged ones from the same pod.
	expectControl(t, ctx, func(b []byte) error { return sendUDP(attacker.NS, toRemote, b) }, atRemote, remote)
	expectControl(t, ctx, func(b []byte) error { return sendUDP(attacker.NS, toLocal, b) }, atLocal, local)

	// 5. Past the guard (as a member could, or a pod without it): a frame
	// from n0's own address whose inner source is not in n0's ranges is
	// dropped by n1's data plane as spoofed-source; one from n0's pod
	// range is delivered.
	tunnel1 := func() (map[string]float64, error) { return dropped(ctx, n1) }
	before1, err := tunnel1()
	if err != nil {
		t.Fatal(err)
	}
	for _, src := range []netip.Addr{remote.IP, netip.MustParseAddr("192.0.2.7")} {
		if err := sendUDP(n0.NS, netip.AddrPortFrom(n1.UnderlayIP, dataPort), weftFrame(0, 0, 1, forged(src, toRemote))); err != nil {
			t.Fatal(err)
		}
	}
	diff = waitGrown(t, ctx, "n1's data plane counting spoofed sources", tunnel1, before1, map[string]float64{"spoofed-source": 2})
	t.Logf("n1's data plane dropped the frames with foreign inner sources: %v", diff)
	expectControl(t, ctx, func(b []byte) error {
		inner := ipv4UDP(netip.AddrPortFrom(attacker.IP, 40000), toRemote, b)
		return sendUDP(n0.NS, netip.AddrPortFrom(n1.UnderlayIP, dataPort), weftFrame(0, 0, 1, inner))
	}, atRemote, remote)

	// 6. IPIP from an underlay host that is no peer never reaches the
	// data plane: n1's guard drops it.
	guard1 := func() (map[string]float64, error) { return guardDrops(ctx, n1) }
	before, err := guard1()
	if err != nil {
		t.Fatal(err)
	}
	gw := netip.MustParseAddr("10.250.0.254") // the underlay bridge's address
	if err := sendRaw(c.Underlay, ipv4IPIP(gw, n1.UnderlayIP, forged(attacker.IP, toRemote))); err != nil {
		t.Fatal(err)
	}
	waitGrown(t, ctx, "n1's guard counting IPIP from no peer", guard1, before, map[string]float64{"ipip-non-peer": 1})
	expectControl(t, ctx, func(b []byte) error { return sendUDP(attacker.NS, toRemote, b) }, atRemote, remote)
}

// TestGuardAcrossRestart: what an operator expects of the pods' guard when
// the router crashes and comes back. While it is down, the pods on the node
// keep talking and still cannot spoof (the rules and the pods set live in
// the kernel); the restarted router keeps the tables (their counters go on)
// and reconciles the set with its allocator: a new pod is let through, a
// deleted one's entry goes.
func TestGuardAcrossRestart(t *testing.T) {
	c, ctx := startSecCluster(t, 1, 1, func(*Node) []string { return nil })
	n0 := c.Nodes[0]
	a, err := n0.AddPod(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := n0.AddPod(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	if err := Ping(ctx, a.NS, b.IP); err != nil {
		t.Fatal(err)
	}
	before, err := guardDrops(ctx, n0)
	if err != nil {
		t.Fatal(err)
	}
	if err := n0.Router().Kill(); err != nil {
		t.Fatal(err)
	}
	<-n0.Router().Proc().Exited()

	atB := listenUDP(t, b, hostilePort)
	toB := netip.AddrPortFrom(b.IP, hostilePort)
	if err := sendRaw(a.NS, ipv4UDP(netip.AddrPortFrom(netip.MustParseAddr("10.40.0.9"), 40000), toB, []byte("forged"))); err != nil {
		t.Fatal(err)
	}
	expectControl(t, ctx, func(p []byte) error { return sendUDP(a.NS, toB, p) }, atB, b)
	if err := Ping(ctx, a.NS, b.IP); err != nil {
		t.Fatalf("with the router down: %v", err)
	}

	if _, err := n0.StartRouter(n0.Router().Args...); err != nil {
		t.Fatal(err)
	}
	if err := n0.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	read := func() (map[string]float64, error) { return guardDrops(ctx, n0) }
	diff := waitGrown(t, ctx, "the spoofed packet sent while the router was down, still counted", read, before, map[string]float64{"pod-spoofed-source": 1})
	t.Logf("guard drops since before the crash: %v", diff)

	cPod, err := n0.AddPod(ctx, "c")
	if err != nil {
		t.Fatal(err)
	}
	if err := Ping(ctx, cPod.NS, a.IP); err != nil {
		t.Fatalf("a pod added after the restart: %v", err)
	}
	if err := n0.DelPod(ctx, b); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, "the pods set to follow the allocator", func() (bool, string) {
		out, err := n0.NS.Exec(ctx, "nft", "list", "set", "bridge", "weft", "pods")
		if err != nil {
			return false, err.Error()
		}
		s := string(out)
		ok := strings.Contains(s, " . "+a.IP.String()) && strings.Contains(s, " . "+cPod.IP.String()) && !strings.Contains(s, " . "+b.IP.String()+",") && !strings.Contains(s, " . "+b.IP.String()+" ")
		return ok, s
	})
}
