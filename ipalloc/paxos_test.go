package ipalloc

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// paxosNet is a tiny network of Paxos participants that drops, duplicates,
// reorders and crashes (restarting from what was persisted before each
// send), with a global view of every Accepted ever sent: a value is chosen
// when a quorum of acceptors sent Accepted for one ballot, whether or not
// any learner hears of it.
type paxosNet struct {
	rng     *rand.Rand
	names   []PeerName
	nodes   map[PeerName]*Paxos
	disk    map[PeerName]PaxosState
	msgs    []paxosWire
	votes   map[Ballot]map[PeerName]bool
	values  map[Ballot][]PeerName
	chosen  map[string]Ballot // value -> a ballot that chose it
	learned map[PeerName][]PeerName
	timing  Timing
	n       int
}

type paxosWire struct {
	from, to PeerName
	data     []byte
}

func newPaxosNet(seed uint64, n int) *paxosNet {
	pn := &paxosNet{
		rng:   rand.New(rand.NewPCG(seed, seed+1)),
		nodes: map[PeerName]*Paxos{}, disk: map[PeerName]PaxosState{},
		votes: map[Ballot]map[PeerName]bool{}, values: map[Ballot][]PeerName{},
		chosen: map[string]Ballot{}, learned: map[PeerName][]PeerName{},
		timing: Timing{PaxosRetry: 3, PaxosPatience: 4}, n: n,
	}
	for i := range n {
		nm := PeerName(fmt.Sprintf("n%d", i))
		pn.names = append(pn.names, nm)
		pn.restart(nm)
	}
	return pn
}

func (pn *paxosNet) restart(nm PeerName) {
	pn.nodes[nm] = NewPaxos(nm, pn.n, pn.disk[nm], pn.timing, rand.New(rand.NewPCG(pn.rng.Uint64(), 0)))
}

// out persists, then sends (the Ready contract).
func (pn *paxosNet) out(from PeerName, outs []PaxosOut) {
	px := pn.nodes[from]
	if px.Dirty() {
		pn.disk[from] = px.HardState()
		px.ClearDirty()
	}
	for _, o := range outs {
		tos := []PeerName{o.To}
		if o.To == "" {
			tos = nil
			for _, q := range pn.names {
				if q != from {
					tos = append(tos, q)
				}
			}
		}
		for _, to := range tos {
			pn.msgs = append(pn.msgs, paxosWire{from, to, EncodeMsg(o.Msg)})
		}
		if o.Msg.Type == Accepted { // also counts the sender's own vote
			pn.vote(from, o.Msg)
		}
	}
	if v, ok := px.Chosen(); ok {
		if prev, had := pn.learned[from]; had && !slices.Equal(prev, v) {
			panic(fmt.Sprintf("%s learned %v and then %v", from, prev, v))
		}
		pn.learned[from] = v
	}
}

func (pn *paxosNet) vote(acceptor PeerName, m *PaxosMsg) {
	v := pn.votes[m.Ballot]
	if v == nil {
		v = map[PeerName]bool{}
		pn.votes[m.Ballot] = v
	}
	if old, ok := pn.values[m.Ballot]; ok && !slices.Equal(old, m.Value) {
		panic(fmt.Sprintf("ballot %s carries %v and %v", m.Ballot, old, m.Value))
	}
	pn.values[m.Ballot] = m.Value
	v[acceptor] = true
	if len(v) >= pn.n/2+1 {
		pn.chosen[fmt.Sprint(m.Value)] = m.Ballot
	}
}

func (pn *paxosNet) step() {
	switch r := pn.rng.IntN(100); {
	case r < 60 && len(pn.msgs) > 0:
		i := pn.rng.IntN(len(pn.msgs))
		w := pn.msgs[i]
		pn.msgs = slices.Delete(pn.msgs, i, i+1)
		m, err := DecodeMsg(w.data)
		if err != nil {
			panic(err)
		}
		pn.out(w.to, pn.nodes[w.to].Step(w.from, m.(*PaxosMsg)))
	case r < 70 && len(pn.msgs) > 0:
		i := pn.rng.IntN(len(pn.msgs))
		pn.msgs = slices.Delete(pn.msgs, i, i+1)
	case r < 74 && len(pn.msgs) > 0:
		pn.msgs = append(pn.msgs, pn.msgs[pn.rng.IntN(len(pn.msgs))])
	case r < 90:
		nm := pn.names[pn.rng.IntN(len(pn.names))]
		pn.out(nm, pn.nodes[nm].Tick())
	case r < 96:
		nm := pn.names[pn.rng.IntN(len(pn.names))]
		pn.out(nm, pn.nodes[nm].Propose())
	default:
		pn.restart(pn.names[pn.rng.IntN(len(pn.names))])
	}
}

// TestPaxosSafety: across many seeds with drops, duplicates, reordering and
// crashes, never two different values chosen, and every learner learns the
// chosen one; once the network stops losing messages, everyone learns.
func TestPaxosSafety(t *testing.T) {
	r := newRand(t)
	seeds := 400
	if testing.Short() {
		seeds = 60
	}
	learnedAll := 0
	for range seeds {
		seed := r.Uint64()
		n := 3 + int(seed%5)
		pn := newPaxosNet(seed, n)
		func() {
			defer func() {
				if e := recover(); e != nil {
					t.Fatalf("seed %d (%d peers): %v", seed, n, e)
				}
			}()
			for range 3000 {
				pn.step()
			}
			// Heal: no more loss or crashes; everyone keeps proposing.
			for round := 0; round < 200 && len(pn.learned) < n; round++ {
				for len(pn.msgs) > 0 {
					w := pn.msgs[0]
					pn.msgs = pn.msgs[1:]
					m, _ := DecodeMsg(w.data)
					pn.out(w.to, pn.nodes[w.to].Step(w.from, m.(*PaxosMsg)))
				}
				for _, nm := range pn.names {
					pn.out(nm, pn.nodes[nm].Propose())
					pn.out(nm, pn.nodes[nm].Tick())
				}
			}
		}()
		if len(pn.chosen) > 1 {
			t.Fatalf("seed %d (%d peers): several values chosen: %v", seed, n, pn.chosen)
		}
		for nm, v := range pn.learned {
			if len(pn.chosen) != 1 || pn.chosen[fmt.Sprint(v)] == (Ballot{}) {
				t.Fatalf("seed %d: %s learned %v, but the chosen values are %v", seed, nm, v, pn.chosen)
			}
		}
		if len(pn.learned) == n {
			learnedAll++
		} else {
			t.Errorf("seed %d (%d peers): only %d learned after healing", seed, n, len(pn.learned))
		}
	}
	t.Logf("%d schedules, all peers learned in %d", seeds, learnedAll)
}

func TestPaxosValue(t *testing.T) {
	// Three peers, no loss: the value names every peer that answered.
	pn := newPaxosNet(1, 3)
	pn.out("n0", pn.nodes["n0"].Propose())
	for len(pn.msgs) > 0 {
		w := pn.msgs[0]
		pn.msgs = pn.msgs[1:]
		m, _ := DecodeMsg(w.data)
		pn.out(w.to, pn.nodes[w.to].Step(w.from, m.(*PaxosMsg)))
	}
	want := []PeerName{"n0", "n1", "n2"}
	for _, nm := range pn.names {
		if v, ok := pn.nodes[nm].Chosen(); !ok || !slices.Equal(v, want) {
			t.Errorf("%s: chosen %v, %v; want %v", nm, v, ok, want)
		}
	}
	if q := pn.nodes["n0"].Quorum(); q != 2 {
		t.Errorf("quorum of 3 = %d", q)
	}

	// With one peer silent, the proposer waits for patience, then proposes
	// what it knows with the quorum it has.
	pn = newPaxosNet(2, 3)
	pn.out("n0", pn.nodes["n0"].Propose())
	for tick := 0; ; tick++ {
		for len(pn.msgs) > 0 {
			w := pn.msgs[0]
			pn.msgs = pn.msgs[1:]
			if w.to == "n2" || w.from == "n2" {
				continue
			}
			m, _ := DecodeMsg(w.data)
			pn.out(w.to, pn.nodes[w.to].Step(w.from, m.(*PaxosMsg)))
		}
		if v, ok := pn.nodes["n0"].Chosen(); ok {
			if !slices.Equal(v, []PeerName{"n0", "n1"}) {
				t.Fatalf("chosen %v, want [n0 n1]", v)
			}
			if tick < pn.timing.PaxosPatience-1 {
				t.Fatalf("proposed after %d ticks, before patience %d ran out", tick, pn.timing.PaxosPatience)
			}
			break
		}
		if tick > 100 {
			t.Fatal("nothing chosen")
		}
		pn.out("n0", pn.nodes["n0"].Tick())
	}
}

func TestPaxosMsgValidate(t *testing.T) {
	b := Ballot{Round: 1, Peer: "a"}
	for _, tt := range []struct {
		m  PaxosMsg
		ok bool
	}{
		{PaxosMsg{Type: Prepare, Ballot: b}, true},
		{PaxosMsg{Type: Prepare}, false},
		{PaxosMsg{Type: Prepare, Ballot: b, Value: []PeerName{"a"}}, false},
		{PaxosMsg{Type: Accept, Ballot: b}, false},
		{PaxosMsg{Type: Accept, Ballot: b, Value: []PeerName{"a", "b"}}, true},
		{PaxosMsg{Type: Accept, Ballot: b, Value: []PeerName{"b", "a"}}, false},
		{PaxosMsg{Type: Accept, Ballot: b, Value: []PeerName{"a", "a"}}, false},
		{PaxosMsg{Type: Promise, Ballot: b}, true},
		{PaxosMsg{Type: Promise, Ballot: b, Accepted: b}, false},
		{PaxosMsg{Type: Promise, Ballot: b, Accepted: b, Value: []PeerName{"x"}}, true},
		{PaxosMsg{Type: 9, Ballot: b}, false},
		{PaxosMsg{Type: Nack, Ballot: Ballot{Round: 1, Peer: "bad name"}}, false},
	} {
		if err := tt.m.validate(); (err == nil) != tt.ok {
			t.Errorf("%+v: validate() = %v, want ok %v", tt.m, err, tt.ok)
		}
	}
}
