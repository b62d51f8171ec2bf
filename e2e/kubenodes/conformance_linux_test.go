package kubenodes

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/weft-net/weft/e2e"
	"github.com/weft-net/weft/e2e/conformance"
	"github.com/weft-net/weft/internal/ociimage"
)

// The upstream conformance run (make conformance) and the command run
// (make kube-run): both bring the cluster up with weft installed as
// TestKubeNodes does, run one program against it from the underlay
// namespace (where the API server and every node's address are reachable)
// and take everything down when it ends, however it ends.
var (
	runConformance = flag.Bool("conformance", os.Getenv("WEFT_CONFORMANCE") == "1",
		"run the Kubernetes e2e suite's network tests against the real-node cluster (make conformance; also WEFT_CONFORMANCE=1)")
	conformanceFocus = flag.String("conformance.focus", DefaultFocus, "the e2e suite's --ginkgo.focus")
	conformanceSkip  = flag.String("conformance.skip", DefaultSkip, "the e2e suite's --ginkgo.skip")
	conformanceTime  = flag.Duration("conformance.timeout", 80*time.Minute, "how long the e2e suite may run")
	conformanceProcs = flag.Int("conformance.procs", 3, "ginkgo processes running specs at once (1: e2e.test alone, serially)")
	conformanceOut   = flag.String("conformance.out", "", "directory for the suite's log, JSON report and summary (default <bin>/conformance)")
	conformanceDNS   = flag.Bool("conformance.dns", true, "deploy the cluster DNS (CoreDNS, built from e2e/conformance/dns) before the suite runs, as a cluster has it")

	kubeRunCmd = flag.String("kubenodes.cmd", os.Getenv("WEFT_KUBENODES_CMD"),
		"a shell command run against the real-node cluster once weft is Ready (make kube-run CMD=...; also WEFT_KUBENODES_CMD), with KUBECONFIG and KUBECTL set; the cluster stays up until it exits")
	kubeRunTime = flag.Duration("kubenodes.cmd-timeout", 60*time.Minute, "how long the -kubenodes.cmd command may run")
)

// DefaultFocus is the part of the e2e suite make conformance runs: the
// sig-network specs of pod-to-pod (intra- and inter-node), node-to-pod,
// hostPort, Services (ClusterIP, NodePort, endpoints, session affinity)
// the API objects of the pod network (EndpointSlice, Proxy) and DNS
// (names of Services and pods through the cluster DNS, which
// TestConformance deploys).
const DefaultFocus = `\[sig-network\] (Networking|Services|HostPort|EndpointSlice|Proxy|Conntrack|DNS)`

// DefaultSkip leaves out what this cluster cannot have or what is not the
// pod network's: a cloud (LoadBalancer, ESIPP, the providers' SSH), IPv6
// and dual stack, SCTP (no module),
// the Internet, and what disrupts the cluster, runs only serially or is
// marked slow (minutes each).
const DefaultSkip = `\[Feature:|\[Disruptive\]|\[Serial\]|\[Slow\]|\[Flaky\]|LoadBalancer|ESIPP|IPv6|[Dd]ual[- ]?[Ss]tack|SCTP|[Ii]nternet`

// TestConformance is make conformance: the e2e suite (e2e.test, built from
// the pinned k8s.io/kubernetes) with DefaultFocus against three real nodes
// running weft. Every spec that fails fails the test; the counts and the
// list are logged and written to <bin>/conformance/summary.txt.
func TestConformance(t *testing.T) {
	if !*runConformance {
		t.Skip("kubenodes: the e2e suite runs with -conformance or WEFT_CONFORMANCE=1 (make conformance)")
	}
	run := e2e.NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), *conformanceTime+20*time.Minute)
	defer cancel()
	log := run.Log()

	start := time.Now()
	tools, err := conformance.Build(ctx, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("e2e suite and agnhost (cached): %s, %s", tools.Dir, time.Since(start).Round(time.Millisecond))
	var coredns string
	if *conformanceDNS {
		start := time.Now()
		if coredns, err = conformance.BuildCoreDNS(ctx, log); err != nil {
			t.Fatal(err)
		}
		t.Logf("CoreDNS (cached): %s, %s", coredns, time.Since(start).Round(time.Millisecond))
	}
	images, err := conformanceImages(ctx, run, tools, coredns)
	if err != nil {
		t.Fatal(err)
	}
	c := clusterWithWeft(t, ctx, run, images, *conformanceDNS)
	if *conformanceDNS {
		step(t, c, "cluster DNS (CoreDNS) rolled out", func() error { return c.DeployDNS(ctx) })
	}

	out := *conformanceOut
	if out == "" {
		bin, err := run.BinDir()
		if err != nil {
			t.Fatal(err)
		}
		out = filepath.Join(bin, "conformance")
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	jsonReport := filepath.Join(out, "report.json")
	_ = os.Remove(jsonReport) // never read an older run's
	suiteArgs := []string{
		"--kubeconfig=" + c.API.Admin.Kubeconfig,
		"--kubectl-path=" + c.API.Bins.Kubectl,
		// skeleton: no cloud; the specs that need one (or SSH to the
		// nodes) skip themselves.
		"--provider=skeleton",
		"--num-nodes=" + fmt.Sprint(len(c.Nodes)),
		"--report-dir=" + out,
		"--e2e-output-dir=" + out,
	}
	ginkgoArgs := []string{
		"focus=" + *conformanceFocus,
		"skip=" + *conformanceSkip,
		"json-report=" + jsonReport,
		"timeout=" + conformanceTime.String(),
		"no-color",
		"v",
	}
	var argv []string
	if *conformanceProcs > 1 {
		// The ginkgo CLI runs the suite in procs processes and merges
		// their reports (the way upstream runs it in parallel).
		argv = []string{tools.Ginkgo, fmt.Sprintf("--procs=%d", *conformanceProcs)}
		for _, a := range ginkgoArgs {
			argv = append(argv, "--"+a)
		}
		argv = append(append(append(argv, tools.E2ETest), "--"), suiteArgs...)
	} else {
		argv = append([]string{tools.E2ETest}, suiteArgs...)
		for _, a := range ginkgoArgs {
			argv = append(argv, "--ginkgo."+a)
		}
	}
	logPath := filepath.Join(out, "e2e.log")
	_ = os.Remove(logPath)
	t.Logf("e2e suite: focus %q skip %q, %d processes; log %s", *conformanceFocus, *conformanceSkip, *conformanceProcs, logPath)
	var runErr error
	step(t, c, "e2e suite (e2e.test)", func() error {
		runErr = runInUnderlay(ctx, run, c, "e2e.test", logPath, *conformanceTime+5*time.Minute, argv)
		return nil // judged below, from the report
	})
	data, err := os.ReadFile(jsonReport)
	if err != nil {
		t.Fatalf("the suite wrote no report (%v; it ended with %v); its log %s ends:\n%s", err, runErr, logPath, tailFile(logPath, 60))
	}
	res, err := conformance.Summarize(data)
	if err != nil {
		t.Fatal(err)
	}
	summary := fmt.Sprintf("focus: %s\nskip:  %s\n%s", *conformanceFocus, *conformanceSkip, res.Table())
	if err := os.WriteFile(filepath.Join(out, "summary.txt"), []byte(summary), 0o644); err != nil {
		t.Error(err)
	}
	t.Logf("e2e suite results (also %s):\n%s", filepath.Join(out, "summary.txt"), summary)
	if len(res.Failed) > 0 {
		t.Errorf("%d e2e specs failed (see above and %s)", len(res.Failed), logPath)
	}
	if len(res.Passed) == 0 {
		t.Errorf("no e2e spec passed: the focus %q selects nothing this cluster can run", *conformanceFocus)
	}
	if runErr != nil && len(res.Failed) == 0 {
		t.Errorf("e2e.test ended with %v but no spec failed: a suite-level failure, see %s:\n%s", runErr, logPath, tailFile(logPath, 40))
	}
}

// TestKubeNodesCommand is make kube-run: the cluster with weft Ready, then
// the -kubenodes.cmd shell command (e.g. `sleep 3600` to look around with
// `nsenter`, or a test suite of one's own) from the underlay namespace,
// with KUBECONFIG (the admin's) and KUBECTL set. The test fails when the
// command fails; the cluster is taken down when it ends.
func TestKubeNodesCommand(t *testing.T) {
	if *kubeRunCmd == "" {
		t.Skip("kubenodes: give a command with -kubenodes.cmd or WEFT_KUBENODES_CMD (make kube-run CMD=...)")
	}
	run := e2e.NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), *kubeRunTime+15*time.Minute)
	defer cancel()
	bin, err := run.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	c := clusterWithWeft(t, ctx, run, []string{filepath.Join(bin, "weft-image.tar"), filepath.Join(bin, "pause-image.tar")}, false)
	t.Setenv("KUBECONFIG", c.API.Admin.Kubeconfig)
	t.Setenv("KUBECTL", c.API.Bins.Kubectl)
	logPath := filepath.Join(run.Dir(), "command.log")
	t.Logf("running %q in the underlay namespace %s (KUBECONFIG=%s); its output: %s", *kubeRunCmd, c.Net.Underlay.Name, c.API.Admin.Kubeconfig, logPath)
	var cmdErr error
	step(t, c, "command", func() error {
		cmdErr = runInUnderlay(ctx, run, c, "command", logPath, *kubeRunTime, []string{"/bin/sh", "-c", *kubeRunCmd})
		return nil
	})
	t.Logf("command output:\n%s", tailFile(logPath, 200))
	if cmdErr != nil {
		t.Errorf("%q: %v", *kubeRunCmd, cmdErr)
	}
}

// runInUnderlay runs argv in the underlay namespace with its output in
// logPath and waits for it, killing it (and what it started) when timeout
// passes or ctx ends.
func runInUnderlay(ctx context.Context, run *e2e.Run, c *Cluster, name, logPath string, timeout time.Duration, argv []string) error {
	p, err := run.Start(c.Net.Underlay, name, logPath, argv...)
	if err != nil {
		return err
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-p.Exited():
		return p.Wait()
	case <-timer.C:
	case <-ctx.Done():
	}
	_ = p.Stop(10 * time.Second)
	return fmt.Errorf("%s killed after %s (or the test's deadline): %w", name, timeout, errors.Join(p.Wait(), context.DeadlineExceeded))
}

// clusterWithWeft brings the cluster up with images in every containerd
// (and the kubelets' clusterDNS set if dns: the caller deploys it),
// applies weft as TestKubeNodes does (e2e/kubenodes/overlay) and waits for
// every router and node to be Ready. On a failure it shows the cluster's
// state and fails the test; the run takes everything down.
func clusterWithWeft(t *testing.T, ctx context.Context, run *e2e.Run, images []string, dns bool) *Cluster {
	t.Helper()
	for _, f := range images {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("%v: run `make image` (both images) first", err)
		}
	}
	c, err := newCluster(ctx, t, run, Options{Images: images, ClusterDNS: dns})
	if err != nil {
		t.Fatal(err)
	}
	deployWeft(ctx, t, c)
	// The control plane reaches pods as from a node: in a cluster the API
	// server runs on a node with weft (the proxy subresource, webhooks and
	// the suite's Proxy and DNS specs dial pod addresses from it), and its
	// packets to a pod on another node leave with the node's own pod-range
	// address (the routes' src). Here it runs in the underlay, so the
	// underlay routes the pod range through n0, and n0 masquerades what
	// comes from the API server's address to another node's pods: weft's
	// peers drop a packet whose source lies outside the sending peer's
	// ranges (vxlan-spoofed-source), as they must.
	n0 := c.Nodes[0]
	step(t, c, "underlay: pod range via "+n0.Name+", masqueraded there", func() error {
		_, dst, err := net.ParseCIDR(PodRange)
		if err != nil {
			return err
		}
		gw := net.IP(n0.UnderlayIP.AsSlice())
		if err := c.Net.Underlay.WithHandle(func(h *netlink.Handle) error {
			return h.RouteReplace(&netlink.Route{Dst: dst, Gw: gw})
		}); err != nil {
			return err
		}
		rule := fmt.Sprintf(`table ip weft-e2e-controlplane { chain post { type nat hook postrouting priority 100; ip saddr %s ip daddr %s oifname != "weft" masquerade; }; }`,
			c.API.Addr.Addr(), PodRange)
		if out, err := n0.NS.Exec(ctx, "nft", rule); err != nil {
			return fmt.Errorf("nft in %s: %w: %s", n0.Name, err, out)
		}
		return nil
	})
	return c
}

// conformanceImages are the tarballs the nodes import for the suite: weft's
// image, the pause image also under the suite's pause name, and agnhost
// under the names e2e.test pulls (read from its --list-images), the
// Conntrack spec's regression-issue-74839 (BuildExtras) and busybox (this
// machine's busybox-static); with a
// coredns binary, also CoreDNS's image (DNSImage), /coredns in agnhost, and
// the DNS specs' glibc-dns-testing.
func conformanceImages(ctx context.Context, run *e2e.Run, tools conformance.Tools, coredns string) ([]string, error) {
	bin, err := run.BinDir()
	if err != nil {
		return nil, err
	}
	weftImage, pauseImage := filepath.Join(bin, "weft-image.tar"), filepath.Join(bin, "pause-image.tar")
	for _, f := range []string{weftImage, pauseImage} {
		if _, err := os.Stat(f); err != nil {
			return nil, fmt.Errorf("%w: run `make image` (both images) first, or `make conformance`", err)
		}
	}
	// --list-images prints and exits before the suite reads a kubeconfig.
	list, err := exec.CommandContext(ctx, tools.E2ETest, "--list-images").Output()
	if err != nil {
		return nil, fmt.Errorf("e2e.test --list-images: %w", err)
	}
	version, err := conformance.AgnhostVersion(tools.KubeSrc)
	if err != nil {
		return nil, err
	}
	agnhostTags, pauseTags, err := conformance.ImagesFor(string(list), version)
	if err != nil {
		return nil, err
	}
	agnhost := filepath.Join(run.Dir(), "agnhost-image.tar")
	if err := conformance.AgnhostImage(conformance.ImageSpec{
		Agnhost: tools.Agnhost, KubeSrc: tools.KubeSrc, CoreDNS: coredns, Tags: agnhostTags, Created: time.Unix(0, 0).UTC(),
	}, agnhost); err != nil {
		return nil, err
	}
	run.Log().Info("conformance: agnhost image built", "tags", agnhostTags, "tarball", agnhost)
	pause := filepath.Join(run.Dir(), "pause-conformance.tar")
	if err := retag(pauseImage, pause, pauseTags); err != nil {
		return nil, err
	}
	images := []string{weftImage, pause, agnhost}
	if tags := conformance.TagsOf(string(list), "regression-issue-74839"); len(tags) > 0 {
		extras, err := conformance.BuildExtras(ctx, run.Log())
		if err != nil {
			return nil, err
		}
		img := filepath.Join(run.Dir(), "regression-issue-74839-image.tar")
		if err := conformance.ProgramImage(extras.Regression74839, "regression-issue-74839", tags, time.Unix(0, 0).UTC(), img); err != nil {
			return nil, err
		}
		images = append(images, img)
	}
	if tags := conformance.TagsOf(string(list), "busybox"); len(tags) > 0 {
		img := filepath.Join(run.Dir(), "busybox-image.tar")
		if err := conformance.BusyBoxImage(conformance.BusyBox, tags, time.Unix(0, 0).UTC(), img); err != nil {
			return nil, err
		}
		images = append(images, img)
	}
	if coredns != "" {
		img := filepath.Join(run.Dir(), "coredns-image.tar")
		if err := conformance.ProgramImage(coredns, "coredns", []string{DNSImage}, time.Unix(0, 0).UTC(), img); err != nil {
			return nil, err
		}
		images = append(images, img)
		if tags := conformance.TagsOf(string(list), "glibc-dns-testing"); len(tags) > 0 {
			img := filepath.Join(run.Dir(), "glibc-dns-testing-image.tar")
			if err := conformance.GlibcDNSImage(coredns, tags, time.Unix(0, 0).UTC(), img); err != nil {
				return nil, err
			}
			run.Log().Info("conformance: glibc-dns-testing image built", "tags", tags, "tarball", img)
			images = append(images, img)
		}
	}
	return images, nil
}

// retag writes the image of the tarball in as out, under its own tag and
// every one of tags.
func retag(in, out string, tags []string) error {
	m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(in) })
	if err != nil || len(m) != 1 || len(m[0].RepoTags) == 0 {
		return fmt.Errorf("reading %s: want one tagged image: %v", in, err)
	}
	tags = append([]string{m[0].RepoTags[0]}, tags...)
	img, err := tarball.ImageFromPath(in, nil)
	if err != nil {
		return fmt.Errorf("reading %s: %w", in, err)
	}
	return ociimage.WriteTarball(out, img, tags)
}
