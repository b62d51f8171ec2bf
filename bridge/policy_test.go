package bridge

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"

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
