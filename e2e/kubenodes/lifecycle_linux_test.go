package kubenodes

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weft-net/weft/e2e"
	"github.com/weft-net/weft/e2e/kubeapi"
)

// TestKubeLateAPIUninstall is weft's life on two real nodes from the start
// of a new cluster to its uninstall, as a user meets it:
//
//   - deploy/ applied as it is (no overlay): the routers reach the API
//     server at the kubernetes Service's ClusterIP, and kube-proxy is not
//     running yet, so that address does not answer (Weave's #3938). The
//     routers stay alive past the liveness probe's window, /readyz and
//     their log say why they are not ready, the nodes stay NotReady; once
//     kube-proxy runs they turn ready without a restart.
//   - pods on both nodes reach each other;
//   - the uninstall as docs/kubernetes.md says it: kubectl delete -k
//     deploy/ (the nodes turn NotReady), the deploy/uninstall DaemonSet
//     until it is rolled out, then its deletion: no weft link, nftables
//     table, route, CNI config, state or socket is left on either node
//     (checked inside each node's namespaces), and the nodes stay
//     NotReady.
func TestKubeLateAPIUninstall(t *testing.T) {
	if !*runKube {
		t.Skip("kubenodes: the real-node cluster runs with -kubenodes (make e2e-kube)")
	}
	run := e2e.NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	bin, err := run.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	probe, err := BuildProbeImage(ctx, run.Dir())
	if err != nil {
		t.Fatal(err)
	}
	images := []string{filepath.Join(bin, "weft-image.tar"), filepath.Join(bin, "pause-image.tar"), probe}
	c, err := newCluster(ctx, t, run, Options{Nodes: 2, Images: images, KubeProxyLater: true})
	skipOnHostFeature(t, err)
	if err != nil {
		t.Fatal(err)
	}
	root, err := kubeapi.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	deploy := filepath.Join(root, "deploy")

	// The routers' API address: the kubernetes Service's ClusterIP, which
	// only kube-proxy's rules lead to the API server.
	svc, err := c.CS.CoreV1().Services("default").Get(ctx, "kubernetes", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vip := svc.Spec.ClusterIP
	step(t, c, "kubectl apply -k deploy/ (no kube-proxy yet)", func() error {
		_, err := c.API.Kubectl(ctx, "apply", "-k", deploy)
		return err
	})
	var started map[string]corev1.ContainerStatus
	step(t, c, "routers alive and waiting for the API at the Service address", func() error {
		return poll(ctx, 3*time.Minute, "every router running, /healthz ok, /readyz and its log saying it waits for "+vip, func() (bool, string) {
			st, why := routerStatuses(ctx, c)
			if why != "" {
				return false, why
			}
			for _, n := range c.Nodes {
				if _, err := n.HTTPGet(ctx, "/healthz"); err != nil {
					return false, err.Error()
				}
				_, err := n.HTTPGet(ctx, "/readyz")
				if err == nil || !strings.Contains(err.Error(), "waiting for the Kubernetes API (https://"+vip+":443)") {
					return false, fmt.Sprintf("%s /readyz: %v", n.Name, err)
				}
				if countInPodLogs(n, "cannot read the node list and the ConfigMap") == 0 {
					return false, n.Name + ": no line in the router's log saying why it waits"
				}
			}
			started = st
			return true, ""
		})
	})
	for _, n := range c.Nodes {
		_, err := n.HTTPGet(ctx, "/readyz")
		t.Logf("%s while kube-proxy is not running: /readyz %v", n.Name, err)
	}
	// Alive past the liveness probe's window (initialDelaySeconds +
	// failureThreshold x periodSeconds of deploy/weft.yaml: a router whose
	// /healthz failed would have been restarted by then), still waiting.
	ds, err := c.CS.AppsV1().DaemonSets("kube-system").Get(ctx, "weft", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	lp := ds.Spec.Template.Spec.Containers[0].LivenessProbe
	window := time.Duration(lp.InitialDelaySeconds+lp.FailureThreshold*lp.PeriodSeconds)*time.Second + 5*time.Second
	step(t, c, fmt.Sprintf("routers alive past the liveness window (%s)", window), func() error {
		var last time.Time
		for _, s := range started {
			if s.State.Running.StartedAt.After(last) {
				last = s.State.Running.StartedAt.Time
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Until(last.Add(window))):
		}
		st, why := routerStatuses(ctx, c)
		if why != "" {
			return fmt.Errorf("after the liveness window: %s", why)
		}
		for node, s := range st {
			if s.ContainerID != started[node].ContainerID || s.RestartCount != 0 {
				return fmt.Errorf("the router on %s was restarted while it waited for the API server (container %s, then %s, %d restarts)", node, started[node].ContainerID, s.ContainerID, s.RestartCount)
			}
			if s.Ready {
				return fmt.Errorf("the router on %s is ready while the API server's Service address does not answer", node)
			}
		}
		for _, n := range c.Nodes {
			if st := nodeReady(ctx, c, n.Name); st.Status == corev1.ConditionTrue {
				return fmt.Errorf("node %s Ready while its router waits for the API server", n.Name)
			}
		}
		return nil
	})

	// kube-proxy comes up: the Service address answers, the routers go on.
	kubeProxyAt := time.Now()
	for _, n := range c.Nodes {
		if err := c.StartKubeProxy(n); err != nil {
			t.Fatal(err)
		}
	}
	step(t, c, "kube-proxy started: routers Ready without a restart, nodes Ready", func() error {
		return poll(ctx, 3*time.Minute, "every router Ready and every node Ready", func() (bool, string) {
			st, why := routerStatuses(ctx, c)
			if why != "" {
				return false, why
			}
			for _, n := range c.Nodes {
				s := st[n.Name]
				if s.ContainerID != started[n.Name].ContainerID || s.RestartCount != 0 {
					return true, "" // reported below
				}
				if !s.Ready {
					return false, n.Name + ": router not ready"
				}
				if nr := nodeReady(ctx, c, n.Name); nr.Status != corev1.ConditionTrue {
					return false, n.Name + ": node " + string(nr.Status) + " " + nr.Message
				}
			}
			return true, ""
		})
	})
	st, why := routerStatuses(ctx, c)
	if why != "" {
		t.Fatal(why)
	}
	for _, n := range c.Nodes {
		if s := st[n.Name]; s.ContainerID != started[n.Name].ContainerID || s.RestartCount != 0 {
			t.Fatalf("the router on %s was restarted (container %s, then %s, %d restarts); it should have gone on by itself", n.Name, started[n.Name].ContainerID, s.ContainerID, s.RestartCount)
		}
		if countInPodLogs(n, "the API server answers; going on with the start") != 1 {
			t.Errorf("the router on %s did not log that the API server answers", n.Name)
		}
	}
	t.Logf("routers ready and nodes Ready %s after kube-proxy started", time.Since(kubeProxyAt).Round(100*time.Millisecond))

	// Pods on both nodes reach each other: the nodes have weft's bridge,
	// routes and the pods' veths for the uninstall to remove.
	var pods []corev1.Pod
	step(t, c, "a pod on each node, reaching the other", func() error {
		for i, n := range c.Nodes {
			p := probePod(fmt.Sprintf("probe-%d", i), n.Name)
			p.Labels = map[string]string{"app": "probe"}
			if _, err := c.CS.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{}); err != nil {
				return err
			}
		}
		for i := range c.Nodes {
			if err := waitPodReady(ctx, c, "default", fmt.Sprintf("probe-%d", i)); err != nil {
				return err
			}
		}
		pods = probePods(t, ctx, c)
		if m := podMatrix(ctx, pods); !m.AllOK() {
			return fmt.Errorf("pods that did not reach each other: %v\n%s", m.Failures(), m)
		}
		return nil
	})
	// The check can fail: a node with weft on it is not clean.
	for _, n := range c.Nodes {
		left, err := n.WeftLeftovers(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s with weft running: %s", n.Name, strings.Join(left, "; "))
		for _, want := range []string{"link weft", "nftables table ip weft", "file /etc/cni/net.d/10-weft.conflist", "file /var/lib/weft/weft.db"} {
			if !containsLine(left, want) {
				t.Errorf("%s runs weft, but its leftovers do not list %q: %v", n.Name, want, left)
			}
		}
	}
	if t.Failed() {
		t.FailNow()
	}

	// The uninstall, step 1: the routers stop, the nodes turn NotReady.
	// Their logs are followed to the end: the kubelet removes a deleted
	// pod's log files.
	routerLogs, err := followRouterLogs(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	step(t, c, "kubectl delete -k deploy/: routers gone, nodes NotReady", func() error {
		if _, err := c.API.Kubectl(ctx, "delete", "-k", deploy, "--wait=true", "--timeout=2m"); err != nil {
			return err
		}
		return poll(ctx, 2*time.Minute, "no router pod, no CNI config, every node NotReady", func() (bool, string) {
			if p, err := weftPods(ctx, c); err != nil || len(p) != 0 {
				return false, fmt.Sprintf("router pods %d (%v)", len(p), err)
			}
			for _, n := range c.Nodes {
				left, err := n.WeftLeftovers(ctx)
				if err != nil {
					return false, err.Error()
				}
				if containsLine(left, "file /etc/cni/net.d/10-weft.conflist") {
					return false, n.Name + " has its CNI config still"
				}
				if nr := nodeReady(ctx, c, n.Name); nr.Status == corev1.ConditionTrue {
					return false, n.Name + " still Ready"
				}
			}
			return true, ""
		})
	})
	logs := routerLogs()
	for _, n := range c.Nodes {
		nr := nodeReady(ctx, c, n.Name)
		left, _ := n.WeftLeftovers(ctx)
		t.Logf("%s after kubectl delete -k deploy/: Ready=%s %q; left: %s", n.Name, nr.Status, nr.Message, strings.Join(left, "; "))
		if strings.Count(logs[n.Name], "weft's DaemonSet was deleted: removed the CNI config") != 1 {
			t.Errorf("the router on %s did not log that it removed the CNI config; its log ends:\n%s", n.Name, lastLines(logs[n.Name], 15))
		}
		for _, l := range strings.Split(logs[n.Name], "\n") {
			if strings.Contains(l, "level=ERROR") {
				t.Errorf("the router on %s logged an ERROR: %s", n.Name, l)
			}
		}
	}

	// Step 2: the uninstall DaemonSet cleans every node.
	step(t, c, "kubectl apply -k deploy/uninstall/, rolled out: nodes clean", func() error {
		if _, err := c.API.Kubectl(ctx, "apply", "-k", filepath.Join(deploy, "uninstall")); err != nil {
			return err
		}
		if _, err := c.API.Kubectl(ctx, "rollout", "status", "-n", "kube-system", "daemonset/weft-uninstall", "--timeout=3m"); err != nil {
			return err
		}
		for _, n := range c.Nodes {
			left, err := n.WeftLeftovers(ctx)
			if err != nil {
				return err
			}
			if len(left) > 0 {
				return fmt.Errorf("%s is not clean after the uninstall: %s", n.Name, strings.Join(left, "; "))
			}
		}
		return nil
	})
	// Step 3: the uninstall DaemonSet and weft's ConfigMap go; the nodes
	// stay NotReady (no pod network) and clean.
	step(t, c, "kubectl delete -k deploy/uninstall/: nodes stay NotReady and clean", func() error {
		if _, err := c.API.Kubectl(ctx, "delete", "-k", filepath.Join(deploy, "uninstall"), "--wait=true", "--timeout=2m"); err != nil {
			return err
		}
		if _, err := c.API.Kubectl(ctx, "delete", "configmap", "-n", "kube-system", "weft"); err != nil {
			return err
		}
		for _, n := range c.Nodes {
			nr := nodeReady(ctx, c, n.Name)
			if nr.Status == corev1.ConditionTrue {
				return fmt.Errorf("%s is Ready with no pod network", n.Name)
			}
			left, err := n.WeftLeftovers(ctx)
			if err != nil {
				return err
			}
			if len(left) > 0 {
				return fmt.Errorf("%s after the uninstall DaemonSet's deletion: %s", n.Name, strings.Join(left, "; "))
			}
			t.Logf("%s uninstalled: Ready=%s %q, nothing of weft left", n.Name, nr.Status, nr.Message)
		}
		return nil
	})
}

// followRouterLogs follows the log of every node's router container from
// its start; the returned function waits until each has ended (the
// container stopped) and returns them by node.
func followRouterLogs(ctx context.Context, c *Cluster) (func() map[string]string, error) {
	pods, err := weftPods(ctx, c)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	var mu sync.Mutex
	out := map[string]string{}
	var wg sync.WaitGroup
	for node, p := range pods {
		rc, err := c.CS.CoreV1().Pods("kube-system").GetLogs(p.Name, &corev1.PodLogOptions{Container: "weft", Follow: true}).Stream(ctx)
		if err != nil {
			cancel()
			wg.Wait()
			return nil, err
		}
		wg.Go(func() { // ends when the container does, or ctx
			defer rc.Close()
			data, _ := io.ReadAll(rc)
			mu.Lock()
			out[node] = string(data)
			mu.Unlock()
		})
	}
	return func() map[string]string {
		wg.Wait()
		cancel()
		return out
	}, nil
}

// routerStatuses are the router containers' statuses by node; why says
// what is missing when a node has no running router container.
func routerStatuses(ctx context.Context, c *Cluster) (map[string]corev1.ContainerStatus, string) {
	pods, err := weftPods(ctx, c)
	if err != nil {
		return nil, err.Error()
	}
	out := map[string]corev1.ContainerStatus{}
	for _, n := range c.Nodes {
		p := pods[n.Name]
		if p == nil {
			return nil, n.Name + ": no router pod"
		}
		for _, s := range p.Status.ContainerStatuses {
			if s.Name == "weft" && s.State.Running != nil {
				out[n.Name] = s
			}
		}
		if _, ok := out[n.Name]; !ok {
			return nil, n.Name + ": router container not running (" + string(p.Status.Phase) + ")"
		}
	}
	return out, ""
}

func containsLine(lines []string, prefix string) bool {
	for _, l := range lines {
		if strings.HasPrefix(l, prefix) {
			return true
		}
	}
	return false
}

// skipOnHostFeature skips the test when New said this machine lacks a
// kernel feature the nodes need (ErrHostFeature); any other error is the
// caller's to fail on.
func skipOnHostFeature(t *testing.T, err error) {
	t.Helper()
	if errors.Is(err, ErrHostFeature) {
		t.Skip(err)
	}
}
