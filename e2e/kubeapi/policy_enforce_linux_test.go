package kubeapi

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/weft-net/weft/e2e"
)

// TestNetworkPolicyEnforcedOnKubernetes: NetworkPolicy from the outside. Two --kube
// routers with --network-policy against a real kube-apiserver; pods are
// made as a kubelet makes them (the Pod object first, then the CNI ADD
// through the real runtime, then the address in the Pod's status). A
// policy lets only pods labelled role=allowed reach the web pod on TCP
// 8080: a pod on the other node with that label connects (over the
// tunnel), one without it does not, nor does a pod on web's own node
// (bridged), nor the allowed pod on another port; the web pod's node
// itself still reaches it (kubelet probes). Once the policy is deleted,
// everything connects. A refused try is seen as the web node's
// weft_policy_blocked_total growing, not as a time-out.
func TestNetworkPolicyEnforcedOnKubernetes(t *testing.T) {
	ctx, tb := testbed(t, 2)
	c, admin := tb.Cluster, tb.Admin
	n0, n1 := c.Nodes[0], c.Nodes[1]
	for _, n := range c.Nodes {
		if _, err := n.StartRouter("--kube", "--kubeconfig", tb.Weft.Kubeconfig, "--node-name", n.Name, "--kube-namespace", "kube-system", "--network-policy=true"); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range c.Nodes {
		if err := n.WaitReady(ctx); err != nil {
			t.Fatalf("%s: %v\n%s", n.Name, err, n.Router().LogTail(40))
		}
	}
	// No controller manager here makes the namespace's default ServiceAccount.
	if _, err := admin.CoreV1().ServiceAccounts("default").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}

	// The policy exists before the web pod: its ADD must wait for the rules.
	port := intstr.FromInt32(8080)
	tcp := corev1.ProtocolTCP
	np := &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web-from-allowed"},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{
				From:  []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"role": "allowed"}}}},
				Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}},
			}},
		},
	}
	if _, err := admin.NetworkingV1().NetworkPolicies("default").Create(ctx, np, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	mkpod := func(n *e2e.Node, name string, lab map[string]string) *e2e.Pod {
		t.Helper()
		obj := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, Labels: lab},
			Spec:       corev1.PodSpec{NodeName: n.Name, Containers: []corev1.Container{{Name: "c", Image: "c:1"}}},
		}
		obj, err := admin.CoreV1().Pods("default").Create(ctx, obj, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p, err := n.AddPod(ctx, name)
		if err != nil {
			t.Fatalf("ADD %s on %s: %v\n%s", name, n.Name, err, n.Router().LogTail(30))
		}
		obj.Status.Phase = corev1.PodRunning
		obj.Status.PodIP, obj.Status.PodIPs = p.IP.String(), []corev1.PodIP{{IP: p.IP.String()}}
		if _, err := admin.CoreV1().Pods("default").UpdateStatus(ctx, obj, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		return p
	}
	web := mkpod(n0, "web", map[string]string{"app": "web"})
	local := mkpod(n0, "local", map[string]string{"role": "allowed-not"})
	allowed := mkpod(n1, "allowed", map[string]string{"role": "allowed"})
	other := mkpod(n1, "other", nil)

	// web listens on 8080 and 9090 in its namespace.
	for _, pt := range []uint16{8080, 9090} {
		var ln net.Listener
		if err := web.NS.Do(func() (err error) {
			ln, err = net.Listen("tcp", netip.AddrPortFrom(web.IP, pt).String())
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				cn, err := ln.Accept()
				if err != nil {
					return
				}
				cn.Close()
			}
		}()
	}
	blocked := func() uint64 {
		data, err := n0.HTTPGet(ctx, "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(bytes.NewReader(data))
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), `weft_policy_blocked_total{direction="ingress"} `); ok {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil {
					t.Fatal(err)
				}
				return uint64(f)
			}
		}
		t.Fatalf("n0 /metrics has no weft_policy_blocked_total{direction=\"ingress\"}:\n%s", data)
		return 0
	}
	// try connects from ns to web's port: true once connected, false once
	// n0's ingress drop counter grew (the SYN was dropped by the policy).
	try := func(from *e2e.Netns, pt uint16) bool {
		t.Helper()
		before := blocked()
		tctx, cancel := context.WithCancel(ctx)
		defer cancel()
		done := make(chan error, 1)
		go func() {
			done <- from.Do(func() error {
				d := net.Dialer{}
				cn, err := d.DialContext(tctx, "tcp", netip.AddrPortFrom(web.IP, pt).String())
				if err == nil {
					cn.Close()
				}
				return err
			})
		}()
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("connecting from %s to web:%d: %v (neither connected nor counted as blocked)", from, pt, err)
				}
				return true
			case <-tick.C:
				if blocked() > before {
					cancel()
					<-done
					return false
				}
			}
		}
	}
	check := func(what string, want bool, from *e2e.Netns, pt uint16) {
		t.Helper()
		if got := try(from, pt); got != want {
			t.Errorf("%s (%s -> web:%d): connected %v, want %v\n%s", what, from, pt, got, want, n0.Router().LogTail(20))
		}
	}
	check("the allowed pod on the other node", true, allowed.NS, 8080)
	check("the unlabelled pod on the other node", false, other.NS, 8080)
	check("the pod on web's own node, not allowed", false, local.NS, 8080)
	check("the allowed pod on a port the policy does not name", false, allowed.NS, 9090)
	check("web's own node (kubelet probes)", true, n0.NS, 8080)

	// n0 logs the blocked connections, naming the policy and both pods
	// (sampled through nflog, at most once per pod pair a minute).
	for _, from := range []*e2e.Pod{other, local} {
		name := map[*e2e.Pod]string{other: "other", local: "local"}[from]
		want := []string{"network policy: TCP " + from.IP.String() + ":", " -> " + web.IP.String() + ":8080 blocked by policy default/web-from-allowed (ingress)",
			"from-pod=default/" + name, "to-pod=default/web"}
		e2e.WaitUntil(t, ctx, "n0 logs the blocked connection from "+name, func() (bool, string) {
			for line := range strings.Lines(n0.Router().LogTail(400)) {
				if containsAll(line, want) {
					return true, ""
				}
			}
			return false, n0.Router().LogTail(20)
		})
	}

	out, err := n0.Weft(ctx, "status", "policy")
	if err != nil || !strings.Contains(string(out), "default/web-from-allowed") || !strings.Contains(string(out), "Blocked connections: logged (nflog group 6784;") {
		t.Errorf("weft status policy on n0 (%v):\n%s", err, out)
	}
	t.Logf("weft status policy:\n%s", out)

	if err := admin.NetworkingV1().NetworkPolicies("default").Delete(ctx, np.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	e2e.WaitUntil(t, ctx, "the unlabelled pod connects once the policy is gone", func() (bool, string) {
		var ok bool
		err := other.NS.Do(func() error {
			cn, err := net.DialTimeout("tcp", netip.AddrPortFrom(web.IP, 8080).String(), 2*time.Second)
			if err == nil {
				ok = true
				cn.Close()
			}
			return nil
		})
		return ok && err == nil, fmt.Sprintf("%v", err)
	})
	check("the pod on web's own node, the policy gone", true, local.NS, 8080)
	check("the other port, the policy gone", true, allowed.NS, 9090)
}

func containsAll(s string, subs []string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}
