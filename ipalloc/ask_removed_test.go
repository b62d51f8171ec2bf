package ipalloc

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// TestRejoinLearnsRemovalByAnother (make test-long seeds 5658, 5805): b
// removes the dead x and takes its ranges over while c answers; then c
// starts without state under its own name, still knowing x (the mesh's
// memory, the ConfigMap). Nobody tells c of x's removal: b's barrier is
// closed, and it holds c's acknowledgement from before. The old code held
// c back for good, "waiting to hear from every other owner of the ring
// (x)". Now c asks a and b who of those it waits for is removed, learns
// that b removed x, acknowledges it to b, and allocates.
func TestRejoinLearnsRemovalByAnother(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "x"))
	c.run(5)
	c.peers["x"] = nil // x dies
	if err := c.peers["b"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("b")
	c.run(3 * simTiming.RemoveRetry)
	if slices.Contains(c.peers["b"].Ring().Peers(), "x") {
		t.Fatalf("b's reclaim of x did not complete: %+v", c.peers["b"].Status().Reclaims)
	}
	cp := c.wipe("c", []PeerName{"a", "b", "x"})
	c.pushPull("c", "a")
	c.pushPull("c", "b")
	c.run(1)
	if st := cp.Status().Rejoin; !strings.Contains(st, "(x)") {
		t.Fatalf("c's hold: %q, want it to wait for x at first (it knows x, not its removal)", st)
	}
	c.run(3 * simTiming.RemoveRetry)
	if by := cp.removed["x"]; by != "b" {
		t.Fatalf("c did not learn that b removed x: removed %v, hold %q", cp.removed, cp.Status().Rejoin)
	}
	if st := cp.Status().Rejoin; st != "" {
		t.Fatalf("c still holds back: %q", st)
	}
	if !c.hasEvent("c: ipalloc: a records that b removes x") && !c.hasEvent("c: ipalloc: b records that b removes x") {
		t.Errorf("no event says what c learned: %v", c.events)
	}
	if by := c.disk["c"].Removed["x"]; by != "b" {
		t.Errorf("the learned removal is not on c's disk: %v", c.disk["c"].Removed)
	}
	c.alloc("c", key(1))
	c.run(2)
	if ans, ok := c.answer[key(1)]; !ok || ans.Err != nil {
		t.Fatalf("c allocates nothing after it learned the removal: %+v", ans)
	}
}

// TestBarrierLearnsRemovalByAnother (make test-long seed 3704): c starts
// without state while a's reclaim of the dead x is under way, and learns of
// x as an owner of the rings it merges, not of its removal (a's barrier
// holds c's acknowledgement from before). Then y dies and c runs rmpeer y.
// The old code's barrier waited for x for good; now c asks, learns that a
// removed x, and takes y's ranges over once a and b have answered.
func TestBarrierLearnsRemovalByAnother(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "x", "y"))
	c.run(5)
	c.peers["x"] = nil
	c.cut["b"] = true // a's barrier stays open until b is back
	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3)
	if got := c.peers["a"].Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"b"}) {
		t.Fatalf("a's reclaim waits for %v, want [b]", got)
	}
	// c loses its disk and comes back; a's ring still names x as an owner.
	cp := c.wipe("c", []PeerName{"a", "b", "y"})
	c.pushPull("c", "a")
	c.run(2)
	if !cp.members["x"] || cp.isRemoved("x") {
		t.Fatalf("c should know x as a member, not its removal: members %v removed %v", cp.Members(), cp.removed)
	}
	c.reconnect("b", "c")
	if slices.Contains(c.peers["a"].Ring().Peers(), "x") {
		t.Fatalf("a's reclaim of x did not complete: %+v", c.peers["a"].Status().Reclaims)
	}
	c.peers["y"] = nil
	if err := cp.PeerGone("y"); err != nil {
		t.Fatal(err)
	}
	c.ready("c")
	c.run(4 * simTiming.RemoveRetry)
	if got, ok := cp.Status().Reclaims["y"]; ok && len(got) > 0 {
		t.Fatalf("c's reclaim of y still waits for %v (removed here: %v)", got, cp.removed)
	}
	if slices.Contains(cp.Ring().Peers(), "y") {
		t.Fatalf("y's ranges were not taken over")
	}
	if cp.removed["x"] != "a" {
		t.Errorf("c records x removed by %q, want a", cp.removed["x"])
	}
	for _, q := range []PeerName{"a", "b"} {
		if !c.peers[q].Ring().Equal(cp.Ring()) {
			t.Errorf("%s's ring differs from c's", q)
		}
	}
}

// TestLearnedRemovalIsWithdrawn: a removal that a peer learned from a
// third peer is called off with the reclaimer's Withdraw, as for every
// member the reclaimer told itself. a removes x (alive, but cut off), d
// holds the barrier open; c loses its disk, a withdraws while b and c do
// not hear it, and c learns the removal from b. Once a is heard again, c
// listens to x again, and b too.
func TestLearnedRemovalIsWithdrawn(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "d", "x"))
	c.run(5)
	c.cut["x"], c.cut["d"] = true, true
	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2)
	if c.peers["b"].removed["x"] != "a" || c.peers["c"].removed["x"] != "a" {
		t.Fatalf("b and c do not record a's removal of x")
	}
	if got := c.peers["a"].Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"d"}) {
		t.Fatalf("a's reclaim waits for %v, want [d]", got)
	}
	c.cut["b"], c.cut["c"] = true, true
	cp := c.wipe("c", []PeerName{"a", "b", "d", "x"})
	if err := c.peers["a"].Withdraw("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(1)
	c.cut["a"] = true
	delete(c.cut, "b")
	delete(c.cut, "c")
	c.pushPull("c", "b")
	c.run(2 * simTiming.RemoveRetry)
	if cp.removed["x"] != "a" {
		t.Fatalf("c did not learn a's removal of x from b: %v (hold %q)", cp.removed, cp.Status().Rejoin)
	}
	delete(c.cut, "a")
	c.run(4 * simTiming.RemoveRetry)
	if _, ok := cp.removed["x"]; ok {
		t.Fatalf("c still records x as removed after a withdrew it: %v", cp.removed)
	}
	if _, ok := c.peers["b"].removed["x"]; ok {
		t.Fatalf("b still records x as removed after a withdrew it")
	}
}

// TestAskRemovedFanout: a peer that waits asks who is removed of at most
// askRemovedFanout peers at each retry, and of every peer in turn. Asking
// all of them each time cost N messages per waiting peer per retry, N² a
// retry in a fresh cluster where every peer waits for a while (a fresh
// consensus=200 cluster: 459,458 AskRemoved in two minutes, and no
// settling).
func TestAskRemovedFanout(t *testing.T) {
	seeds := []PeerName{"p", "x"}
	var others []PeerName
	for i := range 20 {
		others = append(others, PeerName(fmt.Sprintf("o%02d", i)))
	}
	u := rangeOf("10.32.0.0/24")
	p, err := NewPeer(PeerConfig{Self: "p", Universe: u, Init: Init{Seeds: seeds}, Peers: append(slices.Clone(others), "x"),
		Timing: simTiming, Rand: rand.New(rand.NewPCG(1, 2))}, HardState{})
	if err != nil {
		t.Fatal(err)
	}
	ring := NewRing(u)
	if err := ring.ClaimEvenly(seeds); err != nil {
		t.Fatal(err)
	}
	// p starts without state: it holds back until it has heard from every
	// owner and live peer. Every other peer shows it the ring; x, an
	// owner, never does (it is down), so p waits for x alone.
	for _, q := range others {
		if err := p.Step(q, &RingMsg{Ring: ring.Clone()}); err != nil {
			t.Fatal(err)
		}
	}
	p.Ready()
	if w := p.waited(); !slices.Equal(w, []PeerName{"x"}) {
		t.Fatalf("p waits for %v, want [x]", w)
	}
	asked := map[PeerName]int{}
	for retry := range 3 {
		for range simTiming.RemoveRetry {
			p.Tick()
		}
		n := 0
		for _, m := range p.Ready().Messages {
			a, ok := m.Msg.(*AskRemoved)
			if !ok {
				continue
			}
			n++
			asked[m.To]++
			if !slices.Equal(a.Peers, []PeerName{"x"}) {
				t.Errorf("asked %s about %v, want [x]", m.To, a.Peers)
			}
		}
		if n != askRemovedFanout {
			t.Errorf("retry %d: %d AskRemoved sent, want %d", retry, n, askRemovedFanout)
		}
	}
	// 3 rounds of 8 cover the 20 in turn: each once, 4 of them twice.
	for _, q := range others {
		if asked[q] < 1 || asked[q] > 2 {
			t.Errorf("%s asked %d times in 3 rounds, want 1 or 2 (in turn): %v", q, asked[q], asked)
		}
	}
	if asked["x"] != 0 {
		t.Errorf("x, the peer waited for, was asked %d times", asked["x"])
	}
}

// TestLateWithdrawAfterTakeover (make test-long seed 6049): a has taken x's
// ranges over, and its barrier left out y because a had learned that b
// removes y. Then a Withdraw of y from b arrives late (b sent it while it
// had lost its state and so answered an acknowledgement with a
// withdrawal; it took its removal of y up again since). a listens to y
// again, so its reclaim record of x waits for y's acknowledgement, which
// the dead y never sends. The old code asked who is removed only for
// reclaims not yet taken over: a waited for y for good. Now it asks,
// learns again that b removes y, and the record closes.
func TestLateWithdrawAfterTakeover(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "x", "y"))
	c.run(5)
	c.peers["x"], c.peers["y"] = nil, nil // both die
	if err := c.peers["b"].PeerGone("y"); err != nil {
		t.Fatal(err)
	}
	c.ready("b")
	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(6 * simTiming.RemoveRetry)
	a := c.peers["a"]
	if a.removed["y"] != "b" || !a.reclaimed["x"] || len(a.Status().Reclaims["x"]) != 0 {
		t.Fatalf("a: removed %v, reclaimed %v, reclaim of x waits for %v; want x taken over, y removed by b",
			a.removed, a.reclaimed, a.Status().Reclaims["x"])
	}
	// b's late Withdraw of y.
	if err := a.Step("b", &Withdraw{Peer: "y"}); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	if _, ok := a.removed["y"]; ok {
		t.Fatalf("a still records y as removed after b's Withdraw: the setup is wrong")
	}
	if got := a.Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"y"}) {
		t.Fatalf("a's reclaim of x waits for %v, want [y]", got)
	}
	c.run(4 * simTiming.RemoveRetry)
	if a.removed["y"] != "b" {
		t.Errorf("a did not learn again that b removes y: %v", a.removed)
	}
	if got := a.Status().Reclaims["x"]; len(got) != 0 {
		t.Errorf("a's reclaim of x still waits for %v", got)
	}
}
