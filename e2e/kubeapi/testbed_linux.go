package kubeapi

import (
	"context"
	"testing"

	"k8s.io/client-go/kubernetes"

	"github.com/weft-net/weft/e2e"
)

// Testbed is what a test of --kube routers starts from: node namespaces on
// an underlay, a kube-apiserver in the underlay namespace with weft's
// manifest applied, the weft ServiceAccount's identity (its kubeconfig is
// what the routers run with), an admin client, and a Node object for every
// node, as in a real cluster whose DaemonSet pods come up one by one.
type Testbed struct {
	Cluster *e2e.Cluster
	Server  *Server
	Weft    *Identity
	Admin   kubernetes.Interface
}

// NewTestbed makes a Testbed of nodes node namespaces in run; it fails t
// on any error. Everything it starts is stopped by run's and t's clean-up.
func NewTestbed(t testing.TB, ctx context.Context, run *e2e.Run, nodes int) *Testbed {
	t.Helper()
	c, err := run.NewCluster(ctx, e2e.ClusterOpts{Nodes: nodes})
	if err != nil {
		t.Fatal(err)
	}
	srv := Start(t, Options{Run: run, NetNS: c.Underlay, Address: e2e.UnderlayGateway})
	if err := srv.ApplyWeft(ctx); err != nil {
		t.Fatal(err)
	}
	id, err := srv.ServiceAccount(ctx, "kube-system", "weft", 0)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := srv.Clientset()
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range c.Nodes {
		if _, err := srv.CreateNode(ctx, n.Name, n.UnderlayIP); err != nil {
			t.Fatal(err)
		}
	}
	return &Testbed{Cluster: c, Server: srv, Weft: id, Admin: admin}
}
