package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/weft-net/weft/api"
)

// ipamReport is the part of /report these tests read.
type ipamReport struct {
	IPAM struct {
		Status string `json:"status"`
		Owners []struct {
			Peer    string  `json:"peer"`
			Size    uint64  `json:"size"`
			Percent float64 `json:"percent"`
		} `json:"owners"`
	} `json:"ipam"`
}

func ipamOf(ctx context.Context, n *Node) (ipamReport, error) {
	var rep ipamReport
	data, err := n.HTTPGet(ctx, "/report")
	if err != nil {
		return rep, err
	}
	return rep, json.Unmarshal(data, &rep)
}

// TestIPAMThreeNodes: three routers with consensus=3 share the ring about
// evenly; pods beyond one node's share get space by donation, all unique;
// a node killed and removed with weft rmpeer has its ranges taken over; a
// node restarted keeps every allocation.
func TestIPAMThreeNodes(t *testing.T) {
	const universe = "10.32.0.0/26" // 64 addresses: about 21 each
	c, ctx := startMeshCluster(t, 3, "--ipalloc-init", "consensus=3", "--ipalloc-range", universe)
	// About a third each, the same ring everywhere.
	waitUntil(t, ctx, "three owners of about a third each in every view", func() (bool, string) {
		var seen []string
		for _, n := range c.Nodes {
			rep, err := ipamOf(ctx, n)
			seen = append(seen, fmt.Sprintf("%s:%+v %v", n.Name, rep.IPAM.Owners, err))
			if err != nil || len(rep.IPAM.Owners) != 3 || rep.IPAM.Status != "ready" {
				return false, strings.Join(seen, " ")
			}
			for _, o := range rep.IPAM.Owners {
				if o.Percent < 25 || o.Percent > 42 {
					return false, strings.Join(seen, " ")
				}
			}
		}
		return true, ""
	})
	if out, err := c.Nodes[0].Weft(ctx, "status", "ipam"); err != nil || strings.Count(string(out), "IPs (") != 3 {
		t.Fatalf("weft status ipam:\n%s (%v)", out, err)
	}

	// 30 pods on n0, more than its share: donations, unique addresses.
	holders := map[netip.Addr]string{}
	var pods []*Pod
	for i := range 30 {
		p, err := c.Nodes[0].AddPod(ctx, fmt.Sprintf("d%02d", i))
		if err != nil {
			t.Fatalf("pod %d beyond the node's share: %v", i, err)
		}
		if h, dup := holders[p.IP]; dup {
			t.Fatalf("%s and %s both hold %s", h, p, p.IP)
		}
		holders[p.IP] = p.String()
		pods = append(pods, p)
	}
	for _, n := range c.Nodes[1:] {
		for i := range 3 {
			p, err := n.AddPod(ctx, fmt.Sprintf("e%d", i))
			if err != nil {
				t.Fatal(err)
			}
			if h, dup := holders[p.IP]; dup {
				t.Fatalf("%s and %s both hold %s", h, p, p.IP)
			}
			holders[p.IP] = p.String()
			pods = append(pods, p)
		}
	}
	if m := PingMatrix(ctx, pods[:10]); !m.AllOK() {
		t.Fatalf("pods on n0 after donations:\n%s", m)
	}

	// Restart n1 hard: every allocation survives.
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
	cl := api.NewClient(n1.Socket)
	for _, p := range n1.Pods() {
		a, err := cl.Lookup(ctx, api.Attachment{ContainerID: p.ContainerID, IfName: p.IfName})
		if err != nil || a.Address != p.Prefix {
			t.Fatalf("after kill -9 and restart %s holds %+v (%v), want %s", p, a, err, p.Prefix)
		}
	}

	// Kill n2 for good and remove it on n0: its ranges are taken over.
	n2 := c.Nodes[2]
	if err := n2.Router().Kill(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, "n2 unreachable on n0", func() (bool, string) {
		st := peerStates(ctx, c.Nodes[0])
		return st[n2.PeerName] == "unreachable", fmt.Sprint(st)
	})
	if out, err := c.Nodes[0].Weft(ctx, "status", "ipam"); err != nil || !strings.Contains(string(out), "unreachable!") {
		t.Errorf("weft status ipam does not mark the dead owner:\n%s (%v)", out, err)
	}
	out, err := c.Nodes[0].Weft(ctx, "rmpeer", n2.Name)
	if err != nil || !strings.Contains(string(out), "rmpeer of "+n2.PeerName) {
		t.Fatalf("weft rmpeer %s: %s (%v)", n2.Name, out, err)
	}
	waitUntil(t, ctx, "n2's ranges taken over in every live view", func() (bool, string) {
		var seen []string
		for _, n := range c.Nodes[:2] {
			rep, err := ipamOf(ctx, n)
			seen = append(seen, fmt.Sprintf("%s:%+v %v", n.Name, rep.IPAM.Owners, err))
			if err != nil {
				return false, strings.Join(seen, " ")
			}
			var total float64
			for _, o := range rep.IPAM.Owners {
				if o.Peer == n2.PeerName {
					return false, strings.Join(seen, " ")
				}
				total += o.Percent
			}
			if total < 99.9 {
				return false, strings.Join(seen, " ")
			}
		}
		return true, ""
	})
	logText, _ := os.ReadFile(c.Nodes[0].RouterLog)
	if !strings.Contains(string(logText), "rmpeer of "+n2.PeerName) || !strings.Contains(string(logText), "taken over") {
		t.Errorf("n0's log does not report the takeover")
	}
	// The survivors still hand out unique addresses.
	for i := range 5 {
		p, err := c.Nodes[0].AddPod(ctx, fmt.Sprintf("f%d", i))
		if err != nil {
			t.Fatal(err)
		}
		if h, dup := holders[p.IP]; dup && !strings.HasPrefix(h, n2.Name+"/") {
			t.Fatalf("%s and %s both hold %s", h, p, p.IP)
		}
		holders[p.IP] = p.String()
	}
}
