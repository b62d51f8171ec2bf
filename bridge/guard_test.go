package bridge

import (
	"net/netip"
	"slices"
	"testing"
)

func addrRange(first, last string) AddrRange {
	return AddrRange{First: netip.MustParseAddr(first), Last: netip.MustParseAddr(last)}
}

// TestIntervalBounds: ranges of the ring (not aligned, in any order,
// touching or overlapping) become the elements of an nftables interval
// set, a start and the address after the end, merged; a range that ends
// at 255.255.255.255 has no end element; and the elements read back give
// the merged ranges again.
func TestIntervalBounds(t *testing.T) {
	b := func(a string, end bool) bound { return bound{addr: netip.MustParseAddr(a), end: end} }
	for _, tc := range []struct {
		name   string
		in     []AddrRange
		want   []bound
		merged []AddrRange
	}{
		{"empty", nil, nil, nil},
		{"one address", []AddrRange{addrRange("10.32.0.7", "10.32.0.7")},
			[]bound{b("10.32.0.7", false), b("10.32.0.8", true)}, []AddrRange{addrRange("10.32.0.7", "10.32.0.7")}},
		{"not aligned", []AddrRange{addrRange("10.32.3.17", "10.33.0.200")},
			[]bound{b("10.32.3.17", false), b("10.33.0.201", true)}, []AddrRange{addrRange("10.32.3.17", "10.33.0.200")}},
		{"adjacent merged, out of order", []AddrRange{addrRange("10.32.8.0", "10.32.15.255"), addrRange("10.32.0.0", "10.32.7.255"), addrRange("10.40.0.0", "10.40.0.9")},
			[]bound{b("10.32.0.0", false), b("10.32.16.0", true), b("10.40.0.0", false), b("10.40.0.10", true)},
			[]AddrRange{addrRange("10.32.0.0", "10.32.15.255"), addrRange("10.40.0.0", "10.40.0.9")}},
		{"overlapping and contained", []AddrRange{addrRange("10.0.0.0", "10.0.0.100"), addrRange("10.0.0.50", "10.0.0.60"), addrRange("10.0.0.90", "10.0.1.5")},
			[]bound{b("10.0.0.0", false), b("10.0.1.6", true)}, []AddrRange{addrRange("10.0.0.0", "10.0.1.5")}},
		{"gap of one address", []AddrRange{addrRange("10.0.0.0", "10.0.0.9"), addrRange("10.0.0.11", "10.0.0.20")},
			[]bound{b("10.0.0.0", false), b("10.0.0.10", true), b("10.0.0.11", false), b("10.0.0.21", true)},
			[]AddrRange{addrRange("10.0.0.0", "10.0.0.9"), addrRange("10.0.0.11", "10.0.0.20")}},
		{"to the top", []AddrRange{addrRange("255.255.255.0", "255.255.255.255"), addrRange("0.0.0.0", "0.0.0.0")},
			[]bound{b("0.0.0.0", false), b("0.0.0.1", true), b("255.255.255.0", false)},
			[]AddrRange{addrRange("0.0.0.0", "0.0.0.0"), addrRange("255.255.255.0", "255.255.255.255")}},
		{"everything", []AddrRange{addrRange("128.0.0.0", "255.255.255.255"), addrRange("0.0.0.0", "127.255.255.255")},
			[]bound{b("0.0.0.0", false)}, []AddrRange{addrRange("0.0.0.0", "255.255.255.255")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := intervalBounds(tc.in)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("intervalBounds(%v) = %v, want %v", tc.in, got, tc.want)
			}
			rev := slices.Clone(got)
			slices.Reverse(rev) // the kernel dumps in its own order
			if back := rangesOfBounds(rev); !slices.Equal(back, tc.merged) {
				t.Errorf("rangesOfBounds(%v) = %v, want %v", rev, back, tc.merged)
			}
		})
	}
	for _, bad := range [][]AddrRange{
		{addrRange("10.0.0.9", "10.0.0.1")},
		{{First: netip.MustParseAddr("::1"), Last: netip.MustParseAddr("::2")}},
		{{}},
	} {
		if _, err := intervalBounds(bad); err == nil {
			t.Errorf("intervalBounds(%v) took it", bad)
		}
	}
	// nft's own "0.0.0.0 end" element, and an end at a start's address,
	// are no range.
	if got := rangesOfBounds([]bound{b("0.0.0.0", true), b("10.0.0.0", false), b("10.0.0.5", true)}); !slices.Equal(got, []AddrRange{addrRange("10.0.0.0", "10.0.0.4")}) {
		t.Errorf("rangesOfBounds with nft's 0.0.0.0 end: %v", got)
	}
}
