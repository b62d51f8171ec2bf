package router

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/mesh/meshtest"
	"github.com/weft-net/weft/tunnel/conn/bindtest"
)

// TestInProcessKubeReclaimOnPeerLoss: a Node deleted while its router
// still answers in the mesh (the usual order when a node dies: the Node
// goes, the mesh needs seconds to declare the peer dead) is reclaimed once
// the mesh declares the peer gone, without waiting for the next resync
// pass: here the resync is an hour, so the mesh's news is the only thing
// that can start the pass. Before, the reclaim waited for the resync (a
// minute in a real router: 24-46 s measured in make e2e-kube).
func TestInProcessKubeReclaimOnPeerLoss(t *testing.T) {
	const universe = "10.42.0.0/20"
	hosts := []string{"10.99.0.1", "10.99.0.2", "10.99.0.3"}
	client := casClientset()
	ctx := context.Background()
	for i, h := range hosts {
		node := &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("n%d", i+1)},
			Status:     corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: h}}},
		}
		if _, err := client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	gossip, under := meshtest.NewNetwork(), bindtest.NewNetwork()
	srcDir := t.TempDir()
	for _, p := range cniPlugins {
		if err := os.WriteFile(filepath.Join(srcDir, p), []byte("#!/bin/sh\n# "+p+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	defer hc.CloseIdleConnections()

	nodes := make([]*inprocNode, len(hosts))
	for i, h := range hosts {
		dir := t.TempDir()
		c := Defaults()
		c.Name, c.Nickname, c.Host = fmt.Sprintf("r%d", i+1), fmt.Sprintf("node%d", i+1), h
		c.Kube, c.NodeName, c.KubeNamespace = true, fmt.Sprintf("n%d", i+1), "kube-system"
		c.IPAllocRange, c.HTTPAddr, c.LogLevel = universe, "127.0.0.1:0", "debug"
		c.StateDir, c.Socket, c.CNIBinDir, c.CNIConfDir = dir+"/state", dir+"/weft.sock", dir+"/bin", dir+"/conf"
		c.Bridge = "weft-inproc"
		v, err := c.Validate()
		if err != nil {
			t.Fatal(err)
		}
		n := &inprocNode{name: c.Name, cfg: v, kernel: &fakeKernel{host: netip.MustParseAddr(h), under: under}, api: api.NewClient(c.Socket), log: &syncBuffer{}}
		tr, err := gossip.NewTransport(h + ":6783")
		if err != nil {
			t.Fatal(err)
		}
		n.node, err = build(ctx, n.cfg, slog.New(slog.NewTextHandler(n.log, &slog.HandlerOptions{Level: slog.LevelDebug})).With("node", n.name), n.kernel,
			seams{cniSrcDir: srcDir, gossip: tr, meshTimings: inprocTimings(), kubeClient: client, kubeResync: time.Hour})
		if err != nil {
			t.Fatalf("%s: Build: %v", n.name, err)
		}
		n.status = n.node.statusLn.Addr().String()
		nodes[i] = n
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range nodes {
				t.Logf("log of %s:\n%s", n.name, n.log.String())
			}
		}
	})
	stopped := map[*inprocNode]bool{}
	for _, n := range nodes {
		rctx, cancel := context.WithCancel(context.Background())
		n.cancel, n.done = cancel, make(chan error, 1)
		go func() { n.done <- n.node.Run(rctx) }()
	}
	defer func() {
		for _, n := range nodes {
			if !stopped[n] {
				n.cancel()
				<-n.done
			}
		}
	}()
	for _, n := range nodes {
		waitUntil(t, n.name+" to be ready", func() bool { return n.api.Ready(ctx) == nil })
	}
	k := nodes[0].node.kube
	waitUntil(t, "one ring with three owners and three registered peers", func() bool {
		a, b, c := nodes[0].report(t, hc), nodes[1].report(t, hc), nodes[2].report(t, hc)
		peers, err := k.Peers(ctx)
		return err == nil && len(peers) == 3 && a.IPAM.Seed != "none" && len(a.IPAM.Owners) == 3 &&
			slices.Equal(a.IPAM.Entries, b.IPAM.Entries) && slices.Equal(a.IPAM.Entries, c.IPAM.Entries)
	})

	// n3's Node goes while r3 still runs: both others leave it alone.
	if err := client.CoreV1().Nodes().Delete(ctx, "n3", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes[:2] {
		waitUntil(t, n.name+" to leave the live r3 alone", func() bool {
			return strings.Contains(n.log.String(), "node n3 deleted, but peer r3 still answers in the mesh")
		})
	}
	// Then r3 dies: the mesh's news starts the pass.
	nodes[2].stop(t)
	stopped[nodes[2]] = true
	waitUntil(t, "r1 and r2 to own the whole ring without r3", func() bool {
		a, b := nodes[0].report(t, hc), nodes[1].report(t, hc)
		if !slices.Equal(a.IPAM.Entries, b.IPAM.Entries) {
			return false
		}
		var total uint64
		for _, o := range a.IPAM.Owners {
			if o.Peer == "r3" && o.Size > 0 {
				return false
			}
			total += o.Size
		}
		return total == 1<<(32-20)
	})
	reclaimers := 0
	for _, n := range nodes[:2] {
		reclaimers += strings.Count(n.log.String(), "node of peer r3 deleted: reclaiming its ranges")
	}
	if reclaimers != 1 {
		t.Errorf("%d reclaims of r3, want exactly 1", reclaimers)
	}
}
