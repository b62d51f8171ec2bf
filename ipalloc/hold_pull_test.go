package ipalloc

import "testing"

// TestHoldPullsRings: a peer that holds back waits for a claimed ring
// from every other owner (peer_rejoin.go). The rings it waits for come
// unasked (showClaim, AddPeer, broadcasts, the mesh's push-pull), and any
// of them may be lost: here every broadcast is, and every ring a and g
// send each other before the claim has settled. Neither then has news,
// and this network has no push-pull. Each must pull the other's ring (an
// empty Want), and each must answer the pull although it holds back
// itself, or neither allocates, for good.
func TestHoldPullsRings(t *testing.T) {
	const n = 7
	c := newConsensusCluster(t, n)
	c.noBroadcast = true
	lose := true
	pulls := 0
	c.drop = func(from, to PeerName, m Msg) bool {
		if w, ok := m.(*Want); ok && len(w.Addrs) == 0 {
			pulls++
		}
		_, ring := m.(*RingMsg)
		return lose && ring && (from == "g" && to == "a" || from == "a" && to == "g")
	}
	for i, name := range c.names {
		c.alloc(name, key(i))
	}
	c.run(40)
	if c.answer[key(1)].Address == 0 {
		t.Fatalf("b has no address after 40 ticks: %+v; the test tests nothing", c.answer[key(1)])
	}
	for i, name := range []PeerName{"a", "g"} {
		if a := c.answer[key(i*6)]; a.Address != 0 || !c.peers[name].rejoining() {
			t.Fatalf("%s allocated without the other's ring (%+v, holding %v): the test tests nothing", name, a, c.peers[name].rejoining())
		}
	}
	lose = false
	c.run(3 * simTiming.DonationRetry)
	for i, name := range []PeerName{"a", "g"} {
		if a := c.answer[key(i*6)]; a.Err != nil || a.Address == 0 {
			t.Errorf("%s: no address %d ticks after the rings could pass again: %+v; status %s, holding for %v",
				name, 3*simTiming.DonationRetry, a, c.peers[name].Status(), c.peers[name].rejoinWaits())
		}
	}
	if pulls == 0 {
		t.Error("no ring was pulled")
	}
}
