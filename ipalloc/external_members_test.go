package ipalloc

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// TestRejoinWaitsForExternalMembers is make test-long's seed 11495 in
// small, in --kube mode. Seeds a and b; c joins and gets a donation from
// one of them, D. Then O (the other seed) and c are down, D loses its disk
// and comes back with its seed claim, hearing only e, a joiner as new as
// itself, and the operator removes O. Nothing D can reach names c: without
// more, its hold ends on the first claim and O's takeover, and D owns again
// the range its lost self gave c. (While D holds, its frozen ring names it
// for that range, as any holding peer's does; it allocates nothing.) In --kube mode the ConfigMap names c
// (ExternalMembers): D's hold does not end before the registered peers have
// been read, and then waits for c like any member, until c is back and its
// ring shows D what it no longer owns.
func TestRejoinWaitsForExternalMembers(t *testing.T) {
	seeds := []PeerName{"a", "b"}
	c, pods, donor, other := donatedTo(t, 1)
	ans := Answer{Key: key(1), Address: pods[key(1)]}

	// Every peer that knows of the donation is down; the donor's disk is
	// lost, and it comes back hearing only a new joiner e.
	c.peers[other], c.peers["c"] = nil, nil
	c.inits["e"] = Init{Seeds: seeds}
	c.names = append(c.names, "e")
	c.disk["e"] = &HardState{}
	c.restartKnowing("e", []PeerName{donor})
	c.disk[donor] = &HardState{}
	d, err := NewPeer(PeerConfig{Self: donor, Universe: c.u, Init: c.inits[donor], Peers: []PeerName{"e"}, Timing: simTiming,
		Rand: rand.New(rand.NewPCG(3, 9)), ExternalMembers: true}, HardState{})
	if err != nil {
		t.Fatal(err)
	}
	c.peers[donor] = d
	c.ready(donor)
	c.pushPull(donor, "e")
	c.run(3 * simTiming.RemoveRetry)
	if err := d.PeerGone(other); err != nil {
		t.Fatalf("rmpeer %s on %s: %v", other, donor, err)
	}
	c.ready(donor)
	// Pods start on D's node meanwhile: more than its first claim holds,
	// so that an allocation ended early would take c's range.
	for i := 100; i < 300; i++ {
		c.alloc(donor, key(i))
	}
	c.run(3 * simTiming.RemoveRetry)
	for i := 100; i < 300; i++ {
		if a, ok := c.answer[key(i)]; ok && a.Err == nil {
			t.Fatalf("%s allocated %s to %s before it had read the registered peers", donor, a.Address, key(i))
		}
	}
	if st := d.Status().Rejoin; !strings.Contains(st, "registered") {
		t.Fatalf("%s's hold, before the registered peers were read: %q; want it to wait for them", donor, st)
	}

	// The ConfigMap is read: c is a member, and the hold waits for it.
	if err := d.SetExternalMembers([]PeerName{"a", "b", "c", "e"}); err != nil {
		t.Fatal(err)
	}
	c.ready(donor)
	c.run(3 * simTiming.RemoveRetry)
	if st := d.Status().Rejoin; !strings.Contains(st, "(c)") {
		t.Fatalf("%s's hold once the registered peers are read: %q; want it to wait for c", donor, st)
	}

	// c is back: the hold ends on its ring, and c's range stays c's.
	c.restartKnowing("c", []PeerName{donor, "e"})
	c.pushPull(donor, "c")
	c.run(5 * simTiming.RemoveRetry)
	if st := d.Status().Rejoin; st != "" {
		t.Fatalf("%s still holds once c is back: %q", donor, st)
	}
	if r, ok := overlap(d, c.peers["c"]); ok {
		t.Fatalf("%s and c both own %s", donor, r)
	}
	for i := 100; i < 300; i++ {
		a, ok := c.answer[key(i)]
		if !ok || a.Err != nil {
			continue
		}
		for _, r := range c.peers["c"].Owned() {
			if r.Contains(a.Address) {
				t.Fatalf("%s gave %s to %s, in c's range %s", donor, a.Address, key(i), r)
			}
		}
	}
	if slices.Contains(d.Ring().Peers(), other) {
		t.Errorf("%s still owns ranges after its rmpeer: %v", other, d.Ring().Entries)
	}
	c.alloc(donor, key(2))
	c.run(3)
	if a2, ok := c.answer[key(2)]; !ok || a2.Err != nil || a2.Address == ans.Address {
		t.Fatalf("%s's allocation after the rejoin: %+v (c's pod has %s)", donor, a2, ans.Address)
	}
}

// A peer without ExternalMembers does not wait for them, and one whose
// ring gives it nothing (a joiner: its space comes as donations) does not
// either; SetExternalMembers refuses an invalid name and adds nothing then.
func TestExternalMembersOnlyHoldOwners(t *testing.T) {
	u := rangeOf("10.32.0.0/24")
	p, err := NewPeer(PeerConfig{Self: "j", Universe: u, Init: Init{Seeds: []PeerName{"a", "b"}}, ExternalMembers: true}, HardState{})
	if err != nil {
		t.Fatal(err)
	}
	if p.externalWait() {
		t.Error("a joiner that owns nothing waits for the external members")
	}
	q, err := NewPeer(PeerConfig{Self: "a", Universe: u, Init: Init{Seeds: []PeerName{"a", "b"}}}, HardState{})
	if err != nil {
		t.Fatal(err)
	}
	if q.externalWait() {
		t.Error("a peer without ExternalMembers waits for them")
	}
	r, err := NewPeer(PeerConfig{Self: "a", Universe: u, Init: Init{Seeds: []PeerName{"a", "b"}}, ExternalMembers: true}, HardState{})
	if err != nil {
		t.Fatal(err)
	}
	if !r.externalWait() {
		t.Fatal("a seed without state and with ExternalMembers does not wait for them")
	}
	if err := r.SetExternalMembers([]PeerName{"k2", "not a name!"}); err == nil || !r.externalWait() || slices.Contains(r.Members(), "k2") {
		t.Fatalf("SetExternalMembers with an invalid name: %v, still waiting %v, members %v", err, r.externalWait(), r.Members())
	}
	if err := r.SetExternalMembers([]PeerName{"a", "b", "k"}); err != nil || r.externalWait() || !slices.Contains(r.Members(), "k") || slices.Contains(r.Members(), "a") {
		t.Fatalf("SetExternalMembers: %v, still waiting %v, members %v", err, r.externalWait(), r.Members())
	}
}

// TestRejoinWaitsForRegisteredMembersInUse is make test-long's seed 10788
// in small: a registered peer that owns nothing in the ring the rejoining
// peer hears (it lost its state too) still runs pods on addresses of the
// rejoining peer's ranges, given to it by the lost self. Its ring (the
// first claim) says nothing of them; its Members answer does (InUse). The
// rejoin waits for that answer from every registered peer, as from every
// owner, and so holds those addresses for it, not for a pod of its own.
func TestRejoinWaitsForRegisteredMembersInUse(t *testing.T) {
	c, pods, donor, other := donatedTo(t, 4)
	// The other seed dies and is removed; the donor and c both lose their
	// disks, c's pods still running.
	c.peers[other] = nil
	if err := c.peers[donor].PeerGone(other); err != nil {
		t.Fatal(err)
	}
	c.ready(donor)
	c.run(3 * simTiming.RemoveRetry)
	c.peers[donor], c.peers["c"] = nil, nil
	c.disk[donor], c.disk["c"] = &HardState{}, &HardState{}
	registered := []PeerName{donor, "c"} // the removed seed's Node is deleted
	start := func(n PeerName, peers []PeerName) *Peer {
		p, err := NewPeer(PeerConfig{Self: n, Universe: c.u, Init: c.inits[n], Peers: peers, Timing: simTiming,
			Rand: rand.New(rand.NewPCG(uint64(len(n)), 11)), ExternalMembers: true}, HardState{})
		if err != nil {
			t.Fatal(err)
		}
		c.peers[n] = p
		return p
	}
	cp := start("c", []PeerName{donor})
	cp.HoldFound(pods)
	c.ready("c")
	d := start(donor, []PeerName{"c"})
	c.ready(donor)
	for _, p := range []*Peer{cp, d} {
		if err := p.SetExternalMembers(registered); err != nil {
			t.Fatal(err)
		}
	}
	c.ready("c")
	c.ready(donor)
	// Nobody remembers the removal any more: the operator runs it again.
	if err := d.PeerGone(other); err != nil {
		t.Fatal(err)
	}
	c.ready(donor)
	// The donor's node starts pods of its own at once: they must not get
	// c's addresses.
	for i := 100; i < 350; i++ {
		c.alloc(donor, key(i))
	}
	c.pushPull(donor, "c")
	c.run(5 * simTiming.RemoveRetry)
	if st := d.Status().Rejoin; st != "" {
		t.Fatalf("%s still holds: %q", donor, st)
	}
	for i := 100; i < 350; i++ {
		a, ok := c.answer[key(i)]
		if !ok || a.Err != nil {
			continue
		}
		for k, used := range pods {
			if a.Address == used {
				t.Fatalf("%s gave %s to %s; c's pod %s uses it", donor, used, key(i), k)
			}
		}
	}
}

// donatedTo starts seeds a and b and a joiner c, has c allocate pods
// addresses (keys 1..pods), and returns the cluster, c's pods, the seed
// that gave c its space (the donor) and the other seed. Every assertion of
// the setup is here: each pod got an address, all from the donor's first
// claim, and c owns space.
func donatedTo(t *testing.T, pods int) (c *cluster, addrs map[Key]Address, donor, other PeerName) {
	t.Helper()
	seeds := []PeerName{"a", "b"}
	c = newCluster(t, "10.32.0.0/24", map[PeerName]Init{"a": {Seeds: seeds}, "b": {Seeds: seeds}, "c": {Seeds: seeds}})
	firstClaim := map[PeerName][]Range{"a": c.peers["a"].Owned(), "b": c.peers["b"].Owned()}
	c.run(5)
	for i := 1; i <= pods; i++ {
		c.alloc("c", key(i))
	}
	c.run(10)
	addrs = map[Key]Address{}
	for i := 1; i <= pods; i++ {
		ans, ok := c.answer[key(i)]
		if !ok || ans.Err != nil {
			t.Fatalf("c got no address for %s: %+v", key(i), ans)
		}
		addrs[key(i)] = ans.Address
	}
	for _, s := range seeds {
		for _, r := range firstClaim[s] {
			if r.Contains(addrs[key(1)]) {
				donor = s
			}
		}
	}
	other = seeds[0]
	if donor == other {
		other = seeds[1]
	}
	if donor == "" || len(c.peers["c"].Owned()) == 0 {
		t.Fatalf("c's address %s is from no seed's first claim, or c owns nothing", addrs[key(1)])
	}
	return c, addrs, donor, other
}

// TestUnregisteredPeerAsksNoSpace: in --kube mode a peer asks for space (a
// donation, or the addresses its pods use on a Want) only once the
// registered peers it is given name it. Before, a joiner's first donation
// (its bridge's gateway, asked for at once as the router starts) usually
// came before its router had registered it in the ConfigMap: the donor's
// rejoin after a lost disk, with the joiner down, had nothing that named
// it.
func TestUnregisteredPeerAsksNoSpace(t *testing.T) {
	seeds := []PeerName{"a", "b"}
	c := newCluster(t, "10.32.0.0/26", seeded(seeds...))
	c.run(5)
	bRanges := c.peers["b"].Owned()
	if len(bRanges) == 0 {
		t.Fatal("b owns nothing")
	}
	found := bRanges[0].Start + 5 // a pod on j's node uses it (its state was lost)

	c.inits["j"] = Init{Seeds: seeds}
	c.names = append(c.names, "j")
	c.disk["j"] = &HardState{}
	j, err := NewPeer(PeerConfig{Self: "j", Universe: c.u, Init: c.inits["j"], Peers: seeds, Timing: simTiming,
		Rand: rand.New(rand.NewPCG(5, 5)), ExternalMembers: true}, HardState{})
	if err != nil {
		t.Fatal(err)
	}
	c.peers["j"] = j
	j.HoldFound(map[Key]Address{key(50): found})
	c.ready("j")
	c.pushPull("j", "a")
	c.pushPull("j", "b")
	c.alloc("j", key(1))
	c.run(3 * simTiming.DonationRetry)
	// A read of the registered peers that does not name j yet.
	if err := j.SetExternalMembers(seeds); err != nil {
		t.Fatal(err)
	}
	c.ready("j")
	c.run(3 * simTiming.DonationRetry)
	if a, ok := c.answer[key(1)]; ok && a.Err == nil {
		t.Fatalf("j allocated %s before it was registered", a.Address)
	}
	if o := j.Owned(); len(o) > 0 {
		t.Fatalf("j got %v before it was registered", o)
	}
	for _, p := range []PeerName{"a", "b"} {
		if r := c.peers[p].Ring().Peers(); slices.Contains(r, "j") {
			t.Fatalf("%s's ring gives j space before it was registered: %v", p, c.peers[p].Ring().Entries)
		}
	}
	if st := j.Status().String(); !strings.Contains(st, "registered") {
		t.Fatalf("j's status while unregistered: %q; want it to say it waits to be registered", st)
	}

	// Registered: it asks, gets space, and the address its pod uses.
	if err := j.SetExternalMembers(append(seeds, "j")); err != nil {
		t.Fatal(err)
	}
	c.ready("j")
	c.run(3 * simTiming.DonationRetry)
	if a, ok := c.answer[key(1)]; !ok || a.Err != nil {
		t.Fatalf("j allocated nothing once registered: %+v; status %q", a, j.Status())
	}
	if got, ok := j.Lookup(key(50)); !ok || got != found {
		t.Fatalf("j does not hold %s for its pod once registered (got %s, %v)", found, got, ok)
	}
}
