package ipalloc

import (
	"fmt"
	"math/bits"
	"slices"
)

// Space tracks which addresses of the ranges this peer owns are in use.
// Allocation goes round-robin from the last address handed out (as
// host-local does), so that a just-released address is not reused at once
// while stale ARP or conntrack entries may still point at it.
type Space struct {
	blocks []block // sorted, non-overlapping
	cursor Address // where the next search starts
}

type block struct {
	r     Range
	used  []uint64 // bit i: r.Start+i is in use
	nused uint32
}

func newBlock(r Range) block {
	return block{r: r, used: make([]uint64, (uint64(r.Size())+63)/64)}
}

func (b *block) isUsed(a Address) bool {
	i := uint32(a - b.r.Start)
	return b.used[i/64]&(1<<(i%64)) != 0
}

func (b *block) set(a Address, v bool) {
	i := uint32(a - b.r.Start)
	if v {
		b.used[i/64] |= 1 << (i % 64)
		b.nused++
	} else {
		b.used[i/64] &^= 1 << (i % 64)
		b.nused--
	}
}

// firstFree returns the first free address of b at or after from.
func (b *block) firstFree(from Address) (Address, bool) {
	if from < b.r.Start {
		from = b.r.Start
	}
	for from < b.r.End {
		i := uint32(from - b.r.Start)
		w := ^b.used[i/64] >> (i % 64) // free bits at or above i in this word
		if w != 0 {
			a := from + Address(bits.TrailingZeros64(w))
			if a < b.r.End {
				return a, true
			}
			return 0, false
		}
		from += Address(64 - i%64)
	}
	return 0, false
}

// Add makes r part of the space. r must not overlap what the space has.
func (s *Space) Add(r Range) error {
	if r.Size() == 0 {
		return fmt.Errorf("empty range %s", r)
	}
	for _, b := range s.blocks {
		if b.r.Overlaps(r) {
			return fmt.Errorf("range %s overlaps %s, which this peer owns already", r, b.r)
		}
	}
	s.blocks = append(s.blocks, newBlock(r))
	slices.SortFunc(s.blocks, func(a, b block) int { return int(int64(a.r.Start) - int64(b.r.Start)) })
	return nil
}

// Ranges returns the ranges of the space in order.
func (s *Space) Ranges() []Range {
	out := make([]Range, len(s.blocks))
	for i, b := range s.blocks {
		out[i] = b.r
	}
	return out
}

func (s *Space) find(a Address) *block {
	i, ok := slices.BinarySearchFunc(s.blocks, a, func(b block, a Address) int {
		switch {
		case b.r.End <= a:
			return -1
		case b.r.Start > a:
			return 1
		}
		return 0
	})
	if !ok {
		return nil
	}
	return &s.blocks[i]
}

// Owns reports whether a lies in the space.
func (s *Space) Owns(a Address) bool { return s.find(a) != nil }

// InUse reports whether a is owned and in use.
func (s *Space) InUse(a Address) bool {
	b := s.find(a)
	return b != nil && b.isUsed(a)
}

// Claim marks a as in use. It fails if a is not owned or already in use.
func (s *Space) Claim(a Address) error {
	b := s.find(a)
	if b == nil {
		return fmt.Errorf("address %s is not in a range this peer owns", a)
	}
	if b.isUsed(a) {
		return fmt.Errorf("address %s is already in use", a)
	}
	b.set(a, true)
	return nil
}

// Free marks a as free again; freeing a free address is a no-op.
func (s *Space) Free(a Address) {
	if b := s.find(a); b != nil && b.isUsed(a) {
		b.set(a, false)
	}
}

// Allocate finds a free address after the cursor (wrapping), marks it in use
// and moves the cursor past it.
func (s *Space) Allocate() (Address, bool) {
	if len(s.blocks) == 0 {
		return 0, false
	}
	// Start in the block of the cursor (or the next one), go round once.
	start, cursor := 0, s.cursor
	for start < len(s.blocks) && s.blocks[start].r.End <= cursor {
		start++
	}
	if start == len(s.blocks) { // the cursor is past the last block: wrap
		start, cursor = 0, 0
	}
	for k := 0; k <= len(s.blocks); k++ {
		i := (start + k) % len(s.blocks)
		b := &s.blocks[i]
		if b.nused == b.r.Size() {
			continue
		}
		from := b.r.Start
		if k == 0 {
			from = cursor
		}
		if a, ok := b.firstFree(from); ok {
			b.set(a, true)
			s.cursor = a + 1
			return a, true
		}
	}
	return 0, false
}

// FreeIn counts the free addresses of the space inside r.
func (s *Space) FreeIn(r Range) uint32 {
	var n uint32
	for i := range s.blocks {
		b := &s.blocks[i]
		if !b.r.Overlaps(r) {
			continue
		}
		if r.Start <= b.r.Start && b.r.End <= r.End {
			n += b.r.Size() - b.nused
			continue
		}
		lo, hi := uint32(max(r.Start, b.r.Start)-b.r.Start), uint32(min(r.End, b.r.End)-b.r.Start)
		n += (hi - lo) - b.usedBetween(lo, hi)
	}
	return n
}

// usedBetween counts the used bits in [lo, hi), a word at a time.
func (b *block) usedBetween(lo, hi uint32) uint32 {
	var n int
	for i := lo; i < hi; {
		w := b.used[i/64] >> (i % 64)
		width := min(64-i%64, hi-i)
		if width < 64 {
			w &= 1<<width - 1
		}
		n += bits.OnesCount64(w)
		i += width
	}
	return uint32(n)
}

// Size is the number of addresses in the space; Used of those in use.
func (s *Space) Size() (n uint64) {
	for _, b := range s.blocks {
		n += uint64(b.r.Size())
	}
	return n
}

// Used is the number of addresses in use.
func (s *Space) Used() (n uint64) {
	for _, b := range s.blocks {
		n += uint64(b.nused)
	}
	return n
}

// LargestFreeRun returns the longest run of free addresses inside one range
// of the space (the lowest such run on a tie), or an empty range when no
// address is free.
func (s *Space) LargestFreeRun() Range {
	var best Range
	for i := range s.blocks {
		b := &s.blocks[i]
		if b.r.Size()-b.nused <= best.Size() {
			continue // cannot beat best
		}
		size := b.r.Size()
		var runStart uint32
		inRun := false
		closeRun := func(end uint32) {
			if inRun && end-runStart > best.Size() {
				best = Range{b.r.Start + Address(runStart), b.r.Start + Address(end)}
			}
			inRun = false
		}
		for off := uint32(0); off < size; {
			w := b.used[off/64]
			if off%64 == 0 && off+64 <= size && (w == 0 || w == ^uint64(0)) {
				if w == 0 {
					if !inRun {
						runStart, inRun = off, true
					}
				} else {
					closeRun(off)
				}
				off += 64
				continue
			}
			if w&(1<<(off%64)) == 0 {
				if !inRun {
					runStart, inRun = off, true
				}
			} else {
				closeRun(off)
			}
			off++
		}
		closeRun(size)
	}
	return best
}

// donationRange picks the part of a free run to give away: about half of
// it, as the highest CIDR-aligned block of the largest power of two that
// fits in half the run, so that the donor keeps the low part and the routes
// stay few. A run of one address is given whole.
func donationRange(run Range) Range {
	n := run.Size()
	if n <= 1 {
		return run
	}
	p := uint32(1) << (31 - bits.LeadingZeros32(n/2)) // largest power of two <= n/2
	s := (run.End - Address(p)) &^ Address(p-1)
	if s < run.Start { // cannot happen for n >= 2p-1; keep the range valid anyway
		s = run.End - Address(p)
	}
	return Range{s, s + Address(p)}
}
