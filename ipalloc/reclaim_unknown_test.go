package ipalloc

import (
	"slices"
	"testing"
)

// entryVersion returns the version of the entry at the token of r that
// holds a.
func entryVersion(r *Ring, a Address) uint32 { return r.Entries[r.index(a)].Version }

// addPeer adds a peer that starts without state and knows only peers.
func (c *cluster) addPeer(n PeerName, in Init, peers []PeerName) *Peer {
	c.t.Helper()
	c.inits[n] = in
	c.disk[n] = &HardState{}
	c.names = append(c.names, n)
	slices.Sort(c.names)
	return c.restartKnowing(n, peers)
}

// unseenFreeCounts has x allocate a few addresses while only the peers in
// seeing hear from it, then kills x; it returns the last address x gave.
func unseenFreeCounts(t *testing.T, c *cluster, x PeerName, seeing ...PeerName) Address {
	t.Helper()
	for _, n := range c.names {
		c.cut[n] = n != x && !slices.Contains(seeing, n)
	}
	for i := range 3 {
		c.alloc(x, key(100+i))
		c.run(simTiming.GossipEvery + 1) // free counts go out at most this often
	}
	a, ok := c.answer[key(102)]
	if !ok || a.Err != nil {
		t.Fatalf("%s allocated nothing: %+v", x, a)
	}
	c.peers[x] = nil // x dies
	c.queue = nil
	return a.Address
}

// TestReclaimBarrierLearnsMembers (sim seed 3846): a peer that came back
// under a new name after losing its disk knows only the peer it reached,
// and rmpeers its old name. The old name's last free counts are known
// only to an observer that the new peer never saw. The reclaim must wait
// for that observer too (its acknowledger knows it), not take over on a
// stale view; the old code completed with the one peer it knew, and then
// refused the observer's ring for good ("a ring update takes ranges this
// peer owns").
func TestReclaimBarrierLearnsMembers(t *testing.T) {
	inits := seeded("a", "x")
	inits["obs"] = Init{Observer: true}
	c := newCluster(t, "10.32.0.0/24", inits)
	c.run(5)
	at := unseenFreeCounts(t, c, "x", "obs")
	if va, vo := entryVersion(c.peers["a"].Ring(), at), entryVersion(c.peers["obs"].Ring(), at); vo <= va {
		t.Fatalf("obs has x's entry at version %d, a at %d: the setup failed", vo, va)
	}
	clear(c.cut)
	c.cut["obs"] = true // cut off, or down, while the new peer rejoins
	n := c.addPeer("x2", Init{Observer: true}, []PeerName{"a"})
	c.peers["a"].AddPeer("x2")
	c.ready("a")
	c.run(3)
	if err := n.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("x2")
	c.run(3 * simTiming.RemoveRetry)
	if slices.Contains(n.Members(), "obs") == false {
		t.Errorf("x2's members %v: obs, a member a knows, was not learnt from a's acknowledgement", n.Members())
	}
	if got := n.Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"obs"}) {
		t.Fatalf("the reclaim waits for %v, want [obs] (it took over: %v)", got, n.Owned())
	}
	delete(c.cut, "obs")
	c.peers["obs"].AddPeer("x2")
	c.ready("obs")
	c.run(3 * simTiming.RemoveRetry) // fails on a refused ring
	if slices.Contains(n.Ring().Peers(), "x") {
		t.Fatalf("x still owns ranges after obs came back: %+v", n.Status().Reclaims)
	}
	for _, q := range []PeerName{"a", "obs"} {
		if !c.peers[q].Ring().Equal(n.Ring()) {
			t.Errorf("%s's ring differs from x2's", q)
		}
	}
}

// TestReclaimBeatsUnseenFreeCounts (sim seed 8768): the dead peer's last
// free counts went only to a peer that nobody in the barrier knows (it
// joined while cut off from them). The takeover must still win over them
// when that peer comes back: with a version one above what the reclaimer
// saw, the unseen free counts won, gave the taken ranges back to the dead
// peer in every ring, and the reclaimer refused them for good.
func TestReclaimBeatsUnseenFreeCounts(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "x"))
	c.run(5)
	c.cut["a"] = true
	j := c.addPeer("j", Init{Observer: true}, []PeerName{"x"})
	c.peers["x"].AddPeer("j")
	c.ready("x")
	c.run(3)
	at := unseenFreeCounts(t, c, "x", "j")
	if va, vj := entryVersion(c.peers["a"].Ring(), at), entryVersion(j.Ring(), at); vj <= va+1 {
		t.Fatalf("j has x's entry at version %d, a at %d: the setup failed", vj, va)
	}
	clear(c.cut)
	c.cut["j"] = true
	a := c.peers["a"]
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3)
	if slices.Contains(a.Ring().Peers(), "x") {
		t.Fatalf("a did not take over: %+v", a.Status().Reclaims)
	}
	delete(c.cut, "j")
	a.AddPeer("j")
	c.ready("a")
	j.AddPeer("a")
	c.ready("j")
	c.run(3 * simTiming.RemoveRetry) // fails on a refused ring
	if !j.Ring().Equal(a.Ring()) || slices.Contains(j.Ring().Peers(), "x") {
		t.Fatalf("j's ring %v, a's %v", j.Ring().Entries, a.Ring().Entries)
	}
	if o, _ := a.Ring().Owner(at); o != "a" {
		t.Fatalf("%s is owned by %s, want a", at, o)
	}
}
