package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// connReport is the part of /report about data paths.
type connReport struct {
	Router struct {
		Connections []struct {
			Peer string `json:"peer"`
			Mode string `json:"mode"`
			Path string `json:"path"` // the vxlan path's health
		} `json:"connections"`
	} `json:"router"`
}

// dataModes maps peer name to the data path node n uses to it.
func dataModes(ctx context.Context, n *Node) (map[string]string, error) {
	data, err := n.HTTPGet(ctx, "/report")
	if err != nil {
		return nil, err
	}
	var rep connReport
	if err := json.Unmarshal(data, &rep); err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, c := range rep.Router.Connections {
		if c.Peer != "" {
			out[c.Peer] = c.Mode
		}
	}
	return out, nil
}

// waitModes waits until every node sends to every other node with mode.
func waitModes(t *testing.T, ctx context.Context, c *Cluster, mode string) {
	t.Helper()
	waitUntil(t, ctx, "every node sending to every other with "+mode, func() (bool, string) {
		var seen []string
		ok := true
		for _, n := range c.Nodes {
			m, err := dataModes(ctx, n)
			seen = append(seen, fmt.Sprintf("%s:%v %v", n.Name, m, err))
			for _, o := range c.Nodes {
				if o != n && m[o.PeerName] != mode {
					ok = false
				}
			}
		}
		return ok, strings.Join(seen, " ")
	})
}

// pingAll checks that every pod reaches every other pod and every node's
// bridge, and fails the test with the matrix otherwise.
func pingAll(t *testing.T, ctx context.Context, c *Cluster, pods []*Pod) {
	t.Helper()
	m := PingMatrix(ctx, pods)
	if !m.AllOK() {
		t.Fatalf("pods do not all reach each other:\n%s\nfailures: %v\n%s", m, m.Failures(), routerLogs(c))
	}
	var failed []string
	for _, n := range c.Nodes {
		gw, err := n.Gateway(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pods {
			if err := Ping(ctx, p.NS, gw); err != nil {
				failed = append(failed, fmt.Sprintf("%s -> node %s (%s)", p, n.Name, gw))
			}
		}
	}
	if len(failed) > 0 {
		t.Fatalf("pods do not reach every node: %v\n%s", failed, routerLogs(c))
	}
}

func routerLogs(c *Cluster) string {
	var b strings.Builder
	for _, n := range c.Nodes {
		if r := n.Router(); r != nil {
			fmt.Fprintf(&b, "--- %s router log (tail):\n%s\n", n.Name, r.LogTail(30))
		}
	}
	return b.String()
}

// transfer sends size pseudo-random bytes over TCP from pod from to pod to
// and checks that the same bytes arrive (by SHA-256 and length).
func transfer(ctx context.Context, from, to *Pod, size int64) error {
	var ln net.Listener
	if err := to.NS.Do(func() (err error) {
		ln, err = net.Listen("tcp", netip.AddrPortFrom(to.IP, 5201).String())
		return err
	}); err != nil {
		return fmt.Errorf("listening in %s: %w", to, err)
	}
	defer ln.Close()
	type result struct {
		sum [32]byte
		n   int64
		err error
	}
	got := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- result{err: err}
			return
		}
		defer c.Close()
		h := sha256.New()
		n, err := io.Copy(h, c)
		got <- result{sum: [32]byte(h.Sum(nil)), n: n, err: err}
	}()
	var c net.Conn
	if err := from.NS.Do(func() (err error) {
		d := net.Dialer{Timeout: 10 * time.Second}
		c, err = d.DialContext(ctx, "tcp", netip.AddrPortFrom(to.IP, 5201).String())
		return err
	}); err != nil {
		return fmt.Errorf("connecting from %s to %s: %w", from, to, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	src := rand.NewChaCha8([32]byte{1, 2, 3})
	h := sha256.New()
	n, err := io.Copy(c, io.TeeReader(io.LimitReader(src, size), h))
	c.Close()
	if err != nil {
		return fmt.Errorf("sending from %s to %s after %d bytes: %w", from, to, n, err)
	}
	select {
	case r := <-got:
		if r.err != nil {
			return fmt.Errorf("receiving in %s: %w", to, r.err)
		}
		if r.n != size || !bytes.Equal(r.sum[:], h.Sum(nil)) {
			return fmt.Errorf("%s received %d bytes (sha256 %x), %s sent %d (sha256 %x)", to, r.n, r.sum[:8], from, size, h.Sum(nil)[:8])
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// TestDataplane: three nodes with three pods each, for each of udp and
// ipip: every pod reaches every other pod and every node, 100 MB cross a
// node boundary intact, and a router restarted keeps its pods reachable.
func TestDataplane(t *testing.T) {
	for _, mode := range []string{"udp", "ipip"} {
		t.Run(mode, func(t *testing.T) {
			c, ctx := startMeshCluster(t, 3, "--encap", mode)
			waitModes(t, ctx, c, mode)
			var pods []*Pod
			for _, n := range c.Nodes {
				for i := range 3 {
					p, err := n.AddPod(ctx, fmt.Sprintf("p%d", i))
					if err != nil {
						t.Fatal(err)
					}
					pods = append(pods, p)
				}
			}
			pingAll(t, ctx, c, pods)

			tctx, cancel := context.WithTimeout(ctx, 90*time.Second)
			defer cancel()
			start := time.Now()
			if err := transfer(tctx, pods[0], pods[len(pods)-1], 100<<20); err != nil {
				t.Fatalf("100 MB from %s to %s: %v\n%s", pods[0], pods[len(pods)-1], err, routerLogs(c))
			}
			t.Logf("%s: 100 MB from %s to %s intact in %v", mode, pods[0], pods[len(pods)-1], time.Since(start).Round(time.Millisecond))

			// A router restarted (killed, as a crash would) keeps its pods
			// reachable once it is back.
			n1 := c.Nodes[1]
			if err := n1.Router().Kill(); err != nil {
				t.Fatal(err)
			}
			if err := n1.Router().Restart(); err != nil {
				t.Fatal(err)
			}
			if err := n1.WaitReady(ctx); err != nil {
				t.Fatal(err)
			}
			waitModes(t, ctx, c, mode)
			pingAll(t, ctx, c, pods)
		})
	}
}

// TestDataplaneDonation: addresses that a node got by donation, from a
// range another node owned when the ring was first split, are reachable
// from every other node once the ring has moved on.
func TestDataplaneDonation(t *testing.T) {
	const universe = "10.32.0.0/26" // 64 addresses: about 21 each
	c, ctx := startMeshCluster(t, 3, "--ipalloc-init", "consensus=3", "--ipalloc-range", universe)
	first := map[string][]string{} // node -> owned CIDRs at the start
	for _, n := range c.Nodes {
		data, err := n.HTTPGet(ctx, "/report")
		if err != nil {
			t.Fatal(err)
		}
		var rep struct {
			IPAM struct {
				Owned []string `json:"owned"`
			} `json:"ipam"`
		}
		if err := json.Unmarshal(data, &rep); err != nil {
			t.Fatal(err)
		}
		first[n.Name] = rep.IPAM.Owned
	}
	ownedAtStart := func(node string, a netip.Addr) bool {
		for _, s := range first[node] {
			if p, err := netip.ParsePrefix(s); err == nil && p.Contains(a) {
				return true
			}
		}
		return false
	}
	var moved, pods []*Pod
	for i := range 30 {
		p, err := c.Nodes[0].AddPod(ctx, fmt.Sprintf("d%02d", i))
		if err != nil {
			t.Fatalf("pod %d beyond n0's share: %v", i, err)
		}
		pods = append(pods, p)
		if !ownedAtStart("n0", p.IP) {
			moved = append(moved, p)
		}
	}
	if len(moved) == 0 {
		t.Fatalf("no pod of n0 got an address from donated space; n0 owned %v at the start", first["n0"])
	}
	var remote []*Pod
	for _, n := range c.Nodes[1:] {
		p, err := n.AddPod(ctx, "r0")
		if err != nil {
			t.Fatal(err)
		}
		remote = append(remote, p)
	}
	var failed []string
	for _, from := range remote {
		for _, to := range moved {
			if err := Ping(ctx, from.NS, to.IP); err != nil {
				failed = append(failed, fmt.Sprintf("%s -> %s (%s)", from, to, to.IP))
			}
			if err := Ping(ctx, to.NS, from.IP); err != nil {
				failed = append(failed, fmt.Sprintf("%s (%s) -> %s", to, to.IP, from))
			}
		}
	}
	if len(failed) > 0 {
		t.Fatalf("%d of %d moved addresses unreachable: %v\n%s", len(failed), 2*len(moved)*len(remote), failed, routerLogs(c))
	}
	t.Logf("%d pods of n0 hold addresses from donated space; all reachable from n1 and n2", len(moved))
}
