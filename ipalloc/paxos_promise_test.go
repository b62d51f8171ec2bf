package ipalloc

import (
	"math/rand/v2"
	"testing"
)

// An acceptor's promise is hard state: an acceptor that promised a ballot,
// crashed and came back from what it said to persist, must still refuse
// an Accept below that ballot. (The mutation table's
// 07-promise-not-persisted was caught by TestPaxosSafety's random seeds
// only sometimes.)
func TestPaxosPromiseSurvivesRestart(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	px := NewPaxos("a", 3, PaxosState{}, simTiming, rng)
	high, low := Ballot{Round: 2, Peer: "b"}, Ballot{Round: 1, Peer: "c"}
	out := px.Step("b", &PaxosMsg{Type: Prepare, Ballot: high, Size: 3})
	if len(out) != 1 || out[0].Msg.Type != Promise {
		t.Fatalf("prepare %v: %+v, want one promise", high, out)
	}
	var disk PaxosState // what the Ready after this step persists
	if px.Dirty() {
		disk = px.HardState()
		px.ClearDirty()
	}
	px = NewPaxos("a", 3, disk, simTiming, rng) // crash, restart
	for _, o := range px.Step("c", &PaxosMsg{Type: Accept, Ballot: low, Value: []PeerName{"a", "c"}, Size: 3}) {
		if o.Msg.Type == Accepted {
			t.Fatalf("accepted %v after promising %v before a restart", low, high)
		}
	}
}
