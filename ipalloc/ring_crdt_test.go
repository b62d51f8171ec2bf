package ipalloc

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// ringHistory plays a random valid history: peers that each hold a copy of
// the ring, change only their own entries (give ranges away, recount free
// addresses), merge each other's copies, and sometimes die and are
// reclaimed behind the barrier. Every copy any peer held is kept: those are
// the rings a peer may receive.
func ringHistory(r *rand.Rand, u Range, n, steps int) []*Ring {
	names := peerNames(n)
	claim := NewRing(u)
	if err := claim.ClaimEvenly(names); err != nil {
		panic(err)
	}
	copies := map[PeerName]*Ring{}
	for _, p := range names {
		copies[p] = claim.Clone()
	}
	alive := slices.Clone(names)
	type snapshot struct {
		of   PeerName
		ring *Ring
	}
	var snaps []snapshot
	for range steps {
		p := alive[r.IntN(len(alive))]
		mine := copies[p]
		switch op := r.IntN(10); {
		case op < 3: // give part of an owned range to another peer
			owned := mine.Owned(p)
			if len(owned) == 0 || len(alive) < 2 {
				continue
			}
			rg := owned[r.IntN(len(owned))]
			start := rg.Start + Address(r.IntN(int(rg.Size())))
			end := start + 1 + Address(r.IntN(int(rg.End-start)))
			to := alive[r.IntN(len(alive))]
			if to == p {
				continue
			}
			if err := mine.GiveAway(p, to, Range{start, end}); err != nil {
				panic(err)
			}
		case op < 5: // recount free addresses
			mine.SetFree(p, func(rg Range) uint32 { return uint32(r.IntN(int(rg.Size()) + 1)) })
		case op < 9: // merge another's copy
			q := alive[r.IntN(len(alive))]
			if _, err := mine.Merge(copies[q]); err != nil {
				panic(fmt.Sprintf("%s merging %s's ring: %v", p, q, err))
			}
		default: // a peer dies and another reclaims it, behind the barrier
			if len(alive) < 3 {
				continue
			}
			dead := alive[r.IntN(len(alive))]
			alive = slices.DeleteFunc(alive, func(x PeerName) bool { return x == dead })
			by := alive[r.IntN(len(alive))]
			for _, q := range alive {
				if _, err := copies[by].Merge(copies[q]); err != nil {
					panic(err)
				}
			}
			if _, err := copies[by].Reclaim(dead, by); err != nil {
				panic(err)
			}
			// The dead peer's own copies are refused from now on: only
			// what live peers merged of them travels.
			snaps = slices.DeleteFunc(snaps, func(s snapshot) bool { return s.of == dead })
			delete(copies, dead)
			p = by
		}
		snaps = append(snaps, snapshot{p, copies[p].Clone()})
	}
	pool := make([]*Ring, len(snaps))
	for i, s := range snaps {
		pool[i] = s.ring
	}
	return pool
}

func mustMerge(t *testing.T, a, b *Ring) *Ring {
	t.Helper()
	out := a.Clone()
	if _, err := out.Merge(b); err != nil {
		t.Fatalf("merge: %v\n%v\n%v", err, a.Entries, b.Entries)
	}
	if err := out.Validate(); err != nil {
		t.Fatalf("merged ring invalid: %v", err)
	}
	return out
}

// TestRingMergeCRDT: on random valid histories, merge is commutative,
// associative and idempotent, and never fails.
func TestRingMergeCRDT(t *testing.T) {
	r := newRand(t)
	histories := 60
	if testing.Short() {
		histories = 15
	}
	for h := range histories {
		u := []Range{rangeOf("10.0.0.0/24"), rangeOf("10.32.0.0/12"), rangeOf("192.168.7.16/28")}[h%3]
		pool := ringHistory(r, u, 2+r.IntN(6), 300)
		for range 200 {
			a, b, c := pool[r.IntN(len(pool))], pool[r.IntN(len(pool))], pool[r.IntN(len(pool))]
			ab, ba := mustMerge(t, a, b), mustMerge(t, b, a)
			if !ab.Equal(ba) {
				t.Fatalf("not commutative:\na   %v\nb   %v\nab  %v\nba  %v", a.Entries, b.Entries, ab.Entries, ba.Entries)
			}
			aa := a.Clone()
			if changed, err := aa.Merge(a); err != nil || changed || !aa.Equal(a) {
				t.Fatalf("not idempotent: %v, %v", changed, err)
			}
			left, right := mustMerge(t, ab, c), mustMerge(t, a, mustMerge(t, b, c))
			if !left.Equal(right) {
				t.Fatalf("not associative:\n(ab)c %v\na(bc) %v", left.Entries, right.Entries)
			}
			// Merging what one has already merged changes nothing.
			if changed, err := ab.Clone().Merge(b); err != nil || changed {
				t.Fatalf("merging b into a+b: changed %v, %v", changed, err)
			}
		}
	}
}

func TestRingMergeBasics(t *testing.T) {
	u := Range{0, 16}
	a := NewRing(u)
	if err := a.ClaimEvenly([]PeerName{"a", "b"}); err != nil {
		t.Fatal(err)
	}
	// Into an empty ring: adopted.
	e := NewRing(u)
	if changed, err := e.Merge(a); err != nil || !changed || !e.Equal(a) {
		t.Fatalf("merge into empty: %v, %v, %v", changed, err, e.Entries)
	}
	// An empty ring: nothing changes.
	if changed, err := a.Clone().Merge(NewRing(u)); err != nil || changed {
		t.Fatalf("merge of empty: %v, %v", changed, err)
	}
	// Higher versions win, tokens are added.
	b := a.Clone()
	if err := b.GiveAway("a", "c", Range{4, 6}); err != nil {
		t.Fatal(err)
	}
	m := a.Clone()
	if changed, err := m.Merge(b); err != nil || !changed || !m.Equal(b) {
		t.Fatalf("merge of a newer ring: %v, %v\n%v\nwant %v", changed, err, m.Entries, b.Entries)
	}
	// An older ring changes nothing.
	if changed, err := m.Merge(a); err != nil || changed || !m.Equal(b) {
		t.Fatalf("merge of an older ring: %v, %v", changed, err)
	}
}

func TestRingMergeRefuses(t *testing.T) {
	u := Range{0, 16}
	claim := func(peers ...PeerName) *Ring {
		r := NewRing(u)
		if err := r.ClaimEvenly(peers); err != nil {
			t.Fatal(err)
		}
		return r
	}
	base := claim("a", "b")
	conflict := base.Clone()
	conflict.Entries[1].Peer = "c" // same version, another owner
	badFree := base.Clone()
	badFree.Entries[1].Free = 100
	badFree.Entries[1].Version = 9
	other := claim("a", "b")
	other.Universe = Range{0, 32}
	for _, tt := range []struct {
		name  string
		in    *Ring
		want  string
		isErr error
	}{
		{"nil", nil, "nil ring", nil},
		{"another universe", other, "every peer needs the same --ipalloc-range", nil},
		{"seeded apart", claim("a", "c"), "docs/ipam.md#split-rings", ErrSplitRing},
		{"conflict", conflict, "version 1 is b with 8 free here but c with 8 free", ErrRingConflict},
		{"invalid", badFree, "invalid ring", nil},
	} {
		r := base.Clone()
		_, err := r.Merge(tt.in)
		if err == nil || !strings.Contains(err.Error(), tt.want) || (tt.isErr != nil && !errors.Is(err, tt.isErr)) {
			t.Errorf("%s: Merge = %v, want an error saying %q", tt.name, err, tt.want)
		}
		if !r.Equal(base) {
			t.Errorf("%s: a refused merge changed the ring", tt.name)
		}
	}
	// The split-ring error names both seeds.
	_, err := base.Clone().Merge(claim("a", "c"))
	var se *SplitRingError
	if !errors.As(err, &se) || !strings.Contains(err.Error(), base.Seed.String()) || !strings.Contains(err.Error(), claim("a", "c").Seed.String()) {
		t.Errorf("split ring error %v does not name both seeds", err)
	}
}

func TestSeedOf(t *testing.T) {
	u := Range{0, 16}
	if SeedOf(u, []PeerName{"a", "b"}) != SeedOf(u, []PeerName{"b", "a", "b"}) {
		t.Error("the seed depends on the order of the peers")
	}
	if SeedOf(u, []PeerName{"a", "b"}) == SeedOf(u, []PeerName{"a", "c"}) {
		t.Error("different peers, same seed")
	}
	if SeedOf(u, []PeerName{"a"}) == SeedOf(Range{0, 32}, []PeerName{"a"}) {
		t.Error("different universes, same seed")
	}
	if Seed(0).String() != "none" || len(SeedOf(u, nil).String()) != 16 {
		t.Error("Seed.String")
	}
}

func TestRingGiveAway(t *testing.T) {
	r := manualRing(0, "a", 8, "b")
	r.Entries[0].Free, r.Entries[1].Free = 8, 8
	if err := r.GiveAway("a", "c", Range{2, 4}); err != nil {
		t.Fatal(err)
	}
	// Splitting at 2 and at 4 bumps the entries split; the given one once more.
	want := []Entry{{0, "a", 2, 2}, {2, "c", 4, 2}, {4, "a", 3, 4}, {8, "b", 1, 8}}
	if !slices.Equal(r.Entries, want) {
		t.Fatalf("after GiveAway: %v\nwant %v", r.Entries, want)
	}
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	// At an existing token, to the end of the universe: no new tokens.
	if err := r.GiveAway("b", "a", Range{8, 16}); err != nil {
		t.Fatal(err)
	}
	if len(r.Entries) != 4 || r.Entries[3] != (Entry{8, "a", 2, 8}) {
		t.Fatalf("after giving a whole entry: %v", r.Entries)
	}
	for _, tt := range []struct {
		from, to PeerName
		rg       Range
		want     string
	}{
		{"a", "c", Range{1, 3}, "belongs to c, not a"},
		{"a", "a", Range{0, 1}, "to itself"},
		{"a", "c", Range{3, 3}, "not a range inside"},
		{"a", "c", Range{15, 17}, "not a range inside"},
		{"a", "bad name", Range{0, 1}, "printable ASCII"},
	} {
		if err := r.Clone().GiveAway(tt.from, tt.to, tt.rg); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("GiveAway(%s, %s, %v) = %v, want %q", tt.from, tt.to, tt.rg, err, tt.want)
		}
	}
	if err := NewRing(Range{0, 16}).GiveAway("a", "b", Range{0, 1}); err == nil {
		t.Error("GiveAway on an empty ring succeeded")
	}
}

// TestRingGiveAwayModel compares GiveAway with a naive per-address owner map.
func TestRingGiveAwayModel(t *testing.T) {
	r := newRand(t)
	for range 200 {
		u := Range{100, 100 + Address(1+r.IntN(300))}
		ring := NewRing(u)
		peers := peerNames(1 + r.IntN(4))
		if err := ring.ClaimEvenly(peers); err != nil {
			continue // more peers than addresses
		}
		model := map[Address]PeerName{}
		for a := u.Start; a < u.End; a++ {
			model[a], _ = ring.Owner(a)
		}
		for range 30 {
			start := u.Start + Address(r.IntN(int(u.Size())))
			end := start + 1 + Address(r.IntN(int(u.End-start)))
			from, to := model[start], peerNames(5)[r.IntN(5)]
			err := ring.GiveAway(from, to, Range{start, end})
			allFrom := true
			for a := start; a < end; a++ {
				allFrom = allFrom && model[a] == from
			}
			if (err == nil) != (allFrom && from != to) {
				t.Fatalf("GiveAway(%s, %s, %d-%d) = %v; all owned by %s: %v", from, to, start, end, err, from, allFrom)
			}
			if err == nil {
				for a := start; a < end; a++ {
					model[a] = to
				}
			}
			if err := ring.Validate(); err != nil {
				t.Fatal(err)
			}
			for a := u.Start; a < u.End; a++ {
				if o, _ := ring.Owner(a); o != model[a] {
					t.Fatalf("Owner(%d) = %s, model says %s", a, o, model[a])
				}
			}
		}
	}
}

func TestRingReclaim(t *testing.T) {
	r := manualRing(0, "a", 4, "dead", 8, "b", 12, "dead")
	n, err := r.Reclaim("dead", "b")
	if err != nil || n != 8 {
		t.Fatalf("Reclaim = %d, %v; want 8", n, err)
	}
	j := uint32(1 + reclaimVersionJump)
	want := []Entry{{0, "a", 1, 0}, {4, "b", j, 0}, {8, "b", 1, 0}, {12, "b", j, 0}}
	if !slices.Equal(r.Entries, want) {
		t.Fatalf("after Reclaim: %v", r.Entries)
	}
	if n, err := r.Reclaim("dead", "b"); err != nil || n != 0 {
		t.Errorf("second Reclaim = %d, %v", n, err)
	}
	if _, err := r.Reclaim("b", "b"); err == nil {
		t.Error("Reclaim of self succeeded")
	}
}

func TestRangesMinus(t *testing.T) {
	for _, tt := range []struct {
		a, b, want []Range
	}{
		{[]Range{{0, 10}}, nil, []Range{{0, 10}}},
		{[]Range{{0, 10}}, []Range{{0, 10}}, nil},
		{[]Range{{0, 10}}, []Range{{2, 4}, {6, 8}}, []Range{{0, 2}, {4, 6}, {8, 10}}},
		{[]Range{{0, 4}, {8, 12}}, []Range{{2, 10}}, []Range{{0, 2}, {10, 12}}},
		{[]Range{{5, 6}}, []Range{{0, 100}}, nil},
	} {
		if got := rangesMinus(tt.a, tt.b); !slices.Equal(got, tt.want) {
			t.Errorf("rangesMinus(%v, %v) = %v, want %v", tt.a, tt.b, got, tt.want)
		}
	}
}

// TestLargestFreeRunModel compares LargestFreeRun with a naive scan.
func TestLargestFreeRunModel(t *testing.T) {
	r := newRand(t)
	for range 300 {
		var s Space
		var ranges []Range
		next := Address(1000 + r.IntN(64))
		for range 1 + r.IntN(3) {
			rg := Range{next, next + Address(1+r.IntN(200))}
			ranges = append(ranges, rg)
			if err := s.Add(rg); err != nil {
				t.Fatal(err)
			}
			next = rg.End + Address(r.IntN(3)) // sometimes adjacent blocks
		}
		density := r.Float64()
		for _, rg := range ranges {
			for a := rg.Start; a < rg.End; a++ {
				if r.Float64() < density {
					_ = s.Claim(a)
				}
			}
		}
		// Naive: the longest run of free addresses within one block.
		var want Range
		for _, rg := range ranges {
			for a := rg.Start; a < rg.End; {
				if s.InUse(a) {
					a++
					continue
				}
				b := a
				for b < rg.End && !s.InUse(b) {
					b++
				}
				if b-a > Address(want.Size()) {
					want = Range{a, b}
				}
				a = b
			}
		}
		if got := s.LargestFreeRun(); got != want {
			t.Fatalf("LargestFreeRun() = %v, want %v (ranges %v, density %.2f)", got, want, ranges, density)
		}
	}
}

func TestDonationRange(t *testing.T) {
	for _, tt := range []struct{ run, want Range }{
		{Range{0, 0}, Range{0, 0}},
		{Range{5, 6}, Range{5, 6}},
		{Range{0, 256}, Range{128, 256}},
		{Range{1, 256}, Range{192, 256}}, // half is 127: a /26, at the top
		{Range{10, 13}, Range{12, 13}},
		{Range{0x0a000001, 0x0a0000ff}, Range{0x0a000080, 0x0a0000c0}}, // .1-.254: a /26
	} {
		if got := donationRange(tt.run); got != tt.want {
			t.Errorf("donationRange(%v) = %v, want %v", tt.run, got, tt.want)
		}
	}
	r := newRand(t)
	for range 2000 {
		start := Address(r.Uint32N(1 << 30))
		run := Range{start, start + 1 + Address(r.IntN(5000))}
		d := donationRange(run)
		n := d.Size()
		if d.Start < run.Start || d.End > run.End || n == 0 || n&(n-1) != 0 || uint32(d.Start)%n != 0 {
			t.Fatalf("donationRange(%v) = %v: not an aligned power of two inside", run, d)
		}
		if run.Size() >= 2 && (n > run.Size()/2 || 4*n <= run.Size()/2*2-2) {
			t.Fatalf("donationRange(%v) = %v: not about half", run, d)
		}
	}
}

// BenchmarkRingMerge1000 merges two rings with 1,000 peers' entries each,
// where about a tenth of the entries differ (the common gossip case).
func BenchmarkRingMerge1000(b *testing.B) {
	u := rangeOf("10.32.0.0/12")
	base := NewRing(u)
	if err := base.ClaimEvenly(peerNames(1000)); err != nil {
		b.Fatal(err)
	}
	other := base.Clone()
	for i := 0; i < 1000; i += 10 {
		other.Entries[i].Version++
		other.Entries[i].Free--
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		r := base.Clone()
		if _, err := r.Merge(other); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRingDecode1000 decodes a ring with 1,000 peers' entries.
func BenchmarkRingDecode1000(b *testing.B) {
	u := rangeOf("10.32.0.0/12")
	ring := NewRing(u)
	if err := ring.ClaimEvenly(peerNames(1000)); err != nil {
		b.Fatal(err)
	}
	data := EncodeRing(ring)
	b.ReportMetric(float64(len(data)), "bytes")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeRing(data); err != nil {
			b.Fatal(err)
		}
	}
}
