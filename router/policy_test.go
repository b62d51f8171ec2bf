package router

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/internal/syncbuf"
	"github.com/weft-net/weft/policy"
)

// fakeEnforcer records what it is asked to enforce. gate, if set, is
// called at the start of every Sync, before it takes effect (it may
// block); fail makes that many Syncs fail.
type fakeEnforcer struct {
	mu        sync.Mutex
	rules     *policy.NodeRules // as last synced
	syncs     int               // successful
	failed    int
	fail      int
	gate      func(*policy.NodeRules)
	teardowns int
}

func newFakeEnforcer() *fakeEnforcer { return &fakeEnforcer{} }

func (f *fakeEnforcer) Sync(nr *policy.NodeRules) error {
	f.mu.Lock()
	gate := f.gate
	f.mu.Unlock()
	if gate != nil {
		gate(nr)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail > 0 {
		f.fail--
		f.failed++
		return errors.New("nft: the fake enforcer fails as told")
	}
	f.rules = nr
	f.syncs++
	return nil
}

func (f *fakeEnforcer) Blocked() (uint64, uint64, error) { return 7, 3, nil }

func (f *fakeEnforcer) Teardown() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.teardowns++
	return nil
}

func (f *fakeEnforcer) setGate(g func(*policy.NodeRules)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gate = g
}

func (f *fakeEnforcer) last() *policy.NodeRules {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.rules
}

// isolates reports whether the rules in force isolate pod ns/name.
func (f *fakeEnforcer) isolates(ns, name string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.rules == nil {
		return false
	}
	for _, pr := range f.rules.Pods {
		if pr.Namespace == ns && pr.Name == name && (pr.Ingress.Isolated || pr.Egress.Isolated) {
			return true
		}
	}
	return false
}

// watchedClientset is client-go's fake clientset that says which
// resources are watched: a change made before an informer's watch is
// registered would be lost (the fake's watch has no history).
func watchedClientset(objs ...k8sruntime.Object) (*fake.Clientset, func(resources ...string) bool) {
	f := fake.NewClientset(objs...)
	var mu sync.Mutex
	watched := map[string]bool{}
	f.PrependWatchReactor("*", func(a k8stesting.Action) (bool, watch.Interface, error) {
		var opts metav1.ListOptions
		if wa, ok := a.(k8stesting.WatchActionImpl); ok {
			opts = wa.ListOptions
		}
		w, err := f.Tracker().Watch(a.GetResource(), a.GetNamespace(), opts)
		if err != nil {
			return false, nil, err
		}
		mu.Lock()
		watched[a.GetResource().Resource] = true
		mu.Unlock()
		return true, w, nil
	})
	return f, func(resources ...string) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, r := range resources {
			if !watched[r] {
				return false
			}
		}
		return true
	}
}

// startPolicyWatch runs a policyWatch for node n1 on client with enf
// until the test ends.
func startPolicyWatch(t *testing.T, client *fake.Clientset, enf PolicyEnforcer) (*policyWatch, *prometheus.Registry, *syncbuf.Buffer) {
	t.Helper()
	log := &syncbuf.Buffer{}
	reg := prometheus.NewRegistry()
	w, err := newPolicyWatch(client, "n1", enf, slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})), reg, time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		if t.Failed() {
			t.Logf("log:\n%s", log.String())
		}
	})
	return w, reg, log
}

func namespace(name string, labels map[string]string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

// kpod is a pod as the API server shows it; ip "" has none yet.
func kpod(ns, name, node, ip string, labels map[string]string, ports ...corev1.ContainerPort) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Ports: ports}}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning},
	}
	if ip != "" {
		p.Status.PodIP, p.Status.PodIPs = ip, []corev1.PodIP{{IP: ip}}
	}
	return p
}

func ppod(ns, name, node, ip string, labels map[string]string, ports ...policy.Port) policy.Pod {
	return policy.Pod{Namespace: ns, Name: name, Node: node, IP: netip.MustParseAddr(ip), Labels: labels, Ports: ports}
}

// want is what node n1 must enforce for the world w, by the policy
// package's own translation.
func want(w policy.World) *policy.NodeRules {
	w.Pods, w.Namespaces, w.Policies = slices.Clone(w.Pods), slices.Clone(w.Namespaces), slices.Clone(w.Policies)
	sortWorld(&w)
	return policy.Compile(&w, "n1")
}

func waitRules(t *testing.T, enf *fakeEnforcer, what string, nr *policy.NodeRules) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !reflect.DeepEqual(enf.last(), nr) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: the enforcer has\n%s\nwant\n%s", what, dumpRules(enf.last()), dumpRules(nr))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func dumpRules(nr *policy.NodeRules) string {
	if nr == nil {
		return "  (nothing synced)"
	}
	var b strings.Builder
	for ip, pr := range nr.Pods {
		fmt.Fprintf(&b, "  %s %s/%s ingress %+v egress %+v\n", ip, pr.Namespace, pr.Name, pr.Ingress, pr.Egress)
	}
	return b.String()
}

// TestPolicyWatchFollowsTheCluster: the rules handed to the enforcer
// follow the cluster, as policy.Compile says for the expected world,
// through a NetworkPolicy created, updated and deleted, a pod relabelled
// and a namespace relabelled. A hostNetwork pod and a pod without an
// address are left out; weft status policy lists what is in force.
func TestPolicyWatchFollowsTheCluster(t *testing.T) {
	ctx := context.Background()
	http := corev1.ContainerPort{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}
	hostNet := kpod("default", "host", "n1", "192.168.1.1", map[string]string{"app": "web"})
	hostNet.Spec.HostNetwork = true
	client, watched := watchedClientset(
		namespace("default", map[string]string{"team": "a"}),
		namespace("prod", map[string]string{"team": "b"}),
		kpod("default", "web", "n1", "10.32.0.2", map[string]string{"app": "web"}, http),
		kpod("default", "db", "n1", "10.32.0.3", map[string]string{"app": "db"}),
		kpod("prod", "client", "n2", "10.32.1.4", map[string]string{"app": "client"}),
		hostNet,
		kpod("default", "new", "n1", "", map[string]string{"app": "web"}),
	)
	enf := newFakeEnforcer()
	w, _, _ := startPolicyWatch(t, client, enf)
	waitUntil(t, "the three informers watching", func() bool { return watched("pods", "namespaces", "networkpolicies") })
	var prev *policy.NodeRules
	step := func(what string, w policy.World) {
		t.Helper()
		nr := want(w)
		if prev != nil && reflect.DeepEqual(prev, nr) {
			t.Fatalf("%s: the step changes nothing: the test proves nothing", what)
		}
		prev = nr
		waitRules(t, enf, what, nr)
	}

	nss := []policy.Namespace{{Name: "default", Labels: map[string]string{"team": "a"}}, {Name: "prod", Labels: map[string]string{"team": "b"}}}
	pods := []policy.Pod{
		ppod("default", "web", "n1", "10.32.0.2", map[string]string{"app": "web"}, policy.Port{Name: "http", Protocol: corev1.ProtocolTCP, Number: 8080}),
		ppod("default", "db", "n1", "10.32.0.3", map[string]string{"app": "db"}),
		ppod("prod", "client", "n2", "10.32.1.4", map[string]string{"app": "client"}),
	}
	step("no policy", policy.World{Namespaces: nss, Pods: pods})

	tcp := corev1.ProtocolTCP
	named := intstr.FromString("http")
	np := &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "allow-client"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "db"}},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{
				From: []networkingv1.NetworkPolicyPeer{{
					NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "b"}},
					PodSelector:       &metav1.LabelSelector{MatchLabels: map[string]string{"app": "client"}},
				}},
			}},
		},
	}
	created, err := client.NetworkingV1().NetworkPolicies("default").Create(ctx, np, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	step("policy created", policy.World{Namespaces: nss, Pods: pods, Policies: []networkingv1.NetworkPolicy{*np}})

	// Updated: it selects web now, on its named port only.
	np = created.DeepCopy()
	np.Spec.PodSelector.MatchLabels = map[string]string{"app": "web"}
	np.Spec.Ingress[0].Ports = []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &named}}
	if _, err := client.NetworkingV1().NetworkPolicies("default").Update(ctx, np, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	step("policy updated", policy.World{Namespaces: nss, Pods: pods, Policies: []networkingv1.NetworkPolicy{*np}})

	// weft status policy: the policy, and the one local pod it selects
	// (not the hostNetwork pod, nor the one without an address).
	waitUntil(t, "the report to show the updated policy", func() bool {
		rep := w.report()
		return len(rep.Policies) == 1 && reflect.DeepEqual(rep.Policies[0].Pods, []string{"default/web"})
	})
	var out bytes.Buffer
	WritePolicy(&out, w.report())
	text := regexp.MustCompile(`applied at [^;]+; \d+ syncs`).ReplaceAllString(out.String(), "applied at T; N syncs")
	wantText := `NetworkPolicy: enforced on node n1 (rules applied at T; N syncs, 0 failed)
  Watching: 3 pods (2 on this node; left out: 1 hostNetwork, 1 without an address, 0 terminated), 2 namespaces, 1 policies
  Blocked connections: counted in weft_policy_blocked_total, not logged (the enforcer cannot sample)

POLICY                TYPES    PODS ON THIS NODE
default/allow-client  ingress  default/web
`
	if text != wantText {
		t.Errorf("weft status policy:\n%s\nwant\n%s", text, wantText)
	}

	// The client pod relabelled: no longer a peer.
	cl, err := client.CoreV1().Pods("prod").Get(ctx, "client", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cl.Labels = map[string]string{"app": "other"}
	if _, err := client.CoreV1().Pods("prod").Update(ctx, cl, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods[2].Labels = map[string]string{"app": "other"}
	step("pod relabelled", policy.World{Namespaces: nss, Pods: pods, Policies: []networkingv1.NetworkPolicy{*np}})
	if pr := enf.last().Pods[netip.MustParseAddr("10.32.0.2")]; pr == nil || !pr.Ingress.Isolated || len(pr.Ingress.Rules) != 1 || len(pr.Ingress.Rules[0].Peers) != 0 {
		t.Errorf("web's ingress with no peer left: %+v, want isolated, its rule without peers", pr)
	}

	// Back, and then the namespace relabelled: the peer goes again.
	cl.Labels = map[string]string{"app": "client"}
	if _, err := client.CoreV1().Pods("prod").Update(ctx, cl, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods[2].Labels = map[string]string{"app": "client"}
	step("pod labelled again", policy.World{Namespaces: nss, Pods: pods, Policies: []networkingv1.NetworkPolicy{*np}})
	if pr := enf.last().Pods[netip.MustParseAddr("10.32.0.2")]; pr == nil || len(pr.Ingress.Rules) != 1 {
		t.Errorf("web's ingress with the client as a peer: %+v, want one rule", pr)
	}
	if _, err := client.CoreV1().Namespaces().Update(ctx, namespace("prod", map[string]string{"team": "c"}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	nss[1].Labels = map[string]string{"team": "c"}
	step("namespace relabelled", policy.World{Namespaces: nss, Pods: pods, Policies: []networkingv1.NetworkPolicy{*np}})

	// Deleted: nothing is isolated.
	if err := client.NetworkingV1().NetworkPolicies("default").Delete(ctx, "allow-client", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	step("policy deleted", policy.World{Namespaces: nss, Pods: pods})
	out.Reset()
	waitUntil(t, "the report without the policy", func() bool { return len(w.report().Policies) == 0 })
	WritePolicy(&out, w.report())
	if !strings.Contains(out.String(), "No policy selects a pod of this node: its pods are not isolated.") {
		t.Errorf("weft status policy without policies:\n%s", out.String())
	}
}

// TestPolicySyncRetried: a failing Sync is logged once (not at every
// retry), counted in weft_policy_sync_total{result="error"}, and retried
// until it succeeds.
func TestPolicySyncRetried(t *testing.T) {
	client, _ := watchedClientset(namespace("default", nil), kpod("default", "web", "n1", "10.32.0.2", nil))
	enf := newFakeEnforcer()
	enf.fail = 3
	w, reg, log := startPolicyWatch(t, client, enf)
	waitUntil(t, "a successful sync after three failures", func() bool {
		enf.mu.Lock()
		defer enf.mu.Unlock()
		return enf.syncs >= 1 && enf.failed == 3
	})
	waitUntil(t, "the success recorded", func() bool { return w.report().AppliedAt != "" })
	if got := testutil.ToFloat64(w.syncTotal.WithLabelValues("error")); got != 3 {
		t.Errorf("weft_policy_sync_total{result=error} = %v, want 3", got)
	}
	if got := testutil.ToFloat64(w.syncTotal.WithLabelValues("ok")); got < 1 {
		t.Errorf("weft_policy_sync_total{result=ok} = %v, want at least 1", got)
	}
	if n := strings.Count(log.String(), "applying this node's rules failed"); n != 1 {
		t.Errorf("the failure logged %d times, want once:\n%s", n, log.String())
	}
	if !strings.Contains(log.String(), "nft: the fake enforcer fails as told") || !strings.Contains(log.String(), "rules are applied again") {
		t.Errorf("the log does not say what failed and that it recovered:\n%s", log.String())
	}
	rep := w.report()
	if rep.Failed != 3 || rep.Error != "" {
		t.Errorf("report: %d failed, error %q; want 3 and none", rep.Failed, rep.Error)
	}
	// The blocked counters, and the sync metrics, are on the registry.
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP weft_policy_blocked_total Packets dropped by NetworkPolicy on this node, by direction (ingress: into a pod of this node; egress: out of one).
# TYPE weft_policy_blocked_total counter
weft_policy_blocked_total{direction="egress"} 3
weft_policy_blocked_total{direction="ingress"} 7
`), "weft_policy_blocked_total"); err != nil {
		t.Error(err)
	}
	if n, err := testutil.GatherAndCount(reg, "weft_policy_sync_duration_seconds"); err != nil || n != 1 {
		t.Errorf("weft_policy_sync_duration_seconds: %d series, %v", n, err)
	}
}

// TestPolicyRBACMissing: a ServiceAccount that may not list pods gets an
// error naming the permission, in the report and in a pod's ADD, which
// cannot know the pod's policies and fails (the runtime retries).
func TestPolicyRBACMissing(t *testing.T) {
	client, _ := watchedClientset(namespace("default", nil))
	client.PrependReactor("list", "pods", func(k8stesting.Action) (bool, k8sruntime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "",
			errors.New(`User "system:serviceaccount:kube-system:weft" cannot list resource "pods" in API group "" at the cluster scope`))
	})
	enf := newFakeEnforcer()
	w, _, log := startPolicyWatch(t, client, enf)
	const wantMsg = "the router's ServiceAccount needs get, list and watch on pods"
	waitUntil(t, "the report to name the missing permission", func() bool { return strings.Contains(w.report().Error, wantMsg) })
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the ADD's deadline has passed
	err := w.admit(ctx, "default", "web", netip.MustParseAddr("10.32.0.9"))
	if err == nil || !strings.Contains(err.Error(), wantMsg) || !strings.Contains(err.Error(), "default/web") {
		t.Errorf("ADD: %v, want an error naming the pod and the permission", err)
	}
	if !strings.Contains(log.String(), wantMsg) {
		t.Errorf("the log does not name the permission:\n%s", log.String())
	}
	var out bytes.Buffer
	WritePolicy(&out, w.report())
	if !strings.Contains(out.String(), "not read yet") || !strings.Contains(out.String(), wantMsg) {
		t.Errorf("weft status policy:\n%s", out.String())
	}
	if enf.last() != nil {
		t.Errorf("synced before the lists were read: %s", dumpRules(enf.last()))
	}
}

// TestPolicyAdmitUnselected: a pod no policy of its namespace selects is
// not held up by the policy sync (here one held until the ADD answered),
// its address still reaches the next sync, and leaves the rules when it
// is released.
func TestPolicyAdmitUnselected(t *testing.T) {
	np := &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "db-only"},
		Spec:       networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "db"}}},
	}
	client, _ := watchedClientset(namespace("default", nil), kpod("default", "web", "n1", "", map[string]string{"app": "web"}), np)
	enf := newFakeEnforcer()
	w, _, _ := startPolicyWatch(t, client, enf)
	waitUntil(t, "the first sync", func() bool { return w.report().AppliedAt != "" })
	release := make(chan struct{})
	enf.setGate(func(*policy.NodeRules) { <-release })
	ip := netip.MustParseAddr("10.32.0.9")
	if err := w.admit(context.Background(), "default", "web", ip); err != nil {
		t.Fatal(err)
	}
	if err := w.admit(context.Background(), "", "", netip.MustParseAddr("10.32.0.10")); err != nil {
		t.Fatalf("an ADD without a pod name: %v", err)
	}
	// Once syncs go through, the pod is there at its new address (the
	// API server does not show it yet), until the address is released.
	close(release)
	waitUntil(t, "the pod at its new address in the rules", func() bool {
		nr := enf.last()
		return nr != nil && nr.Pods[ip] != nil && nr.Pods[ip].Name == "web"
	})
	w.forget(ip)
	waitUntil(t, "the released address gone from the rules", func() bool { return enf.last().Pods[ip] == nil })
}

// TestPolicyADDWaitsForRules: through the local API of a whole --kube
// router, a pod's ADD answers only once the rules of the policy that
// selects it, with its new address, are applied. The enforcer holds the
// Sync that isolates the pod until the ADD either answers (a failure: it
// answered before its rules were applied) or is seen waiting for them;
// whether the rules were in force is read the moment the ADD answers. So
// a router that answers first fails, whatever the timing.
func TestPolicyADDWaitsForRules(t *testing.T) {
	client, nodes, _, _ := startKubeRouters(t, "10.42.0.0/20", []string{"10.98.0.1"}, time.Minute)
	n := nodes[0]
	ctx := context.Background()
	if err := n.api.Ready(ctx); err != nil {
		waitUntil(t, "the router ready", func() bool { return n.api.Ready(ctx) == nil })
	}
	if _, err := client.CoreV1().Namespaces().Create(ctx, namespace("default", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Pods("default").Create(ctx, kpod("default", "web", "n1", "", map[string]string{"app": "web"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	np := &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "deny-web"},
		Spec:       networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}}},
	}
	if _, err := client.NetworkingV1().NetworkPolicies("default").Create(ctx, np, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The router must know the policy before the ADD (Kubernetes makes
	// no promise for a pod created before its network plugin has seen
	// the policy).
	waitUntil(t, "the router to see the policy", func() bool {
		r := n.node.policy.report()
		return r.Watching.Policies == 1 && r.Watching.Pods == 0
	})
	enf := n.kernel.policy
	started, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	enf.setGate(func(nr *policy.NodeRules) {
		for _, pr := range nr.Pods {
			if pr.Name == "web" && pr.Ingress.Isolated {
				once.Do(func() { close(started) })
				<-release
			}
		}
	})
	type answer struct {
		al      *api.Allocation
		err     error
		inForce bool
	}
	done := make(chan answer, 1)
	go func() {
		al, err := n.api.Allocate(ctx, api.AllocateRequest{Attachment: api.Attachment{ContainerID: "web-1", IfName: "eth0"}, PodNamespace: "default", PodName: "web"})
		done <- answer{al, err, enf.isolates("default", "web")}
	}()
	var a answer
	answered := false
	waitUntil(t, "the ADD to answer or to wait for the Sync that isolates the pod", func() bool {
		select {
		case a = <-done:
			answered = true
			return true
		default:
		}
		select {
		case <-started:
		default:
			return false
		}
		n.node.policy.mu.Lock()
		defer n.node.policy.mu.Unlock()
		return n.node.policy.waiting > 0
	})
	if answered {
		t.Fatalf("the ADD answered (err %v, its rules in force: %v) while the Sync that isolates the pod was held", a.err, a.inForce)
	}
	close(release)
	a = <-done
	if a.err != nil {
		t.Fatal(a.err)
	}
	if !a.inForce {
		t.Fatal("the ADD answered before the pod's rules were applied")
	}
	pr := enf.last().Pods[a.al.Address.Addr()]
	if pr == nil || pr.Name != "web" || !pr.Ingress.Isolated {
		t.Fatalf("rules at the pod's address %s: %+v", a.al.Address.Addr(), pr)
	}
}

// TestPolicyStatusNotEnforced: with an enforcer whose every sync fails,
// weft status policy says the rules are not enforced, why, and still
// lists what they would be.
func TestPolicyStatusNotEnforced(t *testing.T) {
	np := &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "deny-web"},
		Spec:       networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}}},
	}
	client, _ := watchedClientset(namespace("default", nil), kpod("default", "web", "n1", "10.32.0.2", map[string]string{"app": "web"}), np)
	w, _, _ := startPolicyWatch(t, client, &fakeEnforcer{fail: 1 << 30})
	waitUntil(t, "a failed sync", func() bool { r := w.report(); return r.Failed > 0 && len(r.Policies) == 1 })
	var out bytes.Buffer
	WritePolicy(&out, w.report())
	for _, s := range []string{"NOT ENFORCED on node n1: the rules below were never applied", "the fake enforcer fails as told", "default/deny-web  ingress  default/web"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("weft status policy lacks %q:\n%s", s, out.String())
		}
	}
}

// TestPolicySummary: the networkpolicy line of weft status.
func TestPolicySummary(t *testing.T) {
	for _, tc := range []struct {
		rep  PolicyReport
		want string
	}{
		{PolicyReport{Off: "--network-policy=false"}, "off (--network-policy=false)"},
		{PolicyReport{Enabled: true}, "starting: the pod, namespace and NetworkPolicy lists are not read yet"},
		{PolicyReport{Enabled: true, Synced: true, Syncs: 2, Failed: 2}, "NOT ENFORCED: the rules failed to apply (weft status policy)"},
		{PolicyReport{Enabled: true, Synced: true, Syncs: 1, Applied: true}, "enforced (0 policies select pods of this node)"},
		{PolicyReport{Enabled: true, Synced: true, Syncs: 1, Applied: true, Policies: []PolicyInForce{{}}}, "enforced (1 policy selects pods of this node)"},
	} {
		var b bytes.Buffer
		WriteStatus(&b, Report{Policy: tc.rep})
		if want := "        Service: networkpolicy\n         Status: " + tc.want + "\n"; !strings.Contains(b.String(), want) {
			t.Errorf("weft status with %+v:\n%s\nwant the lines\n%s", tc.rep, b.String(), want)
		}
	}
}
