package crypt

// The replay window: a sliding bitmap of the counters seen (RFC 6479). The
// bitmap is a ring of 64-bit blocks; moving the window forward clears
// whole blocks instead of shifting bits, so that every check is O(1) and
// a jump far ahead costs at most one pass over the ring.
const (
	blockBits  = 64
	ringBlocks = 128 // a power of two
	// WindowSize is how far behind the highest counter seen a counter may
	// be and still be accepted (once): one block less than the ring, the
	// block the highest counter is in being partly in the future.
	WindowSize = (ringBlocks - 1) * blockBits // 8128
)

// Window is one receive key's replay window. The zero value is empty: it
// accepts every counter once. It is not safe for concurrent use.
type Window struct {
	last uint64 // the highest counter accepted
	ring [ringBlocks]uint64
}

// Accept reports whether counter c is new: neither seen before nor more
// than WindowSize behind the highest counter seen; it records it if so.
// Call it only for frames that authenticated, so that forged frames never
// move the window.
func (w *Window) Accept(c uint64) bool {
	block := c / blockBits
	if c > w.last {
		cur := w.last / blockBits
		// Clear the blocks the window moves over (all of them at most).
		for i, n := uint64(1), min(block-cur, ringBlocks); i <= n; i++ {
			w.ring[(cur+i)%ringBlocks] = 0
		}
		w.last = c
	} else if w.last-c > WindowSize {
		return false
	}
	bit := uint64(1) << (c % blockBits)
	b := &w.ring[block%ringBlocks]
	if *b&bit != 0 {
		return false
	}
	*b |= bit
	return true
}
