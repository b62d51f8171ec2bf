package policy_test

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/weft-net/weft/policy"
	"github.com/weft-net/weft/policy/policytest"
)

// The random worlds come from policytest, which package bridge's tests of
// the kernel's enforcement draw from too; so these tests live outside
// package policy (policytest imports it).

var (
	worlds = flag.Int("policy.worlds", 400, "random worlds TestCompileMatchesModel checks")
	seed0  = flag.Uint64("policy.seed", 0, "first seed of TestCompileMatchesModel (replay a failure with -policy.seed=N -policy.worlds=1)")
)

// randWorld makes a small random cluster: 3 to 8 pods, at random
// addresses of two /24s, on three nodes.
func randWorld(r *rand.Rand) *policy.World {
	spots := make([]policytest.Spot, 3+r.IntN(6))
	for i := range spots {
		spots[i] = policytest.Spot{IP: netip.AddrFrom4([4]byte{10, 32, byte(r.IntN(2)), byte(2 + i)}), Node: fmt.Sprintf("n%d", r.IntN(3))}
	}
	return policytest.World(r, spots, 5)
}

// compiledAllowedIn evaluates c as the nodes would, egress on the
// source's node and ingress on the destination's, with the nodes' rules
// cached in nodes.
func compiledAllowedIn(w *policy.World, nodes map[string]*policy.NodeRules, c policy.Conn) bool {
	rules := func(n string) *policy.NodeRules {
		if nodes[n] == nil {
			nodes[n] = policy.Compile(w, n)
		}
		return nodes[n]
	}
	ok := true
	for _, x := range w.Pods {
		if x.IP == c.Src {
			ok = ok && rules(x.Node).Egress(c)
		}
		if x.IP == c.Dst {
			ok = ok && rules(x.Node).Ingress(c)
		}
	}
	return ok
}

// TestCompileMatchesModel: for random worlds, the compiled rules of the
// nodes allow exactly what the model allows, for every pair of pods and
// some outside addresses, over protocols and ports the policies name.
func TestCompileMatchesModel(t *testing.T) {
	n := *worlds
	if testing.Short() {
		n = 50
	}
	addrs := []netip.Addr{netip.MustParseAddr("192.0.2.9"), netip.MustParseAddr("10.32.0.4"), netip.MustParseAddr("10.32.1.5"), netip.MustParseAddr("8.8.8.8")}
	var checked, allowed int
	for s := *seed0; s < *seed0+uint64(n); s++ {
		w := randWorld(rand.New(rand.NewPCG(s, 0x9e3779b9)))
		nodes := map[string]*policy.NodeRules{}
		all := append([]netip.Addr{}, addrs...)
		for _, x := range w.Pods {
			all = append(all, x.IP)
		}
		for _, src := range all {
			for _, dst := range all {
				if src == dst {
					continue
				}
				for _, proto := range []corev1.Protocol{corev1.ProtocolTCP, corev1.ProtocolUDP} {
					for _, port := range []uint16{53, 55, 80, 8080, 9} {
						for _, fromNode := range []bool{false, true} {
							c := policy.Conn{Src: src, Dst: dst, Protocol: proto, Port: port, FromNode: fromNode}
							want := policy.Allowed(w, c)
							if got := compiledAllowedIn(w, nodes, c); got != want {
								t.Fatalf("seed %d: %s (from node %v): compiled rules allow=%v, the model %v\nworld: %+v", s, c, fromNode, got, want, w)
							}
							checked++
							if want {
								allowed++
							}
						}
					}
				}
			}
		}
	}
	t.Logf("%d worlds, %d connections checked, %d allowed", n, checked, allowed)
	if allowed == 0 || allowed == checked {
		t.Fatalf("the worlds are degenerate: %d of %d allowed", allowed, checked)
	}
}

// FuzzCompileMatchesModel explores seeds of random worlds beyond the test's.
func FuzzCompileMatchesModel(f *testing.F) {
	f.Add(uint64(1), uint16(80))
	f.Fuzz(func(t *testing.T, s uint64, port uint16) {
		w := randWorld(rand.New(rand.NewPCG(s, 1)))
		nodes := map[string]*policy.NodeRules{}
		for _, src := range w.Pods {
			for _, dst := range w.Pods {
				c := policy.Conn{Src: src.IP, Dst: dst.IP, Protocol: corev1.ProtocolTCP, Port: port}
				if src.IP != dst.IP && policy.Allowed(w, c) != compiledAllowedIn(w, nodes, c) {
					t.Fatalf("seed %d: %s: compiled and model differ", s, c)
				}
			}
		}
	})
}

// TestOriginsSharePeers: in random worlds, the rules of one node that
// come from the same rule of a policy (Rule.From) have the same peers,
// whichever pod they are for, so that an enforcer may keep one set of
// peers for them; every compiled rule says where it comes from, and no
// two rules of one pod in one direction come from the same place.
func TestOriginsSharePeers(t *testing.T) {
	shared := 0
	for s := range uint64(400) {
		w := randWorld(rand.New(rand.NewPCG(s, 0x9e3779b9)))
		for _, node := range []string{"n0", "n1", "n2"} {
			nr := policy.Compile(w, node)
			peers := map[policy.Origin][]policy.Interval{}
			for _, pr := range nr.Pods {
				for _, d := range []policy.Direction{pr.Ingress, pr.Egress} {
					seen := map[policy.Origin]bool{}
					for _, r := range d.Rules {
						if r.From.IsZero() {
							t.Fatalf("seed %d: pod %s: a rule without its origin: %+v", s, pr.IP, r)
						}
						if seen[r.From] {
							t.Fatalf("seed %d: pod %s: two rules from %s", s, pr.IP, r.From)
						}
						seen[r.From] = true
						if p, ok := peers[r.From]; ok {
							if fmt.Sprint(p) != fmt.Sprint(r.Peers) {
								t.Fatalf("seed %d: rules from %s with peers %v and %v", s, r.From, p, r.Peers)
							}
							shared++
						}
						peers[r.From] = r.Peers
					}
				}
			}
		}
	}
	if shared == 0 {
		t.Fatal("no two rules came from the same place: the test proves nothing")
	}
	t.Logf("%d rules had the peers of another pod's rule from the same place", shared)
}

// TestIsolatingPolicies: in random worlds, a pod's direction names the
// policies that isolate it there (what a blocked connection is blocked
// by): some exactly when it is isolated, each once, in the World's order,
// and every rule comes from one of them.
func TestIsolatingPolicies(t *testing.T) {
	named := 0
	for s := range uint64(400) {
		w := randWorld(rand.New(rand.NewPCG(s, 0x9e3779b9)))
		order := map[string]int{}
		for i, p := range w.Policies {
			order[p.Namespace+"/"+p.Name] = i
		}
		for _, node := range []string{"n0", "n1", "n2"} {
			for _, pr := range policy.Compile(w, node).Pods {
				for _, d := range []policy.Direction{pr.Ingress, pr.Egress} {
					if d.Isolated != (len(d.Policies) > 0) {
						t.Fatalf("seed %d: pod %s: isolated %v by %v", s, pr.IP, d.Isolated, d.Policies)
					}
					for i, name := range d.Policies {
						k, ok := order[name]
						if !ok || (i > 0 && k <= order[d.Policies[i-1]]) {
							t.Fatalf("seed %d: pod %s: policies %v: not the World's, once each, in its order", s, pr.IP, d.Policies)
						}
					}
					for _, r := range d.Rules {
						if !slices.Contains(d.Policies, r.From.Policy) {
							t.Fatalf("seed %d: pod %s: a rule from %s, not one of its isolating policies %v", s, pr.IP, r.From.Policy, d.Policies)
						}
					}
					named += len(d.Policies)
				}
			}
		}
	}
	if named == 0 {
		t.Fatal("no pod was isolated: the test proves nothing")
	}
}

// TestPeerJoiningKeepsRules: in random worlds, a pod more (on another
// node, so that it is only ever a peer here) changes the peers of the
// node's rules, never which rules a pod has (their origins, in order),
// but for a named port of an egress rule that the new pod is the first
// to resolve to its ports: an enforcer changes sets, not chains.
func TestPeerJoiningKeepsRules(t *testing.T) {
	changed := 0
	for s := range uint64(400) {
		r := rand.New(rand.NewPCG(s, 0x9e3779b9))
		w := randWorld(r)
		before := policy.Compile(w, "n0")
		more := *w
		x := w.Pods[r.IntN(len(w.Pods))] // its ports
		x.Name, x.IP, x.Node = "joiner", netip.MustParseAddr("10.32.2.9"), "n9"
		x.Namespace = []string{"a", "b", "c"}[r.IntN(3)]
		x.Labels = map[string]string{}
		for _, k := range []string{"app", "tier"} {
			if r.IntN(3) > 0 {
				x.Labels[k] = []string{"x", "y", "z"}[r.IntN(3)]
			}
		}
		more.Pods = append(slices.Clone(w.Pods), x)
		after := policy.Compile(&more, "n0")
		origins := func(d policy.Direction) (out []policy.Origin) {
			for _, r := range d.Rules {
				if r.From.NamedPorts == "" || fmt.Sprint(r.Peers) != fmt.Sprint([]policy.Interval{{Lo: x.IP, Hi: x.IP}}) {
					out = append(out, r.From)
				}
			}
			return out
		}
		for a, pb := range before.Pods {
			pa := after.Pods[a]
			if pa.Ingress.Isolated != pb.Ingress.Isolated || pa.Egress.Isolated != pb.Egress.Isolated ||
				!slices.Equal(origins(pa.Ingress), origins(pb.Ingress)) || !slices.Equal(origins(pa.Egress), origins(pb.Egress)) {
				t.Fatalf("seed %d: pod %s: a pod more elsewhere changed its rules:\n%+v\n%+v", s, a, pb, pa)
			}
			if fmt.Sprint(pa) != fmt.Sprint(pb) {
				changed++
			}
		}
	}
	if changed == 0 {
		t.Fatal("no pod more changed any rule's peers: the test proves nothing")
	}
	t.Logf("%d pods' rules changed their peers", changed)
}
