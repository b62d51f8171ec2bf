package ipalloc

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func seeded(names ...PeerName) map[PeerName]Init {
	inits := map[PeerName]Init{}
	for _, n := range names {
		inits[n] = Init{Seeds: names}
	}
	return inits
}

func everyone(PeerName) bool { return true }

func TestPeerLeave(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c"))
	a := c.peers["a"]
	c.alloc("a", key(1))
	c.alloc("a", GatewayKey("weft"))
	c.run(3)

	// Pods hold addresses: refused without force, and nothing changes.
	if _, err := a.Leave(everyone, false); !errors.Is(err, ErrPodsHeld) || !strings.Contains(err.Error(), key(1).String()) {
		t.Fatalf("Leave with a pod, no force: %v", err)
	}
	if a.HasReady() {
		t.Fatal("a refused Leave has output")
	}
	// Nobody reachable: refused.
	if _, err := a.Leave(func(PeerName) bool { return false }, true); !errors.Is(err, ErrNoHeir) {
		t.Fatalf("Leave with nobody alive: %v", err)
	}
	// b and c own as much: the first by name is the heir.
	owned := a.Owned()
	res, err := a.Leave(everyone, true)
	if err != nil {
		t.Fatal(err)
	}
	if res.Heir != "b" || res.Size != 85 || len(res.Dropped) != 2 || !slices.Equal(res.Ranges, owned) {
		t.Fatalf("Leave = %+v", res)
	}
	c.ready("a")
	if c.disk["a"].Left != "b" || len(c.disk["a"].Allocations) != 0 {
		t.Fatalf("a saved left %q, allocations %v", c.disk["a"].Left, c.disk["a"].Allocations)
	}
	if left, heir, ok := a.Leaving(); !left || heir != "b" || ok {
		t.Fatalf("Leaving before the ack = %v %s %v", left, heir, ok)
	}
	c.run(3)
	if left, _, ok := a.Leaving(); !left || !ok {
		t.Fatal("the heir did not confirm")
	}
	if got := a.Status().String(); got != "left the cluster (weft reset): ranges handed to b" {
		t.Errorf("status: %q", got)
	}
	for _, n := range []PeerName{"b", "c"} {
		r := c.peers[n].Ring()
		if slices.Contains(r.Peers(), "a") {
			t.Errorf("%s's ring still names a: %v", n, r.Entries)
		}
		if by := c.peers[n].Removed()["a"]; by != "b" {
			t.Errorf("%s: a removed by %q, want b", n, by)
		}
	}
	if st := c.peers["b"].Status(); len(st.Reclaims["a"]) != 0 {
		t.Errorf("b still waits for %v", st.Reclaims["a"])
	}
	if !c.hasEvent("b: ipalloc: a left the cluster (weft reset) and handed its ranges to this peer, which now owns 170 addresses") ||
		!c.hasEvent("b: ipalloc: every live peer has stopped listening to a") {
		t.Errorf("events: %v", c.events)
	}
	// Once left, a allocates nothing and cannot rmpeer; again is harmless.
	c.alloc("a", key(2))
	if got := c.answer[key(2)]; !errors.Is(got.Err, ErrLeft) {
		t.Errorf("allocation after leaving: %+v", got)
	}
	if err := a.PeerGone("c"); !errors.Is(err, ErrLeft) {
		t.Errorf("rmpeer after leaving: %v", err)
	}
	if res, err := a.Leave(everyone, false); err != nil || res.Heir != "b" {
		t.Errorf("second Leave: %+v, %v", res, err)
	}
	c.ready("a")
	c.run(3)
	// A restart from disk stays left, and the heir answers a retry.
	a = c.start("a")
	c.run(3)
	if left, heir, ok := a.Leaving(); !left || heir != "b" || !ok {
		t.Fatalf("after a restart: left %v heir %s confirmed %v", left, heir, ok)
	}
}

func TestPeerLeaveHeirOwnsLeast(t *testing.T) {
	// d joins later and owns nothing: it gets everything.
	inits := seeded("a", "b", "c")
	inits["d"] = Init{Observer: true}
	c := newCluster(t, "10.32.0.0/24", inits)
	c.run(3)
	res, err := c.peers["c"].Leave(everyone, false)
	if err != nil || res.Heir != "d" {
		t.Fatalf("Leave = %+v, %v; want heir d", res, err)
	}
	c.ready("c")
	c.run(5)
	if got := c.peers["d"].Owned(); len(got) != 1 || got[0] != res.Ranges[0] {
		t.Fatalf("d owns %v, want %v", got, res.Ranges)
	}
	// A peer that never shared this ring is not an heir.
	p, err := NewPeer(PeerConfig{Self: "x", Universe: c.u, Init: Init{Seeds: []PeerName{"x"}}, Peers: []PeerName{"y"}}, HardState{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Leave(everyone, false); !errors.Is(err, ErrHolding) {
		t.Fatalf("Leave while it waits for the stranger's ring: %v", err)
	}
	p.rejoin, p.a.frozen = false, false // as if past its hold
	if _, err := p.Leave(everyone, false); !errors.Is(err, ErrNoHeir) {
		t.Fatalf("Leave with only a stranger about: %v", err)
	}
}

func TestPeerLeaveAlone(t *testing.T) {
	p, err := NewPeer(PeerConfig{Self: "a", Universe: rangeOf("10.32.0.0/24"), Init: Init{Seeds: []PeerName{"a"}}}, HardState{})
	if err != nil {
		t.Fatal(err)
	}
	p.Allocate(key(1))
	p.Ready()
	res, err := p.Leave(nil, true)
	if err != nil || res.Heir != "" || len(res.Dropped) != 1 {
		t.Fatalf("Leave alone = %+v, %v", res, err)
	}
	rd := p.Ready()
	if rd.Left != "" || len(rd.Messages) != 0 || len(rd.Allocs) != 1 {
		t.Errorf("Ready = %+v", rd)
	}
	if left, _, ok := p.Leaving(); !left || !ok {
		t.Error("a lone peer that left is not done")
	}
}

func TestPeerLeaveLateDonation(t *testing.T) {
	// a is full and asks b for space; before the donation arrives, a
	// leaves (to b: c owns more after donations to it). The
	// donation reaches a after it left: a hands it on, and c takes it.
	c := newCluster(t, "10.32.0.0/26", seeded("a", "b", "c"))
	for i := 0; i < 30; i++ {
		c.alloc("c", key(100+i))
	}
	c.run(3)
	for i := 0; c.peers["a"].Stats().Free > 0; i++ {
		c.alloc("a", key(i))
	}
	c.alloc("a", key(99)) // waits: a asks a donor
	if len(c.queue) == 0 {
		t.Fatal("a asked nobody")
	}
	res, err := c.peers["a"].Leave(everyone, true)
	if err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	if got := c.answer[key(99)]; !errors.Is(got.Err, ErrLeft) {
		t.Errorf("the waiting allocation: %+v", got)
	}
	c.run(10)
	for _, n := range []PeerName{"b", "c"} {
		if r := c.peers[n].Ring(); slices.Contains(r.Peers(), "a") {
			t.Fatalf("%s's ring still gives a %v (heir %s)", n, r.Owned("a"), res.Heir)
		}
	}
	if !c.peers["b"].Ring().Equal(c.peers["c"].Ring()) {
		t.Error("rings differ")
	}
	if left, _, ok := c.peers["a"].Leaving(); !left || !ok {
		t.Error("a's leave not confirmed")
	}
}

func TestPeerLeaveWhileReclaiming(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "d"))
	c.peers["d"] = nil
	c.cut["c"] = true
	if err := c.peers["a"].PeerGone("d"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2)
	if _, err := c.peers["a"].Leave(everyone, true); err == nil || !strings.Contains(err.Error(), "taking over the ranges of d") {
		t.Fatalf("Leave during a reclaim: %v", err)
	}
}

func TestPeerHoldFound(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", map[PeerName]Init{"a": {Consensus: 2}, "b": {Consensus: 2}})
	a := c.peers["a"]
	gw, pod, theirs := c.u.Start+1, c.u.Start+7, c.u.Start+200
	a.HoldFound(map[Key]Address{
		GatewayKey("weft"):              gw,
		ReclaimedKey("weft", pod):       pod,
		ReclaimedKey("weft", theirs):    theirs,
		ReclaimedKey("weft", c.u.Start): c.u.Start, // the network address
	})
	if rd := a.Ready(); len(rd.Allocs) != 0 {
		t.Fatalf("held before the ring is known: %+v", rd.Allocs)
	}
	c.run(30) // the first claim: a gets the lower half
	if a.Ring().Empty() {
		t.Fatal("no claim")
	}
	for k, want := range map[Key]Address{GatewayKey("weft"): gw, ReclaimedKey("weft", pod): pod} {
		if got, ok := c.disk["a"].Allocations[k]; !ok || got != want {
			t.Errorf("%s: saved %s %v, want %s", k, got, ok, want)
		}
	}
	// theirs lies in b's range, which b does not use: a asks b for it
	// (found_test.go), and holds it once b gave it.
	if got, ok := c.disk["a"].Allocations[ReclaimedKey("weft", theirs)]; !ok || got != theirs {
		t.Errorf("%s, in b's range and free there, is not held: %s %v", theirs, got, ok)
	}
	if o, _ := c.peers["b"].Ring().Owner(theirs); o != "a" {
		t.Errorf("b's ring gives %s to %s", theirs, o)
	}
	// b learns of it either from a's Want or from the members a sends
	// along with its claim (showClaim), which carry what a's node uses.
	if !c.hasEvent("a: ipalloc: re-claimed 10.32.0.7") ||
		!c.hasEvent("the ring gives it to b: asking b for it") && !c.hasEvent("b: ipalloc: gave 10.32.0.200/32 (1 addresses) to a, whose node uses them") {
		t.Errorf("events: %v", c.events)
	}
	// The gateway key keeps its address; new pods get others.
	c.alloc("a", GatewayKey("weft"))
	c.alloc("a", key(1))
	if got := c.answer[GatewayKey("weft")].Address; got != gw {
		t.Errorf("gateway: %s, want %s", got, gw)
	}
	if got := c.answer[key(1)].Address; got == gw || got == pod {
		t.Errorf("new pod got %s, which is in use", got)
	}
	// Re-claimed addresses count as pods for Leave.
	if _, err := a.Leave(everyone, false); !errors.Is(err, ErrPodsHeld) || !strings.Contains(err.Error(), "_weft_reclaimed_10.32.0.7") {
		t.Errorf("Leave: %v", err)
	}
}

func TestPeerLeaveChain(t *testing.T) {
	// a leaves to b; b leaves to c before a's handover reaches it: b
	// names c, and a hands over to c, which ends up with all of it.
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "d"))
	c.run(3) // the seed peers have heard from each other (ErrHolding before)
	only := func(q PeerName) func(PeerName) bool { return func(p PeerName) bool { return p == q } }
	if res, err := c.peers["a"].Leave(only("b"), false); err != nil || res.Heir != "b" {
		t.Fatalf("a leaves: %+v, %v", res, err)
	}
	c.ready("a")
	if res, err := c.peers["b"].Leave(only("c"), false); err != nil || res.Heir != "c" {
		t.Fatalf("b leaves: %+v, %v", res, err)
	}
	c.ready("b")
	c.run(10)
	for _, n := range []PeerName{"a", "b"} {
		if left, heir, ok := c.peers[n].Leaving(); !left || heir != "c" || !ok {
			t.Errorf("%s: left %v, heir %s, confirmed %v", n, left, heir, ok)
		}
	}
	if c.disk["a"].Left != "c" {
		t.Errorf("a saved heir %q, want c", c.disk["a"].Left)
	}
	if !c.hasEvent("a: ipalloc: b has left the cluster too: handing over to its heir c") {
		t.Errorf("events: %v", c.events)
	}
	for _, n := range []PeerName{"c", "d"} {
		if peers := c.peers[n].Ring().Peers(); !slices.Equal(peers, []PeerName{"c", "d"}) {
			t.Errorf("%s's ring is owned by %v", n, peers)
		}
	}
	if !c.peers["c"].Ring().Equal(c.peers["d"].Ring()) {
		t.Error("rings differ")
	}
}
