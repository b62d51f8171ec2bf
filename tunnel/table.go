package tunnel

import (
	"fmt"
	"net/netip"
	"slices"
)

// OwnedRange is the addresses First..Last (inclusive) and their owner.
type OwnedRange struct {
	First, Last netip.Addr
	Peer        string
}

func (r OwnedRange) String() string { return fmt.Sprintf("%s-%s(%s)", r.First, r.Last, r.Peer) }

// Table is an immutable lookup of owners over sorted, disjoint ranges: a
// snapshot of the ring, made by SetRing whenever the ring changes. A
// lookup is a binary search and takes no lock.
type Table struct {
	ranges []OwnedRange
}

// NewTable checks and sorts ranges. They must be IPv4, First <= Last, and
// must not overlap.
func NewTable(ranges []OwnedRange) (*Table, error) {
	rs := slices.Clone(ranges)
	for _, r := range rs {
		if !r.First.Is4() || !r.Last.Is4() || r.Last.Less(r.First) {
			return nil, fmt.Errorf("owned range %s: want IPv4 addresses with first <= last", r)
		}
		if r.Peer == "" {
			return nil, fmt.Errorf("owned range %s: no owner", r)
		}
	}
	slices.SortFunc(rs, func(a, b OwnedRange) int { return a.First.Compare(b.First) })
	for i := 1; i < len(rs); i++ {
		if !rs[i-1].Last.Less(rs[i].First) {
			return nil, fmt.Errorf("owned ranges %s and %s overlap", rs[i-1], rs[i])
		}
	}
	return &Table{ranges: rs}, nil
}

// Owner is the peer that owns dst.
func (t *Table) Owner(dst netip.Addr) (string, bool) {
	if t == nil {
		return "", false
	}
	i, found := slices.BinarySearchFunc(t.ranges, dst, func(r OwnedRange, a netip.Addr) int { return r.First.Compare(a) })
	if !found {
		i--
	}
	if i < 0 || t.ranges[i].Last.Less(dst) {
		return "", false
	}
	return t.ranges[i].Peer, true
}

// Ranges returns the table's ranges, sorted.
func (t *Table) Ranges() []OwnedRange {
	if t == nil {
		return nil
	}
	return slices.Clone(t.ranges)
}
