package ipalloc

import (
	"errors"
	"strings"
	"testing"
)

// staleCluster: seeds a and b and an observer; b's disk is backed up, and
// then the observer gets a donation, from b's share if it can.
func staleCluster(t *testing.T) (c *cluster, backup HardState, obsAddr Address) {
	seeds := []PeerName{"a", "b"}
	c = newCluster(t, "10.32.0.0/26", map[PeerName]Init{"a": {Seeds: seeds}, "b": {Seeds: seeds}, "obs": {Observer: true}})
	c.run(3)
	c.alloc("a", key(90)) // a has less free: the observer asks b
	c.run(2 * simTiming.GossipEvery)
	backup = c.disk["b"].Clone()
	return c, backup, 0
}

// checkNoDuplicate fails if two keys got one address.
func checkNoDuplicate(t *testing.T, c *cluster) {
	t.Helper()
	seen := map[Address]Key{}
	for k, a := range c.answer {
		if a.Err != nil || a.Address == 0 {
			continue
		}
		if o, ok := seen[a.Address]; ok {
			t.Fatalf("%s given to both %s and %s", a.Address, o, k)
		}
		seen[a.Address] = k
	}
}

// TestStaleDiskDonatedSince: b donated to the observer after its backup;
// restored from it, it must not hand out the donated range, and it knows
// its state is stale once it hears the cluster's ring.
func TestStaleDiskDonatedSince(t *testing.T) {
	c, backup, _ := staleCluster(t)
	c.alloc("obs", key(1))
	c.run(5)
	obsAddr := c.answer[key(1)].Address
	if owner, _ := c.peers["a"].Ring().Owner(obsAddr); obsAddr == 0 || owner != "obs" {
		t.Fatalf("setup: %+v", c.answer[key(1)])
	}
	*c.disk["b"] = backup
	b := c.start("b")
	for i := 10; i < 40; i++ {
		c.alloc("b", key(i))
	}
	if st := b.Status().String(); !strings.Contains(st, "started with state") {
		t.Errorf("b's status in its start hold: %s", st)
	}
	for i := 10; i < 40; i++ {
		if a, ok := c.answer[key(i)]; ok && a.Err == nil {
			t.Fatalf("b allocated %s to %s before it heard from a live peer", a.Address, key(i))
		}
	}
	c.run(40)
	if !c.hasEvent("is older than what peers know of this node") {
		t.Errorf("b did not find its state stale: %v", c.events)
	}
	checkNoDuplicate(t, c)
	if o, _ := b.Ring().Owner(obsAddr); o != "obs" {
		t.Errorf("b's ring gives %s to %s", obsAddr, o)
	}
	got := 0
	for i := 10; i < 40; i++ {
		if a := c.answer[key(i)]; a.Err == nil && a.Address != 0 {
			got++
		}
	}
	if got == 0 {
		t.Errorf("b allocated nothing after its rejoin: %s", b.Status())
	}
}

// TestStaleDiskPodsSince: b's pod got an address after its backup; b,
// restored from it, holds that address again (found on the node) and
// hands it to no other pod.
func TestStaleDiskPodsSince(t *testing.T) {
	c, backup, _ := staleCluster(t)
	c.alloc("b", key(1))
	c.run(2 * simTiming.GossipEvery)
	pod := c.answer[key(1)].Address
	if pod == 0 {
		t.Fatalf("setup: %+v", c.answer[key(1)])
	}
	*c.disk["b"] = backup
	b := c.start("b")
	b.HoldFound(map[Key]Address{key(1): pod})
	for i := 10; i < 30; i++ {
		c.alloc("b", key(i))
	}
	c.run(40)
	checkNoDuplicate(t, c)
	if a, ok := b.Lookup(key(1)); !ok || a != pod {
		t.Errorf("b holds %s for its pod %s, which uses %s", a, key(1), pod)
	}
	if !c.hasEvent("is older than what peers know of this node") {
		t.Errorf("b did not find its state stale")
	}
}

// TestStaleDiskAlone: b restarts from its backup while every other peer
// is cut off: it waits (its ADDs fail at their deadline), and once the
// network heals it finds its state stale and hands out no address twice.
func TestStaleDiskAlone(t *testing.T) {
	c, backup, _ := staleCluster(t)
	c.alloc("obs", key(1))
	c.run(5)
	c.cut["a"], c.cut["obs"] = true, true
	*c.disk["b"] = backup
	b := c.start("b")
	for i := 10; i < 40; i++ {
		c.alloc("b", key(i))
	}
	c.run(simTiming.AllocDeadline + 2)
	for i := 10; i < 40; i++ {
		if a := c.answer[key(i)]; a.Err == nil {
			t.Fatalf("b allocated %s to %s while it heard from no peer", a.Address, key(i))
		}
	}
	if st := b.Status().String(); !strings.Contains(st, "started with state") {
		t.Errorf("b's status while cut off: %s", st)
	}
	// weft reset meanwhile, forced or not, hands nothing over: b may give
	// the range its lost self gave the observer.
	for _, force := range []bool{false, true} {
		if _, err := b.Leave(func(PeerName) bool { return true }, force); !errors.Is(err, ErrHolding) || !strings.Contains(err.Error(), "started with state") {
			t.Errorf("b's leave (force %v) in its start hold: %v, want ErrHolding", force, err)
		}
	}
	clear(c.cut)
	c.pushPull("a", "b")
	c.pushPull("obs", "b")
	for i := 40; i < 50; i++ {
		c.alloc("b", key(i))
	}
	c.run(40)
	checkNoDuplicate(t, c)
	if !c.hasEvent("is older than what peers know of this node") {
		t.Errorf("b did not find its state stale")
	}
}

// TestStaleDiskHearsEveryLivePeer: b donated to the observer after its
// backup while a was cut off, so a never heard of it. b, restored and
// started while the observer is cut off, hears a's ring first: that is not
// enough to end its start hold (a knows nothing newer), it waits for the
// observer too, whose ring shows the donation.
func TestStaleDiskHearsEveryLivePeer(t *testing.T) {
	c, backup, _ := staleCluster(t)
	c.cut["a"] = true
	c.alloc("obs", key(1))
	c.run(5)
	donated, ok := Range{}, false
	for _, rg := range c.peers["obs"].Owned() {
		if o, _ := backup.Ring.Owner(rg.Start); o == "b" {
			donated, ok = rg, true
		}
	}
	if !ok {
		t.Fatalf("setup: the observer owns %v, none of it from b", c.peers["obs"].Owned())
	}
	c.cut["obs"] = true
	delete(c.cut, "a")
	*c.disk["b"] = backup
	b := c.start("b")
	c.pushPull("a", "b")
	for i := 10; i < 50; i++ {
		c.alloc("b", key(i))
	}
	c.run(5)
	for i := 10; i < 50; i++ {
		if a := c.answer[key(i)]; a.Err == nil && a.Address != 0 {
			t.Fatalf("b allocated %s to %s having heard only from a (its status: %s)", a.Address, key(i), b.Status())
		}
	}
	if st := b.Status().String(); !strings.Contains(st, "obs") {
		t.Errorf("b's status does not name the peer it waits for: %s", st)
	}
	delete(c.cut, "obs")
	c.pushPull("obs", "b")
	c.run(40)
	if !c.hasEvent("is older than what peers know of this node") {
		t.Errorf("b did not find its state stale")
	}
	for i := 10; i < 50; i++ {
		if a := c.answer[key(i)]; a.Err == nil && donated.Contains(a.Address) {
			t.Fatalf("b allocated %s to %s, in %s, which it gave to the observer", a.Address, key(i), donated)
		}
	}
	checkNoDuplicate(t, c)
}

// TestStaleReason: what in a ring shows that this peer's state is older
// than what its lost self sent, and what does not.
func TestStaleReason(t *testing.T) {
	c, _, _ := staleCluster(t)
	b := c.peers["b"]
	own := -1
	r := b.Ring()
	for i, e := range r.Entries {
		if e.Peer == "b" {
			own = i
			break
		}
	}
	if own < 0 {
		t.Fatal("setup: b owns nothing")
	}
	if why := b.staleReason(b.Ring()); why != "" {
		t.Errorf("its own ring: %s", why)
	}
	change := func(f func(e *Entry)) *Ring {
		r := b.Ring()
		f(&r.Entries[own])
		return r
	}
	for name, r := range map[string]*Ring{
		"a newer free count":                   change(func(e *Entry) { e.Version++; e.Free-- }),
		"the same version, another free count": change(func(e *Entry) { e.Free-- }),
		"given away by a donation":             change(func(e *Entry) { e.Version += 2; e.Peer = "obs" }),
	} {
		if b.staleReason(r) == "" {
			t.Errorf("%s: not seen as stale", name)
		}
	}
	// A reclaim (a removal of b) is not a stale state: Merge refuses it
	// as a takeaway, and b learns it was removed.
	if why := b.staleReason(change(func(e *Entry) { e.Version += reclaimVersionJump; e.Peer = "a" })); why != "" {
		t.Errorf("a reclaim seen as stale: %s", why)
	}
	// A range given to b with addresses in use that b does not hold.
	r = b.Ring()
	for i, e := range r.Entries {
		if e.Peer == "a" {
			r.Entries[i].Peer, r.Entries[i].Version, r.Entries[i].Free = "b", e.Version+2, 1
			break
		}
	}
	if b.staleReason(r) == "" {
		t.Errorf("a range of b's with addresses in use it does not hold: not seen as stale")
	}
}
