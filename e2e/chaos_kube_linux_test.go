package e2e_test

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/weft-net/weft/e2e"
	"github.com/weft-net/weft/e2e/kubeapi"
)

// TestChaosKube: the chaos of TestChaos with routers in --kube mode against
// a real kube-apiserver (no --peers, consensus among the Nodes), and
// instead of rmpeer the Node objects: a machine gone and its Node deleted
// (one live router reclaims its ranges), a fresh machine registering the
// Node again under a new peer name, and a Node deleted while its router
// runs and registered again (as a kubelet does after `kubectl delete
// node`).
func TestChaosKube(t *testing.T) {
	if testing.Short() {
		t.Skip("e2e: skipped in -short mode")
	}
	seed := chaosSeedValue(t)
	run := e2e.NewTestRun(t)
	ctx, cancel := chaosContext(t)
	defer cancel()
	tb := kubeapi.NewTestbed(t, ctx, run, chaosNodes)
	c, srv, id := tb.Cluster, tb.Server, tb.Weft
	admin := tb.Admin
	// How often each peer's reclaim was logged when its Node was last
	// deleted: deleted waits for one more.
	// (A line with the peer, "deleted" and "reclaiming": the wording of
	// the router's and of the kube package's log lines.)
	reclaims := func(peer string) int {
		total := 0
		for _, m := range c.Nodes {
			for _, line := range strings.Split(readFile(m.RouterLog), "\n") {
				if strings.Contains(line, peer) && strings.Contains(line, "deleted") && strings.Contains(line, "reclaiming") {
					total++
				}
			}
		}
		return total
	}
	before := map[string]int{}
	hooks := &kubeHooks{
		deleteNode: func(ctx context.Context, n *e2e.Node) error {
			before[n.PeerName] = reclaims(n.PeerName)
			return admin.CoreV1().Nodes().Delete(ctx, n.Name, metav1.DeleteOptions{})
		},
		createNode: func(ctx context.Context, n *e2e.Node) error {
			_, err := srv.CreateNode(ctx, n.Name, n.UnderlayIP)
			if !apierrors.IsConflict(err) {
				return err
			}
			// The node's router changed the new Node between CreateNode's
			// create and its status update: set the addresses again on the
			// Node as it is now.
			return retry.RetryOnConflict(retry.DefaultRetry, func() error {
				node, err := admin.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
				if err != nil {
					return err
				}
				node.Status.Addresses = []corev1.NodeAddress{
					{Type: corev1.NodeInternalIP, Address: n.UnderlayIP.String()},
					{Type: corev1.NodeHostName, Address: n.Name},
				}
				_, err = admin.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
				return err
			})
		},
		deleted: func(ctx context.Context, n *e2e.Node, peer string) bool {
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			return pollCond(wctx, func() bool { return reclaims(peer) > before[peer] })
		},
	}
	cc := newChaos(t, ctx, c, seed, hooks, func(n *e2e.Node) []string {
		return []string{"--kube", "--kubeconfig", id.Kubeconfig, "--node-name", n.Name, "--kube-namespace", "kube-system",
			"--ipalloc-range", chaosUniverse}
	})
	cc.run(schedule(seed, scheduleOpts{Nodes: chaosNodes, Ops: *chaosOps, CheckEvery: *chaosEvery, Kube: true, MaxPods: *chaosPods}))
}
