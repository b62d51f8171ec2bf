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
// lookup is a binary search and takes no lock. It runs for every packet
// of the userspace path: the bounds are kept as integers in arrays of
// their own (firsts is what the search reads: 4 bytes a range, 1,000
// ranges in 4 KB), the owners beside them.
type Table struct {
	ranges        []OwnedRange
	firsts, lasts []uint32
	peers         []string
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
	t := &Table{ranges: rs, firsts: make([]uint32, len(rs)), lasts: make([]uint32, len(rs)), peers: make([]string, len(rs))}
	for i, r := range rs {
		t.firsts[i], t.lasts[i], t.peers[i] = u32(r.First), u32(r.Last), r.Peer
	}
	return t, nil
}

// Owner is the peer that owns dst.
func (t *Table) Owner(dst netip.Addr) (string, bool) {
	if t == nil || !dst.Is4() {
		return "", false
	}
	k := u32(dst)
	// The last range whose first address is at most k.
	lo, hi := 0, len(t.firsts)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if t.firsts[m] <= k {
			lo = m + 1
		} else {
			hi = m
		}
	}
	i := lo - 1
	if i < 0 || t.lasts[i] < k {
		return "", false
	}
	return t.peers[i], true
}

// Ranges returns the table's ranges, sorted.
func (t *Table) Ranges() []OwnedRange {
	if t == nil {
		return nil
	}
	return slices.Clone(t.ranges)
}
