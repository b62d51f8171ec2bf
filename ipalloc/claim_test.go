package ipalloc

import (
	"errors"
	"strings"
	"testing"
)

// Peers that count different consensus sizes (--peers lists of different
// lengths, or Kubernetes nodes that saw different node counts) refuse each
// other by name, with both values, instead of each choosing with a quorum
// of its own: on the old code a and b (N=3, quorum 2) chose a ring, and c,
// d and e (N=5, quorum 3) another, seeded apart (Weave's #3908).
func TestPeerConsensusSizeMismatch(t *testing.T) {
	inits := map[PeerName]Init{"a": {Consensus: 3}, "b": {Consensus: 3}, "c": {Consensus: 5}, "d": {Consensus: 5}, "e": {Consensus: 5}}
	c := newCluster(t, "10.32.0.0/24", inits)
	var refusals []error
	c.onRefuse = func(err error) bool {
		var size *ConsensusSizeError
		if errors.As(err, &size) {
			refusals = append(refusals, err)
			return true
		}
		return false
	}
	c.run(200)
	seeds := map[Seed]bool{}
	for _, n := range c.names {
		if r := c.peers[n].Ring(); !r.Empty() {
			seeds[r.Seed] = true
		}
	}
	if len(seeds) > 1 {
		t.Fatalf("%d rings seeded apart: %v", len(seeds), c.events)
	}
	if len(refusals) == 0 {
		t.Fatal("no peer refused another consensus size")
	}
	msg := refusals[0].Error()
	for _, want := range []string{"consensus=3", "consensus=5", "same --ipalloc-init consensus=N"} {
		if !strings.Contains(msg, want) {
			t.Errorf("refusal %q does not say %q", msg, want)
		}
	}
	if st := c.peers["a"].Status().String(); !strings.Contains(st, "first claim halted") {
		t.Errorf("a's status: %s", st)
	}
	// The operator gives c, d and e N=3... as they saved N=5, the restart
	// is refused until their (ringless) state is removed.
	for _, n := range []PeerName{"c", "d", "e"} {
		c.inits[n] = Init{Consensus: 3}
		if _, err := NewPeer(PeerConfig{Self: n, Universe: c.u, Init: c.inits[n], Peers: c.names, Timing: simTiming}, c.disk[n].Clone()); err == nil ||
			!strings.Contains(err.Error(), "consensus=5 (saved in its state)") {
			t.Fatalf("restart of %s with another N: %v", n, err)
		}
		*c.disk[n] = HardState{}
		c.start(n)
	}
	c.onRefuse = func(err error) bool { var size *ConsensusSizeError; return errors.As(err, &size) } // in flight still
	c.run(300)
	ring := c.peers["a"].Ring()
	if ring.Empty() {
		t.Fatalf("no claim once every peer counts N=3: %s", c.peers["a"].Status())
	}
	for _, n := range c.names {
		if !c.peers[n].Ring().Equal(ring) {
			t.Errorf("%s's ring differs", n)
		}
	}
}

// The consensus size travels in a versioned field: an old message without
// it decodes (size unknown, not checked); a field from a newer version, or
// a size out of range, is refused.
func TestPaxosSizeWire(t *testing.T) {
	m := &PaxosMsg{Type: Prepare, Ballot: Ballot{Round: 2, Peer: "a"}, Size: 7}
	got, err := DecodeMsg(EncodeMsg(m))
	if err != nil || got.(*PaxosMsg).Size != 7 {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
	old := EncodeMsg(&PaxosMsg{Type: Prepare, Ballot: Ballot{Round: 2, Peer: "a"}})
	if got, err := DecodeMsg(old); err != nil || got.(*PaxosMsg).Size != 0 {
		t.Fatalf("old format: %+v, %v", got, err)
	}
	for name, data := range map[string][]byte{
		"newer fields": append(append([]byte{}, old...), 2, 7),
		"size 0":       append(append([]byte{}, old...), 1, 0),
		"size 10001":   append(append([]byte{}, old...), 1, 0x91, 0x4e),
		"truncated":    append(append([]byte{}, old...), 1),
	} {
		if _, err := DecodeMsg(data); !errors.Is(err, ErrBadMessage) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// A seed peer that lost its disk but keeps its name must not rebuild its
// original share and allocate from it: the cluster may have moved its
// ranges on. On the old code b handed out an address that a already held
// (a got b's range by reclaim... here by donation from b's lost self), and
// then refused the cluster's ring. Now it holds back until it has heard
// from every peer it knows, then re-claims its pods' addresses and
// allocates only from what it really owns.
func TestPeerLostDiskKeepsName(t *testing.T) {
	seeds := []PeerName{"a", "b"}
	c := newCluster(t, "10.32.0.0/28", map[PeerName]Init{"a": {Seeds: seeds}, "b": {Seeds: seeds}, "obs": {Observer: true}})
	c.run(3)
	// b's pods, then a donation to the observer from b's share.
	c.alloc("b", key(1))
	c.run(2)
	podAddr := c.answer[key(1)].Address
	c.alloc("obs", key(2))
	c.run(5)
	obsAddr := c.answer[key(2)].Address
	if obsAddr == 0 || podAddr == 0 {
		t.Fatalf("setup: %+v %+v", c.answer[key(1)], c.answer[key(2)])
	}
	owner, _ := c.peers["b"].Ring().Owner(obsAddr)
	if owner != "obs" {
		t.Skipf("the donation came from %s, not b", owner)
	}
	// b loses its disk; its pod still runs (found on its bridge).
	*c.disk["b"] = HardState{}
	b := c.start("b")
	b.HoldFound(map[Key]Address{key(1): podAddr})
	for i := 3; i < 16; i++ {
		c.alloc("b", key(i))
	}
	c.ready("b")
	for i := 3; i < 16; i++ {
		if a, ok := c.answer[key(i)]; ok && a.Err == nil {
			t.Fatalf("b allocated %s to %s before it heard from the cluster", a.Address, key(i))
		}
	}
	if st := b.Status().String(); !strings.Contains(st, "started without state") {
		t.Errorf("b's status while it holds back: %s", st)
	}
	c.run(20)
	seen := map[Address]Key{podAddr: key(1), obsAddr: key(2)}
	for i := 3; i < 16; i++ {
		a := c.answer[key(i)]
		if a.Err != nil {
			continue
		}
		if k, dup := seen[a.Address]; dup {
			t.Fatalf("%s got %s, which %s holds", key(i), a.Address, k)
		}
		seen[a.Address] = key(i)
	}
	if got, ok := b.Lookup(key(1)); !ok || got != podAddr {
		t.Errorf("b did not re-claim its pod's %s: %s, %v", podAddr, got, ok)
	}
	if !b.Ring().Equal(c.peers["a"].Ring()) {
		t.Error("b's ring differs from a's")
	}
}
