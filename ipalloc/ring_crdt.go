package ipalloc

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
)

// The ring is a CRDT: a map from token to entry where merge keeps, per
// token, the entry with the higher version, and tokens are only ever added.
// Merge is then commutative, associative and idempotent, so peers that have
// seen the same updates hold the same ring whatever the order they saw them
// in. Three rules keep it a correct map of ownership:
//
//   - Only the owner of an entry changes it (GiveAway, SetFree), and every
//     change bumps its version. Reclaim, for a peer that is gone for good, is
//     the one exception; see Peer.PeerGone for the barrier that makes it safe.
//   - A peer knows every token inside the ranges it owns: it got them with
//     the ring that gave it the range, and only it can add more. So the
//     sender of a ring whose entry t is newer than ours also sent every token
//     that splits t's range.
//   - Two versions of one token with the same number but different content
//     cannot both come from the owner: Merge refuses them as a conflict.

// Errors of ring merges.
var (
	// ErrSplitRing is wrapped by the error for a ring that was seeded apart
	// from ours (see SplitRingError).
	ErrSplitRing = errors.New("the rings were seeded apart")
	// ErrRingConflict is wrapped when the same version of a token differs.
	ErrRingConflict = errors.New("conflicting ring entries")
)

// SplitRingError is returned by Merge for a ring with another seed.
type SplitRingError struct {
	Local, Remote Seed
}

func (e *SplitRingError) Error() string {
	return fmt.Sprintf("%v: this peer's ring has seed %s, the other ring seed %s; "+
		"they were claimed separately and can never be merged (see docs/ipam.md#split-rings)",
		ErrSplitRing, e.Local, e.Remote)
}

func (e *SplitRingError) Unwrap() error { return ErrSplitRing }

// Merge merges other into r: per token the higher version wins, tokens are
// only added. It validates other first and the result after, and on any
// error leaves r unchanged; it never panics on peer data. Merging into an
// empty ring adopts other. changed reports whether r changed.
func (r *Ring) Merge(other *Ring) (changed bool, err error) {
	if other == nil {
		return false, errors.New("merging a nil ring")
	}
	if other.Universe != r.Universe {
		return false, fmt.Errorf("ring is for range %s, but this peer's is for %s: every peer needs the same --ipalloc-range", other.Universe, r.Universe)
	}
	if err := other.Validate(); err != nil {
		return false, fmt.Errorf("invalid ring: %w", err)
	}
	if other.Empty() {
		return false, nil
	}
	if r.Empty() {
		*r = *other.Clone()
		return true, nil
	}
	if r.Seed != other.Seed {
		return false, &SplitRingError{Local: r.Seed, Remote: other.Seed}
	}
	out := make([]Entry, 0, max(len(r.Entries), len(other.Entries)))
	i, j := 0, 0
	for i < len(r.Entries) || j < len(other.Entries) {
		switch {
		case j == len(other.Entries) || (i < len(r.Entries) && r.Entries[i].Token < other.Entries[j].Token):
			out = append(out, r.Entries[i])
			i++
		case i == len(r.Entries) || other.Entries[j].Token < r.Entries[i].Token:
			out = append(out, other.Entries[j])
			changed = true
			j++
		default: // the same token
			mine, theirs := r.Entries[i], other.Entries[j]
			switch {
			case theirs.Version > mine.Version:
				out = append(out, theirs)
				changed = true
			case theirs.Version == mine.Version && theirs != mine:
				return false, fmt.Errorf("%w: token %s version %d is %s with %d free here but %s with %d free in the other ring",
					ErrRingConflict, mine.Token, mine.Version, mine.Peer, mine.Free, theirs.Peer, theirs.Free)
			default:
				out = append(out, mine)
			}
			i++
			j++
		}
	}
	if !changed {
		return false, nil
	}
	merged := &Ring{Universe: r.Universe, Seed: r.Seed, Entries: out}
	if err := merged.Validate(); err != nil {
		return false, fmt.Errorf("the merged ring would be invalid: %w", err)
	}
	r.Entries = out
	return true, nil
}

// index returns the index of the entry whose range holds a (a must be in
// the universe of a non-empty ring).
func (r *Ring) index(a Address) int {
	return sort.Search(len(r.Entries), func(i int) bool { return r.Entries[i].Token > a }) - 1
}

// splitAt makes a a token, if it is not one already. The new entry keeps
// the owner of the range it splits; both halves get a new version, and
// free counts no larger than their ranges (the owner recounts them).
func (r *Ring) splitAt(a Address) {
	i := r.index(a)
	e := &r.Entries[i]
	if e.Token == a {
		return
	}
	e.Version++
	upper := Entry{Token: a, Peer: e.Peer, Version: e.Version, Free: e.Free}
	r.Entries = slices.Insert(r.Entries, i+1, upper)
	for _, k := range []int{i, i + 1} {
		r.Entries[k].Free = min(r.Entries[k].Free, r.rangeOf(k).Size())
	}
}

// checkVersions refuses a change that would overflow a version.
func (r *Ring) checkVersions(rg Range, by uint32) error {
	for i, e := range r.Entries {
		if r.rangeOf(i).Overlaps(rg) && e.Version > math.MaxUint32-by {
			return fmt.Errorf("ring entry %s: version %d cannot grow any more", e.Token, e.Version)
		}
	}
	return nil
}

// GiveAway hands the range rg, all owned by from, to peer to: the ring is
// split at rg's edges (new tokens) and every entry inside gets the new owner
// and a new version. Only from may call it on its own ring (the owner
// changes its entries). The given entries' free counts are their whole
// ranges: a donor gives only free addresses; the new owner recounts.
func (r *Ring) GiveAway(from, to PeerName, rg Range) error {
	switch {
	case r.Empty():
		return errors.New("giving away part of an empty ring")
	case rg.Size() == 0 || rg.Start < r.Universe.Start || rg.End > r.Universe.End:
		return fmt.Errorf("giving away %s: not a range inside %s", rg, r.Universe)
	case from == to:
		return fmt.Errorf("giving %s from %s to itself", rg, from)
	}
	if err := ValidatePeerName(to); err != nil {
		return fmt.Errorf("giving away %s: %w", rg, err)
	}
	for i := r.index(rg.Start); i < len(r.Entries) && r.Entries[i].Token < rg.End; i++ {
		if r.Entries[i].Peer != from {
			return fmt.Errorf("giving away %s: %s belongs to %s, not %s", rg, r.rangeOf(i), r.Entries[i].Peer, from)
		}
	}
	if err := r.checkVersions(rg, 3); err != nil {
		return err
	}
	r.splitAt(rg.Start)
	if rg.End < r.Universe.End {
		r.splitAt(rg.End)
	}
	for i := r.index(rg.Start); i < len(r.Entries) && r.Entries[i].Token < rg.End; i++ {
		e := &r.Entries[i]
		e.Peer, e.Version, e.Free = to, e.Version+1, r.rangeOf(i).Size()
	}
	return nil
}

// reclaimVersionJump is how far Reclaim raises the versions of the entries
// it takes over. It is not a multiple of rejoinVersionJump (1024): a peer
// removed while it was alive, whose own versions grow by that jump when it
// rejoins, would otherwise meet the takeover at the same version with
// other content (a conflict that no merge can settle).
const reclaimVersionJump = 1<<11 + 1<<9

// Reclaim hands every entry of dead to by, each with its version plus
// reclaimVersionJump, and returns how many addresses changed hands. It is
// the only change of an entry not made by its owner: call it only for a
// peer that is gone for good, and only once every live peer has stopped
// listening to it (the barrier in Peer.PeerGone). Then every version of
// dead's entries that any live peer the barrier knows will ever accept is
// already in r, and one more would win. The jump is for a peer the barrier
// could not know (one that joined, or came back under a new name, where
// only dead and peers cut off from the reclaimer saw it): dead may have
// sent it free counts newer than any the reclaimer saw, which would
// otherwise win over the takeover and give the reclaimer's new ranges back
// to dead in every ring that merges them, and the reclaimer would refuse
// them for good. No jump helps against a range dead gave to such a peer
// (that peer must keep it): that is why the barrier waits for every member
// any acknowledger knows too.
func (r *Ring) Reclaim(dead, by PeerName) (uint64, error) {
	if dead == by {
		return 0, fmt.Errorf("%s cannot reclaim its own ranges", by)
	}
	if err := ValidatePeerName(by); err != nil {
		return 0, err
	}
	var n uint64
	for i := range r.Entries {
		if r.Entries[i].Peer == dead && r.Entries[i].Version > math.MaxUint32-reclaimVersionJump {
			return 0, fmt.Errorf("ring entry %s: version cannot grow any more", r.Entries[i].Token)
		}
	}
	for i := range r.Entries {
		e := &r.Entries[i]
		if e.Peer != dead {
			continue
		}
		e.Peer = by
		e.Version += reclaimVersionJump
		n += uint64(r.rangeOf(i).Size())
	}
	return n, nil
}

// Peers returns the owners in the ring, sorted.
func (r *Ring) Peers() []PeerName {
	var out []PeerName
	for _, e := range r.Entries {
		out = append(out, e.Peer)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// Equal reports whether r and o are the same ring.
func (r *Ring) Equal(o *Ring) bool {
	return r.Universe == o.Universe && r.Seed == o.Seed && slices.Equal(r.Entries, o.Entries)
}

// rangesMinus returns the addresses of a that are not in b (both sorted,
// non-overlapping lists), as sorted ranges.
func rangesMinus(a, b []Range) []Range {
	var out []Range
	for _, x := range a {
		cur := x.Start
		for _, y := range b {
			if y.End <= cur || y.Start >= x.End {
				continue
			}
			if y.Start > cur {
				out = append(out, Range{cur, y.Start})
			}
			cur = max(cur, y.End)
		}
		if cur < x.End {
			out = append(out, Range{cur, x.End})
		}
	}
	return out
}
