package router

import (
	"testing"
	"time"
)

// The Kubernetes side must not take a peer for dead while the mesh's view
// means nothing yet: before the mesh started, and after it started until
// it joined a peer or meshSettle passed.
func TestPeerMaybeAliveUntilTheMeshSettles(t *testing.T) {
	const peer = "02:00:00:00:00:01"
	r := &Router{}
	if !r.peerMaybeAlive(peer) {
		t.Fatal("a peer counted as dead before the mesh started")
	}
	recent := time.Now().Add(-meshSettle / 2)
	r.meshSince.Store(&recent)
	if !r.peerMaybeAlive(peer) {
		t.Fatal("a peer counted as dead before the mesh joined anyone or settled")
	}
	long := time.Now().Add(-meshSettle - time.Second)
	r.meshSince.Store(&long)
	if r.peerMaybeAlive(peer) {
		t.Fatal("a peer the settled mesh does not see counted as alive: a lone survivor could never reclaim")
	}
}
