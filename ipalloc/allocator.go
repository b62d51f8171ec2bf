package ipalloc

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Key names one network attachment of one container: the unit that holds an
// address. The same key always gets the same address back.
type Key struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifName"`
}

func (k Key) String() string { return k.ContainerID + "/" + k.IfName }

// Compare orders keys by container id, then interface.
func (k Key) Compare(o Key) int {
	if c := strings.Compare(k.ContainerID, o.ContainerID); c != 0 {
		return c
	}
	return strings.Compare(k.IfName, o.IfName)
}

// Allocation is one address held by one key.
type Allocation struct {
	Key     Key     `json:"key"`
	Address Address `json:"address"`
}

// Errors of the allocator.
var (
	ErrNoRange   = errors.New("this peer owns no part of the address range yet")
	ErrNoSpace   = errors.New("no free address left in the ranges this peer owns")
	ErrNotOwned  = errors.New("address is not in a range this peer owns")
	ErrAddrInUse = errors.New("address is held by another container")
)

// Allocator hands out the addresses of the ranges this peer owns. It is a
// pure state machine: the caller persists every change it makes before it
// tells anybody about the result.
type Allocator struct {
	self     PeerName
	ring     *Ring
	space    Space
	reserved map[Address]bool // never handed out: the universe's network and broadcast addresses
	byKey    map[Key]Address
	byAddr   map[Address]Key
	// frozen: this peer started without state and does not yet know what
	// its entries are (Peer's rejoin): it neither writes its free counts
	// (a version bump of its own that could clash with one its lost self
	// made) nor refuses a ring that moves its ranges away (its lost self
	// may have given them).
	frozen bool
	// noFree: it writes no free count (a peer that started with state
	// and has not yet heard from a live peer, peer_stale.go), but refuses
	// a ring that takes its ranges as usual.
	noFree bool
}

// NewAllocator returns an allocator for self over universe, with an empty ring.
func NewAllocator(self PeerName, universe Range) *Allocator {
	a := &Allocator{
		self:   self,
		ring:   NewRing(universe),
		byKey:  map[Key]Address{},
		byAddr: map[Address]Key{},
		reserved: map[Address]bool{
			universe.Start:   true,
			universe.End - 1: true,
		},
	}
	return a
}

// Self is the peer this allocator allocates for.
func (a *Allocator) Self() PeerName { return a.self }

// Ring returns a copy of the ring.
func (a *Allocator) Ring() *Ring { return a.ring.Clone() }

// Universe is the whole pod range.
func (a *Allocator) Universe() Range { return a.ring.Universe }

// ClaimAlone claims the whole empty ring for this peer: what a lone peer
// with no others to agree with does.
func (a *Allocator) ClaimAlone() error {
	r := a.ring.Clone()
	if err := r.ClaimEvenly([]PeerName{a.self}); err != nil {
		return err
	}
	return a.SetRing(r)
}

// SetRing replaces the ring (from disk, or a later claim) after validating it
// against the universe and the current allocations: a ring under which an
// address held here would no longer be owned here is refused.
func (a *Allocator) SetRing(r *Ring) error {
	if r.Universe != a.ring.Universe {
		return fmt.Errorf("ring is for range %s, but this peer allocates in %s", r.Universe, a.ring.Universe)
	}
	if err := r.Validate(); err != nil {
		return err
	}
	if slices.Equal(r.Owned(a.self), a.space.Ranges()) {
		// Same ranges: the space and its allocations stand as they are.
		a.ring = r.Clone()
		a.refreshFree()
		return nil
	}
	var sp Space
	for _, rg := range r.Owned(a.self) {
		if err := sp.Add(rg); err != nil {
			return err
		}
	}
	for addr := range a.reserved {
		if sp.Owns(addr) {
			_ = sp.Claim(addr)
		}
	}
	for addr, k := range a.byAddr {
		if err := sp.Claim(addr); err != nil {
			return fmt.Errorf("%s holds %s: %w", k, addr, err)
		}
	}
	sp.cursor = a.space.cursor
	a.ring, a.space = r.Clone(), sp
	a.refreshFree()
	return nil
}

// refreshFree writes this peer's free counts into the ring.
func (a *Allocator) refreshFree() bool {
	if a.frozen || a.noFree {
		return false
	}
	return a.ring.SetFree(a.self, a.space.FreeIn)
}

// Restore re-enters an allocation read back from disk.
func (a *Allocator) Restore(k Key, addr Address) error {
	if old, ok := a.byKey[k]; ok {
		if old == addr {
			return nil
		}
		return fmt.Errorf("%s holds both %s and %s", k, old, addr)
	}
	if other, ok := a.byAddr[addr]; ok {
		return fmt.Errorf("%s: %w (%s)", addr, ErrAddrInUse, other)
	}
	if a.reserved[addr] {
		return fmt.Errorf("%s is the network or broadcast address of the range", addr)
	}
	if !a.space.Owns(addr) {
		return fmt.Errorf("%s: %w", addr, ErrNotOwned)
	}
	if err := a.space.Claim(addr); err != nil {
		return err
	}
	a.byKey[k], a.byAddr[addr] = addr, k
	a.refreshFree()
	return nil
}

// Allocate returns k's address, handing out a new one if k holds none;
// isNew says which. The address is never one that another key holds.
func (a *Allocator) Allocate(k Key) (addr Address, isNew bool, err error) {
	if addr, ok := a.byKey[k]; ok {
		return addr, false, nil
	}
	if a.space.Size() == 0 {
		return 0, false, ErrNoRange
	}
	addr, ok := a.space.Allocate()
	if !ok {
		return 0, false, ErrNoSpace
	}
	a.byKey[k], a.byAddr[addr] = addr, k
	a.refreshFree()
	return addr, true, nil
}

// Lookup returns k's address, if it holds one.
func (a *Allocator) Lookup(k Key) (Address, bool) {
	addr, ok := a.byKey[k]
	return addr, ok
}

// Holder returns the key that holds addr, if any.
func (a *Allocator) Holder(addr Address) (Key, bool) {
	k, ok := a.byAddr[addr]
	return k, ok
}

// Release frees k's address. Releasing a key that holds nothing is not an error.
func (a *Allocator) Release(k Key) (Address, bool) {
	addr, ok := a.byKey[k]
	if !ok {
		return 0, false
	}
	delete(a.byKey, k)
	delete(a.byAddr, addr)
	a.space.Free(addr)
	a.refreshFree()
	return addr, true
}

// Allocations lists every allocation, ordered by address.
func (a *Allocator) Allocations() []Allocation {
	out := make([]Allocation, 0, len(a.byKey))
	for k, addr := range a.byKey {
		out = append(out, Allocation{Key: k, Address: addr})
	}
	slices.SortFunc(out, func(x, y Allocation) int { return int(int64(x.Address) - int64(y.Address)) })
	return out
}

// Stats summarises this peer's space.
type Stats struct {
	Owned     uint64 // addresses in ranges this peer owns
	Allocated uint64 // held by keys
	Reserved  uint64 // never handed out
	Free      uint64 // can still be handed out
}

// Stats returns the current counts.
func (a *Allocator) Stats() Stats {
	s := Stats{Owned: a.space.Size(), Allocated: uint64(len(a.byKey))}
	for addr := range a.reserved {
		if a.space.Owns(addr) {
			s.Reserved++
		}
	}
	s.Free = s.Owned - s.Allocated - s.Reserved
	return s
}

// Owned returns the ranges this peer owns.
func (a *Allocator) Owned() []Range { return a.space.Ranges() }

// ErrRangeTaken is wrapped by the error for a ring update that gives ranges
// this peer owns to another peer: Weave's "Received update for IP range I
// own". Only an owner gives its ranges away, so such an update comes from a
// peer that reclaimed this one (weft rmpeer of a live peer), from a peer
// with a corrupt state, or from a cluster this peer was never part of.
var ErrRangeTaken = errors.New("a ring update takes ranges this peer owns")

// Merge merges a ring from another peer. It refuses, leaving everything as
// it was, a ring that cannot be merged (Ring.Merge) and one under which this
// peer would own less than it does: this peer alone gives its ranges away.
func (a *Allocator) Merge(in *Ring) (changed bool, err error) {
	r := a.ring.Clone()
	changed, err = r.Merge(in)
	if err != nil || !changed {
		return false, err
	}
	if lost := rangesMinus(a.ring.Owned(a.self), r.Owned(a.self)); len(lost) > 0 {
		// A frozen peer takes the ring's word on its ranges (its lost
		// self may have given them), but never for a range in which it
		// holds an address: that one it knows to be in use.
		held := a.heldIn(lost)
		if !a.frozen || len(held) > 0 {
			owners := map[PeerName]bool{}
			for _, rg := range lost {
				if p, ok := r.Owner(rg.Start); ok {
					owners[p] = true
				}
			}
			shown := held[:min(len(held), 5)]
			return false, fmt.Errorf("%w: it gives %v to %v, with %d of them in use here (%s); refused. "+
				"If this peer was removed with 'weft rmpeer' while it was alive, or its state was restored from an older backup, "+
				"stop it, remove its state and start it again",
				ErrRangeTaken, lost, slices.Sorted(maps.Keys(owners)), len(held), strings.Join(shown, ", "))
		}
	}
	if err := a.SetRing(r); err != nil {
		return false, err
	}
	return true, nil
}

// heldIn lists the allocations in the ranges rgs, as "address (key)".
func (a *Allocator) heldIn(rgs []Range) []string {
	var out []string
	for _, al := range a.Allocations() {
		for _, rg := range rgs {
			if rg.Contains(al.Address) {
				out = append(out, fmt.Sprintf("%s (%s)", al.Address, al.Key))
				break
			}
		}
	}
	return out
}

// lostBy returns the ranges this peer owns that it would not own once in
// is merged (nil if in cannot be merged).
func (a *Allocator) lostBy(in *Ring) []Range {
	r := a.ring.Clone()
	if changed, err := r.Merge(in); err != nil || !changed {
		return nil
	}
	return rangesMinus(a.ring.Owned(a.self), r.Owned(a.self))
}

// GiveAway hands rg, which must be owned here and hold no allocation, to
// peer to.
func (a *Allocator) GiveAway(to PeerName, rg Range) error {
	for _, al := range a.Allocations() {
		if rg.Contains(al.Address) {
			return fmt.Errorf("giving away %s: %s holds %s", rg, al.Key, al.Address)
		}
	}
	r := a.ring.Clone()
	if err := r.GiveAway(a.self, to, rg); err != nil {
		return err
	}
	return a.SetRing(r)
}

// Reclaim takes over every range of dead (see Ring.Reclaim) and returns the
// number of addresses taken.
func (a *Allocator) Reclaim(dead PeerName) (uint64, error) {
	r := a.ring.Clone()
	n, err := r.Reclaim(dead, a.self)
	if err != nil || n == 0 {
		return 0, err
	}
	return n, a.SetRing(r)
}

// DonationRange is the range this peer would give to a peer that asks for
// space: part of its largest free run (see donationRange); false when
// nothing is free.
func (a *Allocator) DonationRange() (Range, bool) {
	run := a.space.LargestFreeRun()
	if run.Size() == 0 {
		return Range{}, false
	}
	return donationRange(run), true
}
