package ipalloc

import "testing"

// TestGossipIsTheLastReadysRing (mutant 16): the ring offered in a
// full-state exchange is the one of the last Ready, never the live ring:
// a change the shell has not persisted yet (here a donation) must not
// leave the peer, or after a crash its disk would contradict what the
// others heard. The simulation caught the mutant only on some seeds.
func TestGossipIsTheLastReadysRing(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b"))
	c.run(3)
	a := c.peers["a"]
	saved := a.Gossip()
	if !saved.Equal(c.disk["a"].Ring) {
		t.Fatalf("after its Ready, a offers a ring that is not the one on its disk")
	}
	if err := a.Step("b", &DonateRequest{ID: 1}); err != nil {
		t.Fatal(err)
	}
	if a.Ring().Equal(saved) {
		t.Fatalf("the donation did not change a's live ring: the test shows nothing")
	}
	if !a.Gossip().Equal(saved) {
		t.Fatalf("before its Ready is persisted, a offers a ring with the donation in it")
	}
	rd := a.Ready()
	if rd.Ring == nil || !a.Gossip().Equal(rd.Ring) {
		t.Fatalf("after the Ready, a does not offer that Ready's ring")
	}
}
