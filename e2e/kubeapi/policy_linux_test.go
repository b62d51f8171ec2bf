package kubeapi

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestNetworkPolicyOnKubernetes: a --kube router with --network-policy,
// as the weft ServiceAccount of deploy/weft.yaml, reads the pods,
// namespaces and NetworkPolicies of a real kube-apiserver (its informers
// sync: the RBAC suffices), and weft status policy lists a policy created
// there with the pod of its node it selects. (Without a kubelet here, the
// test gives the pod its address through the status subresource.)
func TestNetworkPolicyOnKubernetes(t *testing.T) {
	ctx, tb := testbed(t, 1)
	n0, admin := tb.Cluster.Nodes[0], tb.Admin
	if _, err := n0.StartRouter("--kube", "--kubeconfig", tb.Weft.Kubeconfig, "--node-name", n0.Name, "--kube-namespace", "kube-system", "--network-policy=true"); err != nil {
		t.Fatal(err)
	}
	if err := n0.WaitReady(ctx); err != nil {
		t.Fatalf("%v\n%s", err, n0.Router().LogTail(40))
	}
	eventually(t, ctx, "the policy informers synced", func() (bool, string) {
		return countInFile(t, n0.RouterLog, "network policy: watching pods, namespaces and NetworkPolicies") == 1, n0.Router().LogTail(20)
	})

	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "np"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// No controller manager here makes the namespace's default ServiceAccount.
	if _, err := admin.CoreV1().ServiceAccounts("np").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "np", Name: "web", Labels: map[string]string{"app": "web"}},
		Spec:       corev1.PodSpec{NodeName: n0.Name, Containers: []corev1.Container{{Name: "web", Image: "web:1"}}},
	}
	pod, err := admin.CoreV1().Pods("np").Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod.Status.Phase = corev1.PodRunning
	pod.Status.PodIP, pod.Status.PodIPs = "10.32.0.77", []corev1.PodIP{{IP: "10.32.0.77"}}
	if _, err := admin.CoreV1().Pods("np").UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	np := &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "np", Name: "deny-web"},
		Spec:       networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}}},
	}
	if _, err := admin.NetworkingV1().NetworkPolicies("np").Create(ctx, np, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, ctx, "weft status policy to list np/deny-web selecting np/web", func() (bool, string) {
		out, err := n0.HTTPGet(ctx, "/status/policy")
		if err != nil {
			return false, err.Error()
		}
		ok := false
		for _, l := range strings.Split(string(out), "\n") {
			f := strings.Fields(l)
			ok = ok || len(f) == 3 && f[0] == "np/deny-web" && f[1] == "ingress" && f[2] == "np/web"
		}
		return ok, string(out)
	})
	out, _ := n0.HTTPGet(ctx, "/status/policy")
	t.Logf("weft status policy:\n%s", out)
}
