package ipalloc

import (
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// restartKnowing restarts n from its disk as a router does that sees only
// peers in the mesh (a restart or reload while others are down or cut off).
func (c *cluster) restartKnowing(n PeerName, peers []PeerName) *Peer {
	c.t.Helper()
	p, err := NewPeer(PeerConfig{Self: n, Universe: c.u, Init: c.inits[n], Peers: peers, Timing: simTiming,
		Rand: rand.New(rand.NewPCG(uint64(len(n)), 8))}, c.disk[n].Clone())
	if err != nil {
		c.t.Fatal(err)
	}
	c.peers[n] = p
	c.ready(n)
	return p
}

// overlap returns an address owned by both a and b in their own rings.
func overlap(a, b *Peer) (Range, bool) {
	for _, ra := range a.Owned() {
		for _, rb := range b.Owned() {
			if ra.Overlaps(rb) {
				return ra, true
			}
		}
	}
	return Range{}, false
}

// donateUnseen has x give c part of its space, seen by nobody else, and
// then kills x and cuts c off (down, or partitioned away).
func donateUnseen(t *testing.T, c *cluster, x, to PeerName) {
	t.Helper()
	for _, n := range c.names {
		if n != x && n != to {
			c.cut[n] = true
		}
	}
	if err := c.peers[x].Step(to, &DonateRequest{ID: 1}); err != nil {
		t.Fatal(err)
	}
	c.ready(x)
	c.run(1)
	if !slices.Contains(c.peers[to].Ring().Peers(), to) || len(c.peers[to].Owned()) < 2 {
		t.Fatalf("%s got no donation from %s: %v", to, x, c.peers[to].Owned())
	}
	c.peers[x] = nil // x dies
	clear(c.cut)
	c.cut[to] = true
	c.queue = nil
}

// TestReclaimBarrierIsDurable: the reclaimer restarts (or reloads) and
// sees only some peers, or none yet; a cut-off peer holds a donation from
// the dead peer that nobody else knows. The reclaim must wait for it, not
// take the donated range too (two owners of one address, two rings that
// refuse each other). The old barrier was the peers seen since start.
func TestReclaimBarrierIsDurable(t *testing.T) {
	for _, tc := range []struct {
		name  string
		known []PeerName
	}{
		{"restart seeing some peers", []PeerName{"b"}},
		{"restart before the mesh connected", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			names := []PeerName{"a", "b", "c", "x"}
			c := newCluster(t, "10.32.0.0/24", seeded(names...))
			c.run(5)
			donateUnseen(t, c, "x", "c")
			a := c.restartKnowing("a", tc.known)
			if err := a.PeerGone("x"); err != nil {
				t.Fatal(err)
			}
			c.ready("a")
			c.run(3 * simTiming.RemoveRetry)
			if rg, ok := overlap(a, c.peers["c"]); ok {
				t.Fatalf("a took over %s, which x gave to c, while c was cut off", rg)
			}
			if got := a.Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"c"}) {
				t.Errorf("the reclaim waits for %v, want [c]", got)
			}
			delete(c.cut, "c")
			c.run(3 * simTiming.RemoveRetry)
			if slices.Contains(a.Ring().Peers(), "x") {
				t.Fatalf("x still owns ranges after c came back: %+v", a.Status().Reclaims)
			}
			if rg, ok := overlap(a, c.peers["c"]); ok {
				t.Fatalf("a and c both own %s", rg)
			}
			for _, n := range []PeerName{"b", "c"} {
				if !c.peers[n].Ring().Equal(a.Ring()) {
					t.Errorf("%s's ring differs from a's", n)
				}
			}
		})
	}
}

// TestReclaimBarrierMembers: the members are on disk, grow with what the
// peer learns (the mesh, ring owners, AddMember) and a barrier waits for
// each of them that is not removed.
func TestReclaimBarrierMembers(t *testing.T) {
	names := []PeerName{"a", "b", "x"}
	c := newCluster(t, "10.32.0.0/24", seeded(names...))
	c.run(3)
	a := c.peers["a"]
	if got := a.Members(); !slices.Equal(got, []PeerName{"b", "x"}) {
		t.Fatalf("members %v", got)
	}
	// k is registered in the ConfigMap but never seen in the mesh.
	if err := a.AddMember("k"); err != nil {
		t.Fatal(err)
	}
	if err := a.AddMember("bad name"); err == nil {
		t.Error("AddMember took a bad name")
	}
	c.ready("a")
	if !slices.Contains(c.disk["a"].Members, "k") {
		t.Fatalf("k is not on disk: %v", c.disk["a"].Members)
	}
	c.peers["x"] = nil
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2 * simTiming.RemoveRetry)
	if got := a.Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"k"}) {
		t.Fatalf("reclaim waits for %v, want [k]", got)
	}
	// After a restart that sees nobody, it still waits for b and k.
	a = c.restartKnowing("a", nil)
	if got := a.Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"b", "k"}) {
		t.Fatalf("after a restart the reclaim waits for %v, want [b k]", got)
	}
	// k is gone too: removing it lets the reclaim of x go on.
	if err := a.PeerGone("k"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2 * simTiming.RemoveRetry)
	if slices.Contains(a.Ring().Peers(), "x") || !c.hasEvent("a: rmpeer of x: ") {
		t.Fatalf("x not reclaimed: %+v", a.Status().Reclaims)
	}
}

// TestReclaimAloneCompletes: a peer that nobody else shares the ring with
// any more (the survivor of two) reclaims at once: there is nobody to hear.
func TestReclaimAloneCompletes(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "x"))
	c.run(3)
	c.peers["x"] = nil
	a := c.restartKnowing("a", nil)
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	if got := a.Ring().Peers(); !slices.Equal(got, []PeerName{"a"}) {
		t.Fatalf("the ring's owners are %v", got)
	}
}

// TestRemovedPeerStopsAllocating: a peer told that it is removed allocates
// nothing more, across a restart, gives no donation, and says why.
func TestRemovedPeerStopsAllocating(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "x"))
	c.run(3)
	c.alloc("x", key(1))
	c.run(2 * simTiming.GossipEvery) // its free counts are known
	c.cut["c"] = true                // holds a's barrier open: nothing is taken over yet
	c.cut["x"] = true                // x is only cut off, but a is told it is gone
	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2)
	delete(c.cut, "x")
	c.run(simTiming.RemoveRetry + 1) // the Remove reaches x too now
	x := c.peers["x"]
	if !c.hasEvent("x: ipalloc: a is removing this peer") {
		t.Fatalf("x did not log its removal: %v", c.events)
	}
	check := func(when string) {
		t.Helper()
		for _, k := range []Key{key(1), key(2)} { // one it holds, one new
			x.Allocate(k)
			c.ready("x")
			a := c.answer[k]
			var re *RemovedError
			if !errors.Is(a.Err, ErrRemoved) || !errors.As(a.Err, &re) || re.By != "a" || re.Self != "x" {
				t.Fatalf("%s: a removed peer answered %+v", when, a)
			}
		}
		if _, ok := x.Lookup(key(2)); ok {
			t.Fatalf("%s: a removed peer allocated", when)
		}
		if st := x.Status(); st.RemovedBy != "a" || !strings.Contains(st.String(), "weft reset") {
			t.Errorf("%s: status %q", when, st)
		}
	}
	check("at once")
	// No donation from a removed peer: its ranges are being taken over.
	if err := x.Step("b", &DonateRequest{ID: 9}); err != nil {
		t.Fatal(err)
	}
	rd := x.Ready()
	if len(rd.Messages) != 1 || rd.Messages[0].To != "b" {
		t.Fatalf("answer to a donation request: %+v", rd.Messages)
	}
	if _, denied := rd.Messages[0].Msg.(*Denial); !denied {
		t.Fatalf("a removed peer donated: %T", rd.Messages[0].Msg)
	}
	c.disk["x"].Apply(rd)
	x = c.start("x")
	check("after a restart")
}

// TestWithdrawReclaim: while the barrier is open, the reclaimer withdraws
// the removal: nothing was taken over, the other peers listen to x again,
// x allocates again; a Remove that arrives late is undone too; after the
// takeover, a withdrawal is refused, also after a restart.
func TestWithdrawReclaim(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "x"))
	c.run(3)
	a, b := c.peers["a"], c.peers["b"]
	c.cut["c"] = true // holds the barrier open
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2)
	if err := b.Step("x", &DonateRequest{ID: 1}); !errors.Is(err, ErrRemovedPeer) {
		t.Fatalf("b listens to x while it is removed: %v", err)
	}
	if err := c.peers["x"].Withdraw("x"); err == nil {
		t.Error("x withdrew its own removal")
	}
	if err := b.Withdraw("x"); !isReclaiming(err, "x", "a") {
		t.Errorf("b withdrew a's removal: %v", err)
	}
	// Only the reclaimer's Withdraw counts.
	for _, n := range []PeerName{"b", "x"} {
		if err := c.peers[n].Step("c", &Withdraw{Peer: "x"}); err != nil {
			t.Fatal(err)
		}
		c.ready(n)
		if _, ok := c.peers[n].Removed()["x"]; !ok {
			t.Fatalf("%s took c's Withdraw of a's removal of x", n)
		}
	}
	if err := a.Withdraw("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	if _, ok := c.disk["a"].Removed["x"]; ok {
		t.Fatal("the withdrawal is not on disk")
	}
	c.run(2)
	if err := b.Step("x", &RingMsg{Ring: c.peers["x"].Ring()}); err != nil {
		t.Fatalf("b refuses x after the withdrawal: %v", err)
	}
	c.alloc("x", key(1))
	if a := c.answer[key(1)]; a.Err != nil {
		t.Fatalf("x cannot allocate after the withdrawal: %v", a.Err)
	}
	// A Remove delayed in the network reaches b after the withdrawal.
	if err := b.Step("a", &Remove{Peer: "x"}); err != nil {
		t.Fatal(err)
	}
	c.ready("b")
	c.run(2)
	if _, ok := b.Removed()["x"]; ok {
		t.Fatal("a late Remove left x removed on b")
	}
	delete(c.cut, "c")
	c.run(3 * simTiming.RemoveRetry)
	if !slices.Contains(a.Ring().Peers(), "x") {
		t.Fatal("a took over x's ranges after withdrawing")
	}
	for _, n := range c.names {
		if _, ok := c.peers[n].Removed()["x"]; ok {
			t.Errorf("%s still has x removed", n)
		}
	}

	// Now for real: x dies, the reclaim completes, withdrawal is too late.
	c.peers["x"] = nil
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(3 * simTiming.RemoveRetry)
	if slices.Contains(a.Ring().Peers(), "x") {
		t.Fatal("x not reclaimed")
	}
	if err := a.Withdraw("x"); !errors.Is(err, ErrReclaimDone) {
		t.Fatalf("withdrawal after the takeover: %v", err)
	}
	a = c.restartKnowing("a", nil)
	if err := a.Withdraw("x"); !errors.Is(err, ErrReclaimDone) {
		t.Fatalf("withdrawal after the takeover and a restart: %v", err)
	}
}

func isReclaiming(err error, peer, by PeerName) bool {
	var re *ReclaimingError
	return errors.As(err, &re) && re.Peer == peer && re.By == by
}

// TestPeerGoneOtherReclaimer: another live peer's reclaim is a typed
// error (the shell must not take it as done); once that reclaimer is
// removed too, this peer takes the job over.
func TestPeerGoneOtherReclaimer(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "x"))
	c.run(3)
	c.peers["x"] = nil
	c.cut["c"] = true
	if err := c.peers["a"].PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2)
	b := c.peers["b"]
	if err := b.PeerGone("x"); !isReclaiming(err, "x", "a") {
		t.Fatalf("second reclaim: %v", err)
	}
	// a dies before it is done.
	c.peers["a"] = nil
	delete(c.cut, "c")
	if err := b.PeerGone("a"); err != nil {
		t.Fatal(err)
	}
	if err := b.PeerGone("x"); err != nil {
		t.Fatalf("taking over the reclaim of x: %v", err)
	}
	c.ready("b")
	c.run(3 * simTiming.RemoveRetry)
	if got := b.Ring().Peers(); slices.Contains(got, "x") || slices.Contains(got, "a") {
		t.Fatalf("owners after the takeover: %v", got)
	}
}

// TestRemovedPeerBackAfterTakeover: x was down through its whole reclaim
// and starts again from its disk, which still gives it its ranges. Its
// first message to the reclaimer is refused and answered with Remove: it
// stops allocating before it hands out an address the reclaimer owns now.
func TestRemovedPeerBackAfterTakeover(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "x"))
	c.run(3)
	c.peers["x"] = nil
	a := c.peers["a"]
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2 * simTiming.RemoveRetry)
	if slices.Contains(a.Ring().Peers(), "x") {
		t.Fatal("x not reclaimed")
	}
	c.queue = nil
	x, err := NewPeer(PeerConfig{Self: "x", Universe: c.u, Init: c.inits["x"], Peers: c.names, Timing: simTiming}, c.disk["x"].Clone())
	if err != nil {
		t.Fatal(err)
	}
	rd := x.Ready()
	if rd.Broadcast == nil {
		t.Fatal("x does not announce its ring at start")
	}
	if err := a.Step("x", &RingMsg{Ring: rd.Broadcast}); !errors.Is(err, ErrRemovedPeer) {
		t.Fatalf("a took x's ring: %v", err)
	}
	var told bool
	for _, m := range a.Ready().Messages {
		if rm, ok := m.Msg.(*Remove); ok && m.To == "x" && rm.Peer == "x" {
			told = true
			if err := x.Step("a", rm); err != nil {
				t.Fatal(err)
			}
		}
	}
	if !told {
		t.Fatal("a did not tell x that it is removed")
	}
	x.Allocate(key(5))
	rd = x.Ready()
	if len(rd.Answers) != 1 || !errors.Is(rd.Answers[0].Err, ErrRemoved) || len(rd.Allocs) != 0 {
		t.Fatalf("x allocated after it was told it is removed: %+v", rd.Answers)
	}
	// Told at most once every RemoveRetry ticks.
	a.Step("x", &RingMsg{Ring: x.Gossip()})
	for _, m := range a.Ready().Messages {
		if _, ok := m.Msg.(*Remove); ok && m.To == "x" {
			t.Fatal("x told again at once")
		}
	}
}

// TestWithdrawSurvivesRestart: a member that missed the withdrawal (cut
// off) gets it after the reclaimer restarted: the withdrawal is on disk
// until every member confirmed it.
func TestWithdrawSurvivesRestart(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "c", "d", "x"))
	c.run(3)
	c.cut["d"] = true // holds the barrier open
	a := c.peers["a"]
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2)
	if _, ok := c.peers["c"].Removed()["x"]; !ok {
		t.Fatal("c did not record the removal")
	}
	c.cut["c"] = true // misses the withdrawal
	if err := a.Withdraw("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2)
	if !slices.Contains(c.disk["a"].Withdrawn, "x") {
		t.Fatalf("the open withdrawal is not on disk: %v", c.disk["a"].Withdrawn)
	}
	c.queue = nil
	c.restartKnowing("a", []PeerName{"b", "c", "d", "x"})
	clear(c.cut)
	c.run(3 * simTiming.RemoveRetry)
	for _, n := range c.names {
		if _, ok := c.peers[n].Removed()["x"]; ok {
			t.Errorf("%s still has x removed", n)
		}
	}
	if len(c.disk["a"].Withdrawn) != 0 {
		t.Errorf("withdrawal still open on disk once all confirmed: %v", c.disk["a"].Withdrawn)
	}
}

// TestReclaimBarrierRingOwners: an owner known only from a merged ring
// (it got a donation from b, and a never heard from it) is a member: the
// reclaim waits for it.
func TestReclaimBarrierRingOwners(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "x"))
	c.run(3)
	b := c.peers["b"]
	if err := b.Step("n", &DonateRequest{ID: 1}); err != nil {
		t.Fatal(err)
	}
	c.ready("b")
	c.run(2) // b's ring reaches a; n is not in the cluster helper's network
	a := c.peers["a"]
	if !slices.Contains(a.Ring().Peers(), "n") || !slices.Contains(a.Members(), "n") {
		t.Fatalf("a's ring owners %v, members %v", a.Ring().Peers(), a.Members())
	}
	c.peers["x"] = nil
	if err := a.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(2 * simTiming.RemoveRetry)
	if got := a.Status().Reclaims["x"]; !slices.Equal(got, []PeerName{"n"}) {
		t.Fatalf("the reclaim waits for %v, want [n]", got)
	}
}

func TestWithdrawCodec(t *testing.T) {
	for _, m := range []Msg{&Withdraw{Peer: "x"}, &WithdrawAck{Peer: "peer-1"}} {
		b := EncodeMsg(m)
		got, err := DecodeMsg(b)
		if err != nil {
			t.Fatalf("%T: %v", m, err)
		}
		if EncodeMsg(got) == nil || string(EncodeMsg(got)) != string(b) {
			t.Errorf("%T does not round-trip: %+v", m, got)
		}
		if _, err := DecodeMsg(b[:len(b)-1]); !errors.Is(err, ErrBadMessage) {
			t.Errorf("%T cut short: %v", m, err)
		}
		if _, err := DecodeMsg(append(b, 0)); !errors.Is(err, ErrBadMessage) {
			t.Errorf("%T with a byte more: %v", m, err)
		}
	}
	if _, err := DecodeMsg([]byte{wireFormat, byte(kindWithdraw), 0}); !errors.Is(err, ErrBadMessage) {
		t.Errorf("Withdraw of an empty name: %v", err)
	}
}

// TestRemovedPeerLeaves: weft reset on a removed peer needs no heir: its
// reclaimer takes over what it owns.
func TestRemovedPeerLeaves(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "x"))
	c.run(3)
	x := c.peers["x"]
	if err := x.Step("a", &Remove{Peer: "x"}); err != nil {
		t.Fatal(err)
	}
	c.ready("x")
	res, err := x.Leave(func(PeerName) bool { return false }, true) // nobody reachable
	if err != nil || res.Heir != "" {
		t.Fatalf("Leave of a removed peer = %+v, %v", res, err)
	}
	c.ready("x")
	if left, _, done := x.Leaving(); !left || !done || !c.hasEvent("x: ipalloc: leaving the cluster (weft reset) after a removed this peer") {
		t.Fatalf("left %v done %v; events %v", left, done, c.events)
	}
}

// TestRemovedPeerLearnsFromTakeover: x was removed while cut off from its
// reclaimer (a one-way cut: it never got the Remove); the first ring that
// shows the takeover tells it, and it stops allocating.
func TestRemovedPeerLearnsFromTakeover(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b", "x"))
	c.run(3)
	r := c.peers["b"].Ring()
	if _, err := r.Reclaim("x", "a"); err != nil { // a's takeover, as b merged it
		t.Fatal(err)
	}
	x := c.peers["x"]
	if err := x.Step("b", &RingMsg{Ring: r}); !errors.Is(err, ErrRangeTaken) {
		t.Fatalf("Step = %v, want ErrRangeTaken", err)
	}
	x.Allocate(key(1))
	rd := x.Ready()
	var re *RemovedError
	if len(rd.Answers) != 1 || !errors.As(rd.Answers[0].Err, &re) || re.By != "a" {
		t.Fatalf("x allocated after its ranges were taken over: %+v", rd.Answers)
	}
	if rd.Removed["x"] != "a" {
		t.Errorf("the removal is not saved: %v", rd.Removed)
	}
}
