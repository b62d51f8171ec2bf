package tunnel

import (
	"cmp"
	"fmt"
	"math/bits"
	"net/netip"
	"slices"
)

// Route is a kernel route that sends a range owned by another peer into
// the tunnel.
type Route struct {
	Dst netip.Prefix
	// Dev is the tunnel device (weft-tun), or the kernel IPIP device
	// (weft-ipip) for a peer reached by kernel IPIP.
	Dev string
	// Via is, for kernel IPIP, the owner's underlay address (an onlink
	// gateway, as Calico routes); invalid otherwise.
	Via netip.Addr
	// Src is the bridge address, so that replies to traffic from the
	// node itself come back to a local address.
	Src netip.Addr
}

func (r Route) String() string {
	s := r.Dst.String() + " dev " + r.Dev
	if r.Via.IsValid() {
		s += " via " + r.Via.String() + " onlink"
	}
	if r.Src.IsValid() {
		s += " src " + r.Src.String()
	}
	return s
}

func compareRoutes(a, b Route) int {
	if c := a.Dst.Addr().Compare(b.Dst.Addr()); c != 0 {
		return c
	}
	if c := cmp.Compare(a.Dst.Bits(), b.Dst.Bits()); c != 0 {
		return c
	}
	if c := cmp.Compare(a.Dev, b.Dev); c != 0 {
		return c
	}
	if c := a.Via.Compare(b.Via); c != 0 {
		return c
	}
	return a.Src.Compare(b.Src)
}

// RouteTarget says where the traffic to a peer's ranges goes: the device,
// and for kernel IPIP the gateway.
type RouteTarget func(peer string) (dev string, via netip.Addr)

// WantRoutes is the routes that send every range owned by a peer other
// than self into the tunnel: adjacent ranges that go the same way are
// joined, then split into the fewest CIDR prefixes.
func WantRoutes(ranges []OwnedRange, self string, src netip.Addr, target RouteTarget) []Route {
	rs := slices.Clone(ranges)
	slices.SortFunc(rs, func(a, b OwnedRange) int { return a.First.Compare(b.First) })
	type span struct {
		first, last netip.Addr
		dev         string
		via         netip.Addr
	}
	var spans []span
	for _, r := range rs {
		if r.Peer == self || !r.First.Is4() || !r.Last.Is4() || r.Last.Less(r.First) {
			continue
		}
		dev, via := target(r.Peer)
		if n := len(spans); n > 0 {
			last := &spans[n-1]
			if last.dev == dev && last.via == via && last.last.Next() == r.First {
				last.last = r.Last
				continue
			}
		}
		spans = append(spans, span{r.First, r.Last, dev, via})
	}
	var out []Route
	for _, s := range spans {
		for _, p := range PrefixesOf(s.first, s.last) {
			out = append(out, Route{Dst: p, Dev: s.dev, Via: s.via, Src: src})
		}
	}
	return out
}

// PrefixesOf splits the IPv4 range first..last (inclusive) into the fewest
// CIDR prefixes, in order. It returns nil for a range that is not IPv4 or
// is empty.
func PrefixesOf(first, last netip.Addr) []netip.Prefix {
	if !first.Is4() || !last.Is4() || last.Less(first) {
		return nil
	}
	lo, hi := u32(first), uint64(u32(last))
	var out []netip.Prefix
	for uint64(lo) <= hi {
		// The largest block that starts at lo (alignment) and fits.
		size := 32
		if lo != 0 {
			size = bits.TrailingZeros32(lo)
		}
		for size > 0 && uint64(lo)+(uint64(1)<<size)-1 > hi {
			size--
		}
		out = append(out, netip.PrefixFrom(addrOf(lo), 32-size))
		next := uint64(lo) + uint64(1)<<size
		if next > 0xffffffff {
			break
		}
		lo = uint32(next)
	}
	return out
}

func u32(a netip.Addr) uint32 {
	b := a.As4()
	return uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
}

func addrOf(v uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// DiffRoutes compares the routes wanted with those the tunnel devices
// have. It returns the routes to add (or to replace, where the kernel has
// another route to the same destination) and the routes to remove: those
// that are not wanted and whose destination is not replaced by an added
// one, so that a destination that stays routed is never without a route.
// Both come sorted, without duplicates.
func DiffRoutes(want, have []Route) (add, del []Route) {
	w := slices.Clone(want)
	slices.SortFunc(w, compareRoutes)
	w = slices.CompactFunc(w, func(a, b Route) bool { return compareRoutes(a, b) == 0 })
	wanted := make(map[Route]bool, len(w))
	for _, r := range w {
		wanted[r] = true
	}
	present := make(map[Route]bool, len(have))
	for _, r := range have {
		present[r] = true
	}
	replaced := map[netip.Prefix]bool{}
	for _, r := range w {
		if !present[r] {
			add = append(add, r)
			replaced[r.Dst] = true
		}
	}
	for r := range present {
		if !wanted[r] && !replaced[r.Dst] {
			del = append(del, r)
		}
	}
	slices.SortFunc(del, compareRoutes)
	return add, del
}

// checkWant rejects a wanted route with two different targets for one
// destination, which no kernel table can hold.
func checkWant(want []Route) error {
	seen := make(map[netip.Prefix]Route, len(want))
	for _, r := range want {
		if o, ok := seen[r.Dst]; ok && o != r {
			return fmt.Errorf("routes %s and %s have the same destination", o, r)
		}
		seen[r.Dst] = r
	}
	return nil
}
