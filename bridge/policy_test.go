package bridge

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/weft-net/weft/policy"
)

// randPolicyWorld makes a random cluster in the style of package policy's
// tests: the pods local (on node n0) and remote (on n1) at the given
// addresses, three namespaces, few labels, up to five policies with
// podSelectors, namespaceSelectors, ipBlocks with excepts, numbered,
// ranged and named ports, so that selectors often match and often not.
func randPolicyWorld(r *rand.Rand, local, remote []netip.Addr) *policy.World {
	pick := func(xs ...string) string { return xs[r.IntN(len(xs))] }
	labelsOf := func() map[string]string {
		m := map[string]string{}
		for _, k := range []string{"app", "tier"} {
			if r.IntN(3) > 0 {
				m[k] = pick("x", "y", "z")
			}
		}
		return m
	}
	selOf := func() *metav1.LabelSelector {
		s := &metav1.LabelSelector{}
		switch r.IntN(4) {
		case 1:
			s.MatchLabels = map[string]string{"app": pick("x", "y", "z")}
		case 2:
			s.MatchExpressions = []metav1.LabelSelectorRequirement{{Key: "tier", Operator: metav1.LabelSelectorOpIn, Values: []string{pick("x", "y", "z"), "y"}}}
		case 3:
			s.MatchExpressions = []metav1.LabelSelectorRequirement{{Key: "app", Operator: metav1.LabelSelectorOpDoesNotExist}}
		}
		return s
	}
	w := &policy.World{}
	nss := []string{"a", "b", "c"}
	for _, n := range nss {
		w.Namespaces = append(w.Namespaces, policy.Namespace{Name: n, Labels: labelsOf()})
	}
	add := func(a netip.Addr, node string) {
		x := policy.Pod{Namespace: pick(nss...), Name: "p" + a.String(), Labels: labelsOf(), IP: a, Node: node}
		for _, pn := range []policy.Port{{Name: "http", Protocol: corev1.ProtocolTCP, Number: 80}, {Name: "http", Protocol: corev1.ProtocolTCP, Number: 8080},
			{Name: "dns", Protocol: corev1.ProtocolUDP, Number: 53}, {Name: "dns", Number: 53}} {
			if r.IntN(3) == 0 {
				x.Ports = append(x.Ports, pn)
			}
		}
		w.Pods = append(w.Pods, x)
	}
	for _, a := range local {
		add(a, "n0")
	}
	for _, a := range remote {
		add(a, "n1")
	}
	peerOf := func() networkingv1.NetworkPolicyPeer {
		switch r.IntN(4) {
		case 0:
			b := &networkingv1.IPBlock{CIDR: pick("10.32.0.0/16", "10.32.1.0/24", "10.32.0.4/30", "0.0.0.0/0", "192.0.2.0/24", "198.51.100.7/32")}
			if r.IntN(2) == 0 {
				b.Except = append(b.Except, pick("10.32.0.0/29", "10.32.1.4/31", "10.32.0.5/32", "192.0.2.8/30"))
			}
			return networkingv1.NetworkPolicyPeer{IPBlock: b}
		case 1:
			return networkingv1.NetworkPolicyPeer{PodSelector: selOf()}
		case 2:
			return networkingv1.NetworkPolicyPeer{NamespaceSelector: selOf()}
		}
		return networkingv1.NetworkPolicyPeer{PodSelector: selOf(), NamespaceSelector: selOf()}
	}
	proto := func(p corev1.Protocol) *corev1.Protocol { return &p }
	portsOf := func() []networkingv1.NetworkPolicyPort {
		var out []networkingv1.NetworkPolicyPort
		for range r.IntN(3) {
			pp := networkingv1.NetworkPolicyPort{}
			switch r.IntN(3) {
			case 1:
				pp.Protocol = proto(corev1.ProtocolUDP)
			case 2:
				pp.Protocol = proto(corev1.ProtocolTCP)
			}
			switch r.IntN(4) {
			case 0:
				v := intstr.FromInt32([]int32{53, 80, 8080}[r.IntN(3)])
				pp.Port = &v
			case 1:
				v := intstr.FromString(pick("http", "dns", "none"))
				pp.Port = &v
			case 2:
				v := intstr.FromInt32(50)
				end := []int32{60, 90, 40}[r.IntN(3)]
				pp.Port, pp.EndPort = &v, &end
			}
			out = append(out, pp)
		}
		return out
	}
	for i := range r.IntN(6) {
		spec := networkingv1.NetworkPolicySpec{PodSelector: *selOf()}
		switch r.IntN(4) {
		case 1:
			spec.PolicyTypes = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}
		case 2:
			spec.PolicyTypes = []networkingv1.PolicyType{networkingv1.PolicyTypeEgress}
		case 3:
			spec.PolicyTypes = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress}
		}
		for range r.IntN(3) {
			rule := networkingv1.NetworkPolicyIngressRule{Ports: portsOf()}
			for range r.IntN(3) {
				rule.From = append(rule.From, peerOf())
			}
			spec.Ingress = append(spec.Ingress, rule)
		}
		for range r.IntN(3) {
			rule := networkingv1.NetworkPolicyEgressRule{Ports: portsOf()}
			for range r.IntN(3) {
				rule.To = append(rule.To, peerOf())
			}
			spec.Egress = append(spec.Egress, rule)
		}
		w.Policies = append(w.Policies, networkingv1.NetworkPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: pick(nss...), Name: fmt.Sprintf("np%d", i)}, Spec: spec})
	}
	return w
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
// addresses, both protocols and the ports the policies name.
func TestPolicyEncodingMatchesRules(t *testing.T) {
	n := 300
	if testing.Short() {
		n = 50
	}
	all := slices.Concat(testLocal, testRemote, testOther)
	checked, allowed := 0, 0
	for seed := range uint64(n) {
		nr := randNodeRules(seed)
		w := mustWant(t, nr)
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
func checkDiff(t *testing.T, a, b *polState) {
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

// TestPolicyDiffOnePod: a change of one pod's rules touches its chain and
// sets only.
func TestPolicyDiffOnePod(t *testing.T) {
	a, b := netip.MustParseAddr("10.32.0.2"), netip.MustParseAddr("10.32.0.3")
	rules := func(port uint16, peers ...policy.Interval) *policy.NodeRules {
		return &policy.NodeRules{Pods: map[netip.Addr]*policy.PodRules{
			a: {IP: a, Ingress: policy.Direction{Isolated: true, Rules: []policy.Rule{{AnyPeer: true, Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: 80, Hi: 80}}}}}},
			b: {IP: b, Ingress: policy.Direction{Isolated: true, Rules: []policy.Rule{{Peers: peers, Ports: []policy.PortRange{{Protocol: corev1.ProtocolTCP, Lo: port, Hi: port}}}}}},
		}}
	}
	x := policy.Interval{Lo: a, Hi: a}
	y := policy.Interval{Lo: netip.MustParseAddr("10.32.0.7"), Hi: netip.MustParseAddr("10.32.0.9")}
	s0 := mustWant(t, rules(80, x)).state
	o := diffPolicy(mustWant(t, rules(80, x, y)).state, s0)
	if len(o.peerDiffs) != 1 || o.peerDiffs[0].name != "ingress-10.32.0.3-0-peers" || len(o.peerDiffs[0].add) != 1 || len(o.peerDiffs[0].del) != 0 {
		t.Fatalf("a peer more: %+v", o)
	}
	o.peerDiffs = nil
	if !o.empty() {
		t.Fatalf("a peer more wrote more than the set: %+v", o)
	}
	o = diffPolicy(mustWant(t, rules(81, x)).state, s0)
	if len(o.portDiffs) != 1 || o.portDiffs[0].name != "ingress-10.32.0.3-0-ports" {
		t.Fatalf("another port: %+v", o)
	}
	o.portDiffs = nil
	if !o.empty() {
		t.Fatalf("another port wrote more than the set: %+v", o)
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
