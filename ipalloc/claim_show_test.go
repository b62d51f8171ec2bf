package ipalloc

import "testing"

// TestConsensusClaimShownWithoutBroadcast: every peer of a fresh
// consensus cluster starts without state and holds back until it has
// merged a claimed ring from every other owner (peer_rejoin.go). The ring
// every peer claims from the chosen value is the same, and past the mesh's
// broadcast limit (about 60 owners) no broadcast carries it: each peer
// must show the others its claim itself (showClaim), or the cluster
// allocates nothing until the periodic push-pull has brought every peer a
// ring from every other (a fresh consensus=100 cluster: no first address
// within minutes). Here no broadcast arrives at all, nor any Members ask.
func TestConsensusClaimShownWithoutBroadcast(t *testing.T) {
	const n = 7
	c := newConsensusCluster(t, n)
	c.noBroadcast = true
	// The Members answers go along with the rings (each peer owns
	// ranges, so its hold waits for every owner's members): no ask is
	// needed, and none arrives here.
	c.drop = func(from, to PeerName, m Msg) bool {
		mm, ok := m.(*Members)
		return ok && mm.Ask
	}
	for i, name := range c.names {
		c.alloc(name, key(i))
	}
	c.run(60)
	for i, name := range c.names {
		a, ok := c.answer[key(i)]
		if !ok || a.Err != nil || a.Address == 0 {
			t.Errorf("%s: no address after 60 ticks: %+v (answered %v); status %s, holding for %v",
				name, a, ok, c.peers[name].Status(), c.peers[name].rejoinWaits())
		}
	}
}
