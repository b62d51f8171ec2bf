package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// meshReport is the part of /report these tests read.
type meshReport struct {
	Router struct {
		Mesh struct {
			Name  string `json:"name"`
			Peers []struct {
				Name  string `json:"name"`
				State string `json:"state"`
			} `json:"peers"`
		} `json:"mesh"`
	} `json:"router"`
}

// report fetches a node's /report.
func report(ctx context.Context, n *Node) (meshReport, error) {
	var rep meshReport
	data, err := n.HTTPGet(ctx, "/report")
	if err != nil {
		return rep, err
	}
	return rep, json.Unmarshal(data, &rep)
}

// peerStates maps peer name to state as node n sees them.
func peerStates(ctx context.Context, n *Node) map[string]string {
	rep, err := report(ctx, n)
	if err != nil {
		return map[string]string{"error": err.Error()}
	}
	out := map[string]string{}
	for _, p := range rep.Router.Mesh.Peers {
		out[p.Name] = p.State
	}
	return out
}

// waitUntil polls cond until it holds or ctx ends (WaitUntil).
func waitUntil(t *testing.T, ctx context.Context, what string, cond func() (bool, string)) {
	t.Helper()
	WaitUntil(t, ctx, what, cond)
}

// TestMeshThreeNodes: three routers in three node namespaces joined over the
// veth underlay reach Peers: 3 everywhere; a router killed is reported
// unreachable and rejoins under the same name when restarted; a partition
// of the underlay heals by itself.
func TestMeshThreeNodes(t *testing.T) {
	c, ctx := startMeshCluster(t, 3)
	names := map[string]bool{}
	for _, n := range c.Nodes {
		names[n.PeerName] = true
	}
	allAlive := func(nodes ...*Node) func() (bool, string) {
		return func() (bool, string) {
			var seen []string
			for _, n := range nodes {
				st := peerStates(ctx, n)
				seen = append(seen, fmt.Sprintf("%s:%v", n.Name, st))
				alive := 0
				for name, s := range st {
					if names[name] && s == "alive" {
						alive++
					}
				}
				if alive != len(names) {
					return false, strings.Join(seen, " ")
				}
			}
			return true, ""
		}
	}
	waitUntil(t, ctx, "all three peers alive in every view", allAlive(c.Nodes...))
	for _, n := range c.Nodes {
		text, err := n.HTTPGet(ctx, "/status")
		if err != nil || !strings.Contains(string(text), "Peers: 3") || !strings.Contains(string(text), "Connections: 2 (2 established)") {
			t.Fatalf("%s /status:\n%s (%v)", n.Name, text, err)
		}
		out, err := n.Weft(ctx, "status", "peers")
		if err != nil || strings.Count(string(out), "alive") != 3 {
			t.Fatalf("%s weft status peers:\n%s (%v)", n.Name, out, err)
		}
		if out, err := n.Weft(ctx, "status", "connections"); err != nil || strings.Count(string(out), "established") != 2 {
			t.Fatalf("%s weft status connections:\n%s (%v)", n.Name, out, err)
		}
	}

	// Kill one: the others report it unreachable.
	victim := c.Nodes[1]
	others := []*Node{c.Nodes[0], c.Nodes[2]}
	if err := victim.Router().Kill(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, victim.Name+" unreachable in the others' views", func() (bool, string) {
		var seen []string
		for _, n := range others {
			st := peerStates(ctx, n)
			seen = append(seen, fmt.Sprintf("%s:%v", n.Name, st))
			if st[victim.PeerName] != "unreachable" {
				return false, strings.Join(seen, " ")
			}
		}
		return true, ""
	})
	// Restarted, it rejoins under the same name.
	if err := victim.Router().Restart(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, "the restarted peer alive again everywhere", allAlive(c.Nodes...))
	if rep, err := report(ctx, victim); err != nil || rep.Router.Mesh.Name != victim.PeerName {
		t.Fatalf("restarted peer calls itself %q (%v), want %q", rep.Router.Mesh.Name, err, victim.PeerName)
	}

	// Partition: cut n2's underlay link; the others lose it, it loses them.
	cut := c.Nodes[2]
	if _, err := c.Underlay.Exec(ctx, "ip", "link", "set", "u-"+cut.Name, "down"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, "the partition seen on both sides", func() (bool, string) {
		a, b := peerStates(ctx, c.Nodes[0]), peerStates(ctx, cut)
		return a[cut.PeerName] == "unreachable" && b[c.Nodes[0].PeerName] == "unreachable", fmt.Sprintf("%v / %v", a, b)
	})
	// Heal: no operator action, the views converge again.
	if _, err := c.Underlay.Exec(ctx, "ip", "link", "set", "u-"+cut.Name, "up"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, "the mesh healed after the partition", allAlive(c.Nodes...))
}
