package router

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestInProcessKubeReclaimOnPeerLoss: a Node deleted while its router
// still answers in the mesh (the usual order when a node dies: the Node
// goes, the mesh needs seconds to declare the peer dead) is reclaimed once
// the mesh declares the peer gone, without waiting for the next resync
// pass: here the resync is an hour, so the mesh's news is the only thing
// that can start the pass. Before, the reclaim waited for the resync (a
// minute in a real router: 24-46 s measured in make e2e-kube).
func TestInProcessKubeReclaimOnPeerLoss(t *testing.T) {
	const universe = "10.42.0.0/20"
	hosts := []string{"10.99.0.1", "10.99.0.2", "10.99.0.3"}
	client, nodes, hc, stop := startKubeRouters(t, universe, hosts, time.Hour)
	ctx := context.Background()
	for _, n := range nodes {
		waitUntil(t, n.name+" to be ready", func() bool { return n.api.Ready(ctx) == nil })
	}
	k := nodes[0].node.kube
	waitUntil(t, "one ring with three owners and three registered peers", func() bool {
		a, b, c := nodes[0].report(t, hc), nodes[1].report(t, hc), nodes[2].report(t, hc)
		peers, err := k.Peers(ctx)
		return err == nil && len(peers) == 3 && a.IPAM.Seed != "none" && len(a.IPAM.Owners) == 3 &&
			slices.Equal(a.IPAM.Entries, b.IPAM.Entries) && slices.Equal(a.IPAM.Entries, c.IPAM.Entries)
	})

	// n3's Node goes while r3 still runs: both others leave it alone.
	if err := client.CoreV1().Nodes().Delete(ctx, "n3", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes[:2] {
		waitUntil(t, n.name+" to leave the live r3 alone", func() bool {
			return strings.Contains(n.log.String(), "node n3 deleted, but peer r3 still answers in the mesh")
		})
	}
	// Then r3 dies: the mesh's news starts the pass.
	stop(nodes[2])
	waitRingWithout(t, hc, nodes[0], nodes[1], "r3", universe)
	reclaimers := 0
	for _, n := range nodes[:2] {
		reclaimers += strings.Count(n.log.String(), "node of peer r3 deleted: reclaiming its ranges")
	}
	if reclaimers != 1 {
		t.Errorf("%d reclaims of r3, want exactly 1", reclaimers)
	}
}
