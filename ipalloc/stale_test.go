package ipalloc

import (
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
