package ipalloc

import (
	"slices"
	"strings"
	"testing"
)

// wipe restarts n under its own name from an empty disk (a wiped
// --state-dir), knowing peers.
func (c *cluster) wipe(n PeerName, peers []PeerName) *Peer {
	c.t.Helper()
	c.disk[n] = &HardState{}
	return c.restartKnowing(n, peers)
}

// pushPull queues the gossip rings of a and b to each other (memberlist's
// push-pull, as at a mesh join).
func (c *cluster) pushPull(a, b PeerName) {
	for _, pr := range [][2]PeerName{{a, b}, {b, a}} {
		c.queue = append(c.queue, simMsg{pr[0], pr[1], EncodeMsg(&RingMsg{Ring: c.peers[pr[0]].Gossip()})})
	}
}

// reconnect ends n's cut, queues the push-pull of a and n (the mesh's
// join once they reach each other again), and runs until quiet.
func (c *cluster) reconnect(n, a PeerName) {
	delete(c.cut, n)
	c.pushPull(a, n)
	c.run(3 * simTiming.RemoveRetry)
}

// TestRejoinResumesReclaim (reliability.md, finding 2; chaos seed 2): the
// peer that ran rmpeer of a dead peer loses its disk while the barrier is
// open (a cut-off peer has not answered), and comes back under the same
// name. The old code forgot the reclaim and held back for good, "waiting to
// hear from every other owner of the ring (x)", x being the dead peer that
// every other peer refuses. A peer that recorded the removal reminds it;
// it takes the reclaim up again, its hold no longer waits for x, and once
// the cut-off peer is back both complete.
func TestRejoinResumesReclaim(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "x"))
	c.run(5)
	c.peers["x"] = nil // x dies
	c.cut["c"] = true
	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3)
	if got := c.peers["a"].Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"c"}) {
		t.Fatalf("the reclaim waits for %v, want [c]", got)
	}
	if c.peers["b"].removed["x"] != "a" {
		t.Fatalf("b does not record a's removal of x: %v", c.peers["b"].removed)
	}
	c.run(simTiming.RemoveRetry) // a while later, its disk is lost
	a := c.wipe("a", []PeerName{"b", "c"})
	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)
	if by, ok := a.removed["x"]; !ok || by != "a" {
		t.Fatalf("a did not take its reclaim of x up again: removed %v (status %q)", a.removed, a.Status().Rejoin)
	}
	if got := a.Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"c"}) {
		t.Errorf("the resumed reclaim waits for %v, want [c]", got)
	}
	if st := a.Status().Rejoin; strings.Contains(st, "(x") || strings.Contains(st, " x)") || strings.Contains(st, ", x") {
		t.Errorf("the hold still waits for the removed x: %q", st)
	}
	if !c.hasEvent("a: ipalloc: b records that this peer removes x") {
		t.Errorf("no event says why the reclaim was taken up again: %v", c.events)
	}
	c.reconnect("c", "a")
	if st := a.Status().Rejoin; st != "" {
		t.Fatalf("a still holds back after c came back: %q", st)
	}
	if slices.Contains(a.Ring().Peers(), "x") {
		t.Fatalf("x still owns ranges: %+v", a.Status().Reclaims)
	}
	for _, q := range []PeerName{"b", "c"} {
		if !c.peers[q].Ring().Equal(a.Ring()) {
			t.Errorf("%s's ring differs from a's", q)
		}
	}
	c.alloc("a", key(1))
	c.run(2)
	if ans, ok := c.answer[key(1)]; !ok || ans.Err != nil {
		t.Fatalf("a allocates nothing after the rejoin: %+v", ans)
	}
}

// TestRejoinWaitsForDeadOwnerUntilRmpeer: nobody heard of the removal
// before the reclaimer lost its disk (or no rmpeer was run yet), so the
// rejoining peer waits for the dead owner. Its status names it and says
// what to run; rmpeer of it is accepted while the peer holds back, ends the
// hold and takes the ranges over.
func TestRejoinWaitsForDeadOwnerUntilRmpeer(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "x"))
	c.run(5)
	c.peers["x"] = nil
	a := c.wipe("a", []PeerName{"b"})
	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)
	st := a.Status().Rejoin
	if !strings.Contains(st, "(x)") || !strings.Contains(st, "weft rmpeer NAME") {
		t.Fatalf("status %q: want it to name x and say what to run", st)
	}
	if err := a.PeerGone("x"); err != nil {
		t.Fatalf("rmpeer while holding back: %v", err)
	}
	c.ready("a")
	c.run(3 * simTiming.RemoveRetry)
	if st := a.Status().Rejoin; st != "" {
		t.Fatalf("a still holds back after rmpeer x: %q", st)
	}
	if slices.Contains(a.Ring().Peers(), "x") || !a.Ring().Equal(c.peers["b"].Ring()) {
		t.Fatalf("x not taken over, or the rings differ: %v / %v", a.Ring().Entries, c.peers["b"].Ring().Entries)
	}
}
