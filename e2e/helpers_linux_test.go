package e2e

import (
	"context"
	"strings"
	"testing"
	"time"
)

// startMeshCluster makes an n-node cluster and starts a router in every
// node, each given every node's underlay address as --peers (as a
// DaemonSet's peer list would be) plus args, and waits until all are ready.
func startMeshCluster(t *testing.T, n int, args ...string) (*Cluster, context.Context) {
	t.Helper()
	return startSecCluster(t, n, n, func(*Node) []string { return args })
}

// startSecCluster makes an n-node cluster and starts a router in every node
// with every node's underlay address as --peers plus args(node); it waits
// until the first ready nodes are ready (the others may never be).
func startSecCluster(t *testing.T, n, ready int, args func(*Node) []string) (*Cluster, context.Context) {
	t.Helper()
	if testing.Short() {
		t.Skip("e2e: skipped in -short mode")
	}
	run := NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	c, err := run.NewCluster(ctx, ClusterOpts{Nodes: n})
	if err != nil {
		t.Fatal(err)
	}
	var all []string
	for _, node := range c.Nodes {
		all = append(all, node.UnderlayIP.String())
	}
	for _, node := range c.Nodes {
		if _, err := node.StartRouter(append([]string{"--peers", strings.Join(all, ",")}, args(node)...)...); err != nil {
			t.Fatal(err)
		}
	}
	for _, node := range c.Nodes[:ready] {
		if err := node.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return c, ctx
}
