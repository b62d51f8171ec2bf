package ipalloc

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
)

// PeerName is a peer's stable identity in the mesh.
type PeerName string

// MaxPeerNameLen is the longest peer name a ring or message may carry (the
// mesh's limit on --name).
const MaxPeerNameLen = 64

// ValidatePeerName checks a name that came from outside: 1 to
// MaxPeerNameLen bytes of printable ASCII without spaces, commas or
// parentheses (the mesh's rule: they delimit names in status text).
func ValidatePeerName(n PeerName) error {
	if n == "" || len(n) > MaxPeerNameLen {
		return fmt.Errorf("peer name %q: must be 1 to %d characters", n, MaxPeerNameLen)
	}
	for _, c := range []byte(n) {
		if c <= ' ' || c > '~' || c == '(' || c == ')' || c == ',' {
			return fmt.Errorf("peer name %q: only printable ASCII without spaces, commas or parentheses", n)
		}
	}
	return nil
}

// Seed identifies the first claim a ring descends from: a hash of the
// universe and of the sorted peers that shared the empty ring. Every ring
// that grew from the same claim has the same seed; two rings with different
// seeds were claimed apart (a split brain at first start, or two clusters
// joined by mistake) and are never merged. Zero means "not recorded" (a ring
// saved by a version of weft that had no seeds).
type Seed uint64

func (s Seed) String() string {
	if s == 0 {
		return "none"
	}
	return fmt.Sprintf("%016x", uint64(s))
}

// SeedOf is the seed of a claim of universe by peers (order and duplicates
// do not matter).
func SeedOf(universe Range, peers []PeerName) Seed {
	ps := slices.Clone(peers)
	slices.Sort(ps)
	ps = slices.Compact(ps)
	h := sha256.New()
	var b [8]byte
	binary.BigEndian.PutUint32(b[:4], uint32(universe.Start))
	binary.BigEndian.PutUint32(b[4:], uint32(universe.End))
	h.Write([]byte("weft ring seed\x00"))
	h.Write(b[:])
	for _, p := range ps {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	s := Seed(binary.BigEndian.Uint64(h.Sum(nil)))
	if s == 0 { // 0 means "none"
		s = 1
	}
	return s
}

// Entry is one token of the ring: the range from Token to the next entry's
// token (or to the end of the universe) belongs to Peer. Only the owner
// changes an entry, and every change bumps Version, so that merging two
// copies keeps the newer one.
type Entry struct {
	Token   Address  `json:"token"`
	Peer    PeerName `json:"peer"`
	Version uint32   `json:"version"`
	Free    uint32   `json:"free"` // free addresses in the range, as its owner last said
}

// Ring is the shared map of who owns which part of the universe. An empty
// ring owns nothing; once claimed, its first entry is the universe's start,
// and tokens are only ever added (ranges split), never removed, so every
// address has exactly one owner.
type Ring struct {
	Universe Range   `json:"universe"`
	Seed     Seed    `json:"seed,omitempty"` // the first claim this ring grew from
	Entries  []Entry `json:"entries"`        // sorted by Token, unique
}

// NewRing returns the empty ring over universe.
func NewRing(universe Range) *Ring { return &Ring{Universe: universe} }

// Empty reports whether nobody has claimed the ring yet.
func (r *Ring) Empty() bool { return len(r.Entries) == 0 }

// Clone returns a deep copy.
func (r *Ring) Clone() *Ring {
	return &Ring{Universe: r.Universe, Seed: r.Seed, Entries: slices.Clone(r.Entries)}
}

// rangeOf is the range of entry i.
func (r *Ring) rangeOf(i int) Range {
	end := r.Universe.End
	if i+1 < len(r.Entries) {
		end = r.Entries[i+1].Token
	}
	return Range{Start: r.Entries[i].Token, End: end}
}

// ErrRingNotEmpty is returned when a claim is made on a ring that has owners.
var ErrRingNotEmpty = errors.New("the ring has already been claimed")

// ClaimEvenly splits the empty universe among peers in about equal shares,
// with boundaries aligned to a power of two so that the routes stay few.
// Every peer that runs it with the same peers builds the same ring.
func (r *Ring) ClaimEvenly(peers []PeerName) error {
	if !r.Empty() {
		return ErrRingNotEmpty
	}
	ps := slices.Clone(peers)
	slices.Sort(ps)
	ps = slices.Compact(ps)
	if len(ps) == 0 {
		return errors.New("no peers to claim the ring for")
	}
	size := uint64(r.Universe.Size())
	n := uint64(len(ps))
	if n > size {
		return fmt.Errorf("%d peers cannot share %d addresses", n, size)
	}
	// Largest power-of-two alignment that keeps each share within 1/64 of even.
	align := uint64(1)
	for align*2*n*64 <= size {
		align *= 2
	}
	for i, p := range ps {
		off := uint64(i) * size / n / align * align
		r.Entries = append(r.Entries, Entry{Token: r.Universe.Start + Address(off), Peer: p, Version: 1})
	}
	for i := range r.Entries {
		r.Entries[i].Free = r.rangeOf(i).Size()
	}
	r.Seed = SeedOf(r.Universe, ps)
	return nil
}

// FirstClaimOnly reports whether r is claimed and still exactly as its
// first claim made it: every entry at version 1. Every later change (a
// free count, a split, a donation, a reclaim) raises a version, so a
// ring like this has seen no address handed out by anyone.
func (r *Ring) FirstClaimOnly() bool {
	if r.Empty() {
		return false
	}
	for _, e := range r.Entries {
		if e.Version != 1 {
			return false
		}
	}
	return true
}

// Owned returns the ranges peer owns, in order, adjacent ones joined.
func (r *Ring) Owned(peer PeerName) []Range {
	var out []Range
	for i, e := range r.Entries {
		if e.Peer != peer {
			continue
		}
		rg := r.rangeOf(i)
		if n := len(out); n > 0 && out[n-1].End == rg.Start {
			out[n-1].End = rg.End
			continue
		}
		out = append(out, rg)
	}
	return out
}

// OwnedRange is a range and its owner.
type OwnedRange struct {
	Range
	Peer PeerName
}

// Ownership lists every range of the ring with its owner, in address
// order, adjacent ranges of the same owner joined: what the data plane
// routes by.
func (r *Ring) Ownership() []OwnedRange {
	var out []OwnedRange
	for i, e := range r.Entries {
		rg := r.rangeOf(i)
		if n := len(out); n > 0 && out[n-1].Peer == e.Peer && out[n-1].End == rg.Start {
			out[n-1].End = rg.End
			continue
		}
		out = append(out, OwnedRange{Range: rg, Peer: e.Peer})
	}
	return out
}

// Owner returns the owner of a, or false when a is outside the universe or
// the ring is empty.
func (r *Ring) Owner(a Address) (PeerName, bool) {
	e, ok := r.EntryOf(a)
	return e.Peer, ok
}

// EntryOf returns the entry whose range holds a, or false when a is
// outside the universe or the ring is empty.
func (r *Ring) EntryOf(a Address) (Entry, bool) {
	if !r.Universe.Contains(a) || r.Empty() {
		return Entry{}, false
	}
	i := sort.Search(len(r.Entries), func(i int) bool { return r.Entries[i].Token > a }) - 1
	if i < 0 {
		return Entry{}, false
	}
	return r.Entries[i], true
}

// Share is one owner's part of the ring, for status.
type Share struct {
	Peer PeerName
	Size uint64 // addresses owned
	Free uint64 // as last reported
}

// Shares sums the ring by owner, largest first, then by name.
func (r *Ring) Shares() []Share {
	m := map[PeerName]*Share{}
	var order []PeerName
	for i, e := range r.Entries {
		s, ok := m[e.Peer]
		if !ok {
			s = &Share{Peer: e.Peer}
			m[e.Peer] = s
			order = append(order, e.Peer)
		}
		s.Size += uint64(r.rangeOf(i).Size())
		s.Free += uint64(e.Free)
	}
	out := make([]Share, 0, len(order))
	for _, p := range order {
		out = append(out, *m[p])
	}
	slices.SortFunc(out, func(a, b Share) int {
		if a.Size != b.Size {
			if a.Size > b.Size {
				return -1
			}
			return 1
		}
		if a.Peer < b.Peer {
			return -1
		}
		if a.Peer > b.Peer {
			return 1
		}
		return 0
	})
	return out
}

// SetFree records peer's free count for the entries it owns, bumping the
// version of each entry whose count changed. free maps a token to its count.
// An entry at the highest version keeps its count: a wrapped version would
// lose to every older copy of it (the count is only a hint for donors).
func (r *Ring) SetFree(peer PeerName, free func(Range) uint32) (changed bool) {
	for i := range r.Entries {
		e := &r.Entries[i]
		if e.Peer != peer || e.Version == math.MaxUint32 {
			continue
		}
		if f := free(r.rangeOf(i)); f != e.Free {
			e.Free = f
			e.Version++
			changed = true
		}
	}
	return changed
}

// Validate checks the invariants of a ring that came from outside (disk or a
// peer): it returns an error rather than letting a bad ring in.
func (r *Ring) Validate() error {
	if r.Universe.Size() == 0 {
		return errors.New("ring has an empty universe")
	}
	if r.Universe.Contains(0xffffffff) {
		return errors.New("ring universe includes 255.255.255.255")
	}
	for i, e := range r.Entries {
		if !r.Universe.Contains(e.Token) {
			return fmt.Errorf("ring entry %d: token %s is outside the universe %s", i, e.Token, r.Universe)
		}
		if i == 0 && e.Token != r.Universe.Start {
			return fmt.Errorf("ring entry 0: token %s is not the universe start %s", e.Token, r.Universe.Start)
		}
		if i > 0 && e.Token <= r.Entries[i-1].Token {
			return fmt.Errorf("ring entry %d: token %s is not above the previous %s", i, e.Token, r.Entries[i-1].Token)
		}
		if e.Peer == "" {
			return fmt.Errorf("ring entry %d (%s): no owner", i, e.Token)
		}
		if err := ValidatePeerName(e.Peer); err != nil {
			return fmt.Errorf("ring entry %d (%s): %w", i, e.Token, err)
		}
		if e.Free > r.rangeOf(i).Size() {
			return fmt.Errorf("ring entry %d (%s): %d free is more than the range's %d addresses", i, e.Token, e.Free, r.rangeOf(i).Size())
		}
	}
	return nil
}

// Percent is part as a percentage of whole, for status lines.
func Percent(part, whole uint64) float64 {
	if whole == 0 {
		return 0
	}
	return 100 * float64(part) / float64(whole)
}
