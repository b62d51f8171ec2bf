package ipalloc

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

const self PeerName = "self"

// claimedAllocator returns an allocator for self that owns all of universe.
func claimedAllocator(t testing.TB, universe string) *Allocator {
	t.Helper()
	a := NewAllocator(self, rangeOf(universe))
	if err := a.ClaimAlone(); err != nil {
		t.Fatal(err)
	}
	return a
}

func key(i int) Key { return Key{ContainerID: fmt.Sprintf("c%04d", i), IfName: "eth0"} }

func TestAllocatorSameKeySameAddress(t *testing.T) {
	a := claimedAllocator(t, "10.32.0.0/12")
	k := Key{ContainerID: "abc", IfName: "eth0"}
	first, isNew, err := a.Allocate(k)
	if err != nil || !isNew {
		t.Fatalf("Allocate = %s, %v, %v", first, isNew, err)
	}
	if first == rangeOf("10.32.0.0/12").Start {
		t.Fatal("handed out the network address")
	}
	again, isNew, err := a.Allocate(k)
	if err != nil || isNew || again != first {
		t.Fatalf("second Allocate = %s, %v, %v; want %s, false", again, isNew, err, first)
	}
	other, _, _ := a.Allocate(Key{ContainerID: "abc", IfName: "eth1"})
	if other == first {
		t.Fatal("another interface of the same container got the same address")
	}
	if got, ok := a.Lookup(k); !ok || got != first {
		t.Errorf("Lookup = %s, %v", got, ok)
	}
	if got, ok := a.Holder(first); !ok || got != k {
		t.Errorf("Holder = %v, %v", got, ok)
	}
	if _, ok := a.Lookup(Key{ContainerID: "nobody", IfName: "eth0"}); ok {
		t.Error("Lookup of an unknown key found something")
	}
}

func TestAllocatorNoRange(t *testing.T) {
	a := NewAllocator(self, rangeOf("10.32.0.0/12"))
	if _, _, err := a.Allocate(key(1)); !errors.Is(err, ErrNoRange) || !ErrIsExhausted(err) {
		t.Fatalf("Allocate before a claim: %v, want ErrNoRange", err)
	}
	// A ring in which somebody else owns everything is no better.
	r := NewRing(rangeOf("10.32.0.0/12"))
	if err := r.ClaimEvenly([]PeerName{"other"}); err != nil {
		t.Fatal(err)
	}
	if err := a.SetRing(r); err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Allocate(key(1)); !errors.Is(err, ErrNoRange) {
		t.Fatalf("Allocate with nothing owned: %v, want ErrNoRange", err)
	}
	if err := a.ClaimAlone(); !errors.Is(err, ErrRingNotEmpty) {
		t.Fatalf("ClaimAlone on a claimed ring: %v, want ErrRingNotEmpty", err)
	}
}

func TestAllocatorNoSpace(t *testing.T) {
	u := rangeOf("192.168.0.0/28")
	a := claimedAllocator(t, "192.168.0.0/28")
	seen := map[Address]bool{}
	for i := range 14 { // 16 less the network and broadcast addresses
		addr, isNew, err := a.Allocate(key(i))
		if err != nil || !isNew || seen[addr] || addr == u.Start || addr == u.End-1 || !u.Contains(addr) {
			t.Fatalf("Allocate #%d = %s, %v, %v", i, addr, isNew, err)
		}
		seen[addr] = true
	}
	if _, _, err := a.Allocate(key(99)); !errors.Is(err, ErrNoSpace) || !ErrIsExhausted(err) {
		t.Fatalf("Allocate on a full range: %v, want ErrNoSpace", err)
	}
	// Existing keys still get their address.
	if _, isNew, err := a.Allocate(key(3)); err != nil || isNew {
		t.Fatalf("Allocate of a holder on a full range: %v, %v", isNew, err)
	}
	if want := (Stats{Owned: 16, Allocated: 14, Reserved: 2, Free: 0}); a.Stats() != want {
		t.Errorf("Stats() = %+v, want %+v", a.Stats(), want)
	}
	addr, ok := a.Release(key(5))
	if !ok {
		t.Fatal("Release of a holder reported nothing")
	}
	if got, _, err := a.Allocate(key(99)); err != nil || got != addr {
		t.Fatalf("Allocate after a release = %s, %v; want %s", got, err, addr)
	}
}

func TestAllocatorRelease(t *testing.T) {
	a := claimedAllocator(t, "10.32.0.0/24")
	addr, _, _ := a.Allocate(key(1))
	if got, ok := a.Release(key(1)); !ok || got != addr {
		t.Fatalf("Release = %s, %v; want %s", got, ok, addr)
	}
	if _, ok := a.Release(key(1)); ok {
		t.Fatal("second Release reported an address")
	}
	if _, ok := a.Release(key(2)); ok {
		t.Fatal("Release of a key that never held anything reported an address")
	}
	if _, ok := a.Holder(addr); ok {
		t.Fatal("released address still has a holder")
	}
	if s := a.Stats(); s.Allocated != 0 || s.Free != 254 {
		t.Fatalf("Stats() after release = %+v", s)
	}
	// Round robin: the released address is not the next one handed out.
	if next, _, _ := a.Allocate(key(2)); next == addr {
		t.Fatalf("the just-released %s was handed out again at once", addr)
	}
}

func TestAllocatorStats(t *testing.T) {
	a := NewAllocator(self, rangeOf("10.32.0.0/24"))
	if s := a.Stats(); s != (Stats{}) {
		t.Errorf("Stats() before a claim = %+v", s)
	}
	// Self owns the upper half, with the broadcast address, not the network address.
	r := NewRing(rangeOf("10.32.0.0/24"))
	if err := r.ClaimEvenly([]PeerName{"a-other", self}); err != nil {
		t.Fatal(err)
	}
	if err := a.SetRing(r); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if _, _, err := a.Allocate(key(i)); err != nil {
			t.Fatal(err)
		}
	}
	if want := (Stats{Owned: 128, Allocated: 3, Reserved: 1, Free: 124}); a.Stats() != want {
		t.Errorf("Stats() = %+v, want %+v", a.Stats(), want)
	}
	if got, want := a.Owned(), []Range{{addr(t, "10.32.0.128"), addr(t, "10.32.1.0")}}; !slices.Equal(got, want) {
		t.Errorf("Owned() = %v, want %v", got, want)
	}
	// The ring carries self's free count; the other peer's stays as claimed.
	for _, e := range a.Ring().Entries {
		want := uint32(128)
		if e.Peer == self {
			want = 124
		}
		if e.Free != want {
			t.Errorf("ring entry of %s: free %d, want %d", e.Peer, e.Free, want)
		}
	}
	// Allocations are ordered by address.
	als := a.Allocations()
	if len(als) != 3 || !slices.IsSortedFunc(als, func(x, y Allocation) int { return int(int64(x.Address) - int64(y.Address)) }) {
		t.Errorf("Allocations() = %v", als)
	}
}

func TestAllocatorSetRing(t *testing.T) {
	u := rangeOf("10.32.0.0/24")
	a := claimedAllocator(t, "10.32.0.0/24")
	held, _, _ := a.Allocate(key(1)) // 10.32.0.1: in the lower half

	// A ring that gives the lower half away is refused, and changes nothing.
	r := NewRing(u)
	r.Entries = []Entry{{Token: u.Start, Peer: "other", Version: 2}, {Token: u.Start + 128, Peer: self, Version: 2}}
	err := a.SetRing(r)
	if err == nil || !strings.Contains(err.Error(), held.String()) {
		t.Fatalf("SetRing that drops %s: %v", held, err)
	}
	if !strings.Contains(err.Error(), key(1).String()) {
		t.Errorf("error %q does not name the holder %s", err, key(1))
	}
	if got := a.Owned(); !slices.Equal(got, []Range{u}) {
		t.Fatalf("refused SetRing changed Owned() to %v", got)
	}

	// A ring for another universe is refused.
	if err := a.SetRing(NewRing(rangeOf("10.33.0.0/24"))); err == nil {
		t.Fatal("SetRing for another universe succeeded")
	}
	// An invalid ring is refused.
	bad := NewRing(u)
	bad.Entries = []Entry{{Token: u.Start + 1, Peer: self}}
	if err := a.SetRing(bad); err == nil {
		t.Fatal("SetRing of an invalid ring succeeded")
	}

	// A ring that keeps the held address here is accepted; the allocation
	// stays, and the address is not handed out again.
	r.Entries = []Entry{{Token: u.Start, Peer: self, Version: 2}, {Token: u.Start + 128, Peer: "other", Version: 2}}
	if err := a.SetRing(r); err != nil {
		t.Fatal(err)
	}
	if got, ok := a.Lookup(key(1)); !ok || got != held {
		t.Fatalf("after SetRing, Lookup = %s, %v", got, ok)
	}
	seen := map[Address]bool{held: true}
	for i := 2; ; i++ {
		addr, _, err := a.Allocate(key(i))
		if errors.Is(err, ErrNoSpace) {
			break
		}
		if err != nil || seen[addr] || addr < u.Start+1 || addr >= u.Start+128 {
			t.Fatalf("Allocate #%d = %s, %v", i, addr, err)
		}
		seen[addr] = true
	}
	if len(seen) != 127 { // the lower half less the network address
		t.Fatalf("handed out %d addresses, want 127", len(seen))
	}
	// The caller's ring is copied, not kept.
	r.Entries[0].Peer = "mutated"
	if p, _ := a.Ring().Owner(u.Start); p != self {
		t.Fatal("SetRing kept a reference to the caller's ring")
	}
}

func TestAllocatorRestore(t *testing.T) {
	u := rangeOf("10.32.0.0/24")
	a := NewAllocator(self, u)
	if err := a.Restore(key(1), u.Start+5); !errors.Is(err, ErrNotOwned) {
		t.Fatalf("Restore before a claim: %v, want ErrNotOwned", err)
	}
	if err := a.ClaimAlone(); err != nil {
		t.Fatal(err)
	}
	if err := a.Restore(key(1), u.Start+5); err != nil {
		t.Fatal(err)
	}
	if err := a.Restore(key(1), u.Start+5); err != nil {
		t.Fatalf("Restore of the same allocation again: %v", err)
	}
	tests := []struct {
		name    string
		k       Key
		addr    Address
		wantErr error
		wantMsg string
	}{
		{"duplicate address", key(2), u.Start + 5, ErrAddrInUse, key(1).String()},
		{"key holds another", key(1), u.Start + 6, nil, "holds both"},
		{"unowned", key(3), u.End, ErrNotOwned, ""},
		{"network address", key(4), u.Start, nil, "network or broadcast"},
		{"broadcast address", key(5), u.End - 1, nil, "network or broadcast"},
	}
	for _, tt := range tests {
		err := a.Restore(tt.k, tt.addr)
		if err == nil {
			t.Errorf("%s: Restore(%s, %s) succeeded", tt.name, tt.k, tt.addr)
			continue
		}
		if tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
			t.Errorf("%s: %v, want %v", tt.name, err, tt.wantErr)
		}
		if !strings.Contains(err.Error(), tt.wantMsg) {
			t.Errorf("%s: %q does not say %q", tt.name, err, tt.wantMsg)
		}
	}
	if s := a.Stats(); s.Allocated != 1 {
		t.Fatalf("failed restores changed the allocations: %+v", s)
	}
	// A restored address is never handed out to another key.
	for i := 10; ; i++ {
		addr, _, err := a.Allocate(key(i))
		if err != nil {
			break
		}
		if addr == u.Start+5 {
			t.Fatalf("restored %s was handed out to %s", addr, key(i))
		}
	}
}

// TestAllocatorModel compares the allocator against a map under a random
// sequence of allocate, release and lookup over many more keys than a /26
// has addresses.
func TestAllocatorModel(t *testing.T) {
	r := newRand(t)
	u := rangeOf("10.40.0.64/26")
	for round := range 10 {
		a := claimedAllocator(t, "10.40.0.64/26")
		byKey := map[Key]Address{}
		byAddr := map[Address]Key{}
		for step := range 3000 {
			k := key(r.IntN(100))
			switch op := r.IntN(10); {
			case op < 5:
				got, isNew, err := a.Allocate(k)
				if old, ok := byKey[k]; ok {
					if err != nil || isNew || got != old {
						t.Fatalf("round %d step %d: Allocate(%s) = %s, %v, %v; holds %s", round, step, k, got, isNew, err, old)
					}
					break
				}
				if len(byKey) == 62 {
					if !errors.Is(err, ErrNoSpace) {
						t.Fatalf("round %d step %d: Allocate(%s) on a full range: %s, %v", round, step, k, got, err)
					}
					break
				}
				if err != nil || !isNew {
					t.Fatalf("round %d step %d: Allocate(%s) = %v, %v", round, step, k, isNew, err)
				}
				if other, ok := byAddr[got]; ok {
					t.Fatalf("round %d step %d: %s got %s, held by %s", round, step, k, got, other)
				}
				if !u.Contains(got) || got == u.Start || got == u.End-1 {
					t.Fatalf("round %d step %d: %s got %s: outside %s or network/broadcast", round, step, k, got, u)
				}
				byKey[k], byAddr[got] = got, k
			case op < 8:
				got, ok := a.Release(k)
				old, held := byKey[k]
				if ok != held || got != old {
					t.Fatalf("round %d step %d: Release(%s) = %s, %v; model %s, %v", round, step, k, got, ok, old, held)
				}
				delete(byKey, k)
				delete(byAddr, old)
			default:
				got, ok := a.Lookup(k)
				old, held := byKey[k]
				if ok != held || got != old {
					t.Fatalf("round %d step %d: Lookup(%s) = %s, %v; model %s, %v", round, step, k, got, ok, old, held)
				}
				if held {
					if h, ok := a.Holder(old); !ok || h != k {
						t.Fatalf("round %d step %d: Holder(%s) = %s, %v; model %s", round, step, old, h, ok, k)
					}
				}
			}
			want := Stats{Owned: 64, Allocated: uint64(len(byKey)), Reserved: 2, Free: 62 - uint64(len(byKey))}
			if got := a.Stats(); got != want {
				t.Fatalf("round %d step %d: Stats() = %+v, model %+v", round, step, got, want)
			}
		}
		if got := a.Allocations(); len(got) != len(byKey) {
			t.Fatalf("round %d: %d allocations, model %d", round, len(got), len(byKey))
		}
		for _, al := range a.Allocations() {
			if byKey[al.Key] != al.Address {
				t.Fatalf("round %d: allocation %v, model %s", round, al, byKey[al.Key])
			}
		}
	}
}
