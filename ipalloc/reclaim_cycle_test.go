package ipalloc

import (
	"slices"
	"strings"
	"testing"
)

// TestLostReclaimerGoesFirstAgain (make test-long's wipe seed 6037): a
// removes x and loses its disk; its Remove reaches b late, after b and c
// removed x at once. b gives way to a (the lower name), c to b, and a,
// which forgot its reclaim, records b's. Each record names another peer
// that gives way, and nobody would ever take x over. b reminds a that it
// removes x; a's record of b, a reclaimer that goes after it, does not
// stand: a takes the reclaim up again, and x's ranges are taken over.
func TestLostReclaimerGoesFirstAgain(t *testing.T) {
	c := newCluster(t, "10.32.0.0/26", seeded("a", "b", "c", "x"))
	c.run(5)
	xRanges := c.peers["x"].Owned()
	if len(xRanges) == 0 {
		t.Fatal("setup: x owns nothing")
	}
	c.peers["x"] = nil // x dies
	c.queue = nil

	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	var late []simMsg // a's Remove to b, delivered after a lost its disk
	for _, m := range c.queue {
		if m.from == "a" && m.to == "b" {
			late = append(late, m)
		}
	}
	c.queue = nil
	c.wipe("a", []PeerName{"b", "c"})
	for _, n := range []PeerName{"b", "c"} {
		if err := c.peers[n].PeerGone("x"); err != nil {
			t.Fatal(err)
		}
		c.ready(n)
	}
	// b's and c's Removes reach a first (a, which forgot, records b's),
	// then a's late Remove reaches b, which gives way to a.
	c.queue = append(c.queue, late...)
	rec := func(n PeerName) PeerName { return c.peers[n].removed["x"] }
	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)
	for _, n := range []PeerName{"a", "b", "c"} {
		if slices.Contains(c.peers[n].Ring().Peers(), "x") {
			t.Errorf("%s's ring still gives x ranges (records a:%s b:%s c:%s); events: %v", n, rec("a"), rec("b"), rec("c"), c.events)
		}
	}
	if !c.hasEvent("a: ipalloc: b records that this peer removes x (weft rmpeer), which this peer recorded as b's") {
		t.Errorf("a did not say why it took the reclaim up: %v", c.events)
	}
	for _, e := range c.events {
		if strings.Contains(e, "refused") {
			t.Errorf("refused: %s", e)
		}
	}
}
