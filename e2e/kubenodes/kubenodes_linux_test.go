package kubenodes

import (
	"archive/tar"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/weft-net/weft/e2e"
	"github.com/weft-net/weft/e2e/kubeapi"
)

var runKube = flag.Bool("kubenodes", false, "run the real-node Kubernetes cluster (make e2e-kube): kubelets, containerd, kube-proxy and weft's DaemonSet")

// TestKubeNodes is `make e2e-kube`: weft installed with `kubectl apply -k`
// on three real kubelet nodes, then what a user meets, in order.
func TestKubeNodes(t *testing.T) {
	if !*runKube {
		t.Skip("kubenodes: the real-node cluster runs with -kubenodes (make e2e-kube)")
	}
	run := e2e.NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	bin, err := run.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	images := []string{filepath.Join(bin, "weft-image.tar"), filepath.Join(bin, "pause-image.tar")}
	for _, f := range images {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("%v: run `make image` (both images) first, or `make e2e-kube`", err)
		}
	}
	probe, err := BuildProbeImage(ctx, run.Dir())
	if err != nil {
		t.Fatal(err)
	}
	// No Loopback: the nodes have no CNI loopback plugin until the
	// DaemonSet's weft install-cni puts it there, as on a bare node.
	c, err := newCluster(ctx, t, run, Options{Images: append(images, probe)})
	skipOnHostFeature(t, err)
	if err != nil {
		t.Fatal(err)
	}
	cs := c.CS

	// Before weft, every node is NotReady: no pod network.
	for _, n := range c.Nodes {
		if st := nodeReady(ctx, c, n.Name); st.Status == corev1.ConditionTrue {
			t.Fatalf("node %s Ready before any pod network: %s", n.Name, st.Message)
		}
	}

	// weft, as a user installs it.
	deployWeft(ctx, t, c)
	// Each node turned Ready only once its router ran: not before the
	// router container started (the kubelet reports Ready when the CNI
	// config the router writes once ready is there).
	pods, err := weftPods(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range c.Nodes {
		started := containerStarted(pods[n.Name], "weft")
		ready := nodeReady(ctx, c, n.Name).LastTransitionTime.Time
		t.Logf("node %s: router started %s, node Ready %s (%s later)", n.Name, started.Format(time.TimeOnly), ready.Format(time.TimeOnly), ready.Sub(started))
		if started.IsZero() || ready.Before(started.Truncate(time.Second)) {
			t.Errorf("node %s Ready at %s, before its router started (%s)", n.Name, ready, started)
		}
	}

	// A Deployment spread over the nodes gets addresses from the range.
	const replicas = 6
	step(t, c, "Deployment of 6 spread over the nodes", func() error {
		if _, err := cs.AppsV1().Deployments("default").Create(ctx, probeDeployment(replicas), metav1.CreateOptions{}); err != nil {
			return err
		}
		return poll(ctx, 3*time.Minute, "the Deployment's pods Running", func() (bool, string) {
			d, err := cs.AppsV1().Deployments("default").Get(ctx, "probe", metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			return d.Status.AvailableReplicas == replicas, fmt.Sprintf("%d of %d available", d.Status.AvailableReplicas, replicas)
		})
	})
	probes := probePods(t, ctx, c)
	rng := netip.MustParsePrefix(PodRange)
	perNode := map[string]int{}
	seen := map[string]string{}
	for _, p := range probes {
		ip, err := netip.ParseAddr(p.Status.PodIP)
		if err != nil || !rng.Contains(ip) {
			t.Errorf("pod %s on %s has address %q, outside %s", p.Name, p.Spec.NodeName, p.Status.PodIP, rng)
		}
		if other, dup := seen[p.Status.PodIP]; dup {
			t.Errorf("pods %s and %s have the same address %s", other, p.Name, p.Status.PodIP)
		}
		seen[p.Status.PodIP] = p.Name
		perNode[p.Spec.NodeName]++
		t.Logf("pod %s on %s: %s", p.Name, p.Spec.NodeName, p.Status.PodIP)
	}
	if len(perNode) != len(c.Nodes) {
		t.Errorf("the Deployment's pods are on %d nodes, want all %d: %v", len(perNode), len(c.Nodes), perNode)
	}

	// Every pod reaches every other.
	step(t, c, "every pod reaches every other (HTTP)", func() error {
		m := podMatrix(ctx, probes)
		t.Logf("pod to pod:\n%s", m)
		if !m.AllOK() {
			return fmt.Errorf("pods that did not reach each other: %v", m.Failures())
		}
		return nil
	})

	// A Service's ClusterIP reaches the pods through kube-proxy.
	step(t, c, "Service ClusterIP through kube-proxy (nftables)", func() error {
		svc, err := cs.CoreV1().Services("default").Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "probe"},
			Spec: corev1.ServiceSpec{
				Selector: map[string]string{"app": "probe"},
				Ports:    []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		url := "http://" + svc.Spec.ClusterIP + "/"
		for _, from := range probes {
			ns, err := PodNetns(from.Name)
			if err != nil {
				return err
			}
			backends := map[string]bool{}
			err = poll(ctx, time.Minute, from.Name+" through "+url, func() (bool, string) {
				body, err := Get(ctx, ns, url, 2*time.Second)
				if err != nil {
					return false, err.Error()
				}
				backends[strings.Fields(body)[0]] = true
				return len(backends) >= 2, fmt.Sprintf("backends so far %v", backends)
			})
			if err != nil {
				return err
			}
			for b := range backends {
				if !strings.HasPrefix(b, "probe-") {
					return fmt.Errorf("%s answered by %q, not a pod of the Service", url, b)
				}
			}
		}
		t.Logf("every pod reached %s (ClusterIP of default/probe), answered by several backends", url)
		return nil
	})

	// A hostPort pod answers on its node's address from other nodes' pods.
	step(t, c, "hostPort pod on n0 from the other nodes' pods", func() error {
		n0 := c.Nodes[0]
		hp := probePod("hostport", n0.Name)
		hp.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 8080, HostPort: 18080, Protocol: corev1.ProtocolTCP}}
		if _, err := cs.CoreV1().Pods("default").Create(ctx, hp, metav1.CreateOptions{}); err != nil {
			return err
		}
		if err := waitPodReady(ctx, c, "default", "hostport"); err != nil {
			return err
		}
		url := "http://" + n0.UnderlayIP.String() + ":18080/"
		for _, from := range probes {
			if from.Spec.NodeName == n0.Name {
				continue
			}
			ns, err := PodNetns(from.Name)
			if err != nil {
				return err
			}
			if err := poll(ctx, 30*time.Second, from.Name+" to "+url, func() (bool, string) {
				body, err := Get(ctx, ns, url, 2*time.Second)
				return err == nil && strings.HasPrefix(body, "hostport "), fmt.Sprint(body, err)
			}); err != nil {
				return err
			}
		}
		return nil
	})

	// The router pod deleted: pods keep their addresses; the cross-node
	// traffic lost meanwhile is measured.
	step(t, c, "router pod on n0 deleted (kubectl delete pod)", func() error {
		n0 := c.Nodes[0]
		var src, dst *corev1.Pod
		for i := range probes {
			p := &probes[i]
			if p.Spec.NodeName == n0.Name && dst == nil {
				dst = p
			}
			if p.Spec.NodeName != n0.Name && src == nil {
				src = p
			}
		}
		ns, err := PodNetns(src.Name)
		if err != nil {
			return err
		}
		before := map[string]string{}
		for _, p := range probes {
			before[p.Name] = p.Status.PodIP
		}
		old := pods[n0.Name]
		stop := make(chan struct{})
		var sent, lost atomic.Int64
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { // ends at close(stop)
			defer wg.Done()
			t := time.NewTicker(100 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-stop:
					return
				case <-t.C:
				}
				sent.Add(1)
				if _, err := Get(ctx, ns, "http://"+dst.Status.PodIP+":8080/", 500*time.Millisecond); err != nil {
					lost.Add(1)
				}
			}
		}()
		start := time.Now()
		_, err = c.API.Kubectl(ctx, "delete", "pod", "-n", "kube-system", old.Name, "--wait=false")
		if err == nil {
			err = poll(ctx, 3*time.Minute, "a new router pod Ready on "+n0.Name, func() (bool, string) {
				now, err := weftPods(ctx, c)
				if err != nil {
					return false, err.Error()
				}
				p := now[n0.Name]
				return p != nil && p.UID != old.UID && podReady(p), "waiting"
			})
		}
		back := time.Since(start)
		time.Sleep(2 * time.Second) // traffic after the new router is ready counts too
		close(stop)
		wg.Wait()
		if err != nil {
			return err
		}
		t.Logf("router pod on %s replaced in %s; %s -> %s: %d of %d requests (every 100ms, 500ms timeout) lost meanwhile", n0.Name, back.Round(100*time.Millisecond), src.Name, dst.Name, lost.Load(), sent.Load())
		after := probePods(t, ctx, c)
		for _, p := range after {
			if before[p.Name] != p.Status.PodIP {
				return fmt.Errorf("pod %s had %s before the router restart and %s after", p.Name, before[p.Name], p.Status.PodIP)
			}
		}
		if m := podMatrix(ctx, after); !m.AllOK() {
			return fmt.Errorf("after the router restart: %v\n%s", m.Failures(), m)
		}
		pods, err = weftPods(ctx, c)
		return err
	})

	// A node drained and its Node deleted: its range is reclaimed by
	// exactly one of the others.
	step(t, c, "node n2 drained and its Node deleted: range reclaimed once", func() error {
		gone := c.Nodes[len(c.Nodes)-1]
		rep, err := report(ctx, gone.Node)
		if err != nil {
			return err
		}
		if _, err := c.API.Kubectl(ctx, "drain", gone.Name, "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=2m"); err != nil {
			return err
		}
		// The node is gone: its kubelet and router with it.
		if err := gone.Kubelet.Stop(10 * time.Second); err != nil {
			t.Logf("stopping kubelet %s: %v", gone.Name, err)
		}
		if _, err := c.API.Kubectl(ctx, "delete", "pod", "-n", "kube-system", pods[gone.Name].Name, "--force", "--grace-period=0"); err != nil {
			t.Logf("deleting %s's router pod: %v", gone.Name, err)
		}
		if err := killMountNSOf(gone); err != nil {
			return err
		}
		if _, err := c.API.Kubectl(ctx, "delete", "node", gone.Name); err != nil {
			return err
		}
		deleted := time.Now()
		want := "node of peer " + rep.Router.Name + " deleted: reclaiming its ranges"
		var claimed int
		err = poll(ctx, 2*time.Minute, "one router reclaiming "+gone.Name+"'s ranges", func() (bool, string) {
			claimed = 0
			for _, n := range c.Nodes[:len(c.Nodes)-1] {
				claimed += countInPodLogs(n, want)
			}
			return claimed >= 1, fmt.Sprintf("%d routers said %q", claimed, want)
		})
		if err != nil {
			return err
		}
		t.Logf("%s's reclaim seen %s after its Node's deletion", gone.Name, time.Since(deleted).Round(100*time.Millisecond))
		time.Sleep(3 * time.Second) // a second reclaim, if any, would come now
		claimed = 0
		for _, n := range c.Nodes[:len(c.Nodes)-1] {
			claimed += countInPodLogs(n, want)
		}
		if claimed != 1 {
			return fmt.Errorf("%d reclaims of %s's ranges, want exactly 1", claimed, gone.Name)
		}
		// And no router still lists it as an owner of the ring.
		err = poll(ctx, time.Minute, "every router's ring without "+gone.Name, func() (bool, string) {
			for _, n := range c.Nodes[:len(c.Nodes)-1] {
				r, err := report(ctx, n.Node)
				if err != nil {
					return false, err.Error()
				}
				for _, o := range r.IPAM.Owners {
					if o.Peer == rep.Router.Name {
						return false, n.Name + " still lists " + o.Peer
					}
				}
			}
			return true, ""
		})
		if err != nil {
			return err
		}
		t.Logf("%s (peer %s) reclaimed by exactly one router", gone.Name, rep.Router.Name)
		c.Nodes = c.Nodes[:len(c.Nodes)-1]
		return nil
	})

	// The password Secret and a rollout restart: encrypted afterwards.
	step(t, c, "password Secret + rollout restart", func() error {
		for _, n := range c.Nodes {
			if rep, err := report(ctx, n.Node); err != nil || rep.Router.Encryption.Enabled {
				return fmt.Errorf("%s before any password: encryption %+v, %v; want disabled", n.Name, rep.Router.Encryption, err)
			}
		}
		if _, err := c.API.Kubectl(ctx, "create", "secret", "generic", "weft-passwd", "-n", "kube-system", "--from-literal=password=e2e-kube-"+run.Prefix()); err != nil {
			return err
		}
		if _, err := c.API.Kubectl(ctx, "rollout", "restart", "-n", "kube-system", "daemonset/weft"); err != nil {
			return err
		}
		if _, err := c.API.Kubectl(ctx, "rollout", "status", "-n", "kube-system", "daemonset/weft", "--timeout=4m"); err != nil {
			return err
		}
		for _, n := range c.Nodes {
			rep, err := report(ctx, n.Node)
			if err != nil {
				return err
			}
			t.Logf("%s after the rollout: encryption %+v", n.Name, rep.Router.Encryption)
			if !rep.Router.Encryption.Enabled {
				return fmt.Errorf("%s is not encrypting after the password rollout: %+v", n.Name, rep.Router.Encryption)
			}
		}
		after := probePods(t, ctx, c)
		if m := podMatrix(ctx, after); !m.AllOK() {
			return fmt.Errorf("after the password rollout: %v\n%s", m.Failures(), m)
		}
		return nil
	})

	// A node joining later: its router comes up (with the password), the
	// node turns Ready, and a pod on it reaches every other pod.
	step(t, c, "a node joining later", func() error {
		n, err := c.AddNode(ctx)
		if err != nil {
			return err
		}
		if err := poll(ctx, 3*time.Minute, "weft Ready on "+n.Name+" and the node Ready", func() (bool, string) {
			pods, err := weftPods(ctx, c)
			if err != nil {
				return false, err.Error()
			}
			if p := pods[n.Name]; p == nil || !podReady(p) {
				return false, "router pod not ready"
			}
			st := nodeReady(ctx, c, n.Name)
			return st.Status == corev1.ConditionTrue, string(st.Status) + " " + st.Message
		}); err != nil {
			return err
		}
		rep, err := report(ctx, n.Node)
		if err != nil {
			return err
		}
		if !rep.Router.Encryption.Enabled {
			return fmt.Errorf("the late node %s is not encrypting: %+v", n.Name, rep.Router.Encryption)
		}
		late := probePod("late", n.Name)
		late.Labels = map[string]string{"app": "late"}
		if _, err := cs.CoreV1().Pods("default").Create(ctx, late, metav1.CreateOptions{}); err != nil {
			return err
		}
		if err := waitPodReady(ctx, c, "default", "late"); err != nil {
			return err
		}
		lp, err := cs.CoreV1().Pods("default").Get(ctx, "late", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if ip, err := netip.ParseAddr(lp.Status.PodIP); err != nil || !rng.Contains(ip) {
			return fmt.Errorf("the late pod's address %q is outside %s", lp.Status.PodIP, rng)
		}
		all := append(probePods(t, ctx, c), *lp)
		m := podMatrix(ctx, all)
		t.Logf("with the late node %s (pod %s at %s):\n%s", n.Name, lp.Name, lp.Status.PodIP, m)
		if !m.AllOK() {
			return fmt.Errorf("with the late node: %v", m.Failures())
		}
		return nil
	})

	// An image upgrade by rolling update (to the image's other tag, as a
	// new version would be): pods keep their addresses; the cross-node
	// traffic lost during the whole rollout is measured.
	step(t, c, "image upgrade by rolling update", func() error {
		tag, err := otherTag(images[0])
		if err != nil {
			return err
		}
		before := probePods(t, ctx, c)
		var src, dst *corev1.Pod
		for i := range before {
			p := &before[i]
			if p.Spec.NodeName == c.Nodes[0].Name && dst == nil {
				dst = p
			}
			if p.Spec.NodeName != c.Nodes[0].Name && src == nil {
				src = p
			}
		}
		if src == nil || dst == nil {
			return fmt.Errorf("no pods on two nodes to measure with")
		}
		ns, err := PodNetns(src.Name)
		if err != nil {
			return err
		}
		stop := measureLoss(ctx, ns, "http://"+dst.Status.PodIP+":8080/")
		start := time.Now()
		_, err = c.API.Kubectl(ctx, "set", "image", "-n", "kube-system", "daemonset/weft", "weft="+tag, "install-cni="+tag)
		if err == nil {
			_, err = c.API.Kubectl(ctx, "rollout", "status", "-n", "kube-system", "daemonset/weft", "--timeout=5m")
		}
		took := time.Since(start)
		sent, lost := stop()
		if err != nil {
			return err
		}
		t.Logf("rolling update to %s over %d nodes took %s; %s -> %s: %d of %d requests (every 100ms, 500ms timeout) lost meanwhile", tag, len(c.Nodes), took.Round(100*time.Millisecond), src.Name, dst.Name, lost, sent)
		after := probePods(t, ctx, c)
		was := map[string]string{}
		for _, p := range before {
			was[p.Name] = p.Status.PodIP
		}
		for _, p := range after {
			if ip, ok := was[p.Name]; ok && ip != p.Status.PodIP {
				return fmt.Errorf("pod %s had %s before the upgrade and %s after", p.Name, ip, p.Status.PodIP)
			}
		}
		if m := podMatrix(ctx, after); !m.AllOK() {
			return fmt.Errorf("after the upgrade: %v\n%s", m.Failures(), m)
		}
		return nil
	})
}

// otherTag is the tag of the weft image tarball that is not weft:latest
// (make image tags weft:latest and weft:<version>).
func otherTag(tarPath string) (string, error) {
	f, err := os.Open(tarPath)
	if err != nil {
		return "", err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err != nil {
			return "", fmt.Errorf("no manifest.json in %s: %v", tarPath, err)
		}
		if h.Name != "manifest.json" {
			continue
		}
		var m []struct{ RepoTags []string }
		if err := json.NewDecoder(tr).Decode(&m); err != nil {
			return "", err
		}
		for _, e := range m {
			for _, t := range e.RepoTags {
				if t != "weft:latest" && !strings.HasSuffix(t, "/weft:latest") {
					return t, nil
				}
			}
		}
		return "", fmt.Errorf("%s has no tag besides weft:latest", tarPath)
	}
}

// measureLoss fetches url from ns every 100 ms (500 ms timeout) until the
// returned stop is called, which says how many were sent and lost.
func measureLoss(ctx context.Context, ns *e2e.Netns, url string) (stop func() (sent, lost int64)) {
	done := make(chan struct{})
	var s, l atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // ends at close(done)
		defer wg.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			s.Add(1)
			if _, err := Get(ctx, ns, url, 500*time.Millisecond); err != nil {
				l.Add(1)
			}
		}
	}()
	return func() (int64, int64) {
		close(done)
		wg.Wait()
		return s.Load(), l.Load()
	}
}

// step runs fn as a phase and fails the test with its error.
func step(t *testing.T, c *Cluster, name string, fn func() error) {
	t.Helper()
	if err := c.Timed(name, fn); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
}

// routerReport is the part of a router's /report the test reads.
type routerReport struct {
	Router struct {
		Name       string `json:"name"`
		Encryption struct {
			Enabled bool   `json:"enabled"`
			AEAD    string `json:"aead"`
		} `json:"encryption"`
	} `json:"router"`
	IPAM struct {
		Owners []struct {
			Peer string `json:"peer"`
		} `json:"owners"`
	} `json:"ipam"`
}

func report(ctx context.Context, n *e2e.Node) (routerReport, error) {
	var rep routerReport
	data, err := n.HTTPGet(ctx, "/report")
	if err != nil {
		return rep, err
	}
	if err := json.Unmarshal(data, &rep); err != nil {
		return rep, fmt.Errorf("%s's /report: %w", n.Name, err)
	}
	if rep.Router.Name == "" {
		return rep, fmt.Errorf("%s's /report names no peer: %.300s", n.Name, data)
	}
	return rep, nil
}

// countInPodLogs counts s in the router container logs kept on node n.
func countInPodLogs(n *Node, s string) int {
	files, _ := filepath.Glob(filepath.Join(n.Root, "var/log/pods/kube-system_weft-*/weft/*.log"))
	total := 0
	for _, f := range files {
		data, _ := os.ReadFile(f)
		total += strings.Count(string(data), s)
	}
	return total
}

// killMountNSOf ends everything on a node (containerd, its shims, the
// router): a node that is gone.
func killMountNSOf(n *Node) error {
	var st syscall.Stat_t
	if err := syscall.Stat(n.MountNS, &st); err != nil {
		return fmt.Errorf("node %s's mount namespace: %w", n.Name, err)
	}
	for _, p := range []*e2e.Proc{n.KubeProxy, n.Containerd} {
		_ = p.Kill()
	}
	hier, err := hierarchies()
	if err != nil {
		return err
	}
	for _, h := range hier {
		if err := removeCgroupTree(filepath.Join(h, n.CgroupRoot)); err != nil {
			return err
		}
	}
	return killMountNS([]uint64{st.Ino})
}

func nodeReady(ctx context.Context, c *Cluster, name string) corev1.NodeCondition {
	n, err := c.CS.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return corev1.NodeCondition{Status: "error", Message: err.Error()}
	}
	for _, cond := range n.Status.Conditions {
		if cond.Type == corev1.NodeReady {
			return cond
		}
	}
	return corev1.NodeCondition{Status: "missing"}
}

func podReady(p *corev1.Pod) bool {
	if p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
		return false
	}
	for _, cond := range p.Status.Conditions {
		if cond.Type == corev1.PodReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}

func containerStarted(p *corev1.Pod, name string) time.Time {
	if p == nil {
		return time.Time{}
	}
	for _, s := range p.Status.ContainerStatuses {
		if s.Name == name && s.State.Running != nil {
			return s.State.Running.StartedAt.Time
		}
	}
	return time.Time{}
}

// weftPods are the weft DaemonSet's pods by node (the newest on each).
func weftPods(ctx context.Context, c *Cluster) (map[string]*corev1.Pod, error) {
	list, err := c.CS.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=weft"})
	if err != nil {
		return nil, err
	}
	out := map[string]*corev1.Pod{}
	for i := range list.Items {
		p := &list.Items[i]
		if p.DeletionTimestamp != nil {
			continue
		}
		if old := out[p.Spec.NodeName]; old == nil || p.CreationTimestamp.After(old.CreationTimestamp.Time) {
			out[p.Spec.NodeName] = p
		}
	}
	return out, nil
}

func waitPodReady(ctx context.Context, c *Cluster, ns, name string) error {
	return poll(ctx, 2*time.Minute, "pod "+ns+"/"+name+" Ready", func() (bool, string) {
		p, err := c.CS.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return podReady(p), string(p.Status.Phase)
	})
}

func probePods(t *testing.T, ctx context.Context, c *Cluster) []corev1.Pod {
	t.Helper()
	list, err := c.CS.CoreV1().Pods("default").List(ctx, metav1.ListOptions{LabelSelector: "app=probe"})
	if err != nil {
		t.Fatal(err)
	}
	var out []corev1.Pod
	for _, p := range list.Items {
		if podReady(&p) {
			out = append(out, p)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// podMatrix has every pod fetch from every other's address.
func podMatrix(ctx context.Context, pods []corev1.Pod) *e2e.Matrix {
	var names []string
	for _, p := range pods {
		names = append(names, p.Spec.NodeName+"/"+p.Name)
	}
	m := e2e.NewMatrix(names)
	for i, from := range pods {
		ns, err := PodNetns(from.Name)
		if err != nil {
			m.Problems = append(m.Problems, err.Error())
			continue
		}
		for j, to := range pods {
			if i == j {
				continue
			}
			url := "http://" + to.Status.PodIP + ":8080/"
			err := poll(ctx, 20*time.Second, names[i]+" -> "+url, func() (bool, string) {
				body, err := Get(ctx, ns, url, 2*time.Second)
				return err == nil && strings.HasPrefix(body, to.Name+" "), fmt.Sprint(body, err)
			})
			m.OK[i][j] = err == nil
		}
	}
	return m
}

func probeContainer() corev1.Container {
	return corev1.Container{
		Name: "probe", Image: ProbeImage, ImagePullPolicy: corev1.PullNever,
		Env: []corev1.EnvVar{{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}}},
		ReadinessProbe: &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromInt32(8080)}},
			PeriodSeconds: 2,
		},
	}
}

func probePod(name, node string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": "hostport"}},
		Spec: corev1.PodSpec{
			NodeName:                      node,
			Containers:                    []corev1.Container{probeContainer()},
			TerminationGracePeriodSeconds: new(int64),
		},
	}
}

func probeDeployment(replicas int32) *appsv1.Deployment {
	labels := map[string]string{"app": "probe"}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "probe"},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					Containers:                    []corev1.Container{probeContainer()},
					TerminationGracePeriodSeconds: new(int64),
					TopologySpreadConstraints: []corev1.TopologySpreadConstraint{{
						MaxSkew: 1, TopologyKey: "kubernetes.io/hostname",
						WhenUnsatisfiable: corev1.DoNotSchedule,
						LabelSelector:     &metav1.LabelSelector{MatchLabels: labels},
					}},
				},
			},
		},
	}
}

// newCluster is New, with the cluster's phase table logged when the test
// ends and its diagnosis when the test failed.
func newCluster(ctx context.Context, t *testing.T, run *e2e.Run, opts Options) (*Cluster, error) {
	t.Helper()
	c, err := New(ctx, run, opts)
	t.Cleanup(func() {
		if c != nil {
			t.Logf("kubenodes phases:\n%s", c.PhaseTable())
			if t.Failed() {
				c.Diagnose(ctx, t.Logf)
			}
		}
	})
	return c, err
}

// deployWeft applies e2e/kubenodes/overlay (deploy/ with the API server's
// address) as a user installs weft, and waits for the router to be Running
// and Ready on every node and every node Ready.
func deployWeft(ctx context.Context, t *testing.T, c *Cluster) {
	t.Helper()
	root, err := kubeapi.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	step(t, c, "kubectl apply -k e2e/kubenodes/overlay (deploy/ + API address)", func() error {
		_, err := c.API.Kubectl(ctx, "apply", "-k", filepath.Join(root, "e2e", "kubenodes", "overlay"))
		return err
	})
	step(t, c, "DaemonSet Running and Ready on every node, nodes Ready", func() error {
		return poll(ctx, 4*time.Minute, "weft Running and Ready on every node and every node Ready", func() (bool, string) {
			pods, err := weftPods(ctx, c)
			if err != nil {
				return false, err.Error()
			}
			var state []string
			ok := len(pods) == len(c.Nodes)
			for _, n := range c.Nodes {
				p := pods[n.Name]
				if p == nil || !podReady(p) {
					ok = false
					state = append(state, n.Name+": router pod not ready")
					continue
				}
				if st := nodeReady(ctx, c, n.Name); st.Status != corev1.ConditionTrue {
					ok = false
					state = append(state, n.Name+": node "+string(st.Status)+" "+st.Message)
				}
			}
			return ok, strings.Join(state, "; ")
		})
	})
}
