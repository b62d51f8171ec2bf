package kubeapi

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/weft-net/weft/e2e"
	"github.com/weft-net/weft/kube"
)

// nodeClean checks that n has no weft CNI config, bridge or state.
func nodeClean(ctx context.Context, n *e2e.Node) error {
	var dirty []string
	if _, err := os.Stat(filepath.Join(n.CNIConfDir, e2e.ConfListFile)); err == nil {
		dirty = append(dirty, "the CNI config")
	}
	if _, err := os.Stat(filepath.Join(n.StateDir, "weft.db")); err == nil {
		dirty = append(dirty, "the state")
	}
	if out, err := n.NS.Exec(ctx, "ip", "link", "show", "weft"); err == nil {
		dirty = append(dirty, "the bridge: "+strings.TrimSpace(string(out)))
	}
	if len(dirty) > 0 {
		return fmt.Errorf("%s still has %s", n.Name, strings.Join(dirty, ", "))
	}
	return nil
}

// TestTakeNodeOut: a node labelled weft.works/reset whose router is
// stopped (the DaemonSet's affinity deletes its pod) hands its ranges over
// and is left with no CNI config, bridge or state: NotReady, and it stays
// so. A router stopped on an unlabelled node leaves everything for its
// restart; one stopped while the DaemonSet is deleted (kubectl delete -k
// deploy/) removes the CNI config; then `weft reset --force` (what
// deploy/uninstall runs on every node) cleans the node.
func TestTakeNodeOut(t *testing.T) {
	ctx, tb := testbed(t, 2)
	c, srv, id := tb.Cluster, tb.Server, tb.Weft
	admin := tb.Admin
	n0, n1 := c.Nodes[0], c.Nodes[1]
	for _, n := range c.Nodes {
		if _, err := n.StartRouter("--kube", "--kubeconfig", id.Kubeconfig, "--node-name", n.Name, "--kube-namespace", "kube-system", "--kube-daemonset", "weft"); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range c.Nodes {
		if err := n.WaitReady(ctx); err != nil {
			t.Fatalf("%s: %v\n%s", n.Name, err, n.Router().LogTail(40))
		}
	}
	eventually(t, ctx, "two owners", func() (bool, string) {
		rep, err := reportOf(ctx, n0)
		return err == nil && len(rep.IPAM.Owners) == 2, fmt.Sprintf("%+v %v", rep.IPAM.Owners, err)
	})

	// The operator marks n1 (after draining it); its router sees it.
	patch := fmt.Appendf(nil, `{"metadata":{"labels":{%q:"true"}}}`, kube.ResetLabel)
	if _, err := admin.CoreV1().Nodes().Patch(ctx, n1.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, ctx, "n1's router to see the label", func() (bool, string) {
		return countInFile(t, n1.RouterLog, "this node is labelled "+kube.ResetLabel) == 1, n1.Router().LogTail(5)
	})
	// The DaemonSet deletes the pod: SIGTERM.
	if err := n1.Router().Stop(); err != nil {
		t.Fatalf("n1: %v\n%s", err, n1.Router().LogTail(30))
	}
	if err := nodeClean(ctx, n1); err != nil {
		t.Fatalf("%v\n%s", err, n1.Router().LogTail(30))
	}
	if countInFile(t, n1.RouterLog, "handed this peer's ranges over") != 1 {
		t.Errorf("n1 did not hand its ranges over:\n%s", n1.Router().LogTail(30))
	}
	eventually(t, ctx, "n0 owning the whole range", func() (bool, string) {
		rep, err := reportOf(ctx, n0)
		return err == nil && len(rep.IPAM.Owners) == 1 && rep.IPAM.Owners[0].Peer == n0.PeerName, fmt.Sprintf("%+v %v", rep.IPAM.Owners, err)
	})

	// An unlabelled node's router stopped: everything stays.
	if err := n0.Router().Stop(); err != nil {
		t.Fatalf("n0: %v", err)
	}
	if err := nodeClean(ctx, n0); err == nil {
		t.Fatal("a plain stop of n0's router removed its CNI config, bridge and state")
	}
	if err := n0.Router().Restart(); err != nil {
		t.Fatal(err)
	}
	if err := n0.WaitReady(ctx); err != nil {
		t.Fatalf("n0 after a restart: %v\n%s", err, n0.Router().LogTail(30))
	}
	// The uninstall as a user types it: the ServiceAccount, its rights and
	// the DaemonSet go. The router's open watch still sees the DaemonSet's
	// deletion; stopped, it removes the CNI config (the node turns
	// NotReady) and leaves the bridge and the state for deploy/uninstall.
	dir, err := DeployDir()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := srv.Kubectl(ctx, "delete", "-k", dir); err != nil {
		t.Fatalf("kubectl delete -k deploy/: %v\n%s", err, out)
	}
	eventually(t, ctx, "n0's router to see its DaemonSet deleted", func() (bool, string) {
		return countInFile(t, n0.RouterLog, "weft's DaemonSet is deleted") == 1, n0.Router().LogTail(5)
	})
	if err := n0.Router().Stop(); err != nil {
		t.Fatalf("n0: %v", err)
	}
	if _, err := os.Stat(filepath.Join(n0.CNIConfDir, e2e.ConfListFile)); !os.IsNotExist(err) {
		t.Fatalf("the CNI config is still there after the uninstall: %v\n%s", err, n0.Router().LogTail(20))
	}
	if _, err := os.Stat(filepath.Join(n0.StateDir, "weft.db")); err != nil {
		t.Errorf("the state went with the DaemonSet: %v", err)
	}
	// weft reset --force with no router: what deploy/uninstall runs.
	if out, err := n0.Weft(ctx, "reset", "--force", "--cni-conf-dir", n0.CNIConfDir, "--state-dir", n0.StateDir, "--bridge", "weft"); err != nil {
		t.Fatalf("weft reset --force without a router: %v\n%s", err, out)
	} else if !strings.Contains(string(out), "this node is clean of weft") {
		t.Errorf("weft reset --force said: %s", out)
	}
	if err := nodeClean(ctx, n0); err != nil {
		t.Fatal(err)
	}
	// The uninstall manifest is valid for the API server.
	if out, err := srv.Kubectl(ctx, "apply", "--dry-run=server", "-k", filepath.Join(dir, "uninstall")); err != nil {
		t.Fatalf("kubectl apply --dry-run=server -k deploy/uninstall: %v\n%s", err, out)
	}
	for _, n := range c.Nodes {
		if errs := errorLines(t, n.RouterLog); len(errs) > 0 {
			t.Errorf("%s logged ERROR:\n%s", n.Name, strings.Join(errs, "\n"))
		}
	}
}
