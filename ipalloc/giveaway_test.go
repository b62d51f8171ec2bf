package ipalloc

import "testing"

// GiveAway is the last guard of a donation: whatever range the caller
// picked, one with an address in use never leaves this peer (the
// mutation table's 12-donation-of-held-address survived without this).
func TestGiveAwayRefusesHeldAddress(t *testing.T) {
	a := NewAllocator(self, rangeOf("10.32.0.0/24"))
	r := NewRing(rangeOf("10.32.0.0/24"))
	if err := r.ClaimEvenly([]PeerName{self}); err != nil {
		t.Fatal(err)
	}
	if err := a.SetRing(r); err != nil {
		t.Fatal(err)
	}
	held, _, err := a.Allocate(key(1))
	if err != nil {
		t.Fatal(err)
	}
	around := Range{held - held%16, held - held%16 + 16}
	if err := a.GiveAway("other", around); err == nil {
		t.Fatalf("gave away %v with %s held in it", around, held)
	}
	if owner, _ := a.Ring().Owner(held); owner != self {
		t.Fatalf("after a refused GiveAway, %s is owned by %q", held, owner)
	}
	// A range with nothing held in it goes.
	free := Range{around.End, around.End + 16}
	if err := a.GiveAway("other", free); err != nil {
		t.Fatalf("giving away the free %v: %v", free, err)
	}
}
