package ipalloc

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

func peerNames(n int) []PeerName {
	out := make([]PeerName, n)
	for i := range out {
		out[i] = PeerName(fmt.Sprintf("peer-%02d", i))
	}
	return out
}

func TestRingClaimEvenly(t *testing.T) {
	for _, universe := range []string{"10.32.0.0/12", "192.168.0.0/24", "192.168.7.16/28"} {
		for _, n := range []int{1, 2, 3, 5, 16} {
			t.Run(fmt.Sprintf("%s/%d peers", universe, n), func(t *testing.T) {
				u := rangeOf(universe)
				peers := peerNames(n)
				ring := NewRing(u)
				if !ring.Empty() {
					t.Fatal("a new ring is not empty")
				}
				if err := ring.ClaimEvenly(peers); err != nil {
					t.Fatal(err)
				}
				if err := ring.Validate(); err != nil {
					t.Fatalf("claimed ring is invalid: %v", err)
				}
				checkEvenClaim(t, ring, peers)

				// The order of the peers does not matter, and duplicates collapse.
				r := newRand(t)
				for range 5 {
					shuffled := slices.Clone(peers)
					shuffled = append(shuffled, shuffled[r.IntN(n)], shuffled[0])
					r.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
					other := NewRing(u)
					if err := other.ClaimEvenly(shuffled); err != nil {
						t.Fatal(err)
					}
					if !slices.Equal(other.Entries, ring.Entries) {
						t.Fatalf("peers %v gave\n%v\nbut %v gave\n%v", shuffled, other.Entries, peers, ring.Entries)
					}
				}

				if err := ring.ClaimEvenly(peers); !errors.Is(err, ErrRingNotEmpty) {
					t.Fatalf("second ClaimEvenly: %v, want ErrRingNotEmpty", err)
				}
			})
		}
	}
}

// checkEvenClaim checks a fresh ClaimEvenly: every address of the universe has
// exactly one owner, each share is within 1/64 of even plus the alignment,
// and tokens are aligned.
func checkEvenClaim(t *testing.T, ring *Ring, peers []PeerName) {
	t.Helper()
	u := ring.Universe
	size, n := uint64(u.Size()), uint64(len(peers))

	// The owned ranges of all peers tile the universe exactly.
	var all []Range
	shares := map[PeerName]uint64{}
	for _, p := range peers {
		for _, rg := range ring.Owned(p) {
			all = append(all, rg)
			shares[p] += uint64(rg.Size())
			if o, ok := ring.Owner(rg.Start); !ok || o != p {
				t.Errorf("Owner(%s) = %q, %v, want %q", rg.Start, o, ok, p)
			}
			if o, ok := ring.Owner(rg.End - 1); !ok || o != p {
				t.Errorf("Owner(%s) = %q, %v, want %q", rg.End-1, o, ok, p)
			}
		}
	}
	slices.SortFunc(all, func(a, b Range) int { return int(int64(a.Start) - int64(b.Start)) })
	next := u.Start
	for _, rg := range all {
		if rg.Start != next {
			t.Fatalf("owned ranges %v do not tile %s: %s expected next", all, u, next)
		}
		next = rg.End
	}
	if next != u.End {
		t.Fatalf("owned ranges %v stop at %s, not at the end of %s", all, next, u)
	}
	if size <= 256 { // small: ask Owner about every address
		for a := u.Start; a < u.End; a++ {
			if _, ok := ring.Owner(a); !ok {
				t.Fatalf("%s has no owner", a)
			}
		}
	}

	// The alignment ClaimEvenly promises: the largest power of two that
	// keeps a share within 1/64 of even, or 1.
	align := uint64(1)
	for align*2*n*64 <= size {
		align *= 2
	}
	if align > 1 && align*64*n > size {
		t.Fatalf("alignment %d is more than 1/64 of an even share", align)
	}
	for _, e := range ring.Entries {
		if off := uint64(e.Token - u.Start); off%align != 0 {
			t.Errorf("token %s is not aligned to %d", e.Token, align)
		}
		if e.Version != 1 {
			t.Errorf("entry %s has version %d, want 1", e.Token, e.Version)
		}
	}
	for i := range ring.Entries {
		if f := ring.Entries[i].Free; f != ring.rangeOf(i).Size() {
			t.Errorf("entry %s: free %d, want the whole range %d", ring.Entries[i].Token, f, ring.rangeOf(i).Size())
		}
	}
	even := float64(size) / float64(n)
	for _, p := range peers {
		if d := float64(shares[p]) - even; d > float64(align)+1 || -d > float64(align)+1 {
			t.Errorf("%s owns %d addresses, even is %.1f: more than the alignment %d off", p, shares[p], even, align)
		}
	}
	if sh := ring.Shares(); len(sh) != len(peers) {
		t.Errorf("Shares() has %d peers, want %d", len(sh), len(peers))
	}
}

func TestRingClaimEvenlyErrors(t *testing.T) {
	if err := NewRing(rangeOf("10.0.0.0/28")).ClaimEvenly(nil); err == nil {
		t.Error("ClaimEvenly with no peers succeeded")
	}
	if err := NewRing(rangeOf("10.0.0.0/28")).ClaimEvenly(peerNames(17)); err == nil {
		t.Error("ClaimEvenly of 17 peers over 16 addresses succeeded")
	}
	r := NewRing(rangeOf("10.0.0.0/28"))
	if err := r.ClaimEvenly([]PeerName{"a", "a", "a"}); err != nil || len(r.Entries) != 1 {
		t.Errorf("ClaimEvenly(a, a, a) = %v, %v", err, r.Entries)
	}
}

// manualRing builds a ring over 0-16 from token:peer pairs.
func manualRing(pairs ...any) *Ring {
	r := NewRing(Range{0, 16})
	for i := 0; i < len(pairs); i += 2 {
		r.Entries = append(r.Entries, Entry{Token: Address(pairs[i].(int)), Peer: PeerName(pairs[i+1].(string)), Version: 1})
	}
	return r
}

func TestRingOwned(t *testing.T) {
	r := manualRing(0, "a", 4, "a", 8, "b", 12, "a", 14, "c")
	tests := []struct {
		peer PeerName
		want []Range
	}{
		{"a", []Range{{0, 8}, {12, 14}}}, // 0-4 and 4-8 joined
		{"b", []Range{{8, 12}}},
		{"c", []Range{{14, 16}}}, // the last entry runs to the end of the universe
		{"d", nil},
	}
	for _, tt := range tests {
		if got := r.Owned(tt.peer); !slices.Equal(got, tt.want) {
			t.Errorf("Owned(%s) = %v, want %v", tt.peer, got, tt.want)
		}
	}
}

func TestRingOwnership(t *testing.T) {
	r := manualRing(0, "a", 4, "a", 8, "b", 12, "a", 14, "c")
	want := []OwnedRange{{Range{0, 8}, "a"}, {Range{8, 12}, "b"}, {Range{12, 14}, "a"}, {Range{14, 16}, "c"}}
	if got := r.Ownership(); !slices.Equal(got, want) {
		t.Errorf("Ownership() = %v, want %v", got, want)
	}
	if got := NewRing(Range{0, 16}).Ownership(); got != nil {
		t.Errorf("Ownership of the empty ring = %v, want nothing", got)
	}
}

func TestRingOwner(t *testing.T) {
	r := manualRing(0, "a", 4, "b", 15, "c")
	r.Universe = Range{0, 16}
	tests := []struct {
		a      Address
		want   PeerName
		wantOK bool
	}{
		{0, "a", true},
		{3, "a", true},
		{4, "b", true},
		{14, "b", true},
		{15, "c", true},
		{16, "", false}, // just past the universe
	}
	for _, tt := range tests {
		if got, ok := r.Owner(tt.a); got != tt.want || ok != tt.wantOK {
			t.Errorf("Owner(%d) = %q, %v, want %q, %v", tt.a, got, ok, tt.want, tt.wantOK)
		}
	}
	shifted := NewRing(Range{100, 116})
	shifted.Entries = []Entry{{Token: 100, Peer: "a"}}
	if _, ok := shifted.Owner(99); ok {
		t.Error("Owner just below the universe has an owner")
	}
	if p, ok := shifted.Owner(115); !ok || p != "a" {
		t.Errorf("Owner at the universe's last address = %q, %v", p, ok)
	}
	if _, ok := NewRing(Range{0, 16}).Owner(3); ok {
		t.Error("an empty ring has an owner")
	}
}

func TestRingShares(t *testing.T) {
	r := manualRing(0, "b", 4, "a", 8, "c", 12, "d", 14, "c")
	r.Entries[0].Free = 1
	r.Entries[2].Free = 2
	r.Entries[4].Free = 1
	want := []Share{
		{Peer: "c", Size: 6, Free: 3}, // 8-12 and 14-16
		{Peer: "a", Size: 4},          // ties sorted by name
		{Peer: "b", Size: 4, Free: 1},
		{Peer: "d", Size: 2},
	}
	if got := r.Shares(); !slices.Equal(got, want) {
		t.Errorf("Shares() = %v, want %v", got, want)
	}
	if got := NewRing(Range{0, 16}).Shares(); len(got) != 0 {
		t.Errorf("Shares() of an empty ring = %v", got)
	}
}

func TestRingSetFree(t *testing.T) {
	r := manualRing(0, "a", 4, "b", 8, "a")
	free := func(rg Range) uint32 { return rg.Size() - 1 }
	if !r.SetFree("a", free) {
		t.Fatal("SetFree did not report a change")
	}
	want := []Entry{{0, "a", 2, 3}, {4, "b", 1, 0}, {8, "a", 2, 7}}
	if !slices.Equal(r.Entries, want) {
		t.Fatalf("after SetFree: %v, want %v", r.Entries, want)
	}
	if r.SetFree("a", free) {
		t.Error("SetFree with the same counts reported a change")
	}
	if !slices.Equal(r.Entries, want) {
		t.Errorf("SetFree with the same counts changed versions: %v", r.Entries)
	}
}

func TestRingClone(t *testing.T) {
	r := manualRing(0, "a", 8, "b")
	c := r.Clone()
	c.Entries[0].Peer = "x"
	if r.Entries[0].Peer != "a" {
		t.Error("Clone shares entries with the original")
	}
}

func TestRingValidate(t *testing.T) {
	tests := []struct {
		name    string
		ring    *Ring
		wantMsg string // empty: valid
	}{
		{"empty ring", manualRing(), ""},
		{"one owner", manualRing(0, "a"), ""},
		{"several", manualRing(0, "a", 3, "b", 15, "a"), ""},
		{"empty universe", &Ring{Universe: Range{5, 5}}, "empty universe"},
		{"token outside", manualRing(0, "a", 16, "b"), "outside the universe"},
		{"token far outside", manualRing(0, "a", 1000, "b"), "outside the universe"},
		{"first token not the start", manualRing(1, "a"), "not the universe start"},
		{"unsorted", manualRing(0, "a", 8, "b", 4, "c"), "not above the previous"},
		{"duplicate token", manualRing(0, "a", 4, "b", 4, "c"), "not above the previous"},
		{"empty owner", manualRing(0, "a", 4, ""), "no owner"},
		{"free too large", func() *Ring { r := manualRing(0, "a", 12, "b"); r.Entries[1].Free = 5; return r }(), "more than the range's 4"},
		{"free fits", func() *Ring { r := manualRing(0, "a", 12, "b"); r.Entries[1].Free = 4; return r }(), ""},
	}
	for _, tt := range tests {
		err := tt.ring.Validate()
		switch {
		case tt.wantMsg == "" && err != nil:
			t.Errorf("%s: Validate() = %v, want nil", tt.name, err)
		case tt.wantMsg != "" && (err == nil || !strings.Contains(err.Error(), tt.wantMsg)):
			t.Errorf("%s: Validate() = %v, want an error saying %q", tt.name, err, tt.wantMsg)
		}
	}
}

func TestPercent(t *testing.T) {
	for _, tt := range []struct {
		part, whole uint64
		want        float64
	}{{0, 0, 0}, {5, 0, 0}, {1, 4, 25}, {1 << 20, 1 << 20, 100}} {
		if got := Percent(tt.part, tt.whole); got != tt.want {
			t.Errorf("Percent(%d, %d) = %v, want %v", tt.part, tt.whole, got, tt.want)
		}
	}
}

func TestRingFirstClaimOnly(t *testing.T) {
	r := NewRing(rangeOf("10.32.0.0/26"))
	if r.FirstClaimOnly() {
		t.Error("an empty ring counts as the first claim")
	}
	if err := r.ClaimEvenly([]PeerName{"a", "b"}); err != nil {
		t.Fatal(err)
	}
	if !r.FirstClaimOnly() {
		t.Fatalf("a fresh claim is not the first claim alone: %v", r)
	}
	if !r.SetFree("a", func(Range) uint32 { return 3 }) {
		t.Fatal("setup: the free count did not change")
	}
	if r.FirstClaimOnly() {
		t.Error("a ring with a changed free count still counts as the first claim alone")
	}
}
