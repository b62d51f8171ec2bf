package kube_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/weft-net/weft/e2e/kubeapi"
	"github.com/weft-net/weft/internal/syncbuf"
	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/kube"
)

// waitFor polls cond until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// clientFor is a client as the router makes it (no overall request
// timeout, which would cut the node watch), dialling into the server's
// namespace.
func clientFor(t *testing.T, cfg *rest.Config) kubernetes.Interface {
	t.Helper()
	c := rest.CopyConfig(cfg)
	c.Timeout = 0
	c.UserAgent = "weft/test"
	cs, err := kubernetes.NewForConfig(c)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// router is one node's Kube in the test.
type router struct {
	node, peer string
	k          *kube.Kube
	log        *syncbuf.Buffer
	reg        *prometheus.Registry
	stop       func()
}

// metric is the value of the counter name in r's registry.
func (r *router) metric(t *testing.T, name string) float64 {
	t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return 0
}

func startRouter(t *testing.T, client kubernetes.Interface, node, peer string, reclaim func(context.Context, string) error) *router {
	t.Helper()
	lg := &syncbuf.Buffer{}
	reg := prometheus.NewRegistry()
	k, err := kube.New(kube.Config{
		Client: client, NodeName: node, PeerName: peer, Nickname: node,
		Reclaim: reclaim, Registerer: reg,
		Resync: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(lg, &slog.HandlerOptions{Level: slog.LevelDebug})).With("self", peer),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- k.Run(ctx) }()
	var once sync.Once
	r := &router{node: node, peer: peer, k: k, log: lg, reg: reg}
	r.stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("%s: Run: %v", peer, err)
				}
			case <-time.After(20 * time.Second):
				t.Errorf("%s: Run did not return", peer)
			}
		})
	}
	t.Cleanup(func() {
		r.stop()
		if t.Failed() {
			t.Logf("log of %s:\n%s", peer, lg.String())
		}
	})
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	if err := k.WaitSynced(wctx); err != nil {
		t.Fatal(err)
	}
	return r
}

func testNode(name, addr string) *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Status: corev1.NodeStatus{
			Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: addr}, {Type: corev1.NodeHostName, Address: name}},
			Conditions: []corev1.NodeCondition{
				{Type: corev1.NodeNetworkUnavailable, Status: corev1.ConditionTrue, Reason: "NoRouteCreated", Message: "no network yet",
					LastTransitionTime: metav1.Now(), LastHeartbeatTime: metav1.Now()},
			},
		},
	}
}

// createNode creates a Node with its addresses and conditions (set
// through the status subresource if the create dropped them).
func createNode(ctx context.Context, t *testing.T, admin kubernetes.Interface, name, addr string) {
	t.Helper()
	want := testNode(name, addr)
	n, err := admin.CoreV1().Nodes().Create(ctx, want, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(n.Status.Addresses) == 0 || len(n.Status.Conditions) == 0 {
		n.Status = want.Status
		if _, err := admin.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// configMap reads the weft ConfigMap's peers and reclaimed maps as admin.
func configMap(ctx context.Context, t *testing.T, admin kubernetes.Interface) (peers map[string]kube.PeerRecord, done map[string]kube.ReclaimRecord) {
	t.Helper()
	peers, done = map[string]kube.PeerRecord{}, map[string]kube.ReclaimRecord{}
	cm, err := admin.CoreV1().ConfigMaps(kube.DefaultNamespace).Get(ctx, kube.DefaultConfigMapName, metav1.GetOptions{})
	if err != nil {
		return peers, done
	}
	if s := cm.Data[kube.KeyPeers]; s != "" {
		if err := json.Unmarshal([]byte(s), &peers); err != nil {
			t.Fatal(err)
		}
	}
	if s := cm.Data[kube.KeyReclaimed]; s != "" {
		if err := json.Unmarshal([]byte(s), &done); err != nil {
			t.Fatal(err)
		}
	}
	return peers, done
}

// TestOnAPIServer runs the package against a real kube-apiserver with
// deploy/weft.yaml applied, as the weft ServiceAccount: routers discover
// each other from the Nodes, register in the ConfigMap, race to record the
// first claim, clear NetworkUnavailable, and reclaim a deleted Node's peer
// exactly once; a ServiceAccount without the permissions gets the RBAC
// message.
func TestOnAPIServer(t *testing.T) {
	srv := kubeapi.Start(t, kubeapi.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	deploy, err := kubeapi.DeployDir()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := srv.Kubectl(ctx, "apply", "-f", filepath.Join(deploy, "weft.yaml")); err != nil {
		t.Fatalf("kubectl apply: %v\n%s", err, out)
	}
	admin, err := srv.Clientset()
	if err != nil {
		t.Fatal(err)
	}
	for i, n := range []string{"node-1", "node-2", "node-3"} {
		createNode(ctx, t, admin, n, fmt.Sprintf("192.0.2.%d", i+1))
	}
	id, err := srv.ServiceAccount(ctx, "kube-system", "weft", 0)
	if err != nil {
		t.Fatal(err)
	}
	weft := clientFor(t, id.Config)
	// node-1's and node-2's routers write their reclaim markers at the
	// same time: both read the ConfigMap first, so one write must conflict.
	racing := kube.NewUpdateBarrier(weft, 2, func(cm *corev1.ConfigMap) bool {
		return strings.Contains(cm.Data[kube.KeyPeers], `"reclaimer"`)
	})

	var mu sync.Mutex
	reclaims := map[string][]string{} // reclaimed peer -> by
	reclaimer := func(self string) func(context.Context, string) error {
		return func(_ context.Context, peer string) error {
			mu.Lock()
			defer mu.Unlock()
			reclaims[peer] = append(reclaims[peer], self)
			return nil
		}
	}
	var routers []*router
	for i, n := range []string{"node-1", "node-2", "node-3"} {
		p := fmt.Sprintf("peer-%d", i+1)
		var c kubernetes.Interface = racing
		if n == "node-3" {
			c = weft
		}
		routers = append(routers, startRouter(t, c, n, p, reclaimer(p)))
	}

	t.Run("discovery", func(t *testing.T) {
		for i, r := range routers {
			var want []string
			for j := range routers {
				if j != i {
					want = append(want, fmt.Sprintf("192.0.2.%d", j+1))
				}
			}
			if got := r.k.PeerAddrs(); !slices.Equal(got, want) {
				t.Errorf("%s: PeerAddrs = %v, want %v", r.peer, got, want)
			}
			if n := r.k.NodeCount(); n != 3 {
				t.Errorf("%s: NodeCount = %d", r.peer, n)
			}
		}
		createNode(ctx, t, admin, "node-4", "192.0.2.4")
		for _, r := range routers {
			waitFor(t, 20*time.Second, r.peer+" to see node-4", func() bool { return slices.Contains(r.k.PeerAddrs(), "192.0.2.4") })
		}
	})

	t.Run("register", func(t *testing.T) {
		waitFor(t, 30*time.Second, "every router registered", func() bool {
			peers, _ := configMap(ctx, t, admin)
			return len(peers) == 3
		})
		peers, _ := configMap(ctx, t, admin)
		for _, r := range routers {
			if p := peers[r.peer]; p.Node != r.node || p.Nickname != r.node {
				t.Errorf("%s: %+v", r.peer, p)
			}
		}
	})

	t.Run("claim", func(t *testing.T) {
		u, _ := ipalloc.ParseUniverse("10.32.0.0/12")
		got := make([]kube.Claim, len(routers))
		var wg sync.WaitGroup
		for i, r := range routers {
			wg.Go(func() {
				c := kube.Claim{Seed: ipalloc.SeedOf(ipalloc.RangeOf(u), []ipalloc.PeerName{ipalloc.PeerName(r.peer)}), Universe: u,
					Peers: []string{r.peer}, By: r.peer}
				var err error
				if got[i], err = r.k.RecordClaim(ctx, c); err != nil {
					t.Errorf("%s: %v", r.peer, err)
				}
			})
		}
		wg.Wait()
		rec, ok, err := routers[0].k.ClaimRecord(ctx)
		if err != nil || !ok {
			t.Fatalf("ClaimRecord: %v, %v", ok, err)
		}
		for i, c := range got {
			if c.Seed != rec.Seed || c.By != rec.By {
				t.Errorf("%s was told %v; recorded %v", routers[i].peer, c, rec)
			}
		}
	})

	t.Run("network available", func(t *testing.T) {
		if err := routers[0].k.SetNetworkAvailable(ctx); err != nil {
			t.Fatal(err)
		}
		n, err := admin.CoreV1().Nodes().Get(ctx, "node-1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeNetworkUnavailable {
				found = true
				if c.Status != corev1.ConditionFalse || c.Reason != "WeftIsUp" || c.Message != "weft is running on this node" {
					t.Errorf("condition %+v", c)
				}
			}
		}
		if !found {
			t.Errorf("no NetworkUnavailable condition: %+v", n.Status.Conditions)
		}
	})

	t.Run("reclaim once", func(t *testing.T) {
		conflicts := func() float64 {
			return routers[0].metric(t, "weft_kube_configmap_conflicts_total") + routers[1].metric(t, "weft_kube_configmap_conflicts_total")
		}
		before := conflicts()
		routers[2].stop() // node-3's router is gone with its node
		if err := admin.CoreV1().Nodes().Delete(ctx, "node-3", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 30*time.Second, "peer-3 reclaimed", func() bool {
			peers, done := configMap(ctx, t, admin)
			_, has := peers["peer-3"]
			return !has && done["peer-3"].By != ""
		})
		_, done := configMap(ctx, t, admin)
		// The others keep passing every 100 ms; for a second none may
		// reclaim again.
		deadline := time.Now().Add(time.Second)
		for time.Now().Before(deadline) {
			mu.Lock()
			n := len(reclaims["peer-3"])
			mu.Unlock()
			if n != 1 {
				t.Fatalf("peer-3 reclaimed %d times: %v", n, reclaims)
			}
			time.Sleep(50 * time.Millisecond)
		}
		mu.Lock()
		by := reclaims["peer-3"][0]
		mu.Unlock()
		if done["peer-3"].By != by || done["peer-3"].Node != "node-3" {
			t.Errorf("note %+v; reclaimed by %s", done["peer-3"], by)
		}
		if c := conflicts() - before; c != 1 {
			t.Errorf("%v conflicts, want 1: the two routers' marker writes raced", c)
		}
		if n := routers[0].metric(t, "weft_kube_reclaims_total") + routers[1].metric(t, "weft_kube_reclaims_total"); n != 1 {
			t.Errorf("weft_kube_reclaims_total sums to %v, want 1", n)
		}
		for _, r := range routers[:2] {
			if r.peer == by {
				if !strings.Contains(r.log.String(), "node node-3 deleted: reclaiming peer peer-3's ranges") {
					t.Errorf("%s's log lacks the reclaim line", r.peer)
				}
			}
		}
	})

	t.Run("forbidden", func(t *testing.T) {
		if _, err := admin.CoreV1().ServiceAccounts("default").Create(ctx,
			&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "nobody"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		nobody, err := srv.ServiceAccount(ctx, "default", "nobody", 0)
		if err != nil {
			t.Fatal(err)
		}
		lg := &syncbuf.Buffer{}
		k, err := kube.New(kube.Config{Client: clientFor(t, nobody.Config), NodeName: "node-1",
			Logger: slog.New(slog.NewTextHandler(lg, nil))})
		if err != nil {
			t.Fatal(err)
		}
		for name, f := range map[string]func(context.Context) error{
			"RegisterPeer":        func(ctx context.Context) error { return k.RegisterPeer(ctx, "peer-x", "x") },
			"SetNetworkAvailable": k.SetNetworkAvailable,
		} {
			rctx, rcancel := context.WithTimeout(ctx, 3*time.Second)
			if err := f(rctx); err == nil {
				t.Errorf("%s without permissions succeeded", name)
			}
			rcancel()
		}
		for _, want := range []string{
			"kubernetes API refused get configmaps (weft, kube-system): the weft ServiceAccount needs that permission — check deploy/weft.yaml's ClusterRole/Role",
			"kubernetes API refused patch nodes/status (node-1): the weft ServiceAccount needs that permission",
		} {
			if !strings.Contains(lg.String(), want) {
				t.Errorf("log lacks %q:\n%s", want, lg)
			}
		}
	})
	// Last: the API server goes away. Nothing returns or crashes; calls
	// retry until their context ends; each failing operation is logged
	// once, however often it is retried.
	t.Run("api server down", func(t *testing.T) {
		if err := srv.APIServer.Kill(); err != nil {
			t.Fatalf("killing kube-apiserver: %v", err)
		}
		r := routers[0]
		dctx, dcancel := context.WithTimeout(ctx, 4*time.Second)
		defer dcancel()
		if err := r.k.SetNetworkAvailable(dctx); err == nil {
			t.Fatal("SetNetworkAvailable succeeded with the API server down")
		}
		waitFor(t, 20*time.Second, "the node watch to notice", func() bool {
			return strings.Contains(r.log.String(), "op=\"list nodes\"") || strings.Contains(r.log.String(), "op=\"watch nodes\"")
		})
		log := r.log.String()
		for _, op := range []string{"patch nodes/status", "list nodes", "watch nodes"} {
			if n := strings.Count(log, "kubernetes API call failed; retrying with backoff (up to 30s), the router keeps running on its own state meanwhile\" self=peer-1 op=\""+op+"\""); n > 1 {
				t.Errorf("%q: %d streak lines, want at most 1:\n%s", op, n, log)
			}
		}
		if got := r.k.PeerAddrs(); len(got) != 2 {
			t.Errorf("PeerAddrs with the API server down = %v; want the last known", got)
		}
	})
}
