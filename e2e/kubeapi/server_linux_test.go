package kubeapi

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/weft-net/weft/e2e"
)

const weftSA = "system:serviceaccount:kube-system:weft"

// canI is one `kubectl auth can-i` question about the weft ServiceAccount.
type canI struct {
	verb, resource, ns, sub string // sub: a subresource
}

func (c canI) args() []string {
	a := []string{"auth", "can-i", c.verb, c.resource, "--as=" + weftSA}
	if c.ns == "" {
		a = append(a, "--all-namespaces")
	} else {
		a = append(a, "--namespace="+c.ns)
	}
	if c.sub != "" {
		a = append(a, "--subresource="+c.sub)
	}
	return a
}

func (c canI) String() string {
	return strings.Join(c.args()[2:5], " ") + " " + strings.Join(c.args()[5:], " ")
}

var (
	// Everything the router does with the API.
	mustAllow = []canI{
		{"get", "nodes", "", ""},
		{"list", "nodes", "", ""},
		{"watch", "nodes", "", ""},
		{"get", "nodes/node-a", "", ""},
		{"patch", "nodes/node-a", "", "status"},
		{"get", "configmaps/weft", "kube-system", ""},
		{"update", "configmaps/weft", "kube-system", ""},
		{"create", "configmaps", "kube-system", ""},
		{"get", "daemonsets/weft", "kube-system", ""},
		{"watch", "daemonsets/weft", "kube-system", ""},
		// NetworkPolicy: read only, cluster wide.
		{"list", "pods", "", ""},
		{"watch", "pods", "", ""},
		{"get", "pods", "default", ""},
		{"list", "namespaces", "", ""},
		{"watch", "namespaces", "", ""},
		{"list", "networkpolicies.networking.k8s.io", "", ""},
		{"watch", "networkpolicies.networking.k8s.io", "", ""},
	}
	// A sample of what it must not do.
	mustDeny = []canI{
		{"delete", "nodes", "", ""},
		{"create", "nodes", "", ""},
		{"update", "nodes/node-a", "", ""},
		{"patch", "nodes/node-a", "", ""},
		{"update", "nodes/node-a", "", "status"},
		{"get", "nodes/node-a", "", "proxy"},
		{"get", "secrets", "kube-system", ""},
		{"get", "secrets/weft-passwd", "kube-system", ""},
		{"list", "secrets", "", ""},
		{"create", "pods", "kube-system", ""},
		{"delete", "pods", "default", ""},
		{"patch", "pods", "default", ""},
		{"get", "pods", "default", "log"},
		{"create", "pods", "default", "exec"},
		{"update", "namespaces/default", "", ""},
		{"create", "networkpolicies.networking.k8s.io", "default", ""},
		{"delete", "networkpolicies.networking.k8s.io", "default", ""},
		{"get", "configmaps/other", "kube-system", ""},
		{"list", "configmaps", "kube-system", ""},
		{"watch", "configmaps", "kube-system", ""},
		{"delete", "configmaps/weft", "kube-system", ""},
		{"patch", "configmaps/weft", "kube-system", ""}, // writes are compare-and-swap updates
		{"get", "configmaps/weft", "default", ""},
		{"create", "configmaps", "default", ""},
		{"update", "configmaps/weft", "default", ""},
		{"get", "daemonsets", "kube-system", ""},
		{"update", "daemonsets/weft", "kube-system", ""},
		{"create", "serviceaccounts/weft", "kube-system", "token"},
		{"create", "clusterrolebindings", "", ""},
		{"escalate", "clusterroles", "", ""},
		{"bind", "clusterroles", "", ""},
		{"impersonate", "users", "", ""},
		{"create", "events", "kube-system", ""},
		{"*", "*", "", ""},
	}
)

// TestManifestOnServer applies deploy/ to a real API server and checks
// what the weft ServiceAccount may do, both ways, by asking the server
// (kubectl auth can-i, SelfSubjectRulesReview) and by doing it as the
// ServiceAccount with a token from the TokenRequest API.
func TestManifestOnServer(t *testing.T) {
	srv := Start(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	deploy, err := DeployDir()
	if err != nil {
		t.Fatal(err)
	}
	manifest := filepath.Join(deploy, "weft.yaml")
	kubectl := func(args ...string) string {
		t.Helper()
		out, err := srv.Kubectl(ctx, args...)
		if err != nil {
			t.Fatal(err)
		}
		return string(out)
	}
	admin, err := srv.Clientset()
	if err != nil {
		t.Fatal(err)
	}

	// A server-side dry run validates everything and creates nothing.
	out := kubectl("apply", "--dry-run=server", "-f", manifest)
	if !strings.Contains(out, "daemonset.apps/weft created (server dry run)") {
		t.Errorf("dry run said:\n%s", out)
	}
	if _, err := admin.AppsV1().DaemonSets("kube-system").Get(ctx, "weft", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("after a dry run, get daemonset: %v, want NotFound", err)
	}

	// What kustomize renders passes the same checks, with its image.
	rendered := kubectl("kustomize", deploy)
	if err := checkManifest([]byte(rendered)); err != nil {
		t.Errorf("kubectl kustomize deploy/:\n%v", err)
	}
	checkKustomizeImage(t, deploy, rendered)

	kubectl("apply", "-k", deploy)
	out = kubectl("apply", "-f", manifest) // the plain file over the kustomized one
	if !strings.Contains(out, "daemonset.apps/weft") {
		t.Errorf("apply -f said:\n%s", out)
	}
	ds, err := admin.AppsV1().DaemonSets("kube-system").Get(ctx, "weft", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if errs := checkDaemonSet(ds); len(errs) > 0 {
		t.Errorf("the DaemonSet as stored: %v", errors.Join(errs...))
	}

	for _, c := range mustAllow {
		if yes, err := srv.canI(ctx, c); err != nil || !yes {
			t.Errorf("weft cannot %s (err %v): the router needs it", c, err)
		}
	}
	for _, c := range mustDeny {
		if yes, err := srv.canI(ctx, c); err != nil || yes {
			t.Errorf("weft can %s (err %v): it must not", c, err)
		}
	}

	id, err := srv.ServiceAccount(ctx, "kube-system", "weft", 0)
	if err != nil {
		t.Fatal(err)
	}
	if id.User != weftSA {
		t.Errorf("identity %q, want %q", id.User, weftSA)
	}
	sa, err := kubernetes.NewForConfig(id.Config)
	if err != nil {
		t.Fatal(err)
	}
	checkRulesReview(ctx, t, srv, sa)
	if _, err := srv.CreateNode(ctx, "node-a", netip.MustParseAddr("192.0.2.1")); err != nil {
		t.Fatal(err)
	}
	actAsWeft(ctx, t, admin, sa)
}

// canI asks kubectl auth can-i, which exits 0 for yes and 1 for no.
func (s *Server) canI(ctx context.Context, c canI) (bool, error) {
	out, err := s.Kubectl(ctx, c.args()...)
	var ke *KubectlError
	switch {
	case err == nil && strings.TrimSpace(string(out)) == "yes":
		return true, nil
	case errors.As(err, &ke) && ke.ExitCode() == 1 && strings.TrimSpace(string(out)) == "no":
		return false, nil
	case err != nil:
		return false, err
	}
	return false, errors.New("unexpected answer " + string(out))
}

// checkKustomizeImage: the rendered containers run the image that
// kustomization.yaml names.
func checkKustomizeImage(t *testing.T, deploy, rendered string) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(deploy, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		Images []struct{ Name, NewName, NewTag string }
	}
	if err := yaml.Unmarshal(data, &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	i := slices.IndexFunc(k.Images, func(im struct{ Name, NewName, NewTag string }) bool { return im.Name == "weft" })
	if i < 0 {
		t.Fatal("kustomization.yaml sets no image for weft")
	}
	want := k.Images[i].NewName + ":" + k.Images[i].NewTag
	if n := strings.Count(rendered, "image: "+want+"\n"); n != 2 {
		t.Errorf("the rendered manifest runs image %s in %d containers, want 2 (router and install-cni)", want, n)
	}
}

// checkRulesReview asks the server, as the ServiceAccount, what it may do,
// and compares with exactly what weft.yaml grants, less what any
// ServiceAccount may do (asked the same way as one with no bindings).
func checkRulesReview(ctx context.Context, t *testing.T, srv *Server, sa kubernetes.Interface) {
	t.Helper()
	admin, err := srv.Clientset()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().ServiceAccounts("kube-system").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "nobody"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	nobodyID, err := srv.ServiceAccount(ctx, "kube-system", "nobody", 0)
	if err != nil {
		t.Fatal(err)
	}
	nobody, err := kubernetes.NewForConfig(nobodyID.Config)
	if err != nil {
		t.Fatal(err)
	}
	for ns, want := range map[string][]perm{
		"kube-system": append(slices.Clone(wantClusterPerms), wantNamespacePerms...),
		"default":     wantClusterPerms,
	} {
		base := rulesReview(ctx, t, nobody, ns)
		var got []perm
		for _, p := range rulesReview(ctx, t, sa, ns) {
			if !slices.Contains(base, p) {
				got = append(got, p)
			}
		}
		sortPerms(want)
		if !slices.Equal(got, want) {
			t.Errorf("in namespace %s weft may %v (beyond what every ServiceAccount may: %v), want exactly %v", ns, got, base, want)
		}
	}
}

// rulesReview is what cs may do in ns, by a SelfSubjectRulesReview.
func rulesReview(ctx context.Context, t *testing.T, cs kubernetes.Interface, ns string) []perm {
	t.Helper()
	rev, err := cs.AuthorizationV1().SelfSubjectRulesReviews().Create(ctx, &authorizationv1.SelfSubjectRulesReview{
		Spec: authorizationv1.SelfSubjectRulesReviewSpec{Namespace: ns},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rev.Status.Incomplete {
		t.Fatalf("rules review in %s incomplete: %s", ns, rev.Status.EvaluationError)
	}
	var rules []rbacv1.PolicyRule
	for _, r := range rev.Status.ResourceRules {
		rules = append(rules, rbacv1.PolicyRule{Verbs: r.Verbs, APIGroups: r.APIGroups, Resources: r.Resources, ResourceNames: r.ResourceNames})
	}
	return perms(rules)
}

// actAsWeft does what the router does, as the ServiceAccount, and a few
// things it must not.
func actAsWeft(ctx context.Context, t *testing.T, admin, sa kubernetes.Interface) {
	t.Helper()
	nodes, err := sa.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil || len(nodes.Items) != 1 {
		t.Fatalf("weft lists nodes: %v (%d nodes)", err, len(nodes.Items))
	}
	n := nodes.Items[0]
	if !slices.Contains(n.Status.Addresses, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: "192.0.2.1"}) ||
		!slices.ContainsFunc(n.Status.Conditions, func(c corev1.NodeCondition) bool {
			return c.Type == corev1.NodeNetworkUnavailable && c.Status == corev1.ConditionTrue
		}) {
		t.Errorf("CreateNode made %+v, want InternalIP 192.0.2.1 and NetworkUnavailable true", n.Status)
	}
	w, err := sa.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{ResourceVersion: nodes.ResourceVersion})
	if err != nil {
		t.Fatalf("weft watches nodes: %v", err)
	}
	w.Stop()

	cond := []byte(`{"status":{"conditions":[{"type":"NetworkUnavailable","status":"False","reason":"WeftIsUp","message":"weft is running on this node"}]}}`)
	if _, err := sa.CoreV1().Nodes().Patch(ctx, "node-a", types.StrategicMergePatchType, cond, metav1.PatchOptions{}, "status"); err != nil {
		t.Errorf("weft patches nodes/status: %v", err)
	}
	got, err := admin.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(got.Status.Conditions, func(c corev1.NodeCondition) bool {
		return c.Type == corev1.NodeNetworkUnavailable && c.Status == corev1.ConditionFalse && c.Reason == "WeftIsUp"
	}) {
		t.Errorf("node-a conditions after weft's patch: %+v", got.Status.Conditions)
	}
	if _, err := sa.CoreV1().Nodes().Patch(ctx, "node-a", types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("weft patches the node itself: %v, want Forbidden", err)
	}
	if err := sa.CoreV1().Nodes().Delete(ctx, "node-a", metav1.DeleteOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("weft deletes a node: %v, want Forbidden", err)
	}

	cms := sa.CoreV1().ConfigMaps("kube-system")
	cm, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "weft"}, Data: map[string]string{"k": "1"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("weft creates its ConfigMap: %v", err)
	}
	cm.Data["k"] = "2"
	if cm, err = cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("weft updates its ConfigMap: %v", err)
	}
	stale := cm.DeepCopy()
	stale.ResourceVersion = "1"
	if _, err := cms.Update(ctx, stale, metav1.UpdateOptions{}); !apierrors.IsConflict(err) {
		t.Errorf("a compare-and-swap with a stale resourceVersion: %v, want Conflict", err)
	}
	if cm, err = cms.Get(ctx, "weft", metav1.GetOptions{}); err != nil || cm.Data["k"] != "2" {
		t.Errorf("weft reads its ConfigMap: %v %v", err, cm.Data)
	}
	// NetworkPolicy: the router's informers list (and watch) these.
	for what, err := range map[string]error{
		"lists Pods":            second(sa.CoreV1().Pods("").List(ctx, metav1.ListOptions{})),
		"lists Namespaces":      second(sa.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})),
		"lists NetworkPolicies": second(sa.NetworkingV1().NetworkPolicies("").List(ctx, metav1.ListOptions{})),
	} {
		if err != nil {
			t.Errorf("weft %s: %v", what, err)
		}
	}
	for what, err := range map[string]error{
		"deletes its ConfigMap":          cms.Delete(ctx, "weft", metav1.DeleteOptions{}),
		"patches its ConfigMap":          second(cms.Patch(ctx, "weft", types.MergePatchType, []byte(`{"data":{"k":"3"}}`), metav1.PatchOptions{})),
		"lists ConfigMaps":               second(cms.List(ctx, metav1.ListOptions{})),
		"reads another ConfigMap":        second(cms.Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})),
		"creates a ConfigMap in default": second(sa.CoreV1().ConfigMaps("default").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "weft"}}, metav1.CreateOptions{})),
		"lists Secrets":                  second(sa.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{})),
		"creates a Pod":                  second(sa.CoreV1().Pods("default").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "x"}, Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "i"}}}}, metav1.CreateOptions{})),
		"creates a NetworkPolicy":        second(sa.NetworkingV1().NetworkPolicies("default").Create(ctx, &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Name: "x"}}, metav1.CreateOptions{})),
		"deletes a Namespace":            sa.CoreV1().Namespaces().Delete(ctx, "default", metav1.DeleteOptions{}),
		"reads another DaemonSet":        second(sa.AppsV1().DaemonSets("kube-system").Get(ctx, "kube-proxy", metav1.GetOptions{})),
		"lists DaemonSets":               second(sa.AppsV1().DaemonSets("kube-system").List(ctx, metav1.ListOptions{})),
		"deletes its DaemonSet":          sa.AppsV1().DaemonSets("kube-system").Delete(ctx, "weft", metav1.DeleteOptions{}),
		"reads its own ServiceAccount":   second(sa.CoreV1().ServiceAccounts("kube-system").Get(ctx, "weft", metav1.GetOptions{})),
		"creates a ClusterRoleBinding":   second(sa.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "x"}, RoleRef: rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "cluster-admin"}}, metav1.CreateOptions{})),
	} {
		if !apierrors.IsForbidden(err) {
			t.Errorf("weft %s: %v, want Forbidden", what, err)
		}
	}
}

func second[T any](_ T, err error) error { return err }

// TestServerInUnderlay starts the server where an e2e cluster's nodes
// reach it, and uses the weft ServiceAccount's kubeconfig from inside a
// node's namespace, as a router there would.
func TestServerInUnderlay(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("kubeapi: needs root to make network namespaces")
	}
	if testing.Short() {
		t.Skip("kubeapi: skipped in -short mode")
	}
	run := e2e.NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := run.NewCluster(ctx, e2e.ClusterOpts{Nodes: 1})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	srv := Start(t, Options{Run: run, NetNS: c.Underlay, Address: e2e.UnderlayGateway})
	t.Logf("control plane ready in %s at %s", time.Since(start).Round(time.Millisecond), srv.URL)
	if srv.URL != "https://10.250.0.254:6443" {
		t.Errorf("URL %s, want https://10.250.0.254:6443", srv.URL)
	}
	if err := srv.ApplyWeft(ctx); err != nil {
		t.Fatal(err)
	}
	id, err := srv.ServiceAccount(ctx, "kube-system", "weft", 0)
	if err != nil {
		t.Fatal(err)
	}
	n0 := c.Nodes[0].NS
	out, err := srv.KubectlIn(ctx, n0, id.Kubeconfig, nil, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != weftSA {
		t.Errorf("from node n0 the kubeconfig is %q, want %q", out, weftSA)
	}
	if _, err := srv.CreateNode(ctx, "n0", c.Nodes[0].UnderlayIP); err != nil {
		t.Fatal(err)
	}
	out, err = srv.KubectlIn(ctx, n0, id.Kubeconfig, nil, "get", "nodes", "-o", `jsonpath={.items[*].status.addresses[?(@.type=="InternalIP")].address}`)
	if err != nil || string(out) != c.Nodes[0].UnderlayIP.String() {
		t.Errorf("weft lists the nodes' InternalIPs from n0: %q, %v; want %s", out, err, c.Nodes[0].UnderlayIP)
	}
	_, err = srv.KubectlIn(ctx, n0, id.Kubeconfig, nil, "get", "secrets", "-n", "kube-system")
	var ke *KubectlError
	if !errors.As(err, &ke) || !strings.Contains(ke.Stderr, "forbidden") {
		t.Errorf("weft lists secrets from n0: %v, want forbidden", err)
	}
	// The admin's client from the test process dials inside the underlay.
	admin, err := srv.Clientset()
	if err != nil {
		t.Fatal(err)
	}
	v, err := admin.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	if v.GitVersion != KubeVersion {
		t.Errorf("server version %s, want %s", v.GitVersion, KubeVersion)
	}
}
