package ipalloc

import (
	"errors"
	"math"
	"net/netip"
	"strings"
	"testing"
)

func TestAddressRoundTrip(t *testing.T) {
	tests := []struct {
		in   string
		want Address
	}{
		{"0.0.0.0", 0},
		{"0.0.0.1", 1},
		{"10.32.0.0", 0x0a200000},
		{"192.168.1.255", 0xc0a801ff},
		{"255.255.255.255", math.MaxUint32},
		{"::ffff:10.0.0.1", 0x0a000001}, // IPv4-mapped is unmapped
	}
	for _, tt := range tests {
		got, err := AddressFrom(netip.MustParseAddr(tt.in))
		if err != nil {
			t.Errorf("AddressFrom(%s): %v", tt.in, err)
			continue
		}
		if got != tt.want {
			t.Errorf("AddressFrom(%s) = %#x, want %#x", tt.in, uint32(got), uint32(tt.want))
		}
		if back := got.Addr(); back != netip.MustParseAddr(tt.in).Unmap() {
			t.Errorf("Addr(%#x) = %s, want %s", uint32(got), back, tt.in)
		}
		if got.String() != netip.MustParseAddr(tt.in).Unmap().String() {
			t.Errorf("String(%#x) = %s", uint32(got), got)
		}
	}

	for _, bad := range []netip.Addr{netip.MustParseAddr("fd00::1"), netip.MustParseAddr("::1"), {}} {
		if _, err := AddressFrom(bad); err == nil {
			t.Errorf("AddressFrom(%v) accepted a non-IPv4 address", bad)
		}
	}

	r := newRand(t)
	for range 10000 {
		a := Address(r.Uint32())
		b, err := AddressFrom(a.Addr())
		if err != nil || b != a {
			t.Fatalf("round trip of %#x gave %#x, %v", uint32(a), uint32(b), err)
		}
	}
}

func TestParseUniverse(t *testing.T) {
	for _, ok := range []string{"10.32.0.0/12", "192.168.0.0/24", "10.0.0.0/8", "172.16.0.0/28", "100.64.0.0/10", "1.0.0.0/8", "254.0.0.0/8"} {
		p, err := ParseUniverse(ok)
		if err != nil {
			t.Errorf("ParseUniverse(%q): %v", ok, err)
			continue
		}
		if p.String() != ok {
			t.Errorf("ParseUniverse(%q) = %s", ok, p)
		}
	}

	tests := []struct {
		in      string
		wantMsg string // a part of the message that tells the operator what to do
	}{
		{"foo", "not a CIDR such as 10.32.0.0/12"},
		{"", "not a CIDR"},
		{"10.32.0.0", "not a CIDR"},
		{" 10.32.0.0/12", "not a CIDR"},
		{"fd00::/64", "IPv6"},
		{"::ffff:10.0.0.0/104", "IPv6"},
		{"10.32.0.1/12", "did you mean 10.32.0.0/12?"},
		{"192.168.0.7/24", "did you mean 192.168.0.0/24?"},
		{"10.0.0.0/7", "between /8 and /28"},
		{"0.0.0.0/0", "between /8 and /28"},
		{"10.0.0.0/29", "between /8 and /28"},
		{"10.0.0.0/32", "between /8 and /28"},
		{"0.0.0.0/8", "0.0.0.0 or 255.255.255.255"},
		{"255.255.255.0/24", "0.0.0.0 or 255.255.255.255"},
		{"255.255.255.240/28", "0.0.0.0 or 255.255.255.255"},
		{"255.0.0.0/8", "0.0.0.0 or 255.255.255.255"},
		{"127.0.0.0/8", "loopback or multicast"},
		{"127.1.0.0/16", "loopback or multicast"},
		{"224.0.0.0/8", "loopback or multicast"},
		{"239.255.0.0/16", "loopback or multicast"},
	}
	for _, tt := range tests {
		p, err := ParseUniverse(tt.in)
		if err == nil {
			t.Errorf("ParseUniverse(%q) = %s, want an error", tt.in, p)
			continue
		}
		if !errors.Is(err, ErrBadRange) {
			t.Errorf("ParseUniverse(%q): %v does not wrap ErrBadRange", tt.in, err)
		}
		if !strings.Contains(err.Error(), tt.wantMsg) {
			t.Errorf("ParseUniverse(%q): %q does not say %q", tt.in, err, tt.wantMsg)
		}
		if !strings.Contains(err.Error(), `"`+tt.in+`"`) {
			t.Errorf("ParseUniverse(%q): %q does not name the input", tt.in, err)
		}
	}
}

func TestRangeOf(t *testing.T) {
	tests := []struct {
		prefix     string
		start, end string // end is exclusive
		size       uint32
	}{
		{"10.32.0.0/12", "10.32.0.0", "10.48.0.0", 1 << 20},
		{"192.168.0.0/24", "192.168.0.0", "192.168.1.0", 256},
		{"172.16.0.16/28", "172.16.0.16", "172.16.0.32", 16},
		{"172.16.0.17/28", "172.16.0.16", "172.16.0.32", 16}, // masked
	}
	for _, tt := range tests {
		r := rangeOf(tt.prefix)
		if r.Start != addr(t, tt.start) || r.End != addr(t, tt.end) || r.Size() != tt.size {
			t.Errorf("RangeOf(%s) = %v-%v size %d, want %s-%s size %d", tt.prefix, r.Start, r.End, r.Size(), tt.start, tt.end, tt.size)
		}
	}
}

func TestRangeBasics(t *testing.T) {
	r := Range{Start: 10, End: 20}
	for _, tt := range []struct {
		a    Address
		want bool
	}{{9, false}, {10, true}, {19, true}, {20, false}} {
		if got := r.Contains(tt.a); got != tt.want {
			t.Errorf("%v.Contains(%d) = %v", r, tt.a, got)
		}
	}
	for _, tt := range []struct {
		o    Range
		want bool
	}{
		{Range{0, 10}, false},
		{Range{0, 11}, true},
		{Range{19, 30}, true},
		{Range{20, 30}, false},
		{Range{12, 13}, true},
		{Range{0, 100}, true},
		{Range{15, 15}, false}, // empty
	} {
		if got := r.Overlaps(tt.o); got != tt.want {
			t.Errorf("Overlaps(%d-%d) = %v, want %v", tt.o.Start, tt.o.End, got, tt.want)
		}
		if got := tt.o.Overlaps(r); got != tt.want {
			t.Errorf("reverse Overlaps(%d-%d) = %v, want %v", tt.o.Start, tt.o.End, got, tt.want)
		}
	}
	for _, tt := range []struct {
		r    Range
		want uint32
	}{{Range{10, 20}, 10}, {Range{10, 10}, 0}, {Range{20, 10}, 0}, {Range{0, math.MaxUint32}, math.MaxUint32}} {
		if got := tt.r.Size(); got != tt.want {
			t.Errorf("Size(%d-%d) = %d, want %d", tt.r.Start, tt.r.End, got, tt.want)
		}
	}
}

func TestRangeString(t *testing.T) {
	tests := []struct {
		r    Range
		want string
	}{
		{rangeOf("10.32.0.0/12"), "10.32.0.0/12"},
		{rangeOf("10.32.0.0/32"), "10.32.0.0/32"},
		{Range{addr(t, "10.0.0.1"), addr(t, "10.0.0.5")}, "10.0.0.1-10.0.0.4"},
		{Range{addr(t, "10.0.0.0"), addr(t, "10.0.0.3")}, "10.0.0.0-10.0.0.2"},
		{Range{0, math.MaxUint32}, "0.0.0.0-255.255.255.254"},
		{Range{addr(t, "10.0.0.8"), addr(t, "10.0.0.8")}, "empty range at 10.0.0.8"},
		{Range{}, "empty range at 0.0.0.0"},
	}
	for _, tt := range tests {
		if got := tt.r.String(); got != tt.want {
			t.Errorf("String(%d-%d) = %q, want %q", tt.r.Start, tt.r.End, got, tt.want)
		}
	}
}

// naiveCIDRs is the model of Range.CIDRs: walk the binary tree of all
// prefixes from 0.0.0.0/0 down, keeping each prefix that lies wholly inside r
// and descending into those that only overlap it. This yields the minimal
// cover, in order, by construction.
func naiveCIDRs(r Range) []netip.Prefix {
	var out []netip.Prefix
	var walk func(start uint64, bits int)
	walk = func(start uint64, bits int) {
		end := start + 1<<(32-bits)
		switch {
		case end <= uint64(r.Start) || start >= uint64(r.End):
			return
		case start >= uint64(r.Start) && end <= uint64(r.End):
			out = append(out, netip.PrefixFrom(Address(start).Addr(), bits))
			return
		}
		walk(start, bits+1)
		walk(start+1<<(32-bits-1), bits+1)
	}
	walk(0, 0)
	return out
}

// checkCIDRs checks the properties of r.CIDRs() directly, not only through
// the model: aligned, in order, contiguous (so disjoint and covering exactly
// r), and minimal (no two neighbours form one aligned block).
func checkCIDRs(t *testing.T, r Range, got []netip.Prefix) {
	t.Helper()
	next := uint64(r.Start)
	for i, p := range got {
		if !p.Addr().Is4() || p.Masked() != p {
			t.Fatalf("%d-%d: block %d %s is not an aligned IPv4 prefix", r.Start, r.End, i, p)
		}
		a, _ := AddressFrom(p.Addr())
		if uint64(a) != next {
			t.Fatalf("%d-%d: block %d %s starts at %d, want %d (gap, overlap or disorder)", r.Start, r.End, i, p, a, next)
		}
		next += 1 << (32 - p.Bits())
		if i > 0 {
			q := got[i-1]
			if q.Bits() == p.Bits() && q.Bits() > 0 {
				if merged := netip.PrefixFrom(q.Addr(), q.Bits()-1); merged.Masked() == merged {
					t.Fatalf("%d-%d: blocks %s and %s could be one %s", r.Start, r.End, q, p, merged)
				}
			}
		}
	}
	if next != uint64(r.End) && r.Size() > 0 {
		t.Fatalf("%d-%d: blocks end at %d", r.Start, r.End, next)
	}
	if r.Size() == 0 && len(got) != 0 {
		t.Fatalf("empty range %d-%d has blocks %v", r.Start, r.End, got)
	}
}

func TestRangeCIDRsEdges(t *testing.T) {
	tests := []struct {
		r    Range
		want []string
	}{
		{Range{}, nil},
		{Range{5, 5}, nil},
		{Range{7, 3}, nil},
		{Range{0, 1}, []string{"0.0.0.0/32"}},
		{Range{0, 2}, []string{"0.0.0.0/31"}},
		{Range{1, 4}, []string{"0.0.0.1/32", "0.0.0.2/31"}},
		{rangeOf("10.32.0.0/12"), []string{"10.32.0.0/12"}},
		{Range{addr(t, "10.0.0.1"), addr(t, "10.0.0.255")}, []string{
			"10.0.0.1/32", "10.0.0.2/31", "10.0.0.4/30", "10.0.0.8/29", "10.0.0.16/28",
			"10.0.0.32/27", "10.0.0.64/26", "10.0.0.128/26", "10.0.0.192/27", "10.0.0.224/28",
			"10.0.0.240/29", "10.0.0.248/30", "10.0.0.252/31", "10.0.0.254/32"}},
		{Range{math.MaxUint32 - 1, math.MaxUint32}, []string{"255.255.255.254/32"}},
	}
	for _, tt := range tests {
		got := tt.r.CIDRs()
		var gs []string
		for _, p := range got {
			gs = append(gs, p.String())
		}
		if strings.Join(gs, " ") != strings.Join(tt.want, " ") {
			t.Errorf("CIDRs(%d-%d) = %v, want %v", tt.r.Start, tt.r.End, gs, tt.want)
		}
	}
	// The largest range: all but 255.255.255.255, 32 blocks from /1 to /32.
	all := Range{0, math.MaxUint32}
	got := all.CIDRs()
	checkCIDRs(t, all, got)
	if len(got) != 32 || got[0].String() != "0.0.0.0/1" || got[31].String() != "255.255.255.254/32" {
		t.Errorf("CIDRs(all) = %v", got)
	}
}

func TestRangeCIDRsModel(t *testing.T) {
	r := newRand(t)
	for i := range 20000 {
		var rg Range
		switch i % 4 {
		case 0: // small: checked address by address
			rg.Start = Address(r.Uint32N(1 << 16))
			rg.End = rg.Start + Address(r.Uint32N(300))
		case 1: // small, near the top of the address space
			rg.End = Address(math.MaxUint32 - r.Uint32N(300))
			rg.Start = rg.End - Address(r.Uint32N(300))
		case 2: // anywhere, any size
			a, b := Address(r.Uint32N(math.MaxUint32)), Address(r.Uint32N(math.MaxUint32))
			rg = Range{min(a, b), max(a, b)}
		case 3: // aligned-ish boundaries, where merges are likeliest to be missed
			sh := r.IntN(24)
			a, b := Address(r.Uint32N(1<<(32-sh-1)))<<sh, Address(r.Uint32N(1<<(32-sh-1)))<<sh
			rg = Range{min(a, b), max(a, b)}
		}
		got := rg.CIDRs()
		checkCIDRs(t, rg, got)
		want := naiveCIDRs(rg)
		if len(got) != len(want) {
			t.Fatalf("CIDRs(%d-%d) = %v, model %v", rg.Start, rg.End, got, want)
		}
		for j := range got {
			if got[j] != want[j] {
				t.Fatalf("CIDRs(%d-%d) = %v, model %v", rg.Start, rg.End, got, want)
			}
		}
		if rg.Size() <= 300 {
			// Enumerate: every address in and around the range is covered
			// by exactly as many blocks as it should be.
			lo, hi := uint64(rg.Start), uint64(rg.End)
			lo = max(lo, 3) - 3
			hi = min(hi+3, math.MaxUint32)
			for a := lo; a < hi; a++ {
				n := 0
				for _, p := range got {
					if p.Contains(Address(a).Addr()) {
						n++
					}
				}
				want := 0
				if rg.Contains(Address(a)) {
					want = 1
				}
				if n != want {
					t.Fatalf("CIDRs(%d-%d): %s is in %d blocks, want %d", rg.Start, rg.End, Address(a), n, want)
				}
			}
		}
	}
}
