package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/state"
)

// owners lists the owners in a node's view of the ring, sorted.
func owners(ctx context.Context, n *Node) ([]string, float64, error) {
	rep, err := ipamOf(ctx, n)
	if err != nil {
		return nil, 0, err
	}
	var out []string
	var total float64
	for _, o := range rep.IPAM.Owners {
		out = append(out, o.Peer)
		total += o.Percent
	}
	slices.Sort(out)
	return out, total, nil
}

// logLine returns the first line of n's router log that contains every one
// of parts, or "".
func logLine(n *Node, parts ...string) string {
	f, err := os.Open(n.RouterLog)
	if err != nil {
		return ""
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 64<<10), 1<<20)
	for s.Scan() {
		line := s.Text()
		ok := true
		for _, p := range parts {
			if !strings.Contains(line, p) {
				ok = false
				break
			}
		}
		if ok {
			return line
		}
	}
	return ""
}

// addPods adds count pods named prefix0.. on n; every address must be new
// to seen (addresses are unique on one ring), which it then records.
func addPods(t *testing.T, ctx context.Context, n *Node, prefix string, count int, seen map[netip.Addr]string) []*Pod {
	t.Helper()
	var pods []*Pod
	for i := range count {
		p, err := n.AddPod(ctx, fmt.Sprintf("%s%d", prefix, i))
		if err != nil {
			t.Fatal(err)
		}
		if other, dup := seen[p.IP]; dup {
			t.Fatalf("%s got %s, which %s holds", p, p.IP, other)
		}
		seen[p.IP] = p.String()
		pods = append(pods, p)
	}
	return pods
}

// TestIPAMReclaimAfterLostState: a router with pods is stopped and its
// state deleted; started again, it re-claims the addresses its pods use
// (found in the bridge's neighbour table, since they pinged the gateway),
// so new pods get other addresses, and old and new pods all talk.
func TestIPAMReclaimAfterLostState(t *testing.T) {
	if testing.Short() {
		t.Skip("e2e: skipped in -short mode")
	}
	run := NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := run.NewCluster(ctx, ClusterOpts{Nodes: 1})
	if err != nil {
		t.Fatal(err)
	}
	n := c.Nodes[0]
	r, err := n.StartRouter("--ipalloc-range", "10.32.0.0/24")
	if err != nil {
		t.Fatal(err)
	}
	if err := n.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	old := map[netip.Addr]string{}
	pods := addPods(t, ctx, n, "old", 6, old)
	for _, p := range pods {
		if err := Ping(ctx, p.NS, p.Gateway); err != nil {
			t.Fatal(err)
		}
	}
	gateway := pods[0].Gateway

	// The state is lost while the router is down; the pods stay.
	if err := r.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(n.StateDir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(n.StateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := r.Restart(); err != nil {
		t.Fatal(err)
	}
	if err := n.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	for ip := range old {
		if line := logLine(n, "re-claimed "+ip.String()+","); line == "" {
			t.Errorf("the router log does not report re-claiming %s", ip)
		}
	}
	if gw := mustReport(t, ctx, n); gw != gateway.String() {
		t.Errorf("the bridge's address changed from %s to %s: the old pods lost their gateway", gateway, gw)
	}

	// New pods never get an old pod's address.
	seen := map[netip.Addr]string{gateway: "the gateway"}
	for ip, p := range old {
		seen[ip] = p
	}
	fresh := addPods(t, ctx, n, "new", 8, seen)
	all := append(append([]*Pod{}, pods[:3]...), fresh[:3]...)
	if m := PingMatrix(ctx, all); !m.AllOK() {
		t.Fatalf("old and new pods after the restart:\n%s", m)
	}
}

// mustReport returns the gateway a node's router reports.
func mustReport(t *testing.T, ctx context.Context, n *Node) string {
	t.Helper()
	var rep struct {
		Router struct {
			Gateway string `json:"gateway"`
		} `json:"router"`
	}
	data, err := n.HTTPGet(ctx, "/report")
	if err == nil {
		err = json.Unmarshal(data, &rep)
	}
	if err != nil {
		t.Fatal(err)
	}
	return rep.Router.Gateway
}

// TestIPAMSplitRings: two pairs of routers claim the range apart (seed=a,b
// and seed=c,d), then join into one mesh. Every router refuses the other
// pair's ring, in a log line that names both seeds and the recovery; the
// rings never mix; pods keep getting unique addresses on each side.
func TestIPAMSplitRings(t *testing.T) {
	if testing.Short() {
		t.Skip("e2e: skipped in -short mode")
	}
	run := NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := run.NewCluster(ctx, ClusterOpts{Nodes: 4})
	if err != nil {
		t.Fatal(err)
	}
	const universe = "10.32.0.0/24"
	u := ipalloc.RangeOf(netip.MustParsePrefix(universe))
	n := c.Nodes
	sides := [][]*Node{{n[0], n[1]}, {n[2], n[3]}}
	seeds := make([]string, 2)
	for i, side := range sides {
		names := []ipalloc.PeerName{ipalloc.PeerName(side[0].PeerName), ipalloc.PeerName(side[1].PeerName)}
		seeds[i] = ipalloc.SeedOf(u, names).String()
		peers := side[0].UnderlayIP.String() + "," + side[1].UnderlayIP.String()
		if i == 1 {
			peers += "," + n[0].UnderlayIP.String() // the mistake: joined to the other pair
		}
		for _, node := range side {
			if _, err := node.StartRouter("--ipalloc-range", universe, "--ipalloc-init", fmt.Sprintf("seed=%s,%s", names[0], names[1]), "--peers", peers); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, node := range n {
		if err := node.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, ctx, "one mesh of four", func() (bool, string) {
		for _, node := range n {
			st := peerStates(ctx, node)
			alive := 0
			for _, s := range st {
				if s == "alive" {
					alive++
				}
			}
			if alive < 3 {
				return false, fmt.Sprintf("%s sees %v", node.Name, st)
			}
		}
		return true, ""
	})
	held := []map[netip.Addr]string{{}, {}}
	for i, side := range sides {
		for _, node := range side {
			addPods(t, ctx, node, "a", 3, held[i])
		}
	}
	// Every router refuses the other ring, naming both seeds and the recovery.
	waitUntil(t, ctx, "every router to refuse the other pair's ring", func() (bool, string) {
		for i, side := range sides {
			for _, node := range side {
				mine, theirs := seeds[i], seeds[1-i]
				if logLine(node, "refused the ring from", "seed "+mine, "seed "+theirs, "docs/ipam.md#split-rings") == "" {
					return false, node.Name + " has not logged the refusal yet"
				}
			}
		}
		return true, ""
	})
	// The rings never mix.
	for _, side := range sides {
		want := []string{side[0].PeerName, side[1].PeerName}
		slices.Sort(want)
		for _, node := range side {
			got, total, err := owners(ctx, node)
			if err != nil || !slices.Equal(got, want) || total < 99.9 {
				t.Errorf("%s's ring is owned by %v (%.1f%%, %v), want only %v", node.Name, got, total, err, want)
			}
			out, err := node.Weft(ctx, "status", "ipam")
			if err != nil || strings.Count(string(out), "IPs (") != 2 {
				t.Errorf("weft status ipam on %s:\n%s (%v)", node.Name, out, err)
			}
		}
	}
	// Both sides keep allocating, each without duplicates.
	for i, side := range sides {
		for _, node := range side {
			addPods(t, ctx, node, "b", 3, held[i])
		}
	}
	for _, node := range n {
		st, _ := node.HTTPGet(ctx, "/status")
		if !strings.Contains(string(st), "Status: ready") {
			t.Errorf("%s: %s", node.Name, st)
		}
	}
}

// TestIPAMReset: weft reset refuses while pods hold addresses; without
// pods, it hands the node's ranges to a live peer, removes the bridge,
// weft's nftables table, the CNI config and the state, and the router
// exits. The others own the whole range, and have stopped listening to it.
func TestIPAMReset(t *testing.T) {
	c, ctx := startMeshCluster(t, 3, "--ipalloc-init", "consensus=3", "--ipalloc-range", "10.32.0.0/24")
	var names []string
	for _, n := range c.Nodes {
		names = append(names, n.PeerName)
	}
	waitUntil(t, ctx, "every router to see the others", func() (bool, string) {
		for _, n := range c.Nodes {
			st := peerStates(ctx, n)
			for _, name := range names {
				if name != n.PeerName && st[name] != "alive" {
					return false, fmt.Sprintf("%s sees %v", n.Name, st)
				}
			}
		}
		return true, ""
	})
	n2 := c.Nodes[2]
	pod, err := n2.AddPod(ctx, "p0")
	if err != nil {
		t.Fatal(err)
	}
	out, err := n2.Weft(ctx, "reset")
	if err == nil || !strings.Contains(string(out), "pods on this node still hold addresses") || !strings.Contains(string(out), "--force") {
		t.Fatalf("weft reset with a pod: %s (%v)", out, err)
	}
	if !n2.Router().Proc().Running() {
		t.Fatal("a refused reset stopped the router")
	}
	if err := n2.RemovePod(ctx, pod); err != nil {
		t.Fatal(err)
	}
	out, err = n2.Weft(ctx, "reset")
	if err != nil || !strings.Contains(string(out), "which has saved them") || !strings.Contains(string(out), "the router has exited") {
		t.Fatalf("weft reset: %s (%v)", out, err)
	}
	if err := n2.Router().Proc().Wait(); err != nil {
		t.Errorf("the router exited with %v after reset", err)
	}
	// What the router made on the node is gone.
	err = n2.NS.WithHandle(func(h *netlink.Handle) error {
		_, err := h.LinkByName(routerBridge)
		return err
	})
	var notFound netlink.LinkNotFoundError
	if !errors.As(err, &notFound) {
		t.Errorf("bridge %s after reset: %v", routerBridge, err)
	}
	if tables, err := n2.NS.Exec(ctx, "nft", "list", "tables"); err != nil || strings.Contains(string(tables), "weft") {
		t.Errorf("nftables after reset: %s (%v)", tables, err)
	}
	for _, f := range []string{filepath.Join(n2.CNIConfDir, ConfListFile), filepath.Join(n2.StateDir, state.FileName), n2.Socket} {
		if _, err := os.Stat(f); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after reset: %v", f, err)
		}
	}
	// The others own everything, and the heir has removed n2 everywhere.
	want := []string{names[0], names[1]}
	slices.Sort(want)
	waitUntil(t, ctx, "n2's ranges owned by the others in every view", func() (bool, string) {
		for _, n := range c.Nodes[:2] {
			got, total, err := owners(ctx, n)
			if err != nil || !slices.Equal(got, want) || total < 99.9 {
				return false, fmt.Sprintf("%s: %v %.1f%% %v", n.Name, got, total, err)
			}
		}
		return true, ""
	})
	heir := ""
	for _, n := range c.Nodes[:2] {
		if logLine(n, n2.PeerName+" left the cluster (weft reset) and handed its ranges to this peer") != "" {
			heir = n.Name
		}
	}
	if heir == "" {
		t.Fatal("no router logged taking n2's ranges")
	}
	waitUntil(t, ctx, "the heir to have every live peer stop listening to n2", func() (bool, string) {
		n := c.Node(heir)
		return logLine(n, "every live peer has stopped listening to "+n2.PeerName) != "", heir + " has not logged it yet"
	})
	// The survivors keep handing out unique addresses.
	seen := map[netip.Addr]string{}
	for _, n := range c.Nodes[:2] {
		addPods(t, ctx, n, "q", 3, seen)
	}
}
