package ipalloc

import (
	"errors"
	"slices"
	"testing"
)

// TestRemovedPeerOffersNoRing (make test-long seed 397): x is removed while
// alive and cut off, and meanwhile changes its ring (here: a free count;
// in the seed, a donation whose message was lost). Once it knows it is
// removed it shows that ring to nobody: not in gossip or push-pull, not to
// a peer that joins, not in a RemoveAck. The old code offered it, and a
// peer that joined after the reclaim took x's late changes and then
// carried a ring the others refuse.
func TestRemovedPeerOffersNoRing(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "x"))
	c.run(5)
	c.cut["x"] = true
	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3 * simTiming.RemoveRetry)
	if slices.Contains(c.peers["a"].Ring().Peers(), "x") {
		t.Fatalf("a's reclaim of x did not complete")
	}
	x := c.peers["x"]
	if x.Gossip().Empty() {
		t.Fatalf("x offers no ring before it knows it is removed")
	}
	delete(c.cut, "x")
	// x may hear of its removal from a's ring, which it refuses.
	c.onRefuse = func(err error) bool { return errors.Is(err, ErrRangeTaken) }
	c.pushPull("x", "a") // the mesh's push-pull once x is back: a tells x
	c.run(3 * simTiming.RemoveRetry)
	if x.removedErr() == nil {
		t.Fatalf("x does not know it is removed: %v", x.removed)
	}
	if !x.Gossip().Empty() {
		t.Errorf("x, removed, still offers its ring in push-pull")
	}
	x.AddPeer("j") // a peer that joins now, and knows nothing of the removal
	x.Step("b", &Remove{Peer: "y"})
	rd := x.Ready()
	if rd.Broadcast != nil {
		t.Errorf("x, removed, broadcasts its ring")
	}
	for _, env := range rd.Messages {
		switch m := env.Msg.(type) {
		case *RingMsg:
			if !m.Ring.Empty() {
				t.Errorf("x, removed, sends its ring to %s", env.To)
			}
		case *RemoveAck:
			if !m.Ring.Empty() {
				t.Errorf("x, removed, acknowledges with its ring to %s", env.To)
			}
		}
	}
}

// TestSecondReclaimerGivesWay (make test-long seed 629): a removes the dead
// x while b is cut off; c loses its state, comes back under its name, and
// is asked to rmpeer x as well. The old code acknowledged c's Remove on a,
// so c took x's ranges over too, with the same jump as a: a then refused
// c's ring ("a ring update takes ranges this peer owns") and counted
// itself as removed. Now a answers with its own Remove; c gives way to
// the lower name and acknowledges, and only a takes x's ranges over.
func TestSecondReclaimerGivesWay(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "x"))
	c.run(5)
	c.peers["x"] = nil
	c.cut["b"] = true
	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3)
	cp := c.wipe("c", []PeerName{"a", "b", "x"})
	c.pushPull("c", "a")
	c.run(2)
	if err := cp.PeerGone("x"); err != nil {
		t.Fatalf("rmpeer x on c: %v", err)
	}
	c.ready("c")
	c.run(3)
	if by := cp.removed["x"]; by != "a" {
		t.Fatalf("c records x removed by %q, want a (the lower name goes first)", by)
	}
	if _, ok := cp.acks["x"]; ok {
		t.Errorf("c still runs its own reclaim of x")
	}
	if !c.hasEvent("c: ipalloc: rmpeer of x: a is removing it too and goes first") {
		t.Errorf("no event says that c gave way: %v", c.events)
	}
	delete(c.cut, "b")
	c.pushPull("a", "b")
	c.run(4 * simTiming.RemoveRetry)
	for _, n := range []PeerName{"a", "b", "c"} {
		if slices.Contains(c.peers[n].Ring().Peers(), "x") {
			t.Fatalf("%s: x still owns ranges", n)
		}
		if !c.peers[n].Ring().Equal(c.peers["a"].Ring()) {
			t.Errorf("%s's ring differs from a's", n)
		}
		if c.peers[n].removedErr() != nil {
			t.Errorf("%s counts itself as removed: %v", n, c.peers[n].removed)
		}
	}
	if cp.reclaimed["x"] {
		t.Errorf("c took x's ranges over too")
	}
}
