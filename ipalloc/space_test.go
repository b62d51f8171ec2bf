package ipalloc

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// space returns a Space holding rs, failing the test if one is refused.
func space(t testing.TB, rs ...Range) *Space {
	t.Helper()
	var s Space
	for _, r := range rs {
		if err := s.Add(r); err != nil {
			t.Fatal(err)
		}
	}
	return &s
}

func TestSpaceAdd(t *testing.T) {
	s := space(t, Range{100, 200})
	tests := []struct {
		r      Range
		wantOK bool
	}{
		{Range{150, 160}, false}, // inside
		{Range{50, 101}, false},  // overlaps the start
		{Range{199, 300}, false}, // overlaps the end
		{Range{0, 1000}, false},  // contains
		{Range{10, 10}, false},   // empty
		{Range{20, 10}, false},   // backwards
		{Range{200, 210}, true},  // adjacent above
		{Range{90, 100}, true},   // adjacent below
		{Range{10, 20}, true},    // apart
	}
	for _, tt := range tests {
		err := s.Add(tt.r)
		if (err == nil) != tt.wantOK {
			t.Errorf("Add(%d-%d): %v, want ok=%v", tt.r.Start, tt.r.End, err, tt.wantOK)
		}
	}
	want := []Range{{10, 20}, {90, 100}, {100, 200}, {200, 210}}
	if got := s.Ranges(); !slices.Equal(got, want) {
		t.Errorf("Ranges() = %v, want %v", got, want)
	}
	if s.Size() != 10+10+100+10 || s.Used() != 0 {
		t.Errorf("Size, Used = %d, %d", s.Size(), s.Used())
	}
}

func TestSpaceAllocateRoundRobin(t *testing.T) {
	s := space(t, Range{0, 8})
	for want := Address(0); want < 4; want++ {
		if a, ok := s.Allocate(); !ok || a != want {
			t.Fatalf("Allocate() = %d, %v, want %d", a, ok, want)
		}
	}
	s.Free(1)
	// 1 is free again, but comes last: the others are handed out first.
	for _, want := range []Address{4, 5, 6, 7, 1} {
		if a, ok := s.Allocate(); !ok || a != want {
			t.Fatalf("Allocate() = %d, %v, want %d", a, ok, want)
		}
	}
	if a, ok := s.Allocate(); ok {
		t.Fatalf("Allocate() on a full space = %d", a)
	}
	s.Free(6)
	s.Free(2)
	// The cursor is after 1, so 2 comes before 6.
	for _, want := range []Address{2, 6} {
		if a, ok := s.Allocate(); !ok || a != want {
			t.Fatalf("Allocate() = %d, %v, want %d", a, ok, want)
		}
	}
}

func TestSpaceAllocateAcrossBlocks(t *testing.T) {
	s := space(t, Range{200, 202}, Range{10, 12}, Range{100, 101})
	var got []Address
	for {
		a, ok := s.Allocate()
		if !ok {
			break
		}
		got = append(got, a)
	}
	if want := []Address{10, 11, 100, 200, 201}; !slices.Equal(got, want) {
		t.Fatalf("allocated %v, want %v", got, want)
	}
	s.Free(10)
	s.Free(201)
	// The cursor is past the last block: wrap to the start.
	for _, want := range []Address{10, 201} {
		if a, ok := s.Allocate(); !ok || a != want {
			t.Fatalf("Allocate() = %d, %v, want %d", a, ok, want)
		}
	}
	var empty Space
	if a, ok := empty.Allocate(); ok {
		t.Fatalf("Allocate() on an empty space = %d", a)
	}
}

func TestSpaceClaimFree(t *testing.T) {
	s := space(t, Range{10, 20})
	if err := s.Claim(12); err != nil {
		t.Fatal(err)
	}
	if err := s.Claim(12); err == nil {
		t.Error("Claim of an address in use succeeded")
	}
	if err := s.Claim(20); err == nil {
		t.Error("Claim of an address not owned succeeded")
	}
	if !s.InUse(12) || s.InUse(13) || s.InUse(20) || !s.Owns(10) || s.Owns(9) || s.Owns(20) {
		t.Error("InUse/Owns disagree with the claims")
	}
	if s.Used() != 1 {
		t.Errorf("Used() = %d, want 1", s.Used())
	}
	s.Free(12)
	s.Free(12) // idempotent
	s.Free(13) // never used
	s.Free(99) // not owned
	if s.Used() != 0 || s.InUse(12) {
		t.Errorf("after Free: Used() = %d, InUse(12) = %v", s.Used(), s.InUse(12))
	}
	if err := s.Claim(12); err != nil {
		t.Errorf("Claim after Free: %v", err)
	}
}

func TestSpaceExhaustion(t *testing.T) {
	// 130 addresses: more than two 64-bit words, not a multiple of 64.
	s := space(t, Range{1000, 1130})
	seen := map[Address]bool{}
	for range 130 {
		a, ok := s.Allocate()
		if !ok || seen[a] || a < 1000 || a >= 1130 {
			t.Fatalf("Allocate() = %d, %v (seen %v)", a, ok, seen[a])
		}
		seen[a] = true
	}
	if a, ok := s.Allocate(); ok {
		t.Fatalf("Allocate() on a full space = %d", a)
	}
	if s.FreeIn(Range{0, 2000}) != 0 || s.Used() != 130 {
		t.Fatalf("full: FreeIn %d, Used %d", s.FreeIn(Range{0, 2000}), s.Used())
	}
	s.Free(1129)
	if a, ok := s.Allocate(); !ok || a != 1129 {
		t.Fatalf("Allocate() after freeing the last = %d, %v", a, ok)
	}
}

func TestSpaceFreeIn(t *testing.T) {
	s := space(t, Range{0, 100}, Range{200, 300})
	for _, a := range []Address{0, 5, 99, 200, 250} {
		if err := s.Claim(a); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		r    Range
		want uint32
	}{
		{Range{0, 100}, 97},      // one whole block
		{Range{0, 300}, 97 + 98}, // both blocks and the gap
		{Range{0, 1}, 0},         // one used address
		{Range{1, 5}, 4},         // partial, all free
		{Range{0, 6}, 4},         // partial, two used
		{Range{90, 210}, 9 + 9},  // the end of one, the gap, the start of the other
		{Range{100, 200}, 0},     // the gap only
		{Range{300, 400}, 0},     // above
		{Range{50, 50}, 0},       // empty
		{Range{250, 251}, 0},
		{Range{251, 300}, 49},
	}
	for _, tt := range tests {
		if got := s.FreeIn(tt.r); got != tt.want {
			t.Errorf("FreeIn(%d-%d) = %d, want %d", tt.r.Start, tt.r.End, got, tt.want)
		}
	}
}

// spaceModel is the naive model of Space: a set of owned addresses, a set of
// used ones, and the round-robin cursor. Every address lies in [lo, hi).
type spaceModel struct {
	owned, used map[Address]bool
	ranges      []Range
	cursor      Address
	lo, hi      Address
}

// allocate is what Space.Allocate must do: the first owned free address at
// or after the cursor, else the first owned free address at all.
func (m *spaceModel) allocate() (Address, bool) {
	for _, from := range []Address{max(m.cursor, m.lo), m.lo} {
		for a := from; a < m.hi; a++ {
			if m.owned[a] && !m.used[a] {
				m.used[a] = true
				m.cursor = a + 1
				return a, true
			}
		}
	}
	return 0, false
}

func TestSpaceModel(t *testing.T) {
	r := newRand(t)
	const area = 2048 // every range falls in [base, base+area)
	base := Address(0x0a000000)
	for round := range 20 {
		var s Space
		m := &spaceModel{owned: map[Address]bool{}, used: map[Address]bool{}, lo: base, hi: base + area + 200}
		randAddr := func() Address { return base + Address(r.IntN(area+20)) - 10 }
		for step := range 3000 {
			switch op := r.IntN(20); {
			case op == 0 || len(m.ranges) == 0: // Add
				start := base + Address(r.IntN(area))
				rg := Range{start, start + Address(1+r.IntN(200))}
				overlap := slices.ContainsFunc(m.ranges, rg.Overlaps)
				err := s.Add(rg)
				if (err == nil) == overlap {
					t.Fatalf("round %d step %d: Add(%d-%d) = %v, model overlap %v", round, step, rg.Start, rg.End, err, overlap)
				}
				if err == nil {
					m.ranges = append(m.ranges, rg)
					for a := rg.Start; a < rg.End; a++ {
						m.owned[a] = true
					}
				}
			case op < 6: // Claim
				a := randAddr()
				err := s.Claim(a)
				if want := m.owned[a] && !m.used[a]; (err == nil) != want {
					t.Fatalf("round %d step %d: Claim(%s) = %v, model says ok=%v", round, step, a, err, want)
				}
				if err == nil {
					m.used[a] = true
				}
			case op < 11: // Free, of a used address mostly
				a := randAddr()
				if len(m.used) > 0 && r.IntN(4) > 0 {
					for u := range m.used {
						a = u
						break
					}
				}
				s.Free(a)
				delete(m.used, a)
			case op < 19: // Allocate
				got, ok := s.Allocate()
				want, wantOK := m.allocate()
				if ok != wantOK || got != want {
					t.Fatalf("round %d step %d: Allocate() = %s, %v, model %s, %v", round, step, got, ok, want, wantOK)
				}
			default: // FreeIn over a random range
				a, b := randAddr(), randAddr()
				rg := Range{min(a, b), max(a, b)}
				var want uint32
				for x := rg.Start; x < rg.End; x++ {
					if m.owned[x] && !m.used[x] {
						want++
					}
				}
				if got := s.FreeIn(rg); got != want {
					t.Fatalf("round %d step %d: FreeIn(%s-%s) = %d, model %d", round, step, rg.Start, rg.End, got, want)
				}
			}
			if s.Used() != uint64(len(m.used)) || s.Size() != uint64(len(m.owned)) {
				t.Fatalf("round %d step %d: Used, Size = %d, %d; model %d, %d", round, step, s.Used(), s.Size(), len(m.used), len(m.owned))
			}
			if a := randAddr(); s.Owns(a) != m.owned[a] || s.InUse(a) != m.used[a] {
				t.Fatalf("round %d step %d: Owns/InUse(%s) = %v/%v, model %v/%v", round, step, a, s.Owns(a), s.InUse(a), m.owned[a], m.used[a])
			}
		}
		// Every model range is in Ranges, in order.
		want := slices.Clone(m.ranges)
		slices.SortFunc(want, func(a, b Range) int { return int(int64(a.Start) - int64(b.Start)) })
		if got := s.Ranges(); !slices.Equal(got, want) {
			t.Fatalf("round %d: Ranges() = %v, model %v", round, got, want)
		}
	}
}

func BenchmarkSpaceAllocate(b *testing.B) {
	s := space(b, rangeOf("10.32.0.0/16"))
	// Half full, scattered, so the search has to skip used words and bits.
	r := rand.New(rand.NewPCG(1, 2))
	for range 1 << 15 {
		_ = s.Claim(rangeOf("10.32.0.0/16").Start + Address(r.IntN(1<<16)))
	}
	b.ResetTimer()
	for b.Loop() {
		a, ok := s.Allocate()
		if !ok {
			b.Fatal("space full")
		}
		s.Free(a)
	}
}
