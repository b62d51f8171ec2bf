package tunnel

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// IPv4 packet helpers for the forwarding path. They work in place and
// allocate nothing.

// checkIPv4 checks that p starts with a well-formed IPv4 header and returns
// the packet cut to the total length that the header gives.
func checkIPv4(p []byte) ([]byte, error) {
	pkt, r := ipv4Check(p)
	switch r {
	case dropNone:
		return pkt, nil
	case dropTruncated:
		if len(p) < IPv4HeaderLen {
			return nil, fmt.Errorf("%w: inner packet of %d bytes", ErrTruncated, len(p))
		}
		return nil, fmt.Errorf("%w: inner packet says %d bytes, %d arrived", ErrTruncated, binary.BigEndian.Uint16(p[2:4]), len(p))
	case dropNotIPv4:
		return nil, fmt.Errorf("%w: IP version %d, weft carries IPv4", ErrInnerPacket, p[0]>>4)
	}
	return nil, fmt.Errorf("%w: header length %d, total length %d", ErrInnerPacket, int(p[0]&0x0f)*4, binary.BigEndian.Uint16(p[2:4]))
}

// ipv4Check is checkIPv4 for the packet path: a drop reason instead of an
// error, no allocation.
func ipv4Check(p []byte) ([]byte, dropReason) {
	if len(p) > 0 && p[0]>>4 != 4 {
		return nil, dropNotIPv4
	}
	if len(p) < IPv4HeaderLen {
		return nil, dropTruncated
	}
	ihl := int(p[0]&0x0f) * 4
	total := int(binary.BigEndian.Uint16(p[2:4]))
	switch {
	case ihl < IPv4HeaderLen || total < ihl:
		return nil, dropMalformed
	case total > len(p):
		return nil, dropTruncated
	}
	return p[:total], dropNone
}

// ipv4Dst and ipv4Src read the addresses of a checked IPv4 packet.
func ipv4Dst(p []byte) netip.Addr { return netip.AddrFrom4([4]byte(p[16:20])) }
func ipv4Src(p []byte) netip.Addr { return netip.AddrFrom4([4]byte(p[12:16])) }

// ipv4DF reports whether the don't-fragment bit is set.
func ipv4DF(p []byte) bool { return p[6]&0x40 != 0 }

// decTTL decrements the TTL of a checked IPv4 packet, as a router does,
// and updates the header checksum (RFC 1624). It reports false, leaving
// the packet alone, when the TTL would reach zero.
func decTTL(p []byte) bool {
	if p[8] <= 1 {
		return false
	}
	p[8]--
	// The TTL is the high byte of the 16-bit word at offset 8: it fell
	// by 0x0100, so the checksum rises by 0x0100 (one's complement).
	sum := uint32(binary.BigEndian.Uint16(p[10:12])) + 0x0100
	sum = (sum & 0xffff) + sum>>16
	binary.BigEndian.PutUint16(p[10:12], uint16(sum))
	return true
}

// checksum is the Internet checksum of b.
func checksum(b []byte, initial uint32) uint16 {
	sum := initial
	for len(b) >= 2 {
		sum += uint32(binary.BigEndian.Uint16(b))
		b = b[2:]
	}
	if len(b) == 1 {
		sum += uint32(b[0]) << 8
	}
	for sum>>16 != 0 {
		sum = (sum & 0xffff) + sum>>16
	}
	return ^uint16(sum)
}

// maxFragNeededLen is the largest message fragNeeded builds.
const maxFragNeededLen = IPv4HeaderLen + 8 + 60 + 8

// fragNeeded writes into out (at least maxFragNeededLen bytes) an ICMP
// "fragmentation needed" (type 3 code 4) for the checked IPv4 packet orig,
// from src to orig's source, with the next-hop MTU, and returns its
// length (RFC 792, RFC 1191).
func fragNeeded(out, orig []byte, src netip.Addr, mtu int) int {
	ihl := int(orig[0]&0x0f) * 4
	quote := min(len(orig), ihl+8)
	n := IPv4HeaderLen + 8 + quote
	ip := out[:IPv4HeaderLen]
	ip[0], ip[1] = 0x45, 0xc0 // IPv4, no options; DSCP CS6 (network control), as the kernel sends ICMP errors
	binary.BigEndian.PutUint16(ip[2:4], uint16(n))
	ip[4], ip[5], ip[6], ip[7] = 0, 0, 0, 0
	ip[8], ip[9] = 64, 1 // TTL, ICMP
	ip[10], ip[11] = 0, 0
	s4 := src.As4()
	copy(ip[12:16], s4[:])
	copy(ip[16:20], orig[12:16])
	binary.BigEndian.PutUint16(ip[10:12], checksum(ip, 0))
	icmp := out[IPv4HeaderLen:n]
	icmp[0], icmp[1] = 3, 4
	icmp[2], icmp[3], icmp[4], icmp[5] = 0, 0, 0, 0
	binary.BigEndian.PutUint16(icmp[6:8], uint16(mtu))
	copy(icmp[8:], orig[:quote])
	binary.BigEndian.PutUint16(icmp[2:4], checksum(icmp, 0))
	return n
}
