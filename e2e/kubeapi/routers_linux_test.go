package kubeapi

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/weft-net/weft/e2e"
)

// routerReport is the part of a router's /report these tests read.
type routerReport struct {
	Router struct {
		Ready bool `json:"ready"`
		Mesh  struct {
			Peers []struct {
				Name  string `json:"name"`
				State string `json:"state"`
			} `json:"peers"`
		} `json:"mesh"`
	} `json:"router"`
	IPAM struct {
		Status string `json:"status"`
		Seed   string `json:"seed"`
		Owners []struct {
			Peer string `json:"peer"`
			Size uint64 `json:"size"`
		} `json:"owners"`
	} `json:"ipam"`
}

func reportOf(ctx context.Context, n *e2e.Node) (routerReport, error) {
	var rep routerReport
	data, err := n.HTTPGet(ctx, "/report")
	if err != nil {
		return rep, err
	}
	return rep, json.Unmarshal(data, &rep)
}

// eventually polls cond until it holds or ctx ends (e2e.WaitUntil).
func eventually(t *testing.T, ctx context.Context, what string, cond func() (bool, string)) {
	t.Helper()
	e2e.WaitUntil(t, ctx, what, cond)
}

func countInFile(t *testing.T, path, s string) int {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(data), s)
}

// TestRoutersOnKubernetes: routers in three node namespaces run with
// --kube against a real kube-apiserver, as the weft ServiceAccount, and no
// --peers. Started one at a time, the first waits (it must not claim the
// ring alone), the first two claim it by consensus among the cluster's
// nodes and record the claim in the ConfigMap, the third joins that ring;
// they find each other from the Node objects, clear NetworkUnavailable,
// carry pod traffic, and when a Node is deleted exactly one live router
// takes its ranges over.
func TestRoutersOnKubernetes(t *testing.T) {
	ctx, tb := testbed(t, 3)
	c, srv, id := tb.Cluster, tb.Server, tb.Weft
	admin := tb.Admin
	start := func(n *e2e.Node) {
		t.Helper()
		if _, err := n.StartRouter("--kube", "--kubeconfig", id.Kubeconfig, "--node-name", n.Name, "--kube-namespace", "kube-system"); err != nil {
			t.Fatal(err)
		}
	}
	n0, n1, n2 := c.Nodes[0], c.Nodes[1], c.Nodes[2]

	// n0 alone: no claim recorded, consensus among 3 nodes needs 2.
	start(n0)
	eventually(t, ctx, "n0 awaiting consensus", func() (bool, string) {
		rep, err := reportOf(ctx, n0)
		return err == nil && strings.HasPrefix(rep.IPAM.Status, "awaiting consensus"), fmt.Sprintf("%+v %v", rep.IPAM, err)
	})
	hold := time.Now().Add(3 * time.Second)
	for time.Now().Before(hold) {
		if rep, err := reportOf(ctx, n0); err == nil && rep.IPAM.Seed != "none" {
			t.Fatalf("n0 claimed the ring alone (seed %s): a node that starts alone must not", rep.IPAM.Seed)
		}
		time.Sleep(300 * time.Millisecond)
	}

	// n1 joins (found through the Node list): the two claim the ring.
	start(n1)
	for _, n := range []*e2e.Node{n0, n1} {
		if err := n.WaitReady(ctx); err != nil {
			t.Fatalf("%s: %v\n%s", n.Name, err, n.Router().LogTail(40))
		}
	}
	rep0, err := reportOf(ctx, n0)
	if err != nil {
		t.Fatal(err)
	}
	seed := rep0.IPAM.Seed
	eventually(t, ctx, "the claim recorded in the ConfigMap", func() (bool, string) {
		cm, err := admin.CoreV1().ConfigMaps("kube-system").Get(ctx, "weft", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return strings.Contains(cm.Data["claim"], seed), fmt.Sprintf("claim %q, ring seed %s", cm.Data["claim"], seed)
	})

	// n2 comes later: it joins the recorded ring and asks for space.
	start(n2)
	if err := n2.WaitReady(ctx); err != nil {
		t.Fatalf("n2: %v\n%s", err, n2.Router().LogTail(40))
	}
	if countInFile(t, n2.RouterLog, "the ring was claimed already; this peer joins it") != 1 {
		t.Errorf("n2 did not join as a latecomer:\n%s", n2.Router().LogTail(40))
	}
	eventually(t, ctx, "one ring, three owners, three peers everywhere", func() (bool, string) {
		var seen []string
		ok := true
		for _, n := range c.Nodes {
			rep, err := reportOf(ctx, n)
			seen = append(seen, fmt.Sprintf("%s: seed %s owners %d peers %d %v", n.Name, rep.IPAM.Seed, len(rep.IPAM.Owners), len(rep.Router.Mesh.Peers), err))
			if err != nil || rep.IPAM.Seed != seed || len(rep.IPAM.Owners) != 3 || len(rep.Router.Mesh.Peers) != 3 {
				ok = false
			}
		}
		return ok, strings.Join(seen, "; ")
	})

	// The ConfigMap maps every peer to its node; NetworkUnavailable is
	// cleared on every node.
	eventually(t, ctx, "every peer registered and every node's network available", func() (bool, string) {
		cm, err := admin.CoreV1().ConfigMaps("kube-system").Get(ctx, "weft", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, n := range c.Nodes {
			if !strings.Contains(cm.Data["peers"], n.PeerName) || !strings.Contains(cm.Data["peers"], `"`+n.Name+`"`) {
				return false, "peers: " + cm.Data["peers"]
			}
			if st := networkUnavailable(ctx, admin, n.Name); st != corev1.ConditionFalse {
				return false, fmt.Sprintf("%s NetworkUnavailable=%s", n.Name, st)
			}
		}
		return true, ""
	})

	// Pods on different nodes reach each other.
	p0, err := n0.AddPod(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	p2, err := n2.AddPod(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	if err := e2e.Ping(ctx, p0.NS, p2.IP); err != nil {
		t.Fatal(err)
	}

	// n2's node is deleted (its router killed first, as a node that is
	// gone): exactly one of n0 and n1 takes its ranges over.
	if err := n2.Router().Kill(); err != nil {
		t.Fatal(err)
	}
	if err := admin.CoreV1().Nodes().Delete(ctx, n2.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, ctx, "n2's ranges taken over by n0 or n1", func() (bool, string) {
		var seen []string
		ok := true
		for _, n := range []*e2e.Node{n0, n1} {
			rep, err := reportOf(ctx, n)
			seen = append(seen, fmt.Sprintf("%s: %+v %v", n.Name, rep.IPAM.Owners, err))
			if err != nil || len(rep.IPAM.Owners) != 2 {
				ok = false
			}
			for _, o := range rep.IPAM.Owners {
				if o.Peer == n2.PeerName {
					ok = false
				}
			}
		}
		return ok, strings.Join(seen, "; ")
	})
	claimed := 0
	for _, n := range []*e2e.Node{n0, n1} {
		claimed += countInFile(t, n.RouterLog, "node of peer "+n2.PeerName+" deleted: reclaiming its ranges")
	}
	if claimed != 1 {
		t.Fatalf("%d routers reclaimed n2's ranges, want exactly 1\n--- n0\n%s\n--- n1\n%s", claimed, n0.Router().LogTail(30), n1.Router().LogTail(30))
	}
	// Deleted and reclaimed, n2 is gone for good: no longer a peer, a
	// join target or a failed connection anywhere in n0's and n1's report.
	n2Gossip := n2.UnderlayIP.String() + ":6783"
	eventually(t, ctx, "n2 forgotten by n0 and n1", func() (bool, string) {
		for _, n := range []*e2e.Node{n0, n1} {
			data, err := n.HTTPGet(ctx, "/report")
			if err != nil {
				return false, err.Error()
			}
			if strings.Contains(string(data), n2Gossip) || strings.Contains(string(data), `"`+n2.PeerName+`"`) {
				return false, fmt.Sprintf("%s still shows n2: %s", n.Name, data)
			}
		}
		return true, ""
	})

	// The API server goes away: a router that restarts meanwhile runs on
	// its saved ring and remembered peers, and keeps its pods connected.
	if err := srv.APIServer.Stop(5 * time.Second); err != nil {
		t.Logf("stopping kube-apiserver: %v", err)
	}
	if err := n0.Router().Restart(); err != nil {
		t.Fatal(err)
	}
	if err := n0.WaitReady(ctx); err != nil {
		t.Fatalf("n0 without an API server: %v\n%s", err, n0.Router().LogTail(40))
	}
	p1, err := n1.AddPod(ctx, "c")
	if err != nil {
		t.Fatal(err)
	}
	if err := e2e.Ping(ctx, p0.NS, p1.IP); err != nil {
		t.Fatalf("pods across nodes without an API server: %v", err)
	}

	// A node without state cannot decide its first claim without the API
	// server: it waits, alive (a liveness probe must not restart it) and
	// not ready, saying why.
	fresh := t.TempDir()
	if _, err := n2.StartRouter("--kube", "--kubeconfig", id.Kubeconfig, "--node-name", n2.Name,
		"--state-dir", fresh, "--name", "02:00:00:00:00:99"); err != nil {
		t.Fatal(err)
	}
	eventually(t, ctx, "the fresh router alive and saying what it waits for", func() (bool, string) {
		if _, err := n2.HTTPGet(ctx, "/healthz"); err != nil {
			return false, err.Error()
		}
		_, err := n2.HTTPGet(ctx, "/readyz")
		return err != nil && strings.Contains(err.Error(), "waiting for the Kubernetes API"), fmt.Sprint(err)
	})
	// Both stop promptly on SIGTERM, API server or not.
	for _, n := range []*e2e.Node{n0, n2} {
		if err := n.Router().Stop(); err != nil {
			t.Errorf("%s: %v\n%s", n.Name, err, n.Router().LogTail(25))
		}
	}
}

func networkUnavailable(ctx context.Context, cs kubernetes.Interface, node string) corev1.ConditionStatus {
	n, err := cs.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return "error: " + corev1.ConditionStatus(err.Error())
	}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeNetworkUnavailable {
			return c.Status
		}
	}
	return "missing"
}
