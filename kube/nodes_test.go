package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	k8stesting "k8s.io/client-go/testing"
)

func TestNodeAddress(t *testing.T) {
	host := corev1.NodeAddress{Type: corev1.NodeHostName, Address: "node-1.example"}
	v6 := internal("fd00::1")
	for _, tc := range []struct {
		name     string
		addrs    []corev1.NodeAddress
		want     corev1.NodeAddressType
		addr     string
		typ      corev1.NodeAddressType
		notFound bool
	}{
		{"internal", []corev1.NodeAddress{host, external("203.0.113.1"), internal("10.0.0.1")}, corev1.NodeInternalIP, "10.0.0.1", corev1.NodeInternalIP, false},
		{"external chosen", []corev1.NodeAddress{internal("10.0.0.1"), external("203.0.113.1")}, corev1.NodeExternalIP, "203.0.113.1", corev1.NodeExternalIP, false},
		{"external missing: internal", []corev1.NodeAddress{internal("10.0.0.1")}, corev1.NodeExternalIP, "10.0.0.1", corev1.NodeInternalIP, false},
		{"internal missing: external", []corev1.NodeAddress{host, external("203.0.113.1")}, corev1.NodeInternalIP, "203.0.113.1", corev1.NodeExternalIP, false},
		{"dual stack: the IPv4 one", []corev1.NodeAddress{v6, internal("10.0.0.2")}, corev1.NodeInternalIP, "10.0.0.2", corev1.NodeInternalIP, false},
		{"only IPv6", []corev1.NodeAddress{v6, host}, corev1.NodeInternalIP, "", "", true},
		{"garbage", []corev1.NodeAddress{internal("not-an-ip"), internal("0.0.0.0")}, corev1.NodeInternalIP, "", "", true},
		{"hostname", []corev1.NodeAddress{internal("10.0.0.1"), host}, corev1.NodeHostName, "node-1.example", corev1.NodeHostName, false},
		{"none", nil, corev1.NodeInternalIP, "", "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr, typ, ok := NodeAddress(node("n", tc.addrs...), tc.want)
			if addr != tc.addr || typ != tc.typ || ok == tc.notFound {
				t.Errorf("NodeAddress = %q, %q, %v; want %q, %q, %v", addr, typ, ok, tc.addr, tc.typ, !tc.notFound)
			}
		})
	}
}

func TestNewValidates(t *testing.T) {
	f := newCASFake()
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{NodeName: "a"}, "no Kubernetes client"},
		{Config{Client: f}, "NODE_NAME"},
		{Config{Client: f, NodeName: "a", AddressType: "Internal"}, `invalid --kube-address-type "Internal"`},
		{Config{Client: f, NodeName: "a", Namespace: "Bad_NS"}, `invalid namespace "Bad_NS"`},
		{Config{Client: f, NodeName: "a", PeerName: "has space"}, "peer name"},
	} {
		_, err := New(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v; want an error containing %q", tc.cfg, err, tc.want)
		}
	}
}

// waitChange waits for a signal on Changes.
func waitChange(t *testing.T, k *testKube) {
	t.Helper()
	select {
	case <-k.Changes():
	case <-time.After(10 * time.Second):
		t.Fatal("no signal on Changes")
	}
}

func TestDiscovery(t *testing.T) {
	f := newCASFake(
		node("a", internal("10.0.0.1")),
		node("b", internal("10.0.0.2"), external("203.0.113.2")),
		node("c", external("203.0.113.3")), // no InternalIP: falls back
		node("d"),                          // no address yet
	)
	k := newTestKube(t, f, "a", "") // discovery only
	k.run(t)
	waitChange(t, k)
	if got, want := k.PeerAddrs(), []string{"10.0.0.2", "203.0.113.3"}; !slices.Equal(got, want) {
		t.Errorf("PeerAddrs = %v, want %v (this node excluded)", got, want)
	}
	if n := k.NodeCount(); n != 4 {
		t.Errorf("NodeCount = %d, want 4", n)
	}
	if k.log.count("no InternalIP address; using its ExternalIP") != 1 || k.log.count("node has no usable address") != 1 {
		t.Errorf("want one line each for c's fallback and d's missing address; log:\n%s", k.log)
	}

	ctx := context.Background()
	nodes := f.CoreV1().Nodes()
	if _, err := nodes.Create(ctx, node("e", internal("10.0.0.5")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "node e discovered", func() bool { return slices.Contains(k.PeerAddrs(), "10.0.0.5") })
	waitChange(t, k)

	d := node("d", internal("10.0.0.4"))
	if _, err := nodes.Update(ctx, d, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "node d's new address", func() bool { return slices.Contains(k.PeerAddrs(), "10.0.0.4") })

	if err := nodes.Delete(ctx, "b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "node b gone", func() bool { return !slices.Contains(k.PeerAddrs(), "10.0.0.2") })
	if got, want := k.PeerAddrs(), []string{"10.0.0.4", "10.0.0.5", "203.0.113.3"}; !slices.Equal(got, want) {
		t.Errorf("PeerAddrs = %v, want %v", got, want)
	}
	if n := k.NodeCount(); n != 4 {
		t.Errorf("NodeCount = %d, want 4", n)
	}
	if k.log.count("kubernetes: node deleted") != 1 {
		t.Errorf("want one line for b's deletion; log:\n%s", k.log)
	}
}

func TestDiscoveryExternalIP(t *testing.T) {
	f := newCASFake(node("a", internal("10.0.0.1")), node("b", internal("10.0.0.2"), external("203.0.113.2")))
	k := newTestKube(t, f, "a", "", func(c *Config) { c.AddressType = corev1.NodeExternalIP })
	k.run(t)
	if got, want := k.PeerAddrs(), []string{"203.0.113.2"}; !slices.Equal(got, want) {
		t.Errorf("PeerAddrs = %v, want %v", got, want)
	}
}

// TestRunAPIDown: the node list fails twice (the API server is down); Run
// keeps trying, logs the streak once, then once that it works again.
func TestRunAPIDown(t *testing.T) {
	f := newCASFake(node("a", internal("10.0.0.1")), node("b", internal("10.0.0.2")))
	f.failN("list", "nodes", 2, apierrors.NewServiceUnavailable("etcd is down"))
	k := newTestKube(t, f, "a", "")
	k.run(t) // the informer's own backoff: about 0.8 s + 1.6 s
	if got := k.PeerAddrs(); !slices.Equal(got, []string{"10.0.0.2"}) {
		t.Errorf("PeerAddrs = %v", got)
	}
	if n := k.log.count("kubernetes API call failed; retrying with backoff"); n != 1 {
		t.Errorf("%d lines for the failure streak, want 1; log:\n%s", n, k.log)
	}
	if n := k.log.count("kubernetes API call works again"); n != 1 {
		t.Errorf("%d lines for the recovery, want 1; log:\n%s", n, k.log)
	}
	if v := counterValue(t, k.metrics.apiErrors.WithLabelValues("list nodes")); v != 2 {
		t.Errorf("weft_kube_api_errors_total{operation=list nodes} = %v, want 2", v)
	}
}

func TestSetNetworkAvailable(t *testing.T) {
	then := metav1.NewTime(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC))
	n := node("a", internal("10.0.0.1"))
	n.Status.Conditions = []corev1.NodeCondition{
		{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: then},
		{Type: corev1.NodeNetworkUnavailable, Status: corev1.ConditionTrue, Reason: "NoRouteCreated", LastTransitionTime: then},
	}
	f := newCASFake(n)
	f.failN("patch", "nodes", 1, apierrors.NewTimeoutError("request timed out", 1))
	now := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
	k := newTestKube(t, f, "a", "pa", func(c *Config) { c.Now = func() time.Time { return now } })
	if err := k.SetNetworkAvailable(context.Background()); err != nil {
		t.Fatal(err)
	}

	var patches []k8stesting.PatchAction
	for _, a := range f.Actions() {
		if p, ok := a.(k8stesting.PatchAction); ok {
			patches = append(patches, p)
		}
	}
	if len(patches) != 2 {
		t.Fatalf("%d patches, want 2 (one timed out)", len(patches))
	}
	p := patches[1]
	if p.GetSubresource() != "status" || p.GetName() != "a" || p.GetPatchType() != types.StrategicMergePatchType {
		t.Errorf("patch of %s/%s type %s; want the status of node a, strategic merge", p.GetName(), p.GetSubresource(), p.GetPatchType())
	}
	var body struct {
		Status struct {
			Conditions []map[string]string `json:"conditions"`
		} `json:"status"`
	}
	if err := json.Unmarshal(p.GetPatch(), &body); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"type": "NetworkUnavailable", "status": "False", "reason": "WeftIsUp", "message": "weft is running on this node",
		"lastTransitionTime": "2025-06-01T12:00:00Z", "lastHeartbeatTime": "2025-06-01T12:00:00Z",
	}
	if len(body.Status.Conditions) != 1 || !mapsEqual(body.Status.Conditions[0], want) {
		t.Errorf("patch %s; want exactly the condition %v", p.GetPatch(), want)
	}

	got, err := f.CoreV1().Nodes().Get(context.Background(), "a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	conds := map[corev1.NodeConditionType]corev1.NodeCondition{}
	for _, c := range got.Status.Conditions {
		conds[c.Type] = c
	}
	if c := conds[corev1.NodeNetworkUnavailable]; c.Status != corev1.ConditionFalse || c.Reason != ConditionReason {
		t.Errorf("NetworkUnavailable after the patch: %+v", c)
	}
	if c := conds[corev1.NodeReady]; c.Status != corev1.ConditionTrue || c.Reason != "KubeletReady" || len(got.Status.Conditions) != 2 {
		t.Errorf("the patch disturbed the other conditions: %+v", got.Status.Conditions)
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestRegisterWaitsForNode: a router whose NODE_NAME has no Node does not
// register (the others would take it for deleted) until the Node appears.
func TestRegisterWaitsForNode(t *testing.T) {
	f := newCASFake(node("b", internal("10.0.0.2")))
	k := newTestKube(t, f, "a", "pa", func(c *Config) {
		c.After = time.After
		c.Resync = 20 * time.Millisecond
	})
	k.run(t)
	eventually(t, "the error line", func() bool { return k.log.count("this node a is not in the node list; check NODE_NAME") == 1 })
	if f.configMap(t) != nil {
		t.Fatal("registered without a Node")
	}
	if _, err := f.CoreV1().Nodes().Create(context.Background(), node("a", internal("10.0.0.1")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "registration", func() bool { return peersOf(t, f.configMap(t))["pa"].Node == "a" })
	if n := k.log.count("not in the node list"); n != 1 {
		t.Errorf("%d error lines, want 1", n)
	}
}

// TestRunStops: Run returns when its context ends and leaves no goroutine
// behind.
func TestRunStops(t *testing.T) {
	before := runtime.NumGoroutine()
	f := newCASFake(node("a", internal("10.0.0.1")), node("b", internal("10.0.0.2")))
	rec := &recorder{}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec))
	stop := k.run(t)
	registered(t, k)
	stop()
	eventually(t, "the goroutines to end", func() bool { return runtime.NumGoroutine() <= before })
	if err := k.Run(context.Background()); err == nil {
		t.Error("a second Run did not fail")
	}
}

// The reset label on this node's Node is seen (through the slimmed cache),
// and its removal too; another node's label is not this node's.
func TestMarkedForReset(t *testing.T) {
	n1, n2 := node("n1", internal("10.0.0.1")), node("n2", internal("10.0.0.2"))
	n2.Labels = map[string]string{ResetLabel: "true"}
	f := newCASFake(n1, n2)
	k := newTestKube(t, f, "n1", "")
	k.run(t)
	if k.MarkedForReset() {
		t.Fatal("n1 marked for reset, but only n2 has the label")
	}
	if k.Synced() != true {
		t.Fatal("Synced false after WaitSynced")
	}
	ctx := context.Background()
	n1.Labels = map[string]string{ResetLabel: "", "other": "x"}
	if _, err := f.CoreV1().Nodes().Update(ctx, n1, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "n1 marked for reset", k.MarkedForReset)
	n1.Labels = map[string]string{"other": "x"}
	if _, err := f.CoreV1().Nodes().Update(ctx, n1, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "n1's mark removed", func() bool { return !k.MarkedForReset() })
}

// The deletion of weft's DaemonSet is seen (an uninstall), and so is its
// coming back.
func TestDaemonSetGone(t *testing.T) {
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "weft", Namespace: "kube-system"}}
	f := newCASFake(node("n1", internal("10.0.0.1")), ds)
	k := newTestKube(t, f, "n1", "", func(c *Config) { c.DaemonSet = "weft" })
	k.run(t)
	ctx := context.Background()
	eventually(t, "the DaemonSet's watch to start", func() bool { return k.dsInf.HasSynced() })
	if k.DaemonSetGone() {
		t.Fatal("DaemonSetGone with the DaemonSet there")
	}
	if err := f.AppsV1().DaemonSets("kube-system").Delete(ctx, "weft", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the deletion seen", k.DaemonSetGone)
	if k.log.count("weft's DaemonSet is deleted") != 1 {
		t.Errorf("the deletion was not logged once:\n%s", k.log.String())
	}
	if _, err := f.AppsV1().DaemonSets("kube-system").Create(ctx, ds, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the DaemonSet back", func() bool { return !k.DaemonSetGone() })
	if _, err := New(Config{Client: f, NodeName: "n1", DaemonSet: "Bad Name"}); err == nil {
		t.Error("an invalid DaemonSet name accepted")
	}
}

// TestSyncedMeansEveryNodeHandled: once the node list has synced, every
// Node of the first list is in the view that NodeCount, PeerAddrs and the
// registration read. The informer's own HasSynced says only that its store
// is full; its handler may still be delivering the list, and a router that
// went on then found its own Node missing (an ERROR in a normal start) and
// counted too few nodes.
func TestSyncedMeansEveryNodeHandled(t *testing.T) {
	const n = 3000
	objs := make([]k8sruntime.Object, 0, n)
	for i := range n {
		objs = append(objs, node(fmt.Sprintf("n%04d", i), internal(fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255+1))))
	}
	for round := range 3 {
		f := newCASFake(objs...)
		k := newTestKube(t, f, fmt.Sprintf("n%04d", n-1), "", func(c *Config) { c.After = time.After })
		stop := k.run(t)
		if got := k.NodeCount(); got != n {
			t.Fatalf("round %d: synced with %d of the %d nodes handled", round, got, n)
		}
		if !k.nodeKnown(fmt.Sprintf("n%04d", n-1)) {
			t.Fatalf("round %d: synced without this node", round)
		}
		stop()
	}
}
