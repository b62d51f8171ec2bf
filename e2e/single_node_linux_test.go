package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/router"
)

// TestSingleNode is the first slice end to end: a weft router in a node
// namespace, 20 pods attached through libcni, pinging each other and the
// gateway; CHECK, DEL twice, a SIGKILL and restart that keeps every
// allocation, GC with a partial list, and a second router refused on the
// same state.
func TestSingleNode(t *testing.T) {
	if testing.Short() {
		t.Skip("e2e: skipped in -short mode")
	}
	run := NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c, err := run.NewCluster(ctx, ClusterOpts{Nodes: 1})
	if err != nil {
		t.Fatal(err)
	}
	n := c.Nodes[0]
	r, err := n.StartRouter()
	if err != nil {
		t.Fatal(err)
	}
	if err := n.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}

	// What the operator sees at start.
	logText, _ := os.ReadFile(n.RouterLog)
	for _, want := range []string{"Command line options: map[", "ipalloc-range:10.32.0.0/12", "ipalloc: owning 10.32.0.0/12 (1048576 addresses, 100% of range)"} {
		if !strings.Contains(string(logText), want) {
			t.Errorf("router log lacks %q", want)
		}
	}
	if fi, err := os.Stat(n.Socket); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("local API socket: %v, %v; want mode 0600", fi.Mode(), err)
	}
	confData, err := os.ReadFile(filepath.Join(n.CNIConfDir, router.ConfListName))
	if err != nil {
		t.Fatal(err)
	}
	var conf struct {
		CNIVersion  string           `json:"cniVersion"`
		CNIVersions []string         `json:"cniVersions"`
		Plugins     []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal(confData, &conf); err != nil || conf.CNIVersion != "1.0.0" || len(conf.Plugins) != 2 ||
		conf.Plugins[0]["type"] != "weft-cni" || conf.Plugins[1]["type"] != "portmap" || !strings.Contains(strings.Join(conf.CNIVersions, ","), "1.1.0") {
		t.Errorf("conflist %s: %v", confData, err)
	}
	if err := n.CNIStatus(ctx); err != nil {
		t.Errorf("CNI STATUS of a ready router: %v", err)
	}

	// 20 pods, unique addresses in the range, gateway the bridge.
	universe := netip.MustParsePrefix("10.32.0.0/12")
	var pods []*Pod
	seen := map[netip.Addr]string{}
	for i := range 20 {
		p, err := n.AddPod(ctx, fmt.Sprintf("p%02d", i))
		if err != nil {
			t.Fatal(err)
		}
		if !universe.Contains(p.IP) || p.Prefix.Bits() != 12 || p.Gateway != netip.MustParseAddr("10.32.0.1") {
			t.Errorf("pod %s got %s gateway %s", p, p.Prefix, p.Gateway)
		}
		if other, dup := seen[p.IP]; dup {
			t.Fatalf("pods %s and %s both got %s", other, p, p.IP)
		}
		seen[p.IP] = p.Name
		pods = append(pods, p)
	}
	m := PingMatrix(ctx, pods)
	if !m.AllOK() {
		t.Fatalf("ping matrix:\n%s", m)
	}
	for _, p := range pods {
		if err := Ping(ctx, p.NS, p.Gateway); err != nil {
			t.Errorf("pod %s cannot ping its gateway: %v", p, err)
		}
		if err := n.CheckPod(ctx, p); err != nil {
			t.Errorf("CHECK %s: %v", p, err)
		}
	}

	// DEL twice succeeds; the address is free again.
	gone := pods[0]
	if err := n.DelPod(ctx, gone); err != nil {
		t.Fatal(err)
	}
	if err := n.DelPod(ctx, gone); err != nil {
		t.Fatalf("second DEL: %v", err)
	}
	cl := api.NewClient(n.Socket)
	if _, err := cl.Lookup(ctx, api.Attachment{ContainerID: gone.ContainerID, IfName: gone.IfName}); !api.IsCode(err, api.CodeNotFound) {
		t.Fatalf("after DEL the router still holds %s: %v", gone, err)
	}
	pods = pods[1:]

	// SIGKILL: pods keep talking while the router is down; after the restart
	// every container keeps its address and no held address is handed out.
	if err := r.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := Ping(ctx, pods[0].NS, pods[1].IP); err != nil {
		t.Errorf("pods lost each other while the router was down: %v", err)
	}
	if err := r.Restart(); err != nil {
		t.Fatal(err)
	}
	if err := n.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	held := map[netip.Addr]bool{}
	for _, p := range pods {
		a, err := cl.Lookup(ctx, api.Attachment{ContainerID: p.ContainerID, IfName: p.IfName})
		if err != nil || a.Address != p.Prefix {
			t.Fatalf("after kill -9 and restart %s holds %+v, %v; want %s", p, a, err, p.Prefix)
		}
		held[p.IP] = true
	}
	if err := n.Attach(ctx, pods[0]); err != nil || pods[0].IP != pods[0].Prefix.Addr() {
		t.Fatalf("repeated ADD after restart: %v", err)
	}
	for i := range 5 {
		p, err := n.AddPod(ctx, fmt.Sprintf("q%d", i))
		if err != nil {
			t.Fatal(err)
		}
		if held[p.IP] {
			t.Fatalf("after restart new pod %s got %s, which another pod holds", p, p.IP)
		}
		held[p.IP] = true
		pods = append(pods, p)
	}
	if m := PingMatrix(ctx, pods[len(pods)-8:]); !m.AllOK() {
		t.Fatalf("ping matrix after restart:\n%s", m)
	}

	// GC with a partial list releases exactly the rest.
	keep, drop := pods[:10], pods[10:]
	if err := n.GC(ctx, keep); err != nil {
		t.Fatal(err)
	}
	for _, p := range keep {
		if _, err := cl.Lookup(ctx, api.Attachment{ContainerID: p.ContainerID, IfName: p.IfName}); err != nil {
			t.Errorf("GC released %s, which was listed: %v", p, err)
		}
	}
	for _, p := range drop {
		if _, err := cl.Lookup(ctx, api.Attachment{ContainerID: p.ContainerID, IfName: p.IfName}); !api.IsCode(err, api.CodeNotFound) {
			t.Errorf("GC kept %s, which was not listed: %v", p, err)
		}
	}
	report, err := n.HTTPGet(ctx, "/status/ipam")
	if err != nil || !strings.Contains(string(report), "(10 active)") {
		t.Errorf("/status/ipam after GC: %s, %v", report, err)
	}

	// A second router on the same state dir is refused with a clear error.
	argv, err := n.RouterArgv("--socket", filepath.Join(n.Dir, "second.sock"), "--http-addr", "127.0.0.1:6799")
	if err != nil {
		t.Fatal(err)
	}
	second, err := run.Start(n.NS, "second-router", filepath.Join(n.Dir, "second.log"), argv...)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-second.Exited():
	case <-ctx.Done():
		t.Fatal("a second router on the same state dir kept running")
	}
	out, _ := os.ReadFile(filepath.Join(n.Dir, "second.log"))
	if !strings.Contains(string(out), "state dir is in use by another weft router") {
		t.Errorf("second router's error does not say the state is locked:\n%s", out)
	}
	if err := n.CNIStatus(ctx); err != nil {
		t.Errorf("the first router suffered from the second: %v", err)
	}
}
