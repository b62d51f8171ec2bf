package ipalloc

import "testing"

// A fresh cluster's peers hold back until each has heard from every other
// owner (peer_rejoin.go); the owners' broadcasts of the first claim end
// that within moments. A peer with pods waiting must not ask another for
// space meanwhile: it owns its third, it just does not know yet (found by
// the e2e test of three routers: a peer with a third of the range was
// given more while it still waited for the third owner).
func TestHoldingPeerAsksNoDonation(t *testing.T) {
	c := newCluster(t, "10.32.0.0/26", map[PeerName]Init{"a": {Consensus: 3}, "b": {Consensus: 3}, "c": {Consensus: 3}})
	c.cut["c"] = true // a and b claim (a quorum of 2) and wait to hear from c
	c.alloc("a", key(1))
	c.alloc("b", key(2))
	// Up to a donation retry after the claim, a holding peer asks nobody.
	claimedAt := -1
	for i := 0; claimedAt < 0 || i < claimedAt+simTiming.DonationRetry; i++ {
		if i > 200 {
			t.Fatal("a and b never claimed the ring")
		}
		c.run(1)
		if claimedAt < 0 && !c.peers["a"].Ring().Empty() {
			claimedAt = i
			if !c.peers["a"].rejoining() {
				t.Fatal("a does not wait for c: the test tests nothing")
			}
		}
		for _, m := range c.queue {
			msg, err := DecodeMsg(m.data)
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := msg.(*DonateRequest); ok && c.peers[m.from].rejoining() {
				t.Fatalf("tick %d (claimed at %d): %s asked %s for space while it holds back", i, claimedAt, m.from, m.to)
			}
		}
	}
	// A hold that lasts asks after all (its answer brings a ring), and
	// everyone gets an address once c is back.
	delete(c.cut, "c")
	c.alloc("c", key(3))
	c.run(60)
	for _, k := range []Key{key(1), key(2), key(3)} {
		if a := c.answer[k]; a.Err != nil || a.Address == 0 {
			t.Fatalf("allocation %v: %+v", k, a)
		}
	}
}
