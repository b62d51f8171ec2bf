package bridge

import (
	"encoding/binary"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/weft-net/weft/policy"
	"github.com/weft-net/weft/policy/policytest"
)

// randPolicyWorld makes a random cluster (policytest.World, as package
// policy's tests do) with pods local (on node n0) and remote (on n1) at
// the given addresses.
func randPolicyWorld(r *rand.Rand, local, remote []netip.Addr) *policy.World {
	var spots []policytest.Spot
	for _, a := range local {
		spots = append(spots, policytest.Spot{IP: a, Node: "n0"})
	}
	for _, a := range remote {
		spots = append(spots, policytest.Spot{IP: a, Node: "n1"})
	}
	return policytest.World(r, spots, 6)
}

var (
	testLocal  = []netip.Addr{netip.MustParseAddr("10.32.0.2"), netip.MustParseAddr("10.32.0.3"), netip.MustParseAddr("10.32.0.4"), netip.MustParseAddr("10.32.0.5")}
	testRemote = []netip.Addr{netip.MustParseAddr("10.32.1.5"), netip.MustParseAddr("10.32.1.6")}
	testOther  = []netip.Addr{netip.MustParseAddr("192.0.2.9"), netip.MustParseAddr("198.51.100.7"), netip.MustParseAddr("10.32.0.9")}
)

func randNodeRules(seed uint64) *policy.NodeRules {
	w := randPolicyWorld(rand.New(rand.NewPCG(seed, 0x5eed)), testLocal, testRemote)
	return policy.Compile(w, "n0")
}

func mustWant(t testing.TB, nr *policy.NodeRules) *polWant {
	t.Helper()
	w, err := wantPolicy(nr)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// evalWant is what the kernel does with a packet that opens connection c
// in the table's state w: the egress chain of the source, if its map has
// it, then the ingress chain of the destination. Each chain returns at
// the first rule whose sets hold the peer and the protocol and port, and
// drops at its end.
func evalWant(w *polWant, c policy.Conn) bool {
	proto, ok := protoNumbers[c.Protocol]
	if !ok {
		return false
	}
	chainPasses := func(name string, peer netip.Addr) bool {
		ch := w.chains[name]
		for _, r := range ch.rules {
			if r.peers != "" && !slices.ContainsFunc(w.state.peerSets[r.peers], func(ar AddrRange) bool {
				return ar.First.Compare(peer) <= 0 && peer.Compare(ar.Last) <= 0
			}) {
				continue
			}
			if r.ports != "" && !slices.ContainsFunc(w.state.portSets[r.ports], func(p portRange) bool {
				return p.proto == proto && p.lo <= c.Port && c.Port <= p.hi
			}) {
				continue
			}
			return true
		}
		return false
	}
	if name, ok := w.state.egress[c.Src]; ok && !chainPasses(name, c.Dst) {
		return false
	}
	if name, ok := w.state.ingress[c.Dst]; ok && !chainPasses(name, c.Src) {
		return false
	}
	return true
}

// TestPolicyEncodingMatchesRules: for random worlds, the table's state
// that wantPolicy encodes lets a connection through exactly when the
// node's rules do (NodeRules.Egress and Ingress), for every pair of
// addresses, both protocols and the ports the policies name; also (two
// worlds in three) with names from hashes that collide.
func TestPolicyEncodingMatchesRules(t *testing.T) {
	n := 300
	if testing.Short() {
		n = 50
	}
	all := slices.Concat(testLocal, testRemote, testOther)
	checked, allowed := 0, 0
	hashes := []func(string) string{hashName, weakHashes["1 digit"], weakHashes["constant"]}
	for seed := range uint64(n) {
		nr := randNodeRules(seed)
		w, err := wantPolicyNamed(nr, hashes[seed%3]) // and names that collide
		if err != nil {
			t.Fatal(err)
		}
		for _, src := range all {
			for _, dst := range all {
				if src == dst {
					continue
				}
				for _, proto := range []corev1.Protocol{corev1.ProtocolTCP, corev1.ProtocolUDP, corev1.ProtocolSCTP} {
					for _, port := range []uint16{0, 40, 50, 53, 55, 60, 80, 90, 8080, 65535} {
						c := policy.Conn{Src: src, Dst: dst, Protocol: proto, Port: port}
						want := nr.Egress(c) && nr.Ingress(c)
						if got := evalWant(w, c); got != want {
							t.Fatalf("seed %d: %s: the table lets it pass=%v, the rules %v", seed, c, got, want)
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
	t.Logf("%d worlds, %d connections, %d allowed", n, checked, allowed)
	if allowed == 0 || allowed == checked {
		t.Fatalf("degenerate worlds: %d of %d allowed", allowed, checked)
	}
}

// checkDiff checks diffPolicy from a to b: applied to a it gives b; it
// writes nothing for a chain or set that is the same in both; from b to b
// it is empty.
func checkDiff(t testing.TB, a, b *polState) {
	t.Helper()
	o := diffPolicy(b, a)
	if got := applyOps(a, b, o); !got.equal(b) {
		t.Fatalf("diff applied: %+v\nwant %+v\nops %+v", got, b, o)
	}
	if again := diffPolicy(b, b); !again.empty() {
		t.Fatalf("diff of a state with itself: %+v", again)
	}
	for _, name := range o.writeChains {
		if h, ok := a.chains[name]; ok && slices.Equal(h, b.chains[name]) {
			t.Fatalf("chain %s rewritten, but it is the same", name)
		}
	}
	for _, d := range o.peerDiffs {
		if slices.Equal(a.peerSets[d.name], b.peerSets[d.name]) {
			t.Fatalf("set %s changed, but it is the same", d.name)
		}
		// The kernel holds bounds: deleting those of del and adding
		// those of add turns a's bounds into b's.
		have := peerElementKeys(a.peerSets[d.name])
		for _, k := range peerElementKeys(d.del) {
			i := slices.Index(have, k)
			if i < 0 {
				t.Fatalf("set %s: deleting element %s that is not there", d.name, k)
			}
			have = slices.Delete(have, i, i+1)
		}
		for _, k := range peerElementKeys(d.add) {
			if slices.Contains(have, k) {
				t.Fatalf("set %s: adding element %s that is there", d.name, k)
			}
			have = append(have, k)
		}
		slices.Sort(have)
		if want := peerElementKeys(b.peerSets[d.name]); !slices.Equal(have, want) {
			t.Fatalf("set %s: elements %v after the diff, want %v", d.name, have, want)
		}
	}
}

func peerElementKeys(rs []AddrRange) []string {
	var out []string
	for _, e := range peerElements(rs) {
		a, _ := netip.AddrFromSlice(e.Key)
		out = append(out, fmt.Sprintf("%s end=%v", a, e.IntervalEnd))
	}
	slices.Sort(out)
	return out
}

// TestPolicyDiff: between random pairs of worlds (and from and to none),
// diffPolicy turns one state into the other, writing only what differs.
func TestPolicyDiff(t *testing.T) {
	empty := newPolState()
	for seed := range uint64(300) {
		a := mustWant(t, randNodeRules(seed)).state
		b := mustWant(t, randNodeRules(seed+1000)).state
		checkDiff(t, a, b)
		checkDiff(t, empty, b)
		checkDiff(t, a, empty)
	}
}

// TestPolicyDiffOnePod: a change of one pod's peers or ports touches one
// set only.
func TestPolicyDiffOnePod(t *testing.T) {
	a, b := netip.MustParseAddr("10.32.0.2"), netip.MustParseAddr("10.32.0.3")
	from := policy.Origin{Policy: "default/b", Index: 0}
	rules := func(port uint16, peers ...policy.Interval) *policy.NodeRules {
		return &policy.NodeRules{Pods: map[netip.Addr]*policy.PodRules{
			a: {IP: a, Ingress: policy.Direction{Isolated: true, Rules: []policy.Rule{{AnyPeer: true, Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: 80, Hi: 80}}}}}},
			b: {IP: b, Ingress: policy.Direction{Isolated: true, Rules: []policy.Rule{{Peers: peers, Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: port, Hi: port}}, From: from}}}},
		}}
	}
	x := policy.Interval{Lo: a, Hi: a}
	y := policy.Interval{Lo: netip.MustParseAddr("10.32.0.7"), Hi: netip.MustParseAddr("10.32.0.9")}
	w0 := mustWant(t, rules(80, x))
	bRule := w0.chains[w0.state.ingress[b]].rules[0]
	o := diffPolicy(mustWant(t, rules(80, x, y)).state, w0.state)
	if len(o.peerDiffs) != 1 || o.peerDiffs[0].name != bRule.peers || len(o.peerDiffs[0].add) != 1 || len(o.peerDiffs[0].del) != 0 {
		t.Fatalf("a peer more: %+v", o)
	}
	o.peerDiffs = nil
	if !o.empty() {
		t.Fatalf("a peer more wrote more than the set: %+v", o)
	}
	// Another port: B's rule names another ports set (the set of TCP 80
	// is A's too), so B gets another chain.
	w1 := mustWant(t, rules(81, x))
	o = diffPolicy(w1.state, w0.state)
	if len(o.newPortSets) != 1 || len(o.newChains) != 1 || len(o.delChains) != 1 || len(o.mapDel) != 1 || len(o.mapAdd) != 1 ||
		o.mapAdd[0].addr != b || len(o.peerDiffs)+len(o.portDiffs)+len(o.delPortSets)+len(o.delPeerSets) != 0 {
		t.Fatalf("another port: %+v", o)
	}
}

func portIn(ps []portRange, proto byte, port uint16) bool {
	return slices.ContainsFunc(ps, func(p portRange) bool { return p.proto == proto && p.lo <= port && port <= p.hi })
}

// FuzzMergePorts: merging keeps exactly the same protocol and port pairs,
// and gives sorted, disjoint, not adjacent ranges (what the kernel's
// interval set takes).
func FuzzMergePorts(f *testing.F) {
	f.Add([]byte{6, 0, 80, 0, 80, 6, 0, 79, 0, 81, 17, 0, 53, 0, 53})
	f.Add([]byte{6, 255, 255, 255, 255, 6, 0, 0, 255, 254})
	f.Fuzz(func(t *testing.T, b []byte) {
		var ps []portRange
		for ; len(b) >= 5; b = b[5:] {
			ps = append(ps, portRange{proto: []byte{6, 17, 132}[int(b[0])%3], lo: binary.BigEndian.Uint16(b[1:3]), hi: binary.BigEndian.Uint16(b[3:5])})
		}
		m := mergePorts(ps)
		for i := 1; i < len(m); i++ {
			p, q := m[i-1], m[i]
			if p.proto > q.proto || (p.proto == q.proto && (p.hi == 65535 || uint32(p.hi)+1 >= uint32(q.lo))) {
				t.Fatalf("merged %v: %v and %v overlap, touch or are out of order", ps, p, q)
			}
		}
		for _, p := range m {
			if p.lo > p.hi {
				t.Fatalf("merged %v: empty range %v", ps, p)
			}
		}
		probe := []uint16{0, 1, 52, 53, 54, 79, 80, 81, 65534, 65535}
		for _, p := range ps {
			probe = append(probe, p.lo, p.hi, p.lo-1, p.hi+1)
		}
		for _, proto := range []byte{6, 17, 132} {
			for _, port := range probe {
				if got, want := portIn(m, proto, port), portIn(ps, proto, port); got != want {
					t.Fatalf("merged %v into %v: %d/%d in=%v, before %v", ps, m, proto, port, got, want)
				}
			}
		}
		// And the kernel's elements read back are the same ranges.
		var back []portRange
		for _, e := range portElements(m) {
			p, ok := portOfElement(e)
			if !ok {
				t.Fatalf("element % x / % x does not read back", e.Key, e.KeyEnd)
			}
			back = append(back, p)
		}
		if !slices.Equal(back, m) {
			t.Fatalf("elements read back %v, want %v", back, m)
		}
	})
}

// FuzzPeerElements: the peers of a rule, as interval set elements, read
// back into the same merged ranges, and hold the same addresses.
func FuzzPeerElements(f *testing.F) {
	f.Add([]byte{10, 32, 0, 2, 10, 32, 0, 2, 0, 0, 0, 0, 9, 255, 255, 255, 11, 0, 0, 0, 255, 255, 255, 255})
	f.Fuzz(func(t *testing.T, b []byte) {
		var ivs []policy.Interval
		for ; len(b) >= 8; b = b[8:] {
			lo, hi := netip.AddrFrom4([4]byte(b[0:4])), netip.AddrFrom4([4]byte(b[4:8]))
			ivs = append(ivs, policy.Interval{Lo: lo, Hi: hi})
		}
		rs := peersOf(ivs)
		back := rangesOfBounds(boundsOfElements(peerElements(rs)))
		if !slices.Equal(back, rs) {
			t.Fatalf("%v: elements read back as %v, want %v", ivs, back, rs)
		}
		in := func(a netip.Addr) bool {
			return slices.ContainsFunc(ivs, func(iv policy.Interval) bool {
				return !iv.Hi.Less(iv.Lo) && iv.Lo.Compare(a) <= 0 && a.Compare(iv.Hi) <= 0
			})
		}
		for _, iv := range ivs {
			for _, a := range []netip.Addr{iv.Lo, iv.Hi, iv.Lo.Prev(), iv.Hi.Next()} {
				if !a.IsValid() {
					continue
				}
				got := slices.ContainsFunc(rs, func(r AddrRange) bool { return r.First.Compare(a) <= 0 && a.Compare(r.Last) <= 0 })
				if got != in(a) {
					t.Fatalf("%v merged into %v: %s in=%v, before %v", ivs, rs, a, got, in(a))
				}
			}
		}
	})
}

// verdictAttrs encodes a verdict as the kernel sends it in a map element.
func verdictAttrs(code uint32, chain string) []byte {
	attr := func(typ uint16, data []byte) []byte {
		b := binary.NativeEndian.AppendUint16(nil, uint16(4+len(data)))
		b = binary.NativeEndian.AppendUint16(b, typ)
		b = append(b, data...)
		for len(b)%4 != 0 {
			b = append(b, 0)
		}
		return b
	}
	b := attr(nftaVerdictCode, binary.BigEndian.AppendUint32(nil, code))
	if chain != "" {
		b = append(b, attr(nftaVerdictChain, append([]byte(chain), 0))...)
	}
	return b
}

// FuzzJumpOfVerdict: a jump reads back as its chain; anything else, and
// any bytes at all, read as no jump, without a panic.
func FuzzJumpOfVerdict(f *testing.F) {
	f.Add(verdictAttrs(nftJump, "ingress-10.32.0.5"))
	f.Add(verdictAttrs(0xfffffffc, "egress-10.32.0.5")) // goto
	f.Add(verdictAttrs(1, ""))                          // accept
	f.Add([]byte{3, 0, 1, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		chain, ok := jumpOfVerdict(b)
		if ok && chain == "" {
			t.Fatalf("% x: a jump without a chain", b)
		}
	})
}

func TestJumpOfVerdict(t *testing.T) {
	for _, tc := range []struct {
		b     []byte
		chain string
		ok    bool
	}{
		{verdictAttrs(nftJump, "ingress-10.32.0.5"), "ingress-10.32.0.5", true},
		{verdictAttrs(nftJump, "abc"), "abc", true},
		{verdictAttrs(0xfffffffc, "ingress-10.32.0.5"), "", false},
		{verdictAttrs(1, ""), "", false},
		{verdictAttrs(nftJump, ""), "", false},
		{nil, "", false},
		{[]byte{200, 0, 1, 0, 0, 0}, "", false},
	} {
		if chain, ok := jumpOfVerdict(tc.b); chain != tc.chain || ok != tc.ok {
			t.Errorf("% x: %q %v, want %q %v", tc.b, chain, ok, tc.chain, tc.ok)
		}
	}
}

func TestWantPolicyRefusesIPv6(t *testing.T) {
	a := netip.MustParseAddr("fd00::1")
	if _, err := wantPolicy(&policy.NodeRules{Pods: map[netip.Addr]*policy.PodRules{a: {IP: a}}}); err == nil {
		t.Fatal("an IPv6 pod address was taken")
	}
}

// sharedWorld: pods a, b, c of node n0 (app=web) and d (app=db) in
// namespace default, one remote pod r (app=client) on n1, and a policy
// that lets web pods take TCP 80 from client pods: the rules of a, b and
// c come from one policy's rule.
func sharedWorld() *policy.World {
	web, client := map[string]string{"app": "web"}, map[string]string{"app": "client"}
	pod := func(name, ip, node string, labels map[string]string) policy.Pod {
		return policy.Pod{Namespace: "default", Name: name, IP: netip.MustParseAddr(ip), Node: node, Labels: labels}
	}
	tcp := corev1.ProtocolTCP
	return &policy.World{
		Namespaces: []policy.Namespace{{Name: "default"}},
		Pods: []policy.Pod{pod("a", "10.32.0.2", "n0", web), pod("b", "10.32.0.3", "n0", web), pod("c", "10.32.0.4", "n0", web),
			pod("d", "10.32.0.5", "n0", map[string]string{"app": "db"}), pod("r", "10.32.1.5", "n1", client)},
		Policies: []networkingv1.NetworkPolicy{{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{MatchLabels: web},
				Ingress: []networkingv1.NetworkPolicyIngressRule{{
					From:  []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{MatchLabels: client}}},
					Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: ptrTo(intstr.FromInt32(80))}},
				}},
			},
		}},
	}
}

func ptrTo[T any](v T) *T { return &v }

// TestPolicySharedByPolicy: the pods one policy selects share its sets
// and one chain; a pod that joins the policy's peers changes one set's
// elements, and nothing else; a pod the policy comes to select gets an
// element in the map, pointing at that chain; sets and chains that no
// pod uses any more go.
func TestPolicySharedByPolicy(t *testing.T) {
	a, b, c, d := netip.MustParseAddr("10.32.0.2"), netip.MustParseAddr("10.32.0.3"), netip.MustParseAddr("10.32.0.4"), netip.MustParseAddr("10.32.0.5")
	w := sharedWorld()
	s0 := mustWant(t, policy.Compile(w, "n0")).state
	if len(s0.chains) != 1 || len(s0.peerSets) != 1 || len(s0.portSets) != 1 || len(s0.ingress) != 3 ||
		s0.ingress[a] != s0.ingress[b] || s0.ingress[a] != s0.ingress[c] {
		t.Fatalf("three pods selected by one policy: %+v, want one chain and one set of each kind for all three", s0)
	}

	// d joins the peers (it is a client now): one set gets one element.
	w.Pods[3].Labels = map[string]string{"app": "client"}
	s1 := mustWant(t, policy.Compile(w, "n0")).state
	o := diffPolicy(s1, s0)
	if len(o.peerDiffs) != 1 || len(o.peerDiffs[0].add) != 1 || len(o.peerDiffs[0].del) != 0 {
		t.Fatalf("a pod joining the peers: %+v", o)
	}
	o.peerDiffs = nil
	if !o.empty() {
		t.Fatalf("a pod joining the peers wrote more than the set: %s", o)
	}
	checkDiff(t, s0, s1)

	// d is a web pod now: it is selected, and its ingress goes to the
	// same chain; it leaves the peers.
	w.Pods[3].Labels = map[string]string{"app": "web"}
	s2 := mustWant(t, policy.Compile(w, "n0")).state
	o = diffPolicy(s2, s1)
	if len(o.mapAdd) != 1 || o.mapAdd[0].addr != d || o.mapAdd[0].chain != s0.ingress[a] || len(o.peerDiffs) != 1 ||
		len(o.newChains)+len(o.writeChains)+len(o.delChains)+len(o.newPeerSets)+len(o.newPortSets)+len(o.mapDel) != 0 {
		t.Fatalf("a pod the policy comes to select: %s", o)
	}
	checkDiff(t, s1, s2)

	// No pod is selected any more: the chain, its sets and the map
	// elements go.
	w.Policies[0].Spec.PodSelector.MatchLabels = map[string]string{"app": "none"}
	s3 := mustWant(t, policy.Compile(w, "n0")).state
	o = diffPolicy(s3, s2)
	if len(o.delChains) != 1 || len(o.delPeerSets) != 1 || len(o.delPortSets) != 1 || len(o.mapDel) != 4 || !s3.equal(newPolState()) {
		t.Fatalf("no pod selected: %s; state %+v", o, s3)
	}
	checkDiff(t, s2, s3)
}

// TestPolicyChainPerCombination: pods selected by the same policies
// share a chain, pods selected by others get others; the sets of a
// policy's rule are shared by all chains that have the rule.
func TestPolicyChainPerCombination(t *testing.T) {
	a, b, c := netip.MustParseAddr("10.32.0.2"), netip.MustParseAddr("10.32.0.3"), netip.MustParseAddr("10.32.0.4")
	w := sharedWorld()
	tcp := corev1.ProtocolTCP
	more := w.Policies[0].DeepCopy()
	more.Name = "b-too"
	more.Spec.PodSelector.MatchLabels = map[string]string{"extra": "yes"}
	more.Spec.Ingress[0].Ports = []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: ptrTo(intstr.FromInt32(443))}}
	w.Policies = append(w.Policies, *more)
	w.Pods[1].Labels = map[string]string{"app": "web", "extra": "yes"}
	want := mustWant(t, policy.Compile(w, "n0"))
	s := want.state
	if len(s.chains) != 2 || s.ingress[a] != s.ingress[c] || s.ingress[a] == s.ingress[b] {
		t.Fatalf("a and c selected by one policy, b by it and another: %+v", s)
	}
	if len(s.peerSets) != 2 || len(s.portSets) != 2 {
		t.Fatalf("two policies' rules: %d peers sets and %d ports sets, want 2 and 2: %+v", len(s.peerSets), len(s.portSets), s)
	}
	ra, rb := want.chains[s.ingress[a]].rules, want.chains[s.ingress[b]].rules
	if len(ra) != 1 || len(rb) != 2 || rb[0].peers != ra[0].peers || rb[0].ports != ra[0].ports {
		t.Fatalf("the first policy's rule in both chains: %+v and %+v", ra, rb)
	}
}

// weakHashes make names collide: one hex digit, and one name for all.
var weakHashes = map[string]func(string) string{
	"sha256":   hashName,
	"1 digit":  func(k string) string { return hashName(k)[:1] },
	"constant": func(string) string { return "0" },
}

// withOrigin is nr with every rule saying it comes from o: the zero
// Origin (no rule says where it comes from), or one for all (rules that
// claim one origin but have different peers).
func withOrigin(nr *policy.NodeRules, o policy.Origin) *policy.NodeRules {
	out := &policy.NodeRules{Node: nr.Node, Pods: map[netip.Addr]*policy.PodRules{}}
	for a, pr := range nr.Pods {
		c := *pr
		for _, d := range []*policy.Direction{&c.Ingress, &c.Egress} {
			d.Rules = slices.Clone(d.Rules)
			for i := range d.Rules {
				d.Rules[i].From = o
			}
		}
		out.Pods[a] = &c
	}
	return out
}

// TestPolicyNamesNeverShared: for random worlds, with names from hashes
// that collide and from sha256, with the rules' origins, without, and
// with one origin claimed by all rules, every rule of every pod names sets that hold exactly its own peers and
// ports, and the chain the map gives a pod has exactly its rules: two
// different contents never get one name. Names stay short and depend
// only on the rules (not on the order in which a map yields them).
func TestPolicyNamesNeverShared(t *testing.T) {
	shared := 0
	for seed := range uint64(300) {
		for _, from := range []*policy.Origin{nil, {}, {Policy: "default/one"}} {
			nr := randNodeRules(seed)
			if from != nil {
				nr = withOrigin(nr, *from)
			}
			for hn, hash := range weakHashes {
				w, err := wantPolicyNamed(nr, hash)
				if err != nil {
					t.Fatal(err)
				}
				for a, pr := range nr.Pods {
					for _, egress := range []bool{false, true} {
						d := pr.Ingress
						if egress {
							d = pr.Egress
						}
						name, ok := w.state.mapOf(egress)[a]
						if ok != d.Isolated {
							t.Fatalf("seed %d, %s: pod %s %s: in the map %v, isolated %v", seed, hn, a, dirName(egress), ok, d.Isolated)
						}
						if !ok {
							continue
						}
						ch := w.chains[name]
						if ch.egress != egress || len(ch.rules) != len(d.Rules) || !slices.Equal(w.state.chains[name], ch.comments()) {
							t.Fatalf("seed %d, %s: pod %s %s: chain %s is %+v for rules %+v", seed, hn, a, dirName(egress), name, ch, d.Rules)
						}
						for i, r := range d.Rules {
							pr := ch.rules[i]
							if (pr.peers == "") != r.AnyPeer || (pr.ports == "") != r.AnyPort {
								t.Fatalf("seed %d, %s: pod %s rule %d: %+v for %+v", seed, hn, a, i, pr, r)
							}
							if pr.peers != "" && !slices.Equal(w.state.peerSets[pr.peers], peersOf(r.Peers)) {
								t.Fatalf("seed %d, %s: pod %s rule %d: set %s holds %v, the rule's peers are %v", seed, hn, a, i, pr.peers, w.state.peerSets[pr.peers], peersOf(r.Peers))
							}
							if pr.ports != "" && !slices.Equal(w.state.portSets[pr.ports], portsOf(r.Ports)) {
								t.Fatalf("seed %d, %s: pod %s rule %d: set %s holds %v, the rule's ports are %v", seed, hn, a, i, pr.ports, w.state.portSets[pr.ports], portsOf(r.Ports))
							}
						}
					}
				}
				for _, names := range [][]string{sortedKeys(w.state.chains), sortedKeys(w.state.peerSets), sortedKeys(w.state.portSets)} {
					for _, n := range names {
						if len(n) >= 28 {
							t.Fatalf("seed %d, %s: name %q is %d bytes", seed, hn, n, len(n))
						}
					}
				}
				if len(w.state.chains) < len(w.state.ingress)+len(w.state.egress) {
					shared++
				}
				// The same rules in another map order: the same names.
				again, _ := wantPolicyNamed(shuffledPods(nr, seed), hash)
				if !again.state.equal(w.state) {
					t.Fatalf("seed %d, %s: the same rules encoded twice:\n%+v\n%+v", seed, hn, w.state, again.state)
				}
			}
		}
	}
	if shared == 0 {
		t.Fatal("no world had two pods on one chain: the test proves nothing")
	}
}

// shuffledPods is nr in a new map, filled in another order.
func shuffledPods(nr *policy.NodeRules, seed uint64) *policy.NodeRules {
	out := &policy.NodeRules{Node: nr.Node, Pods: map[netip.Addr]*policy.PodRules{}}
	addrs := slices.SortedFunc(maps.Keys(nr.Pods), netip.Addr.Compare)
	rand.New(rand.NewPCG(seed, 7)).Shuffle(len(addrs), func(i, j int) { addrs[i], addrs[j] = addrs[j], addrs[i] })
	for _, a := range addrs {
		out.Pods[a] = nr.Pods[a]
	}
	return out
}
