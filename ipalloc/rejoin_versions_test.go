package ipalloc

import (
	"slices"
	"strings"
	"testing"
)

// TestRejoinJumpsOverLostVersions (mutant 19): a seed peer that lost its
// disk and kept its name rejoins from the ring of the one owner it hears
// from, which has not seen its lost self's last free counts; a peer that
// owns nothing (d) has, and the owner never knew d (so neither does the
// rejoining peer, whose hold waits for every member it learns of: d met
// only a's lost self, as a peer that joined while the owner was cut off
// may have). The rejoined
// peer then changes its free counts as often as its lost self did, to
// other counts, so
// without the version jump the same token and version would carry other
// free counts in d's ring than in a's: the rings could never agree (a
// merge keeps either, by position). With the jump, a's new entries are
// newer than anything its lost self sent, and every ring converges on them.
func TestRejoinJumpsOverLostVersions(t *testing.T) {
	inits := seeded("a", "b")
	inits["d"] = Init{Seeds: []PeerName{"a", "b"}} // joins, owns nothing
	c := newCluster(t, "10.32.0.0/24", inits)
	c.run(10)
	if len(c.peers["d"].Owned()) != 0 {
		t.Fatalf("d owns %v: the test needs it to own nothing", c.peers["d"].Owned())
	}
	// b forgets d (it never heard of it): its state without d as a
	// member, restarted knowing only a, and its start hold over.
	var keep []PeerName
	for _, q := range c.disk["b"].Members {
		if q != "d" {
			keep = append(keep, q)
		}
	}
	c.disk["b"].Members = keep
	c.cut = map[PeerName]bool{"d": true}
	c.restartKnowing("b", []PeerName{"a"})
	c.pushPull("a", "b")
	c.run(3)
	if st := c.peers["b"].Status().String(); strings.Contains(st, "started with state") || slices.Contains(c.peers["b"].Members(), "d") {
		t.Fatalf("setup: b holds back or knows d: %s, members %v", st, c.peers["b"].Members())
	}

	// a's lost self allocates while only d hears of its free counts.
	unseenFreeCounts(t, c, "a", "d")
	lost := map[Address]Entry{}
	for _, e := range c.peers["d"].Ring().Entries {
		if e.Peer == "a" {
			lost[e.Token] = e
		}
	}
	stale := 0
	for _, e := range c.peers["b"].Ring().Entries {
		if l, ok := lost[e.Token]; ok && e.Version < l.Version {
			stale++
		}
	}
	if stale == 0 {
		t.Fatal("b has seen every free count of a's lost self: the test tests nothing")
	}

	// a comes back without its disk and hears only from b.
	c.cut = map[PeerName]bool{"d": true}
	a := c.wipe("a", []PeerName{"b"}) // the mesh shows it b alone
	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)
	if st := a.Status().Rejoin; st != "" {
		t.Fatalf("a still holds back: %q", st)
	}
	// It changes its free counts as often as its lost self did (three
	// times), but to other counts: two allocations and a release.
	c.alloc("a", key(1))
	c.run(simTiming.GossipEvery + 1)
	c.alloc("a", key(2))
	c.run(simTiming.GossipEvery + 1)
	a.Release(key(1))
	c.ready("a")
	c.run(simTiming.GossipEvery + 1)

	// d is back: every ring agrees, on a's new entries.
	delete(c.cut, "d")
	c.pushPull("a", "d")
	c.pushPull("b", "d")
	c.run(3 * simTiming.GossipEvery)
	for _, q := range []PeerName{"b", "d"} {
		if !c.peers[q].Ring().Equal(a.Ring()) {
			t.Fatalf("%s's ring differs from a's:\n%s: %v\na: %v", q, q, c.peers[q].Ring().Entries, a.Ring().Entries)
		}
	}
	for _, e := range a.Ring().Entries {
		if l, ok := lost[e.Token]; ok && e.Peer == "a" && e.Version <= l.Version {
			t.Errorf("a's entry %v is not newer than its lost self's %v", e, l)
		}
	}
}

// TestFoundReleasedBeforeHeld (mutant 20): a peer that lost its disk finds
// a pod's address on its bridge (HoldFound) while it still holds back; the
// pod is deleted (CNI DEL) before the hold ends. Its address must not be
// held once the hold ends: nobody would ever release it again.
func TestFoundReleasedBeforeHeld(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", seeded("a", "b"))
	c.run(10)
	c.alloc("a", key(1))
	c.run(2)
	ans, ok := c.answer[key(1)]
	if !ok || ans.Err != nil {
		t.Fatalf("a allocated nothing: %+v", ans)
	}

	a := c.wipe("a", []PeerName{"b"})
	a.HoldFound(map[Key]Address{key(1): ans.Address})
	c.ready("a")
	if st := a.Status().Rejoin; st == "" {
		t.Fatal("a does not hold back: the test tests nothing")
	}
	a.Release(key(1)) // the pod is deleted meanwhile
	c.ready("a")

	c.pushPull("a", "b")
	c.run(3 * simTiming.RemoveRetry)
	if st := a.Status().Rejoin; st != "" {
		t.Fatalf("a still holds back: %q", st)
	}
	if addr, ok := a.a.Lookup(key(1)); ok {
		t.Fatalf("the deleted pod's address %v is held after the hold ended: it leaks", addr)
	}
	if holder, ok := a.a.Holder(ans.Address); ok {
		t.Fatalf("%v is held by %v after its pod was deleted", ans.Address, holder)
	}
}
