package crypt

import (
	"math/rand/v2"
	"testing"
)

func TestWindow(t *testing.T) {
	var w Window
	steps := []struct {
		c    uint64
		want bool
		what string
	}{
		{0, true, "first"},
		{0, false, "duplicate of the first"},
		{1, true, "in order"},
		{5, true, "a gap"},
		{3, true, "out of order, within the window"},
		{3, false, "duplicate out of order"},
		{2, true, "the rest of the gap"},
		{4, true, "the rest of the gap"},
		{5, false, "duplicate of the highest"},
		{WindowSize + 5, true, "the window's far end"},
		{5, false, "exactly the window behind, seen"},
		{6, true, "exactly the window behind, unseen"},
		{4, false, "behind the window"},
		{1 << 40, true, "far ahead"},
		{1<<40 - 1, true, "just behind after the jump"},
		{WindowSize + 6, false, "from before the jump"},
		{1<<40 - WindowSize, true, "the window's end after the jump"},
		{1<<40 - WindowSize - 1, false, "past the window after the jump"},
		{1<<64 - 1, true, "the largest counter"},
		{1<<64 - 1, false, "the largest counter again"},
		{1<<64 - 2, true, "just behind the largest"},
	}
	for _, s := range steps {
		if got := w.Accept(s.c); got != s.want {
			t.Fatalf("%s: Accept(%d) = %v, want %v", s.what, s.c, got, s.want)
		}
	}
}

// TestWindowAgainstModel compares Window with a naive model (a set of
// every counter seen and the highest) over random walks with reordering,
// duplicates and jumps.
func TestWindowAgainstModel(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	for range 50 {
		var w Window
		seen := map[uint64]bool{}
		var last uint64
		next := uint64(r.IntN(100))
		for range 5000 {
			var c uint64
			switch x := r.IntN(100); {
			case x < 60:
				c = next
				next++
			case x < 85: // reordered or duplicate, near the top
				c = last - min(last, uint64(r.IntN(WindowSize+200)))
			case x < 95: // a skip ahead
				next += uint64(r.IntN(3 * WindowSize))
				c = next
			default: // anything below
				c = r.Uint64N(last + 1)
			}
			want := !seen[c] && (c > last || last-c <= WindowSize)
			if len(seen) == 0 {
				want = true
			}
			if got := w.Accept(c); got != want {
				t.Fatalf("seed %d: Accept(%d) with last %d = %v, want %v", seed, c, last, got, want)
			}
			if want {
				seen[c] = true
				last = max(last, c)
			}
		}
	}
}
