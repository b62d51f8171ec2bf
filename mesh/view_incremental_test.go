package mesh

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

// TestViewDerivedIncrementally: after every one of thousands of random
// changes (peers alive, dead, forgotten; reports naming peers unreachable,
// leaving, with duplicates, naming unknown peers and their own origin),
// every peer's state, UnreachableFrom and ReachableFrom, and the counts of
// peers by state and alive, are what deriving every peer from scratch
// gives. The view derives only the peers a change
// concerns (refreshLocked); a caller that forgets to name one leaves it
// stale, and this fails.
func TestViewDerivedIncrementally(t *testing.T) {
	c := newCluster(t)
	p := c.start(1, Config{})
	defer closeAll(t, p)
	m := p.m
	rng := rand.New(rand.NewPCG(1, 2))
	names := make([]PeerName, 24)
	for i := range names {
		names[i] = PeerName(fmt.Sprintf("peer%02d", i))
	}
	names = append(names, m.Name()) // reports may name this peer too
	version := uint64(0)
	pick := func() PeerName { return names[rng.IntN(len(names)-1)] } // not self
	for step := range 5000 {
		var op string
		switch r := rng.IntN(10); {
		case r < 3:
			n := pick()
			op = "alive " + string(n)
			m.onAlive(n, netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 2, 0, byte(rng.IntN(3))}), 6783), nil)
		case r < 5:
			n := pick()
			op = "dead " + string(n)
			m.onDead(n)
		case r < 6:
			n := pick()
			op = "forget " + string(n)
			_ = m.Forget(n) // refused for a live peer: fine
		default:
			var reps []report
			for range 1 + rng.IntN(3) {
				version++
				rep := report{Origin: pick(), Version: version, Leaving: rng.IntN(8) == 0}
				for range rng.IntN(4) {
					rep.Unreachable = append(rep.Unreachable, names[rng.IntN(len(names))])
				}
				if rng.IntN(10) == 0 {
					rep.Unreachable = append(rep.Unreachable, "stranger") // a peer of no view
				}
				reps = append(reps, rep)
			}
			op = fmt.Sprintf("reports %v", reps)
			m.applyReports(reps)
		}
		if err := viewMatchesScratch(m); err != nil {
			t.Fatalf("step %d (%s): %v", step, op, err)
		}
	}
}

// viewMatchesScratch derives every peer as the view did before it was
// incremental, and compares.
func viewMatchesScratch(m *Mesh) error {
	m.mu.Lock()
	from := map[PeerName][]PeerName{}
	for origin, rep := range m.reports {
		if o := m.peers[origin]; o == nil || o.base != StateAlive || rep.Leaving {
			continue
		}
		for _, n := range rep.Unreachable {
			if n != origin && !slices.Contains(from[n], origin) {
				from[n] = append(from[n], origin)
			}
		}
	}
	alive := 0
	for _, p := range m.peers {
		if p.base == StateAlive {
			alive++
		}
	}
	type want struct {
		state       PeerState
		unreachable []PeerName
		reach       int
	}
	wants := map[PeerName]want{}
	for _, p := range m.peers {
		unreachable := slices.Sorted(slices.Values(from[p.Name]))
		others := alive
		if p.base == StateAlive {
			others--
		}
		reach := others - len(unreachable)
		if !p.Self && p.base != StateAlive {
			reach--
		}
		state := p.base
		if state == StateAlive && len(unreachable) > 0 && !p.Self {
			state = StateSuspect
		}
		wants[p.Name] = want{state, unreachable, max(reach, 0)}
	}
	var counts [StateLeft + 1]int
	for _, p := range m.peers {
		counts[wants[p.Name].state]++
	}
	gotCounts, gotAlive := m.counts, m.alive
	m.mu.Unlock()
	if gotCounts != counts || gotAlive != alive {
		return fmt.Errorf("peers by state %v and %d alive; from scratch %v and %d", gotCounts, gotAlive, counts, alive)
	}
	for _, got := range m.Peers() {
		w := wants[got.Name]
		if got.State != w.state || !slices.Equal(got.UnreachableFrom, w.unreachable) || got.ReachableFrom != w.reach {
			return fmt.Errorf("peer %s: state %s, unreachable from %v, reachable from %d; from scratch: %s, %v, %d",
				got.Name, got.State, got.UnreachableFrom, got.ReachableFrom, w.state, w.unreachable, w.reach)
		}
	}
	if n := int(m.numAlive.Load()); n != max(alive, 1) {
		return fmt.Errorf("numAlive %d, from scratch %d", n, max(alive, 1))
	}
	return nil
}
