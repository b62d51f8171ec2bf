package e2e_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/weft-net/weft/e2e"
)

func TestMain(m *testing.M) {
	// Started as a router by StartRouter (through a symlink named weft).
	if filepath.Base(os.Args[0]) == "weft" {
		os.Exit(fakeWeft(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// runNamespaces lists the namespaces in /run/netns that carry the run's prefix.
func runNamespaces(t *testing.T, prefix string) []string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns list: %v: %s", err, out)
	}
	var names []string
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 0 && strings.HasPrefix(f[0], prefix+"-") {
			names = append(names, f[0])
		}
	}
	return names
}

// nsInodes records the inode of every namespace of the run, to find
// processes in them after the names are gone.
func nsInodes(t *testing.T, nss ...*e2e.Netns) map[string]bool {
	t.Helper()
	m := map[string]bool{}
	for _, ns := range nss {
		ino, err := ns.Inode()
		if err != nil {
			t.Fatal(err)
		}
		m[fmt.Sprintf("net:[%d]", ino)] = true
	}
	return m
}

// procsIn lists processes (other than this one) in any of the namespaces.
func procsIn(inodes map[string]bool) []string {
	entries, _ := os.ReadDir("/proc")
	var found []string
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		if link, err := os.Readlink(filepath.Join("/proc", e.Name(), "ns", "net")); err == nil && inodes[link] {
			comm, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
			found = append(found, fmt.Sprintf("%d (%s)", pid, strings.TrimSpace(string(comm))))
		}
	}
	return found
}

// TestReferencePlugins proves the runtime with the reference plugins: pods
// attached by bridge + host-local run inside the node's namespace, reach
// each other and the gateway, pass CHECK, survive a repeated DEL, and Close
// leaves nothing behind.
func TestReferencePlugins(t *testing.T) {
	if _, err := os.Stat(filepath.Join(e2e.RefPluginDir, "bridge")); err != nil {
		t.Skipf("reference CNI plugins not installed in %s (apt-get install containernetworking-plugins): %v", e2e.RefPluginDir, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	run := e2e.NewTestRun(t)
	c, err := run.NewCluster(ctx, e2e.ClusterOpts{Nodes: 1, CNIPath: []string{e2e.RefPluginDir}})
	if err != nil {
		t.Fatal(err)
	}
	n := c.Nodes[0]
	subnet := netip.MustParsePrefix("10.88.0.0/16")
	gateway := netip.MustParseAddr("10.88.0.1")
	if err := n.UseRefConfList(subnet, true); err != nil {
		t.Fatal(err)
	}
	// A daemon, to see that Close kills what runs in a node.
	sleeper, err := run.Start(n.NS, "sleeper", filepath.Join(n.Dir, "sleeper.log"), "sleep", "600")
	if err != nil {
		t.Fatal(err)
	}

	// The first pod makes the bridge; the others are added at once, as a
	// runtime starting several pods does.
	pods := make([]*e2e.Pod, 5)
	errs := make([]error, len(pods))
	pods[0], errs[0] = n.AddPod(ctx, "p0")
	var wg sync.WaitGroup
	for i := 1; i < len(pods); i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pods[i], errs[i] = n.AddPod(ctx, fmt.Sprintf("p%d", i))
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	seen := map[netip.Addr]string{}
	for _, p := range pods {
		if !subnet.Contains(p.IP) || p.IP == gateway {
			t.Errorf("pod %s got %s, want an address in %s other than the gateway", p, p.IP, subnet)
		}
		if other, dup := seen[p.IP]; dup {
			t.Errorf("pods %s and %s both got %s", other, p, p.IP)
		}
		seen[p.IP] = p.Name
		if p.Gateway != gateway {
			t.Errorf("pod %s: gateway %s, want %s", p, p.Gateway, gateway)
		}
	}
	if got := len(n.Pods()); got != len(pods) {
		t.Errorf("node lists %d pods, want %d", got, len(pods))
	}

	// The plugin ran in the node's namespace: the bridge is there and not in
	// the root namespace.
	err = n.NS.WithHandle(func(h *netlink.Handle) error {
		_, err := h.LinkByName("cni-ref")
		return err
	})
	if err != nil {
		t.Errorf("bridge cni-ref not in the node's namespace: %v", err)
	}
	if _, err := netlink.LinkByName("cni-ref"); err == nil {
		t.Errorf("bridge cni-ref is in the root namespace: the plugin ran in the wrong namespace")
	}

	m := e2e.PingMatrix(ctx, pods)
	t.Logf("ping matrix:\n%s", m)
	if !m.AllOK() {
		t.Errorf("pods cannot reach each other: %v", m.Failures())
	}
	for _, p := range pods {
		if err := e2e.Ping(ctx, p.NS, gateway); err != nil {
			t.Error(err)
		}
		if err := n.CheckPod(ctx, p); err != nil {
			t.Error(err)
		}
	}
	// STATUS and GC are passed through (libcni skips them below CNI 1.1.0).
	if err := n.CNIStatus(ctx); err != nil {
		t.Error(err)
	}
	if err := n.GC(ctx, pods); err != nil {
		t.Error(err)
	}

	for _, p := range pods {
		for try := 1; try <= 2; try++ {
			if err := n.DelPod(ctx, p); err != nil {
				t.Errorf("DEL #%d: %v", try, err)
			}
		}
		err := p.NS.WithHandle(func(h *netlink.Handle) error {
			_, err := h.LinkByName(p.IfName)
			return err
		})
		if err == nil {
			t.Errorf("pod %s still has %s after DEL", p, p.IfName)
		}
	}
	// Ping retries until its context ends: keep this one short.
	shortCtx, cancelShort := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancelShort()
	if err := e2e.Ping(shortCtx, pods[0].NS, pods[1].IP); err == nil {
		t.Errorf("pod %s still reaches %s after DEL", pods[0], pods[1].IP)
	}

	all := append([]*e2e.Netns{c.Underlay, n.NS}, pods[0].NS)
	inodes := nsInodes(t, all...)
	if err := run.Close(); err != nil {
		t.Fatal(err)
	}
	if left := runNamespaces(t, run.Prefix()); len(left) > 0 {
		t.Errorf("namespaces left after Close: %v", left)
	}
	if left := procsIn(inodes); len(left) > 0 {
		t.Errorf("processes left in the run's namespaces after Close: %v", left)
	}
	if sleeper.Running() {
		t.Errorf("sleeper (pid %d) survived Close", sleeper.Pid())
	}
	if _, err := os.Stat(run.Dir()); !os.IsNotExist(err) {
		t.Errorf("run directory %s left after Close (%v)", run.Dir(), err)
	}
}

// fakeBinDir makes a bin dir whose weft is this test binary (see TestMain).
func fakeBinDir(t *testing.T) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.Symlink(self, filepath.Join(dir, "weft")); err != nil {
		t.Fatal(err)
	}
	t.Setenv("WEFT_BIN_DIR", dir)
}

// TestRouterLifecycle drives a stand-in router (fakeWeft) through start,
// readiness, status, a pod, kill, restart and stop, on a two-node underlay.
func TestRouterLifecycle(t *testing.T) {
	if _, err := os.Stat(filepath.Join(e2e.RefPluginDir, "bridge")); err != nil {
		t.Skipf("reference CNI plugins not installed in %s: %v", e2e.RefPluginDir, err)
	}
	fakeBinDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	run := e2e.NewTestRun(t)
	c, err := run.NewCluster(ctx, e2e.ClusterOpts{Nodes: 2})
	if err != nil {
		t.Fatal(err)
	}
	n0, n1 := c.Nodes[0], c.Nodes[1]

	// The underlay: nodes reach each other and the bridge, and the default
	// route names eth0 and the node's address, which is what a router uses
	// to find its host address and MTU.
	if err := e2e.Ping(ctx, n0.NS, n1.UnderlayIP); err != nil {
		t.Error(err)
	}
	if err := e2e.Ping(ctx, n1.NS, e2e.UnderlayGateway); err != nil {
		t.Error(err)
	}
	err = n1.NS.WithHandle(func(h *netlink.Handle) error {
		routes, err := h.RouteGet(net.IPv4(192, 0, 2, 1))
		if err != nil {
			return err
		}
		link, err := h.LinkByIndex(routes[0].LinkIndex)
		if err != nil {
			return err
		}
		if link.Attrs().Name != "eth0" || !routes[0].Src.Equal(net.IP(n1.UnderlayIP.AsSlice())) || link.Attrs().MTU != 1500 {
			return fmt.Errorf("default route goes out %s (mtu %d) from %s, want eth0 (1500) from %s",
				link.Attrs().Name, link.Attrs().MTU, routes[0].Src, n1.UnderlayIP)
		}
		return nil
	})
	if err != nil {
		t.Errorf("node %s: %v", n1.Name, err)
	}

	r, err := n0.StartRouter("--ready-after", "300ms")
	if err != nil {
		t.Fatal(err)
	}
	if err := n0.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if tail := r.LogTail(5); !strings.Contains(tail, "fake router n0 ("+n0.PeerName+") starting, bridge weft") {
		t.Errorf("router log does not show the start line:\n%s", tail)
	}
	status := func(n *e2e.Node) (map[string]any, error) {
		body, err := n.HTTPGet(ctx, "/status")
		if err != nil {
			return nil, err
		}
		var s map[string]any
		return s, json.Unmarshal(body, &s)
	}
	s, err := status(n0)
	if err != nil {
		t.Fatal(err)
	}
	if s["nickname"] != "n0" || s["name"] != n0.PeerName || s["starts"] != 1.0 {
		t.Errorf("status of n0 = %v", s)
	}
	// 127.0.0.1:6784 is per node: n1 runs no router.
	if _, err := status(n1); err == nil {
		t.Error("n1 answered on its status address without a router")
	}
	out, err := n0.Weft(ctx, "status")
	if err != nil || !strings.Contains(string(out), `"nickname":"n0"`) {
		t.Errorf("weft status in n0 = %q, %v", out, err)
	}

	// A pod through the conflist the router wrote.
	p, err := n0.AddPod(ctx, "p1")
	if err != nil {
		t.Fatal(err)
	}
	if !netip.MustParsePrefix("10.32.0.0/24").Contains(p.IP) {
		t.Errorf("pod got %s from the router's conflist", p.IP)
	}
	if err := e2e.Ping(ctx, p.NS, n0.UnderlayIP); err != nil {
		t.Error(err)
	}

	// Crash and restart: the state dir survives.
	if err := r.Kill(); err != nil {
		t.Fatal(err)
	}
	if r.Proc().Running() {
		t.Fatal("router runs after Kill")
	}
	if err := r.Restart(); err != nil {
		t.Fatal(err)
	}
	if err := n0.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if s, err := status(n0); err != nil || s["starts"] != 2.0 {
		t.Errorf("status after restart = %v, %v; want starts 2", s, err)
	}
	if err := r.Stop(); err != nil {
		t.Error(err)
	}
	if err := r.Proc().Wait(); err != nil {
		t.Errorf("router did not exit cleanly on SIGTERM: %v", err)
	}

	// A router that ignores SIGTERM is killed, and Stop says so.
	r1, err := n1.StartRouter("--ignore-term", "--ready-after", "0s")
	if err != nil {
		t.Fatal(err)
	}
	if err := n1.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if err := r1.Proc().Stop(300 * time.Millisecond); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("Stop of a router that ignores SIGTERM: %v", err)
	}

	// A router that exits at start: WaitReady says so at once, with its log.
	if _, err := n1.StartRouter("--fail-start"); err != nil {
		t.Fatal(err)
	}
	err = n1.WaitReady(ctx)
	if err == nil || !strings.Contains(err.Error(), "exited before it was ready") || !strings.Contains(err.Error(), "refusing to start") {
		t.Errorf("WaitReady of a failing router: %v", err)
	}
}

// TestCrashedRunIsSwept kills a process that owns a run with SIGKILL: its
// daemon dies with it (Pdeathsig), and the next sweep removes its
// namespaces and directories.
func TestCrashedRunIsSwept(t *testing.T) {
	if os.Getenv("E2E_CRASH_CHILD") == "1" {
		crashChild()
		return
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to make network namespaces")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	child := exec.CommandContext(ctx, self, "-test.run=^TestCrashedRunIsSwept$")
	child.Env = append(os.Environ(), "E2E_CRASH_CHILD=1")
	child.Stderr = os.Stderr
	stdin, err := child.StdinPipe() // held open: the child waits on it
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e2e.Sweep(context.Background(), nil) })
	var prefix, dir string
	var sleeperPid int
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if _, err := fmt.Sscanf(sc.Text(), "READY %s %s %d", &prefix, &dir, &sleeperPid); err == nil {
			break
		}
	}
	if sleeperPid == 0 {
		_ = child.Process.Kill()
		_ = child.Wait()
		t.Fatalf("child did not report its run: %v", sc.Err())
	}
	sleeperStart := startTime(sleeperPid)
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = child.Wait()

	// Pdeathsig: the daemon dies with its owner.
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(10 * time.Second)
	for sleeperStart != 0 && startTime(sleeperPid) == sleeperStart {
		select {
		case <-deadline:
			t.Fatalf("daemon %d outlived its killed owner", sleeperPid)
		case <-tick.C:
		}
	}
	if left := runNamespaces(t, prefix); len(left) == 0 {
		t.Fatalf("the killed run left no namespaces; nothing to sweep (prefix %s)", prefix)
	}

	if err := e2e.Sweep(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if left := runNamespaces(t, prefix); len(left) > 0 {
		t.Errorf("namespaces left after the sweep: %v", left)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("run directory %s left after the sweep (%v)", dir, err)
	}
	if _, err := os.Stat(filepath.Join("/run/weft-e2e", prefix)); !os.IsNotExist(err) {
		t.Errorf("run record left after the sweep (%v)", err)
	}
}

// startTime is a process's start time from /proc, or 0 when it is gone or
// a zombie.
func startTime(pid int) uint64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+1:]))
	if len(f) < 20 || f[0] == "Z" {
		return 0
	}
	v, _ := strconv.ParseUint(f[19], 10, 64)
	return v
}

// crashChild makes a run with a node and a daemon, reports them, and waits
// to be killed.
func crashChild() {
	ctx := context.Background()
	run, err := e2e.NewRun(e2e.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	c, err := run.NewCluster(ctx, e2e.ClusterOpts{Nodes: 1})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	n := c.Nodes[0]
	p, err := run.Start(n.NS, "sleeper", filepath.Join(n.Dir, "sleeper.log"), "sleep", "600")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("READY %s %s %d\n", run.Prefix(), run.Dir(), p.Pid())
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // until killed
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
}
