package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/internal/syncbuf"
	"github.com/weft-net/weft/kube"
	"github.com/weft-net/weft/mesh/meshtest"
	"github.com/weft-net/weft/tunnel/conn/bindtest"
)

// casClientset is client-go's fake clientset whose ConfigMaps take writes
// as the API server does: each write gets a new resourceVersion, and an
// update with another resourceVersion than the stored one is a Conflict.
// (The fake's tracker alone takes any update, and three routers that
// register at once overwrite each other.)
func casClientset() *fake.Clientset {
	f := fake.NewClientset()
	tr := f.Tracker()
	gvr := corev1.SchemeGroupVersion.WithResource("configmaps")
	var mu sync.Mutex
	var rv int64
	f.PrependReactor("create", "configmaps", func(a k8stesting.Action) (bool, k8sruntime.Object, error) {
		cm := a.(k8stesting.CreateAction).GetObject().(*corev1.ConfigMap).DeepCopy()
		mu.Lock()
		defer mu.Unlock()
		rv++
		cm.ResourceVersion = strconv.FormatInt(rv, 10)
		if err := tr.Create(gvr, cm, a.GetNamespace()); err != nil {
			return true, nil, err
		}
		return true, cm, nil
	})
	f.PrependReactor("update", "configmaps", func(a k8stesting.Action) (bool, k8sruntime.Object, error) {
		cm := a.(k8stesting.UpdateAction).GetObject().(*corev1.ConfigMap).DeepCopy()
		mu.Lock()
		defer mu.Unlock()
		cur, err := tr.Get(gvr, a.GetNamespace(), cm.Name)
		if err != nil {
			return true, nil, err
		}
		if cur.(*corev1.ConfigMap).ResourceVersion != cm.ResourceVersion {
			return true, nil, apierrors.NewConflict(gvr.GroupResource(), cm.Name, errors.New("the object has been modified"))
		}
		rv++
		cm.ResourceVersion = strconv.FormatInt(rv, 10)
		if err := tr.Update(gvr, cm, a.GetNamespace()); err != nil {
			return true, nil, err
		}
		return true, cm, nil
	})
	return f
}

// startKubeRouters runs one router in --kube mode per host on a
// casClientset that holds a Node n<i> for each (router r<i>), on meshtest
// and bindtest, with the given resync period, and waits for none of them.
// stop stops one (checking Run's result); the rest stop when the test ends,
// and a failed test logs every router's log.
func startKubeRouters(t *testing.T, universe string, hosts []string, resync time.Duration) (client *fake.Clientset, nodes []*inprocNode, hc *http.Client, stop func(*inprocNode)) {
	t.Helper()
	client = casClientset()
	nodes, hc, stop = startKubeRoutersOn(t, client, universe, hosts, resync, nil)
	return client, nodes, hc, stop
}

// startKubeRoutersOn is startKubeRouters on client; beforeRun, if set, is
// called once every router is built, before any runs, and the routers it
// returns are not run: the test starts each later with its start.
func startKubeRoutersOn(t *testing.T, client *fake.Clientset, universe string, hosts []string, resync time.Duration, beforeRun func([]*inprocNode) []*inprocNode) (nodes []*inprocNode, hc *http.Client, stop func(*inprocNode)) {
	t.Helper()
	ctx := context.Background()
	for i, h := range hosts {
		node := &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("n%d", i+1)},
			Status:     corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: h}}},
		}
		if _, err := client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	gossip, under := meshtest.NewNetwork(), bindtest.NewNetwork()
	srcDir := t.TempDir()
	for _, p := range cniPlugins {
		if err := os.WriteFile(filepath.Join(srcDir, p), []byte("#!/bin/sh\n# "+p+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	hc = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)

	nodes = make([]*inprocNode, len(hosts))
	for i, h := range hosts {
		dir := t.TempDir()
		c := Defaults()
		c.Name, c.Nickname, c.Host = fmt.Sprintf("r%d", i+1), fmt.Sprintf("node%d", i+1), h
		c.Kube, c.NodeName, c.KubeNamespace = true, fmt.Sprintf("n%d", i+1), "kube-system"
		c.IPAllocRange, c.HTTPAddr, c.LogLevel = universe, "127.0.0.1:0", "debug"
		c.StateDir, c.Socket, c.CNIBinDir, c.CNIConfDir = dir+"/state", dir+"/weft.sock", dir+"/bin", dir+"/conf"
		c.Bridge = "weft-inproc"
		v, err := c.Validate()
		if err != nil {
			t.Fatal(err)
		}
		n := &inprocNode{name: c.Name, cfg: v, kernel: &fakeKernel{host: netip.MustParseAddr(h), under: under}, api: api.NewClient(c.Socket), log: &syncbuf.Buffer{}}
		tr, err := gossip.NewTransport(h + ":6783")
		if err != nil {
			t.Fatal(err)
		}
		n.node, err = build(ctx, n.cfg, slog.New(slog.NewTextHandler(n.log, &slog.HandlerOptions{Level: slog.LevelDebug})).With("node", n.name), n.kernel,
			seams{cniSrcDir: srcDir, gossip: tr, meshTimings: inprocTimings(), kubeClient: client, kubeResync: resync})
		if err != nil {
			t.Fatalf("%s: Build: %v", n.name, err)
		}
		n.status = n.node.statusLn.Addr().String()
		nodes[i] = n
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range nodes {
				t.Logf("log of %s:\n%s", n.name, n.log.String())
			}
		}
	})
	var late []*inprocNode
	if beforeRun != nil {
		late = beforeRun(nodes)
	}
	var mu sync.Mutex
	stopped, started := map[*inprocNode]bool{}, map[*inprocNode]bool{}
	for _, n := range nodes {
		n.start = func() {
			mu.Lock()
			defer mu.Unlock()
			rctx, cancel := context.WithCancel(context.Background())
			n.cancel, n.done = cancel, make(chan error, 1)
			started[n] = true
			go func() { n.done <- n.node.Run(rctx) }()
		}
		if !slices.Contains(late, n) {
			n.start()
		}
	}
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, n := range nodes {
			if started[n] && !stopped[n] {
				n.cancel()
				<-n.done
			}
		}
	})

	return nodes, hc, func(n *inprocNode) {
		n.stop(t)
		stopped[n] = true
	}
}

// waitRingWithout waits until a and b agree on the ring and own all of
// universe between them, gone owning none of it.
func waitRingWithout(t *testing.T, hc *http.Client, a, b *inprocNode, gone, universe string) {
	t.Helper()
	size := uint64(1) << (32 - netip.MustParsePrefix(universe).Bits())
	waitUntil(t, a.name+" and "+b.name+" to own the whole ring without "+gone, func() bool {
		ra, rb := a.report(t, hc), b.report(t, hc)
		if !slices.Equal(ra.IPAM.Entries, rb.IPAM.Entries) {
			return false
		}
		var total uint64
		for _, o := range ra.IPAM.Owners {
			if o.Peer == gone && o.Size > 0 {
				return false
			}
			total += o.Size
		}
		return total == size
	})
}

// Three whole routers in --kube mode in this process, without root, on
// client-go's fake clientset (the Nodes and weft's ConfigMap), the fake
// kernel, tuntest, bindtest and meshtest: no --peers, the routers find
// each other from the Node list, make the first claim by consensus among
// the cluster's nodes, record it in the ConfigMap, register there, clear
// each Node's NetworkUnavailable condition, and once r3 is stopped and its
// Node deleted, r1 and r2 reclaim its ranges (exactly one of them, through
// the ConfigMap's marker), drop its entry and agree on the ring without it.
func TestInProcessKube(t *testing.T) {
	const universe = "10.41.0.0/20"
	hosts := []string{"10.98.0.1", "10.98.0.2", "10.98.0.3"}
	client, nodes, hc, stop := startKubeRouters(t, universe, hosts, 500*time.Millisecond)
	ctx := context.Background()
	for _, n := range nodes {
		waitUntil(t, n.name+" to be ready", func() bool { return n.api.Ready(ctx) == nil })
	}
	waitUntil(t, "one ring with three owners", func() bool {
		a, b, c := nodes[0].report(t, hc), nodes[1].report(t, hc), nodes[2].report(t, hc)
		return a.IPAM.Seed != "none" && len(a.IPAM.Owners) == 3 &&
			slices.Equal(a.IPAM.Entries, b.IPAM.Entries) && slices.Equal(a.IPAM.Entries, c.IPAM.Entries)
	})
	// r3's pod: its address must never be handed out twice.
	a3, err := nodes[2].api.Allocate(ctx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "pod-r3", IfName: "eth0"}})
	if err != nil {
		t.Fatal(err)
	}

	// The cluster's records: the first claim and all three peers in the
	// ConfigMap, and every Node's network available.
	k := nodes[0].node.kube
	waitUntil(t, "the first claim and the three peers in the ConfigMap", func() bool {
		_, recorded, err := k.ClaimRecord(ctx)
		peers, perr := k.Peers(ctx)
		return err == nil && perr == nil && recorded && len(peers) == 3
	})
	waitUntil(t, "every Node's NetworkUnavailable condition cleared", func() bool {
		for i := range hosts {
			node, err := client.CoreV1().Nodes().Get(ctx, fmt.Sprintf("n%d", i+1), metav1.GetOptions{})
			if err != nil {
				return false
			}
			ok := false
			for _, c := range node.Status.Conditions {
				ok = ok || c.Type == corev1.NodeNetworkUnavailable && c.Status == corev1.ConditionFalse && c.Reason == kube.ConditionReason
			}
			if !ok {
				return false
			}
		}
		return true
	})

	// r3 goes, then its Node: r1 and r2 reclaim its ranges.
	stop(nodes[2])
	waitUntil(t, "r1 and r2 to see r3 gone", func() bool {
		return !nodes[0].node.alivePeers()["r3"] && !nodes[1].node.alivePeers()["r3"]
	})
	if err := client.CoreV1().Nodes().Delete(ctx, "n3", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitRingWithout(t, hc, nodes[0], nodes[1], "r3", universe)
	waitUntil(t, "r3's entry to leave the ConfigMap", func() bool {
		peers, err := k.Peers(ctx)
		_, has := peers["r3"]
		return err == nil && !has && len(peers) == 2
	})
	reclaimers := 0
	for _, n := range nodes[:2] {
		if strings.Contains(n.log.String(), "node of peer r3 deleted: reclaiming its ranges") {
			reclaimers++
		}
	}
	if reclaimers != 1 {
		t.Errorf("%d routers reclaimed r3, want exactly 1", reclaimers)
	}
	// r3's pod's address is in a range r1 or r2 owns now, and both still
	// allocate.
	addr3 := a3.Address.Addr()
	owned := false
	for _, n := range nodes[:2] {
		for _, c := range n.report(t, hc).IPAM.Owned {
			owned = owned || netip.MustParsePrefix(c).Contains(addr3)
		}
		if _, err := n.api.Allocate(ctx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "pod-" + n.name, IfName: "eth0"}}); err != nil {
			t.Fatalf("%s: allocate after the reclaim: %v", n.name, err)
		}
	}
	if !owned {
		t.Errorf("r3's pod address %s is in no range of r1 or r2 after the reclaim", addr3)
	}

	for _, n := range nodes[:2] {
		stop(n)
	}
	for _, n := range nodes {
		for _, l := range strings.Split(n.log.String(), "\n") {
			if strings.Contains(l, "level=ERROR") && !strings.Contains(l, "component=memberlist") || strings.Contains(l, "did not stop within") {
				t.Errorf("%s: %s", n.name, l)
			}
		}
	}
}

// TestKubeRejoinWaitsForRegisteredPeers: in --kube mode a router that
// starts without state allocates nothing before it has read the peers
// registered in the ConfigMap (one of them may hold what its lost state
// gave away: ipalloc's TestRejoinWaitsForExternalMembers). Three fresh
// routers make the first claim by consensus while every read of the
// ConfigMap fails (the API server unreachable after they started): the
// claim is made, but no router allocates, and each says why; once the
// ConfigMap can be read, all of them do.
func TestKubeRejoinWaitsForRegisteredPeers(t *testing.T) {
	const universe = "10.42.0.0/20"
	hosts := []string{"10.98.1.1", "10.98.1.2", "10.98.1.3"}
	client := casClientset()
	var unreachable atomic.Bool
	client.PrependReactor("get", "configmaps", func(k8stesting.Action) (bool, k8sruntime.Object, error) {
		if unreachable.Load() {
			return true, nil, errors.New("injected: the API server is unreachable")
		}
		return false, nil, nil
	})
	nodes, hc, _ := startKubeRoutersOn(t, client, universe, hosts, 500*time.Millisecond, func([]*inprocNode) []*inprocNode {
		unreachable.Store(true)
		return nil
	})
	ctx := context.Background()
	owners := 0
	waitUntil(t, "the first claim, its owners waiting for the registered peers", func() bool {
		owners = 0
		for _, n := range nodes {
			rep := n.report(t, hc).IPAM
			if rep.Seed == "none" {
				return false
			}
			if len(rep.Owned) > 0 { // not a peer the chosen value left out
				if !strings.Contains(rep.Status, "waiting for the peers registered") {
					return false
				}
				owners++
			}
		}
		return owners >= 2
	})
	for _, n := range nodes {
		actx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		a, err := n.api.Allocate(actx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "early-" + n.name, IfName: "eth0"}})
		cancel()
		if err == nil {
			t.Fatalf("%s allocated %s before it read the registered peers", n.name, a.Address)
		}
		if !strings.Contains(n.log.String(), "reading the peers registered in the ConfigMap failed") {
			t.Errorf("%s's log does not say why it cannot read them", n.name)
		}
	}
	unreachable.Store(false)
	for _, n := range nodes {
		waitUntil(t, n.name+" to allocate once the ConfigMap is read", func() bool {
			actx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			_, err := n.api.Allocate(actx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "pod-" + n.name, IfName: "eth0"}})
			return err == nil
		})
	}
}

// TestKubeJoinerRegistersBeforeAsking: in --kube mode a router asks no
// other peer for space (its bridge's gateway first) before the ConfigMap's
// registered peers name it. r1 and r2 claim the ring; r3 starts later, as
// a joiner that owns nothing, while the API server refuses its
// registration: it gets no space and says why. Once its registration goes
// through, it gets a donation and is ready.
func TestKubeJoinerRegistersBeforeAsking(t *testing.T) {
	const universe = "10.43.0.0/20"
	hosts := []string{"10.98.2.1", "10.98.2.2", "10.98.2.3"}
	client := casClientset()
	var refuse atomic.Bool
	refuse.Store(true)
	registers := func(a k8stesting.Action) bool {
		var obj k8sruntime.Object
		switch a := a.(type) {
		case k8stesting.UpdateAction:
			obj = a.GetObject()
		case k8stesting.CreateAction:
			obj = a.GetObject()
		}
		cm, ok := obj.(*corev1.ConfigMap)
		return ok && strings.Contains(cm.Data["peers"], `"r3"`)
	}
	for _, verb := range []string{"update", "create"} {
		client.PrependReactor(verb, "configmaps", func(a k8stesting.Action) (bool, k8sruntime.Object, error) {
			if refuse.Load() && registers(a) {
				return true, nil, errors.New("injected: the API server refuses r3's registration")
			}
			return false, nil, nil
		})
	}
	nodes, hc, _ := startKubeRoutersOn(t, client, universe, hosts, 500*time.Millisecond, func(ns []*inprocNode) []*inprocNode {
		return ns[2:]
	})
	ctx := context.Background()
	r1, r2, r3 := nodes[0], nodes[1], nodes[2]
	for _, n := range []*inprocNode{r1, r2} {
		waitUntil(t, n.name+" to be ready", func() bool { return n.api.Ready(ctx) == nil })
	}
	k := r1.node.kube
	waitUntil(t, "the first claim recorded in the ConfigMap", func() bool {
		_, recorded, err := k.ClaimRecord(ctx)
		return err == nil && recorded
	})

	r3.start()
	waitUntil(t, "r3 to say it waits to be registered", func() bool {
		return strings.Contains(r3.report(t, hc).IPAM.Status, "before it is registered") &&
			strings.Contains(r3.log.String(), "refuses r3's registration")
	})
	actx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	a, err := r3.api.Allocate(actx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "early", IfName: "eth0"}})
	cancel()
	if err == nil {
		t.Fatalf("r3 allocated %s before it was registered", a.Address)
	}
	for _, n := range []*inprocNode{r1, r2, r3} {
		if slices.ContainsFunc(n.report(t, hc).IPAM.Owners, func(o OwnerReport) bool { return o.Peer == "r3" }) {
			t.Fatalf("%s's ring gives r3 space before r3 was registered: %v", n.name, n.report(t, hc).IPAM.Entries)
		}
	}

	refuse.Store(false)
	waitUntil(t, "r3 to be ready once registered", func() bool { return r3.api.Ready(ctx) == nil })
	peers, err := k.Peers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := peers["r3"]; !ok {
		t.Fatalf("r3 is ready but not registered: %v", peers)
	}
}
