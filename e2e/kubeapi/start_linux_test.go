package kubeapi

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/weft-net/weft/e2e"
)

// logTime is the time of a router log line (slog's text format).
func logTime(line string) (time.Time, bool) {
	v, ok := strings.CutPrefix(line, "time=")
	if !ok {
		return time.Time{}, false
	}
	v, _, _ = strings.Cut(v, " ")
	ts, err := time.Parse(time.RFC3339Nano, v)
	return ts, err == nil
}

// sinceStart is the time from the router's first log line to the first
// line containing what, in its log (0, false if there is none).
func sinceStart(t *testing.T, path, what string) (time.Duration, bool) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var first time.Time
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		ts, ok := logTime(sc.Text())
		if !ok {
			continue
		}
		if first.IsZero() {
			first = ts
		}
		if strings.Contains(sc.Text(), what) {
			return ts.Sub(first), true
		}
	}
	return 0, false
}

// errorLines are the lines of a router log at level ERROR.
func errorLines(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(data), "\n") {
		if strings.Contains(l, " level=ERROR ") {
			out = append(out, l)
		}
	}
	return out
}

// TestFreshStartOnKubernetes: the start an operator meets on a new
// cluster. Two routers with no state and no --peers; n0's API server
// address is the "kubernetes" Service's, which answers only once
// kube-proxy's rule exists on the node (Weave's #3938): n0 stays alive,
// says in /readyz and once in its log why it is not ready, and becomes
// ready without a restart when the address answers. Both join the mesh as
// soon as the node list names the other (measured from the router's start),
// claim the ring, and log no ERROR line, at the start nor at the stop.
func TestFreshStartOnKubernetes(t *testing.T) {
	ctx, tb := testbed(t, 2)
	c, srv, id := tb.Cluster, tb.Server, tb.Weft
	n0, n1 := c.Nodes[0], c.Nodes[1]

	// n0 reaches the API server at the Service address, as in-cluster
	// config does (the server's certificate carries it).
	const svcAddr, svcPort = "10.96.0.1", 443
	svcConfig := filepath.Join(srv.Dir, "weft-service.kubeconfig")
	if err := writeKubeconfig(svcConfig, fmt.Sprintf("https://%s:%d", svcAddr, svcPort), srv.CAData, id.User, id.Token); err != nil {
		t.Fatal(err)
	}
	kubeArgs := func(n *e2e.Node, kubeconfig string) []string {
		return []string{"--kube", "--kubeconfig", kubeconfig, "--node-name", n.Name, "--kube-namespace", "kube-system"}
	}
	if _, err := n0.StartRouter(kubeArgs(n0, svcConfig)...); err != nil {
		t.Fatal(err)
	}
	eventually(t, ctx, "n0 alive, not ready, saying it waits for the API server", func() (bool, string) {
		if _, err := n0.HTTPGet(ctx, "/healthz"); err != nil {
			return false, err.Error()
		}
		_, err := n0.HTTPGet(ctx, "/readyz")
		return err != nil && strings.Contains(err.Error(), "waiting for the Kubernetes API") && strings.Contains(err.Error(), svcAddr), fmt.Sprint(err)
	})
	eventually(t, ctx, "n0 to log why it waits", func() (bool, string) {
		return countInFile(t, n0.RouterLog, "cannot read the node list and the ConfigMap") == 1, n0.Router().LogTail(10)
	})
	pid := n0.Router().Proc().Pid()

	if _, err := n1.StartRouter(kubeArgs(n1, id.Kubeconfig)...); err != nil {
		t.Fatal(err)
	}
	// "kube-proxy" comes up on n0: the Service address answers.
	rule := fmt.Sprintf("table ip weft-test-kubeproxy { chain out { type nat hook output priority -100; ip daddr %s tcp dport %d dnat to %s:%d; }; }",
		svcAddr, svcPort, srv.Addr.Addr(), srv.Addr.Port())
	if out, err := n0.NS.Exec(ctx, "nft", rule); err != nil {
		t.Fatalf("nft: %v: %s", err, out)
	}
	for _, n := range []*e2e.Node{n0, n1} {
		if err := n.WaitReady(ctx); err != nil {
			t.Fatalf("%s: %v\n%s", n.Name, err, n.Router().LogTail(40))
		}
	}
	if got := n0.Router().Proc().Pid(); got != pid {
		t.Errorf("n0's router was restarted (pid %d, then %d); it should have waited", pid, got)
	}
	if countInFile(t, n0.RouterLog, "the API server answers; going on with the start") != 1 {
		t.Errorf("n0 did not say that the API server answers:\n%s", n0.Router().LogTail(30))
	}

	// The first join, from the router's start (figures for the report;
	// TestAddTargetsJoinsAtOnce in mesh checks the behaviour).
	for _, n := range []*e2e.Node{n0, n1} {
		joined, ok1 := sinceStart(t, n.RouterLog, "joined the mesh")
		synced, ok2 := sinceStart(t, n.RouterLog, "node list synced")
		ready, ok3 := sinceStart(t, n.RouterLog, "ready: pods can be attached")
		if !ok1 && !strings.Contains(n.Router().LogTail(200), "peer ") {
			t.Errorf("%s never joined the mesh:\n%s", n.Name, n.Router().LogTail(40))
		}
		t.Logf("%s: from start: node list synced %v (%v), first join %v (%v), ready %v (%v)", n.Name, synced, ok2, joined, ok1, ready, ok3)
	}
	// Both stop cleanly; no ERROR at any point of a normal start and stop.
	for _, n := range []*e2e.Node{n0, n1} {
		if err := n.Router().Stop(); err != nil {
			t.Errorf("%s: %v", n.Name, err)
		}
	}
	for _, n := range []*e2e.Node{n0, n1} {
		if errs := errorLines(t, n.RouterLog); len(errs) > 0 {
			t.Errorf("%s logged ERROR in a normal start and stop:\n%s", n.Name, strings.Join(errs, "\n"))
		}
	}
}
