package ipalloc

import "testing"

// A fresh cluster's peers hold back until each has heard from every other
// owner (peer_rejoin.go); the owners' claims shown end that within moments.
// A peer with pods waiting must not ask another for space meanwhile: it
// owns its third, it just does not know yet (found by the e2e test of
// three routers: a peer with a third of the range was given more while it
// still waited for the third owner). Nor when the hold lasts: it can
// allocate from nothing before the hold ends, so a donation would only
// split the ring (a fresh consensus=100 cluster: 300 to 540 entries that
// no pod needed); it pulls the rings it waits for instead.
func TestHoldingPeerAsksNoDonation(t *testing.T) {
	c := newCluster(t, "10.32.0.0/26", map[PeerName]Init{"a": {Consensus: 3}, "b": {Consensus: 3}, "c": {Consensus: 3}})
	c.cut["c"] = true // a and b claim (a quorum of 2) and wait to hear from c
	c.alloc("a", key(1))
	c.alloc("b", key(2))
	claimedAt := -1
	asks := 0
	check := func(i int) {
		for _, m := range c.queue {
			msg, err := DecodeMsg(m.data)
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := msg.(*DonateRequest); ok {
				asks++
				if c.peers[m.from].rejoining() {
					t.Fatalf("tick %d (claimed at %d): %s asked %s for space while it holds back", i, claimedAt, m.from, m.to)
				}
			}
		}
	}
	// However long the hold lasts, a holding peer asks nobody.
	for i := 0; claimedAt < 0 || i < claimedAt+5*simTiming.DonationRetry; i++ {
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
		check(i)
	}
	// Everyone gets an address once c is back, from its own third: the
	// ring is still the claim's three ranges.
	delete(c.cut, "c")
	c.alloc("c", key(3))
	for i := range 60 {
		c.run(1)
		check(i)
	}
	for _, k := range []Key{key(1), key(2), key(3)} {
		if a := c.answer[k]; a.Err != nil || a.Address == 0 {
			t.Fatalf("allocation %v: %+v", k, a)
		}
	}
	if asks != 0 || len(c.peers["a"].Ring().Entries) != 3 {
		t.Errorf("%d donation requests, a's ring has %d entries: want none and the claim's 3", asks, len(c.peers["a"].Ring().Entries))
	}
}
