package kubeapi

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weft-net/weft/e2e"
)

// sinceLastStart is the part of a router log written by its latest start
// (the harness appends a "=== ... starting" line at each).
func sinceLastStart(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s := string(data)
	if i := strings.LastIndex(s, "=== "); i >= 0 {
		s = s[i:]
	}
	return s
}

// TestRouterRestartWhileReclaimPending: the Node of a live peer is deleted
// (as when a Node object is deleted and re-created under a running
// router), so its reclaim is pending in the ConfigMap and every pass
// leaves it because the mesh sees the peer alive. Another router restarts
// meanwhile, with a password (its key derivation takes a while before the
// mesh exists). It must come back, must not reclaim the live peer (its
// mesh view is empty right after the start), and must not race: in the
// old composition the Kubernetes watch ran before the mesh and the
// allocator were made, so the restarted router either panicked (no
// allocator) or took the live peer's ranges (no mesh, every peer dead).
func TestRouterRestartWhileReclaimPending(t *testing.T) {
	ctx, tb := testbed(t, 2)
	c, id := tb.Cluster, tb.Weft
	admin := tb.Admin
	pw := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(pw, []byte("restart while a reclaim is pending\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	n0, n1 := c.Nodes[0], c.Nodes[1]
	for _, n := range c.Nodes {
		if _, err := n.StartRouter("--kube", "--kubeconfig", id.Kubeconfig, "--node-name", n.Name,
			"--kube-namespace", "kube-system", "--password-file", pw); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range c.Nodes {
		if err := n.WaitReady(ctx); err != nil {
			t.Fatalf("%s: %v\n%s", n.Name, err, n.Router().LogTail(40))
		}
	}
	owners := func(n *e2e.Node) (map[string]bool, error) {
		rep, err := reportOf(ctx, n)
		got := map[string]bool{}
		for _, o := range rep.IPAM.Owners {
			got[o.Peer] = true
		}
		return got, err
	}
	eventually(t, ctx, "one ring of two owners, both peers registered", func() (bool, string) {
		cm, err := admin.CoreV1().ConfigMaps("kube-system").Get(ctx, "weft", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		o0, err0 := owners(n0)
		o1, err1 := owners(n1)
		ok := err0 == nil && err1 == nil && len(o0) == 2 && len(o1) == 2 &&
			strings.Contains(cm.Data["peers"], n0.PeerName) && strings.Contains(cm.Data["peers"], n1.PeerName)
		return ok, fmt.Sprintf("owners %v %v (%v %v), peers %s", o0, o1, err0, err1, cm.Data["peers"])
	})

	// n1's Node goes while its router runs: n0 sees the Node gone and
	// leaves the live peer alone; the reclaim stays pending.
	if err := admin.CoreV1().Nodes().Delete(ctx, n1.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	pending := "peer " + n1.PeerName + " still answers in the mesh: not reclaiming it"
	eventually(t, ctx, "n0 leaving the live peer n1 alone", func() (bool, string) {
		return strings.Contains(sinceLastStart(t, n0.RouterLog), pending), n0.Router().LogTail(5)
	})

	// n0 restarts with the reclaim pending. Its first reclaim pass runs
	// right after the start (once its peer is registered): it must see n1
	// as possibly alive, and say so again.
	if err := n0.Router().Restart(); err != nil {
		t.Fatal(err)
	}
	if err := n0.WaitReady(ctx); err != nil {
		t.Fatalf("n0 after the restart: %v\n%s", err, n0.Router().LogTail(60))
	}
	eventually(t, ctx, "n0's first reclaim pass after the restart leaving n1 alone", func() (bool, string) {
		log := sinceLastStart(t, n0.RouterLog)
		if strings.Contains(log, "reclaiming its ranges") {
			return true, "" // checked below
		}
		return strings.Contains(log, pending), n0.Router().LogTail(5)
	})
	// The pass is over once its warning is out; give a later pass (on a
	// settled mesh) no chance to hide a reclaim: n1 must still own its
	// ranges on both routers, and its ConfigMap entry must be there.
	log := sinceLastStart(t, n0.RouterLog)
	if strings.Contains(log, "reclaiming its ranges") {
		t.Fatalf("n0 reclaimed the ranges of the live peer n1 after its restart:\n%s", n0.Router().LogTail(60))
	}
	for _, bad := range []string{"WARNING: DATA RACE", "panic:"} {
		if strings.Contains(log, bad) {
			t.Fatalf("n0 after the restart: %s\n%s", bad, n0.Router().LogTail(80))
		}
	}
	eventually(t, ctx, "n1 still an owner, seen by both, and its peer entry kept", func() (bool, string) {
		o0, err0 := owners(n0)
		o1, err1 := owners(n1)
		cm, err := admin.CoreV1().ConfigMaps("kube-system").Get(ctx, "weft", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		ok := err0 == nil && err1 == nil && o0[n1.PeerName] && o1[n1.PeerName] && strings.Contains(cm.Data["peers"], n1.PeerName)
		return ok, fmt.Sprintf("owners %v %v (%v %v), peers %s", o0, o1, err0, err1, cm.Data["peers"])
	})
	for _, n := range c.Nodes {
		if err := n.Router().Stop(); err != nil {
			t.Errorf("%s: %v\n%s", n.Name, err, n.Router().LogTail(25))
		}
	}
}
