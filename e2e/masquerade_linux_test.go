package e2e

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestNodeTrafficMasqueraded (found by make conformance: a NodePort, or a
// ClusterIP from a host-network pod, whose endpoint is a pod on another
// node): a node's own traffic to a pod on another node that a masquerade
// gives the tunnel device's address (kube-proxy's rule, here a plain
// nftables masquerade in the node's namespace, from the node's underlay
// address) reaches the pod, and the answer comes back. The old code left
// weft-tun without an address: the masquerade took the node's underlay
// address, and the receiving router dropped the packet as a spoofed
// source.
func TestNodeTrafficMasqueraded(t *testing.T) {
	c, ctx := startMeshCluster(t, 2, "--encap", "udp")
	waitModes(t, ctx, c, "udp")
	p, err := c.Nodes[1].AddPod(ctx, "p0")
	if err != nil {
		t.Fatal(err)
	}
	n0 := c.Nodes[0]
	for _, argv := range [][]string{
		{"nft", "add", "table", "ip", "kubeproxylike"},
		{"nft", "add", "chain", "ip", "kubeproxylike", "post", "{ type nat hook postrouting priority srcnat; }"},
		{"nft", "add", "rule", "ip", "kubeproxylike", "post", "oifname", "weft-tun", "ip", "saddr", n0.UnderlayIP.String(), "masquerade"},
	} {
		if out, err := n0.NS.Exec(ctx, argv...); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(argv, " "), err, out)
		}
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	last := PingFrom(pctx, n0.NS, n0.UnderlayIP, p.IP)
	if last != nil {
		addrs, _ := n0.NS.Exec(ctx, "ip", "-4", "addr", "show", "dev", "weft-tun")
		drops, _ := c.Nodes[1].HTTPGet(ctx, "/metrics")
		var spoofed []string
		for _, l := range strings.Split(string(drops), "\n") {
			if strings.Contains(l, "spoofed") && !strings.HasPrefix(l, "#") {
				spoofed = append(spoofed, l)
			}
		}
		t.Fatalf("n0's masqueraded ping (from %s) to %s on n1: %v\nweft-tun on n0: %s\nn1's spoof drops: %s\n%s",
			n0.UnderlayIP, p.IP, last, addrs, strings.Join(spoofed, "\n"), routerLogs(c))
	}
	// The node's own ping without the masquerade's help still works too.
	if err := Ping(ctx, n0.NS, p.IP); err != nil {
		t.Fatal(err)
	}
}
