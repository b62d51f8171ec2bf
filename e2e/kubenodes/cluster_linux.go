package kubenodes

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/weft-net/weft/e2e"
	"github.com/weft-net/weft/e2e/kubeapi"
)

// Defaults of Options.
const (
	DefaultNodes = 3
	// PodRange is the pod address range of deploy/kustomization.yaml.
	PodRange = "10.32.0.0/12"
	// pollEvery is how often conditions are polled.
	pollEvery = 200 * time.Millisecond
	// apiServerGrace is how long kube-apiserver gets to stop on SIGTERM.
	apiServerGrace = 90 * time.Second
	// logLines is how much of each log a failure shows.
	logLines = 40
)

// Options configure a Cluster.
type Options struct {
	Nodes int // 0 means DefaultNodes
	// Images are tarballs imported into every node's containerd: the weft
	// image (make image), the pause image (hack/image -pause) and any the
	// test needs.
	Images []string
	// Loopback is the CNI loopback plugin put into every node's
	// /opt/cni/bin, as a node's kubernetes-cni package would.
	Loopback string
	// KubeProxyLater leaves kube-proxy off on every node until the test
	// starts it (StartKubeProxy): the kubernetes Service's ClusterIP does
	// not answer there meanwhile, as on a new node whose kube-proxy is not
	// running yet.
	KubeProxyLater bool
	// ClusterDNS sets the kubelets' clusterDNS to DNSServiceIP, for a
	// cluster that runs DeployDNS once the pod network is up (until then
	// pods other than host-network ones get a resolver that does not
	// answer, as on any cluster whose DNS is not up yet).
	ClusterDNS bool
}

// Phase is one timed step of bringing the cluster up or testing it.
type Phase struct {
	Name string
	Took time.Duration
}

// Cluster is a control plane and nodes of real kubelets in a run's namespaces.
type Cluster struct {
	Run   *e2e.Run
	Net   *e2e.Cluster // the underlay and the nodes' network namespaces
	API   *kubeapi.Server
	Host  *Host
	Nodes []*Node
	CS    kubernetes.Interface

	ControllerManager *e2e.Proc
	Scheduler         *e2e.Proc

	Phases []Phase
	log    *slog.Logger
	opts   Options
}

// Node is one kubelet node: a network namespace on the underlay (the
// embedded e2e.Node) and a mount namespace, held by a process of its own,
// in which containerd, the kubelet and kube-proxy run.
type Node struct {
	*e2e.Node
	// Root holds the node's own /opt, /var/lib and /var/log, and the upper
	// layer of its /etc: what the node wrote, readable from the host.
	Root       string
	MountNS    string // /proc/<holder>/ns/mnt
	CgroupRoot string // the kubelet's cgroupRoot, /<prefix>-<node>

	Holder, Containerd, Kubelet, KubeProxy *e2e.Proc
}

// Timed runs fn as a named phase and logs how long it took.
func (c *Cluster) Timed(name string, fn func() error) error {
	start := time.Now()
	err := fn()
	took := time.Since(start)
	c.Phases = append(c.Phases, Phase{Name: name, Took: took})
	c.log.Info("kubenodes: phase", "phase", name, "took", took.Round(time.Millisecond), "ok", err == nil)
	return err
}

// PhaseTable is every phase so far with its duration, one a line.
func (c *Cluster) PhaseTable() string {
	var b strings.Builder
	var total time.Duration
	for _, p := range c.Phases {
		fmt.Fprintf(&b, "  %-52s %8s\n", p.Name, p.Took.Round(100*time.Millisecond))
		total += p.Took
	}
	fmt.Fprintf(&b, "  %-52s %8s\n", "total", total.Round(100*time.Millisecond))
	return b.String()
}

// New brings up the control plane and opts.Nodes kubelet nodes (NotReady:
// no pod network yet). A kernel feature missing on this machine is an
// ErrHostFeature, before anything is made. Everything belongs to run: its
// Close stops the processes, and the host guard registered here kills what
// is left in the nodes' cgroups and mount namespaces, removes the cgroups
// and puts the kernel settings back, before the namespaces go. On an error
// it returns what it got so far too, for Diagnose.
func New(ctx context.Context, run *e2e.Run, opts Options) (*Cluster, error) {
	if opts.Nodes == 0 {
		opts.Nodes = DefaultNodes
	}
	if opts.Nodes < 1 || opts.Nodes > 20 {
		return nil, fmt.Errorf("kubenodes: Options.Nodes %d: give 1 to 20", opts.Nodes)
	}
	c := &Cluster{Run: run, log: run.Log(), opts: opts}
	if err := checkHostFeatures(); err != nil {
		return nil, err
	}
	for _, bin := range []string{"containerd", "containerd-shim-runc-v2", "runc", "ctr", "nsenter", "unshare", "nft"} {
		if _, err := exec.LookPath(bin); err != nil {
			return nil, fmt.Errorf("kubenodes: %s is missing: `make e2e-kube` installs Debian's containerd, runc, nftables and util-linux (apt)", bin)
		}
	}
	var err error
	if err = c.Timed("tools (cached kube binaries)", func() error {
		_, err := kubeapi.Binaries(ctx, c.log)
		return err
	}); err != nil {
		return c, err
	}
	if err = c.Timed("underlay and node namespaces", func() error {
		c.Net, err = run.NewCluster(ctx, e2e.ClusterOpts{Nodes: opts.Nodes})
		return err
	}); err != nil {
		return c, err
	}
	if c.Host, err = claimHost(run.Prefix(), c.log); err != nil {
		return c, err
	}
	// Runs after every process of the run has been stopped (registered
	// before any of them), before the namespaces are deleted.
	run.Defer("restore host settings and remove cgroups", c.Host.Restore)

	if err = c.Timed("control plane (etcd, apiserver, controller-manager, scheduler)", func() error { return c.startControlPlane(ctx) }); err != nil {
		return c, err
	}
	// The same again, earlier: after the nodes' daemons stop (registered
	// later) and before the control plane does, so that no router's watch
	// holds kube-apiserver's shutdown open. The first one stays as the
	// safety net; a second Restore finds nothing left to do.
	run.Defer("kill the nodes' containers and restore host settings", c.Host.Restore)
	for _, n := range c.Net.Nodes {
		if err = c.Timed("node "+n.Name+" (mounts, containerd, images, kubelet, kube-proxy)", func() error {
			return c.startNode(ctx, n)
		}); err != nil {
			return c, err
		}
	}
	if err = c.Timed("nodes registered", func() error { return c.waitRegistered(ctx) }); err != nil {
		return c, err
	}
	return c, nil
}

// AddNode brings up one more node (named n<index>) that joins the running
// cluster: its kubelet registers its Node, and weft's DaemonSet follows.
func (c *Cluster) AddNode(ctx context.Context) (*Node, error) {
	en, err := c.Net.AddNode(ctx, "")
	if err != nil {
		return nil, err
	}
	if err := c.startNode(ctx, en); err != nil {
		return nil, err
	}
	n := c.Nodes[len(c.Nodes)-1]
	return n, poll(ctx, 2*time.Minute, "node "+n.Name+" registered", func() (bool, string) {
		if !n.Kubelet.Running() {
			return false, "kubelet " + n.Name + " exited: " + tailFile(n.Kubelet.LogPath, logLines)
		}
		_, err := c.CS.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		return err == nil, fmt.Sprint(err)
	})
}

func (c *Cluster) startControlPlane(ctx context.Context) error {
	s, err := kubeapi.New(ctx, kubeapi.Options{
		Run: c.Run, NetNS: c.Net.Underlay, Address: e2e.UnderlayGateway,
		// The kubernetes Service gets the server's address as its endpoint,
		// so that its ClusterIP works through kube-proxy as in a cluster.
		// The kubelets by their InternalIP (the node address): the nodes'
		// names resolve nowhere, and exec, logs and the node proxy dial
		// the kubelet (make conformance's specs use all three).
		ExtraArgs: []string{"--endpoint-reconciler-type=lease", "--kubelet-preferred-address-types=InternalIP,Hostname"},
	})
	if err != nil {
		return err
	}
	c.API = s
	// The API server waits for open watches on SIGTERM, up to a minute: a
	// client still running (a router whose container outlived a failed
	// cleanup) must not turn that into kubeapi's 10 s kill. This runs
	// before kubeapi's own stop (and after the clients' stops, which are
	// registered later), which then finds it gone.
	c.Run.Defer("stop kube-apiserver", func() error {
		start := time.Now()
		err := s.APIServer.Stop(apiServerGrace)
		c.log.Info("kubenodes: kube-apiserver stopped", "took", time.Since(start).Round(time.Millisecond), "err", err)
		return err
	})
	if c.CS, err = s.Clientset(); err != nil {
		return err
	}
	kc := s.Admin.Kubeconfig
	c.ControllerManager, err = c.Run.Start(c.Net.Underlay, "kube-controller-manager", filepath.Join(s.Dir, "kube-controller-manager.log"),
		s.Bins.ControllerManager,
		"--kubeconfig="+kc, "--authentication-kubeconfig="+kc, "--authorization-kubeconfig="+kc,
		"--service-account-private-key-file="+s.SAKeyFile, "--root-ca-file="+s.CAFile,
		"--use-service-account-credentials=false", "--leader-elect=false",
		"--bind-address=127.0.0.1", "--cluster-name=weft-e2e",
		// A deleted Node's pods are gone at once (the drain test deletes one).
		"--terminated-pod-gc-threshold=10",
		"--v=1")
	if err != nil {
		return err
	}
	c.Scheduler, err = c.Run.Start(c.Net.Underlay, "kube-scheduler", filepath.Join(s.Dir, "kube-scheduler.log"),
		s.Bins.Scheduler,
		"--kubeconfig="+kc, "--authentication-kubeconfig="+kc, "--authorization-kubeconfig="+kc,
		"--leader-elect=false", "--bind-address=127.0.0.1", "--v=1")
	return err
}

// inNode is argv run inside the node's mount and network namespaces.
func (n *Node) inNode(argv ...string) []string {
	return append([]string{"nsenter", "--mount=" + n.MountNS, "--net=" + n.NS.Path, "--"}, argv...)
}

// Exec runs argv in the node's namespaces and returns its combined output.
func (n *Node) Exec(ctx context.Context, argv ...string) ([]byte, error) {
	full := n.inNode(argv...)
	out, err := exec.CommandContext(ctx, full[0], full[1:]...).CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("node %s: %s: %w: %s", n.Name, strings.Join(argv, " "), err, bytes.TrimSpace(out))
	}
	return out, nil
}

// mountScript makes the node's mount namespace (run by unshare with private
// propagation, so nothing reaches the host's): its own /opt, /var/lib and
// /var/log from root, /etc as an overlay whose writes go to root, and a
// fresh /run; then shared propagation inside, as a kubelet expects.
const mountScript = `set -e
R=%[1]s
mount --bind "$R/opt" /opt
mount --bind "$R/var/lib" /var/lib
mount --bind "$R/var/log" /var/log
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$R/etc-upper,workdir=$R/etc-work" /etc
mount -t tmpfs -o mode=0755 tmpfs /run
mount --make-rshared /
echo ready > %[2]s
exec sleep infinity
`

func (c *Cluster) startNode(ctx context.Context, en *e2e.Node) error {
	n := &Node{Node: en, Root: filepath.Join(en.Dir, "root")}
	c.Nodes = append(c.Nodes, n) // for Diagnose, whatever happens next
	for _, d := range []string{"opt/cni/bin", "var/lib", "var/log", "etc-upper", "etc-work"} {
		if err := os.MkdirAll(filepath.Join(n.Root, d), 0o755); err != nil {
			return fmt.Errorf("kubenodes: %w", err)
		}
	}
	var err error
	if n.CgroupRoot, err = c.Host.MakeCgroupRoot(c.Run.Prefix() + "-" + n.Name); err != nil {
		return err
	}
	ready := filepath.Join(en.Dir, "mounts.ready")
	n.Holder, err = c.Run.Start(n.NS, "mounts "+n.Name, filepath.Join(en.Dir, "mounts.log"),
		"unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", fmt.Sprintf(mountScript, n.Root, ready))
	if err != nil {
		return err
	}
	if err := poll(ctx, 30*time.Second, "node "+n.Name+"'s mount namespace", func() (bool, string) {
		if !n.Holder.Running() {
			return false, "the mount holder exited: " + tailFile(n.Holder.LogPath, logLines)
		}
		_, err := os.Stat(ready)
		return err == nil, fmt.Sprint(err)
	}); err != nil {
		return err
	}
	n.MountNS = fmt.Sprintf("/proc/%d/ns/mnt", n.Holder.Pid())
	var st syscall.Stat_t
	if err := syscall.Stat(n.MountNS, &st); err != nil {
		return fmt.Errorf("kubenodes: %w", err)
	}
	if err := c.Host.AddMountNS(st.Ino); err != nil {
		return err
	}
	if c.opts.Loopback != "" {
		data, err := os.ReadFile(c.opts.Loopback)
		if err != nil {
			return fmt.Errorf("kubenodes: the CNI loopback plugin (make build puts it in bin/): %w", err)
		}
		if err := os.WriteFile(filepath.Join(n.Root, "opt/cni/bin/loopback"), data, 0o755); err != nil {
			return fmt.Errorf("kubenodes: %w", err)
		}
	}

	// containerd, as Debian ships it, with the settings this machine kind
	// needs (cgroupfs, no oom_score_adj below its own).
	cfg := filepath.Join(en.Dir, "containerd.toml")
	if err := os.WriteFile(cfg, []byte(containerdConfig), 0o644); err != nil {
		return fmt.Errorf("kubenodes: %w", err)
	}
	if n.Containerd, err = c.Run.Start(n.NS, "containerd "+n.Name, filepath.Join(en.Dir, "containerd.log"),
		n.inNode("containerd", "--config", cfg)...); err != nil {
		return err
	}
	if err := poll(ctx, 60*time.Second, "containerd on "+n.Name, func() (bool, string) {
		if !n.Containerd.Running() {
			return false, "containerd exited: " + tailFile(n.Containerd.LogPath, logLines)
		}
		out, err := n.Exec(ctx, "ctr", "version")
		return err == nil, string(out)
	}); err != nil {
		return err
	}
	for _, img := range c.opts.Images {
		if _, err := n.Exec(ctx, "ctr", "-n", "k8s.io", "images", "import", img); err != nil {
			return fmt.Errorf("kubenodes: importing %s: %w", img, err)
		}
	}

	kcfg := filepath.Join(en.Dir, "kubelet.yaml")
	dns := ""
	if c.opts.ClusterDNS {
		dns = "clusterDNS:\n- " + DNSServiceIP + "\n"
	}
	if err := os.WriteFile(kcfg, []byte(fmt.Sprintf(kubeletConfig, n.UnderlayIP, n.CgroupRoot, dns)), 0o644); err != nil {
		return fmt.Errorf("kubenodes: %w", err)
	}
	if n.Kubelet, err = c.Run.Start(n.NS, "kubelet "+n.Name, filepath.Join(en.Dir, "kubelet.log"),
		n.inNode(c.API.Bins.Kubelet, "--config="+kcfg, "--kubeconfig="+c.API.Admin.Kubeconfig,
			"--hostname-override="+n.Name, "--node-ip="+n.UnderlayIP.String(), "--v=2")...); err != nil {
		return err
	}
	if c.opts.KubeProxyLater {
		return nil
	}
	return c.StartKubeProxy(n)
}

// StartKubeProxy starts kube-proxy (nftables mode) on n: New does for
// every node unless Options.KubeProxyLater.
func (c *Cluster) StartKubeProxy(n *Node) error {
	if n.KubeProxy != nil {
		return fmt.Errorf("kubenodes: kube-proxy runs on %s already", n.Name)
	}
	pcfg := filepath.Join(n.Dir, "kube-proxy.yaml")
	if err := os.WriteFile(pcfg, []byte(fmt.Sprintf(kubeProxyConfig, c.API.Admin.Kubeconfig, n.Name, PodRange)), 0o644); err != nil {
		return fmt.Errorf("kubenodes: %w", err)
	}
	p, err := c.Run.Start(n.NS, "kube-proxy "+n.Name, filepath.Join(n.Dir, "kube-proxy.log"),
		n.inNode(c.API.Bins.KubeProxy, "--config="+pcfg, "--v=1")...)
	if err != nil {
		return err
	}
	n.KubeProxy = p
	return nil
}

// containerdConfig is containerd 1.6's configuration for a node: state in
// the node's own /var/lib and /run, pod sandboxes from the imported pause
// image, runc with cgroupfs.
const containerdConfig = `version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
`

// kubeletConfig: %[1]s node address, %[2]s cgroupRoot, %[3]s the
// clusterDNS lines (or nothing).
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: %[2]s
address: %[1]s
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
clusterDomain: cluster.local
%[3]sserializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%%"
  imagefs.available: "1%%"
nodeStatusUpdateFrequency: 2s
syncFrequency: 10s
`

// kubeProxyConfig: %[1]s kubeconfig, %[2]s node name, %[3]s pod range. The
// conntrack settings are zero: kube-proxy leaves the host's alone.
const kubeProxyConfig = `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection:
  kubeconfig: %[1]s
hostnameOverride: %[2]s
clusterCIDR: %[3]s
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
`

func (c *Cluster) waitRegistered(ctx context.Context) error {
	return poll(ctx, 2*time.Minute, "every kubelet to register its Node", func() (bool, string) {
		for _, n := range c.Nodes {
			if !n.Kubelet.Running() {
				return false, "kubelet " + n.Name + " exited: " + tailFile(n.Kubelet.LogPath, logLines)
			}
		}
		list, err := c.CS.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		return len(list.Items) == len(c.Nodes), fmt.Sprintf("%d of %d Nodes", len(list.Items), len(c.Nodes))
	})
}

// poll checks cond every pollEvery until it holds, ctx ends or timeout
// passes; the error says what was awaited and the last state.
func poll(ctx context.Context, timeout time.Duration, what string, cond func() (bool, string)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	last := ""
	for {
		ok, state := cond()
		if ok {
			return nil
		}
		last = state
		select {
		case <-ctx.Done():
			return fmt.Errorf("kubenodes: timed out after %s waiting for %s; last seen: %s", timeout, what, last)
		case <-time.After(pollEvery):
		}
	}
}

// tailFile is the last n lines of a file.
func tailFile(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no %s: %v)", path, err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Diagnose writes what matters when something failed: nodes, pods and
// events as the API sees them, and the end of every node's kubelet,
// containerd, kube-proxy and router container logs.
func (c *Cluster) Diagnose(ctx context.Context, logf func(string, ...any)) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if c.API != nil {
		for _, args := range [][]string{
			{"get", "nodes", "-o", "wide"},
			{"get", "pods", "-A", "-o", "wide"},
			{"get", "events", "-A", "--sort-by=.lastTimestamp"},
		} {
			out, err := c.API.Kubectl(ctx, args...)
			logf("--- kubectl %s (err %v) ---\n%s", strings.Join(args, " "), err, lastLines(string(out), 60))
		}
	}
	for _, n := range c.Nodes {
		for _, p := range []*e2e.Proc{n.Kubelet, n.Containerd, n.KubeProxy} {
			if p != nil {
				logf("--- %s: last %d lines of %s ---\n%s", p.Name, logLines, p.LogPath, tailFile(p.LogPath, logLines))
			}
		}
		logs, _ := filepath.Glob(filepath.Join(n.Root, "var/log/pods/kube-system_weft-*/*/*.log"))
		for _, f := range logs {
			logf("--- router pod log on %s: %s ---\n%s", n.Name, f, tailFile(f, logLines))
		}
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
