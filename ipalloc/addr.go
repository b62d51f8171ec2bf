// Package ipalloc owns weft's pod address space: the universe range, the ring
// of owned ranges shared by all peers (a CRDT), Paxos for the first claim,
// donation and reclaim of ranges, and the allocator that hands this peer's
// addresses to pods.
//
// The core is pure: no goroutines, clocks, logging, disk or network. Peer is
// the whole distributed state machine of one peer (Step, Tick, Ready, in the
// shape of etcd's raft), built on Ring, Paxos, Space and Allocator; the
// contract for the shell that drives it is on Peer and in docs/ipam.md.
// Service is the single-peer shell that persists state in bbolt before it
// answers.
package ipalloc

import (
	"errors"
	"fmt"
	"math/bits"
	"net/netip"
)

// Address is an IPv4 address as a number, so that ranges are arithmetic.
type Address uint32

// AddressFrom converts an IPv4 address; anything else is an error.
func AddressFrom(a netip.Addr) (Address, error) {
	a = a.Unmap()
	if !a.Is4() {
		return 0, fmt.Errorf("%s is not an IPv4 address: weft allocates IPv4 only", a)
	}
	b := a.As4()
	return Address(uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])), nil
}

// Addr is the netip form of a.
func (a Address) Addr() netip.Addr {
	return netip.AddrFrom4([4]byte{byte(a >> 24), byte(a >> 16), byte(a >> 8), byte(a)})
}

func (a Address) String() string { return a.Addr().String() }

// Range is the half-open interval [Start, End) of addresses. A Range never
// includes 255.255.255.255, so End always fits.
type Range struct {
	Start, End Address
}

// Size is the number of addresses in r.
func (r Range) Size() uint32 {
	if r.End <= r.Start {
		return 0
	}
	return uint32(r.End - r.Start)
}

// Contains reports whether a lies in r.
func (r Range) Contains(a Address) bool { return a >= r.Start && a < r.End }

// Overlaps reports whether r and o share an address.
func (r Range) Overlaps(o Range) bool {
	return r.Size() > 0 && o.Size() > 0 && r.Start < o.End && o.Start < r.End
}

func (r Range) String() string {
	if r.Size() == 0 {
		return fmt.Sprintf("empty range at %s", r.Start)
	}
	if cidrs := r.CIDRs(); len(cidrs) == 1 {
		return cidrs[0].String()
	}
	return fmt.Sprintf("%s-%s", r.Start, r.End-1)
}

// CIDRs splits r into the fewest CIDR blocks that cover exactly r, in order.
func (r Range) CIDRs() []netip.Prefix {
	var out []netip.Prefix
	for s := r.Start; s < r.End; {
		// The largest block that starts at s (alignment) and fits before End.
		size := uint64(1) << bits.TrailingZeros32(uint32(s))
		if s == 0 {
			size = 1 << 32
		}
		for size > uint64(r.End-s) {
			size >>= 1
		}
		plen := 32 - bits.TrailingZeros64(size)
		out = append(out, netip.PrefixFrom(s.Addr(), plen))
		s += Address(size)
	}
	return out
}

// Limits on the universe (--ipalloc-range).
const (
	MinPrefixLen = 8  // larger than a /8 is almost certainly a typo
	MaxPrefixLen = 28 // 16 addresses: network, broadcast, a gateway and a few pods
)

// ErrBadRange is wrapped by every --ipalloc-range validation error.
var ErrBadRange = errors.New("invalid --ipalloc-range")

// ParseUniverse parses and validates the pod address range (--ipalloc-range).
func ParseUniverse(s string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%w %q: not a CIDR such as 10.32.0.0/12", ErrBadRange, s)
	}
	if !p.Addr().Is4() {
		return netip.Prefix{}, fmt.Errorf("%w %q: IPv6 is not supported yet; give an IPv4 CIDR such as 10.32.0.0/12", ErrBadRange, s)
	}
	if p.Masked() != p {
		return netip.Prefix{}, fmt.Errorf("%w %q: host bits are set; did you mean %s?", ErrBadRange, s, p.Masked())
	}
	if p.Bits() < MinPrefixLen || p.Bits() > MaxPrefixLen {
		return netip.Prefix{}, fmt.Errorf("%w %q: the prefix length must be between /%d and /%d", ErrBadRange, s, MinPrefixLen, MaxPrefixLen)
	}
	// RangeOf cannot hold 255.255.255.255 (Range is half-open in 32 bits), so
	// look at the prefix's last address itself.
	first, _ := AddressFrom(p.Addr())
	if last := uint64(first) + 1<<(32-p.Bits()) - 1; first == 0 || last == 0xffffffff {
		return netip.Prefix{}, fmt.Errorf("%w %q: overlaps 0.0.0.0 or 255.255.255.255", ErrBadRange, s)
	}
	if p.Addr().IsMulticast() || p.Addr().IsLoopback() {
		return netip.Prefix{}, fmt.Errorf("%w %q: a loopback or multicast range cannot hold pods", ErrBadRange, s)
	}
	return p, nil
}

// RangeOf is the Range of a valid IPv4 prefix (as ParseUniverse returns).
func RangeOf(p netip.Prefix) Range {
	a, _ := AddressFrom(p.Masked().Addr())
	size := uint64(1) << (32 - p.Bits())
	end := uint64(a) + size
	if end > 0xffffffff {
		end = 0xffffffff // excludes 255.255.255.255, which ParseUniverse refuses anyway
	}
	return Range{Start: a, End: Address(end)}
}
