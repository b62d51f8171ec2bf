package ipalloc

import (
	"slices"
	"strings"
	"testing"
)

// allocateAll has n allocate until it fails, from key first on, and
// returns the addresses it got.
func (c *cluster) allocateAll(n PeerName, first int) []Address {
	c.t.Helper()
	var got []Address
	for i := first; i < first+1000; i++ {
		c.alloc(n, key(i))
		c.run(1)
		a, ok := c.answer[key(i)]
		if !ok || a.Err != nil {
			return got
		}
		got = append(got, a.Address)
	}
	c.t.Fatalf("%s never ran out of space", n)
	return nil
}

// TestFoundAskedFromOwner (make test-long's wipe seed 1191): a pod on a's
// node uses an address in b's range (a donation from b that every disk
// that knew of it lost). a, back without state, must ask b for it, and b
// must give it and never hand it out; an address that b holds already
// stays b's, and b says that two pods have it.
func TestFoundAskedFromOwner(t *testing.T) {
	c := newCluster(t, "10.32.0.0/26", seeded("a", "b"))
	c.run(5)
	bRanges := c.peers["b"].Owned()
	if len(bRanges) == 0 {
		t.Fatal("b owns nothing")
	}
	c.alloc("b", key(1))
	c.run(1)
	held := c.answer[key(1)].Address // b's pod
	lost := bRanges[0].Start + 7     // a's pod, in b's range
	if held == lost || !bRanges[0].Contains(held) {
		t.Fatalf("setup: b got %s", held)
	}

	a := c.wipe("a", []PeerName{"b"})
	a.HoldFound(map[Key]Address{key(100): lost, key(101): held})
	c.ready("a")
	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)

	if got, ok := a.Lookup(key(100)); !ok || got != lost {
		t.Fatalf("a does not hold %s for its pod (got %s, %v); events: %v", lost, got, ok, c.events)
	}
	if o, _ := c.peers["b"].Ring().Owner(lost); o != "a" {
		t.Errorf("b's ring gives %s to %s, not a", lost, o)
	}
	if !c.hasEvent("asking b for it") || !c.hasEvent("whose node uses them") {
		t.Errorf("neither side said what it did: %v", c.events)
	}
	if _, ok := a.Lookup(key(101)); ok {
		t.Errorf("a holds %s, which b holds for its own pod", held)
	}
	if !c.hasEvent("two pods have one address") {
		t.Errorf("b did not report the address both nodes use: %v", c.events)
	}
	if slices.Contains(c.allocateAll("b", 200), lost) {
		t.Fatalf("b handed out %s, which a's pod uses", lost)
	}
}

// TestFoundHandedOnAtTakeover (make test-long's wipe seed 1151): a pod on
// b's node uses an address in x's range (x gave it to b, and both lost
// what knew of it); x is dead and a removes it. b's acknowledgement says
// that its node uses the address, and a's takeover hands it to b instead
// of taking it.
func TestFoundHandedOnAtTakeover(t *testing.T) {
	c, lost := xDies(t)

	b := c.wipe("b", []PeerName{"a"})
	b.HoldFound(map[Key]Address{key(100): lost})
	c.ready("b")
	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)
	if _, ok := b.Lookup(key(100)); ok {
		t.Fatal("b holds the address before x's ranges are taken over: the test tests nothing")
	}
	if b.Status().Rejoin == "" {
		t.Fatal("b does not wait for x: the test tests nothing")
	}

	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3 * simTiming.RemoveRetry)
	if !c.hasEvent("rmpeer of x") || !c.hasEvent("which reports them in use on its node") {
		t.Fatalf("a did not take x over and hand the address on: %v", c.events)
	}
	if got, ok := b.Lookup(key(100)); !ok || got != lost {
		t.Fatalf("b does not hold %s for its pod (got %s, %v); events: %v", lost, got, ok, c.events)
	}
	if o, _ := c.peers["a"].Ring().Owner(lost); o != "b" {
		t.Errorf("a's ring gives %s to %s, not b", lost, o)
	}
	if slices.Contains(c.allocateAll("a", 200), lost) {
		t.Fatalf("a handed out %s, which b's pod uses", lost)
	}
	for _, e := range c.events {
		if strings.Contains(e, "a pod there may get the same address") {
			t.Errorf("warned: %s", e)
		}
	}
}

// TestRejoinWaitsForMembers (make test-long's wipe seeds 4238 and 5481): a
// gave part of its range to d, a peer that owns nothing else, and then
// lost its disk; d is down when a comes back, so neither the ring a learns
// (b's, which never saw the donation) nor its mesh names d. a must learn d
// from b's members and wait for it, not allocate from the range it gave.
func TestRejoinWaitsForMembers(t *testing.T) {
	inits := seeded("a", "b")
	inits["d"] = Init{Seeds: []PeerName{"a", "b"}} // joins, owns nothing
	c := newCluster(t, "10.32.0.0/26", inits)
	c.run(10)
	// a gives d space that only d sees; then a dies, and d is cut off.
	c.cut = map[PeerName]bool{"b": true}
	if err := c.peers["a"].Step("d", &DonateRequest{ID: 1}); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(1)
	given := c.peers["d"].Owned()
	if len(given) == 0 {
		t.Fatal("setup: d got no donation")
	}
	c.peers["a"] = nil
	c.queue = nil
	c.cut = map[PeerName]bool{"d": true}

	a := c.wipe("a", []PeerName{"b"}) // the mesh shows it b alone
	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)
	st := a.Status().Rejoin
	if !strings.Contains(st, "(d)") {
		t.Fatalf("a does not wait for d, which holds its lost self's donation: %q", st)
	}
	for i := 0; i < 20; i++ {
		c.alloc("a", key(i))
	}
	c.run(2)
	for i := 0; i < 20; i++ {
		if ans, ok := c.answer[key(i)]; ok && ans.Err == nil {
			t.Fatalf("a allocated %s while it waits for d", ans.Address)
		}
	}

	c.reconnect("d", "a")
	if st := a.Status().Rejoin; st != "" {
		t.Fatalf("a still holds back with d back: %q", st)
	}
	for _, rg := range given {
		if o, _ := a.Ring().Owner(rg.Start); o != "d" {
			t.Errorf("a's ring gives %s, which a's lost self gave d, to %s", rg, o)
		}
	}
	for i := 100; i < 110; i++ { // fewer than a's own free addresses: no donation back
		c.alloc("a", key(i))
	}
	c.run(2)
	for i := 100; i < 110; i++ {
		if ans, ok := c.answer[key(i)]; ok && ans.Err == nil && slices.ContainsFunc(given, func(rg Range) bool { return rg.Contains(ans.Address) }) {
			t.Fatalf("a allocated %s, in the range its lost self gave d (%v); a owns %v, ring %v", ans.Address, given, a.Owned(), a.Ring().Entries)
		}
	}
}

// newPairWanted starts seeds a and b and returns the first address b
// would hand out.
func newPairWanted(t *testing.T) (*cluster, Address) {
	t.Helper()
	c := newCluster(t, "10.32.0.0/26", seeded("a", "b"))
	c.run(5)
	bRanges := c.peers["b"].Owned()
	if len(bRanges) == 0 {
		t.Fatal("b owns nothing")
	}
	return c, bRanges[0].Start
}

// TestWantWhileHoldingBack (make test-long seed 7268): a's pod uses an
// address in b's range; b, back without state, holds back when a's Want
// arrives, and has allocations waiting. When its hold ends it must give
// the address to a before it serves them, not hand it to one of them
// while a's next retry is still on its way.
func TestWantWhileHoldingBack(t *testing.T) {
	c, wanted := newPairWanted(t)

	b := c.wipe("b", []PeerName{"a"})
	if err := b.Step("a", &Want{Addrs: []Address{wanted}}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 8; i++ {
		b.Allocate(key(i))
	}
	c.ready("b")
	if b.Status().Rejoin == "" {
		t.Fatal("b does not hold back: the test tests nothing")
	}
	c.pushPull("a", "b")
	c.run(3)
	if st := b.Status().Rejoin; st != "" {
		t.Fatalf("b still holds back: %q", st)
	}
	for i := 0; i < 8; i++ {
		if ans, ok := c.answer[key(i)]; ok && ans.Err == nil && ans.Address == wanted {
			t.Fatalf("b handed %s, which a asked for while b held back, to %s", wanted, key(i))
		}
	}
	if o, _ := b.Ring().Owner(wanted); o != "a" {
		t.Errorf("b's ring gives %s to %s, not a", wanted, o)
	}
}

// TestMembersAnswerCarriesFoundPods (make test-long's seed 5585): every
// disk is lost. a's node runs a pod at an address that a donation of b's
// lost self gave it; the first claim both rebuild gives it to b. b ends
// its hold on a's answer to its Members ask; a's Want for the address is
// lost. The answer lists what a's node uses, and b gives the address to a
// before it hands out anything, instead of to its own first pod.
func TestMembersAnswerCarriesFoundPods(t *testing.T) {
	c, wanted := newPairWanted(t)
	c.drop = func(from, to PeerName, m Msg) bool {
		_, want := m.(*Want)
		return want
	}

	a := c.wipe("a", []PeerName{"b"})
	b := c.wipe("b", []PeerName{"a"})
	a.HoldFound(map[Key]Address{key(100): wanted})
	c.ready("a")
	for i := 0; i < 8; i++ {
		b.Allocate(key(i))
	}
	c.ready("b")
	if b.Status().Rejoin == "" || a.Status().Rejoin == "" {
		t.Fatal("a or b does not hold back: the test tests nothing")
	}
	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)
	if st := b.Status().Rejoin; st != "" {
		t.Fatalf("b still holds back: %q", st)
	}
	for i := 0; i < 8; i++ {
		if ans, ok := c.answer[key(i)]; ok && ans.Err == nil && ans.Address == wanted {
			t.Fatalf("b handed %s, in use on a's node, to %s; events: %v", wanted, key(i), c.events)
		}
	}
	if got, ok := a.Lookup(key(100)); !ok || got != wanted {
		t.Errorf("a does not hold %s for its pod (got %s, %v); events: %v", wanted, got, ok, c.events)
	}
}

// TestLateAckReportIsNoDuplicate (make test-long seed 17740): b's
// acknowledgement of a's removal of x reports an address in use on b's
// node, but it arrives late: meanwhile that pod is gone and the address
// is a's and held by a's own pod. The takeover keeps it with a, as before,
// and does not warn of two pods with one address: b does not use it any
// more, so b does not ask for it either.
func TestLateAckReportIsNoDuplicate(t *testing.T) {
	c := newCluster(t, "10.32.0.0/26", seeded("a", "b", "x"))
	c.run(5)
	oldRing := c.peers["b"].Ring() // what b's late acknowledgement carries
	c.peers["x"] = nil             // x dies
	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3 * simTiming.RemoveRetry)
	if !c.hasEvent("rmpeer of x") {
		t.Fatalf("a did not take x over: %v", c.events)
	}
	c.alloc("a", key(1))
	c.run(1)
	ans := c.answer[key(1)]
	if ans.Err != nil {
		t.Fatal(ans.Err)
	}

	// The acknowledgement b sent while its (since deleted) pod used the
	// address, delivered now.
	if err := c.peers["a"].Step("b", &RemoveAck{Peer: "x", Ring: oldRing, Members: []PeerName{"a"}, InUse: []Address{ans.Address}}); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3 * simTiming.RemoveRetry)
	if got, ok := c.peers["a"].Lookup(key(1)); !ok || got != ans.Address {
		t.Fatalf("a no longer holds %s for its pod (got %s, %v)", ans.Address, got, ok)
	}
	if o, _ := c.peers["a"].Ring().Owner(ans.Address); o != "a" {
		t.Errorf("a's ring gives %s, which a's pod uses, to %s", ans.Address, o)
	}
	if c.hasEvent("two pods have one address") {
		t.Errorf("a warned of a duplicate that a late report made: %v", c.events)
	}
}

// TestDuplicateAtTakeoverReported: pods on both a's and b's nodes use an
// address in x's range (each found on its bridge after its state was
// lost; a donation that both lost). When a takes x over, the address
// stays with a's pod, and b, whose pod still uses it, asks a for it: a
// warns, naming both, and b does not hold it.
func TestDuplicateAtTakeoverReported(t *testing.T) {
	c, dup := xDies(t)
	c.peers["a"].HoldFound(map[Key]Address{key(200): dup})
	c.ready("a")
	b := c.wipe("b", []PeerName{"a"})
	b.HoldFound(map[Key]Address{key(100): dup})
	c.ready("b")
	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)
	if c.hasEvent("two pods have one address") {
		t.Fatalf("warned before x's range has an owner that holds it: %v", c.events)
	}

	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(6 * simTiming.RemoveRetry)
	if !c.hasEvent("rmpeer of x") {
		t.Fatalf("a did not take x over: %v", c.events)
	}
	if got, ok := c.peers["a"].Lookup(key(200)); !ok || got != dup {
		t.Fatalf("a does not hold %s for its pod (got %s, %v); events: %v", dup, got, ok, c.events)
	}
	if _, ok := b.Lookup(key(100)); ok {
		t.Errorf("b holds %s too", dup)
	}
	if !c.hasEvent("b asks for " + dup.String()) {
		t.Errorf("a did not report the address both nodes use: %v", c.events)
	}
}

// xDies starts seeds a, b and x, and kills x; it returns an address in
// x's range.
func xDies(t *testing.T) (*cluster, Address) {
	t.Helper()
	c := newCluster(t, "10.32.0.0/26", seeded("a", "b", "x"))
	c.run(5)
	xRanges := c.peers["x"].Owned()
	if len(xRanges) == 0 {
		t.Fatal("x owns nothing")
	}
	c.peers["x"] = nil // x dies
	return c, xRanges[0].Start + 3
}
