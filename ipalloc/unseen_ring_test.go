package ipalloc

import (
	"strings"
	"testing"
)

// TestReclaimWaitsForTheClustersRing (make test-long's wipe seed 8935): x
// alone made the first claim and gave a and b space; a and b allocated. x
// dies, b is down, and a loses its disk with a pod still on its node. The
// only peer a hears is j, a joiner that knows nothing but the first claim
// (x owns everything). The operator runs rmpeer x on a. The barrier holds
// nobody that knows the cluster's ring (j acknowledges, and names only a),
// and the old code took the whole range over: b's range too, from which
// b's pods have their addresses. a must wait until a peer that has the
// cluster's ring is back, and then take over only what x still owns.
func TestReclaimWaitsForTheClustersRing(t *testing.T) {
	seed := Init{Seeds: []PeerName{"x"}}
	c := newCluster(t, "10.32.0.0/26", map[PeerName]Init{"x": seed, "a": seed, "b": seed})
	c.run(5)
	c.alloc("a", key(1))
	c.alloc("b", key(2))
	c.run(3 * simTiming.RemoveRetry)
	aAddr, bAddr := c.answer[key(1)].Address, c.answer[key(2)].Address
	if c.answer[key(1)].Err != nil || c.answer[key(2)].Err != nil {
		t.Fatalf("setup: a or b got no address: %+v %+v", c.answer[key(1)], c.answer[key(2)])
	}
	if o, _ := c.peers["b"].Ring().Owner(bAddr); o != "b" {
		t.Fatalf("setup: b's address %s is %s's", bAddr, o)
	}

	c.peers["x"], c.peers["b"] = nil, nil // x dies; b is down
	c.queue = nil
	a := c.wipe("a", nil)
	if !a.Ring().FirstClaimOnly() {
		t.Fatalf("setup: a's ring after the wipe is not the first claim alone: %v", a.Ring())
	}
	a.HoldFound(map[Key]Address{key(1): aAddr})
	c.ready("a")
	c.addPeer("j", seed, []PeerName{"a"})
	c.pushPull("a", "j")
	c.run(2)
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3 * simTiming.RemoveRetry)

	if o, _ := a.Ring().Owner(bAddr); o == "a" {
		t.Fatalf("a took over b's range (%s, in use by b's pod) on a ring that is only the first claim; events: %v", bAddr, c.events)
	}
	if c.hasEvent("IPs taken over") {
		t.Fatalf("a completed the reclaim: %v", c.events)
	}
	if !c.hasEvent("rmpeer waits: this node's pods use 1 addresses") {
		t.Errorf("a did not say why the reclaim waits: %v", c.events)
	}

	// b is back: its ring names a (a rejoins) and b joins the barrier.
	c.restartKnowing("b", []PeerName{"a", "j"})
	c.reconnect("b", "a")
	c.run(3 * simTiming.RemoveRetry)
	if !c.hasEvent("rmpeer of x: ") || !c.hasEvent("IPs taken over") {
		t.Fatalf("a did not complete the reclaim once b was back: %v", c.events)
	}
	if got, ok := a.Lookup(key(1)); !ok || got != aAddr {
		t.Errorf("a does not hold %s for its pod (got %s, %v)", aAddr, got, ok)
	}
	for _, n := range []PeerName{"a", "b", "j"} {
		if o, _ := c.peers[n].Ring().Owner(bAddr); o != "b" {
			t.Errorf("%s's ring gives b's address %s to %s", n, bAddr, o)
		}
	}
	if rg, ok := overlap(a, c.peers["b"]); ok {
		t.Errorf("a and b both own %s", rg)
	}
	for _, e := range c.events {
		if strings.Contains(e, "x") && strings.Contains(e, "refused") {
			t.Errorf("refused: %s", e)
		}
	}
}

// TestReclaimWaitsWhenTheAckerLostStateToo (make test-long seed 18083):
// x and q made the first claim; x gave a and b space, and both allocated.
// x dies and b is down; a and q both lose their disks, with their pods
// still on their nodes. Neither knows more than the first claim, and q,
// which owns half of it, moves its own entries on (it allocates). a runs
// rmpeer x: q's acknowledgement brings q's ring, which is no longer the
// first claim alone, so ringUnseen let the takeover go on, over x's whole
// first share, b's address with it. a must wait, since its own pod's
// address lies in an entry of x that its ring has as the first claim made
// it, and take over only what x still owns once b is back.
func TestReclaimWaitsWhenTheAckerLostStateToo(t *testing.T) {
	seed := Init{Seeds: []PeerName{"q", "x"}}
	c := newCluster(t, "10.32.0.0/26", map[PeerName]Init{"x": seed, "q": seed, "a": seed, "b": seed})
	c.run(5)
	c.cut["q"] = true // a and b ask x for space
	c.alloc("a", key(1))
	c.alloc("b", key(2))
	c.run(3 * simTiming.RemoveRetry)
	delete(c.cut, "q")
	c.run(3 * simTiming.RemoveRetry)
	aAddr, bAddr := c.answer[key(1)].Address, c.answer[key(2)].Address
	if c.answer[key(1)].Err != nil || c.answer[key(2)].Err != nil {
		t.Fatalf("setup: a or b got no address: %+v %+v", c.answer[key(1)], c.answer[key(2)])
	}
	first := NewRing(c.peers["x"].Ring().Universe)
	if err := first.ClaimEvenly([]PeerName{"q", "x"}); err != nil {
		t.Fatal(err)
	}
	for _, ad := range []Address{aAddr, bAddr} {
		if o, _ := first.Owner(ad); o != "x" {
			t.Fatalf("setup: %s is in %s's first share, want x's", ad, o)
		}
	}

	c.peers["x"], c.peers["b"] = nil, nil // x dies; b is down
	c.queue = nil
	q := c.wipe("q", []PeerName{"a"})
	a := c.wipe("a", []PeerName{"q"})
	a.HoldFound(map[Key]Address{key(1): aAddr})
	c.ready("a")
	c.run(2)
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3 * simTiming.RemoveRetry)
	c.alloc("q", key(3)) // q moves its own entries on
	c.run(2)
	c.pushPull("a", "q")
	c.run(3 * simTiming.RemoveRetry)
	if q.Ring().FirstClaimOnly() || a.Ring().FirstClaimOnly() {
		t.Fatalf("setup: q did not move its entries on: q's ring %v, a's %v; events %v", q.Ring().Entries, a.Ring().Entries, c.events)
	}

	if o, _ := a.Ring().Owner(bAddr); o == "a" {
		t.Fatalf("a took over b's address %s on rings that know only the first claim; events: %v", bAddr, c.events)
	}
	if c.hasEvent("IPs taken over") {
		t.Fatalf("a completed the reclaim: %v", c.events)
	}
	if !c.hasEvent("rmpeer of x waits: " + aAddr.String() + " is in use on this node") {
		t.Errorf("a did not say why the reclaim waits: %v", c.events)
	}

	// b is back with the cluster's ring: a takes over what x still owns.
	c.restartKnowing("b", []PeerName{"a", "q"})
	c.reconnect("b", "a")
	c.reconnect("b", "q")
	c.run(3 * simTiming.RemoveRetry)
	if !c.hasEvent("IPs taken over") {
		t.Fatalf("a did not complete the reclaim once b was back: %v", c.events)
	}
	for _, n := range []PeerName{"a", "b", "q"} {
		if o, _ := c.peers[n].Ring().Owner(bAddr); o != "b" {
			t.Errorf("%s's ring gives b's address %s to %s", n, bAddr, o)
		}
	}
	if got, ok := a.Lookup(key(1)); !ok || got != aAddr {
		t.Errorf("a does not hold %s for its pod (got %s, %v)", aAddr, got, ok)
	}
	if rg, ok := overlap(a, c.peers["b"]); ok {
		t.Errorf("a and b both own %s", rg)
	}
}
