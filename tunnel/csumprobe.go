package tunnel

import (
	"encoding/binary"
	"net/netip"
)

// Checksum probes of the vxlan paths. A NIC, or a driver, that is asked
// to compute the inner UDP and TCP checksums of VXLAN frames (checksum
// offload) and gets them wrong makes a path that carries ARP and ping
// (their checksums are computed in software) but drops every TCP segment
// and UDP datagram at the receiving kernel: the failure flannel and
// Calico users met on some virtual NICs, fixed by hand with ethtool. The
// ARP probes cannot see it. So each round also sends each vxlan peer a
// small UDP datagram whose checksum is left to the device, exactly as a
// pod's is (the kernel's CHECKSUM_PARTIAL, through an AF_PACKET socket
// with a virtio-net header that asks for it), and a control: the same
// datagram without a checksum (0: none, which no offload touches). The
// peer's router reads both off its VXLAN device before the IP stack,
// checks the checksum as its kernel would, and answers whether it was
// right, in a datagram without a checksum. A probe found wrong is a bad
// round; so is one lost while its control was answered: the outer UDP
// checksum of VXLAN (on by default) is computed on the assumption that
// the inner one will be right, so a wrong inner checksum usually makes
// the receiving kernel drop the whole datagram before the router sees
// it. probeCsumBad bad rounds in a row take the path down. A round
// without any answer (a peer router that is down, or older) says
// nothing: the ARP probes still decide, and its pods' traffic goes on.
//
// Both datagrams go from and to UDP port ChecksumProbePort, inside the
// VXLAN device only (never on the underlay as such); the node's guard
// drops them when they reach its IP stack (bridge.Guard.VXLANProbePort),
// so that they count as no drop and get no ICMP answer.

// ChecksumProbePort is the UDP port (source and destination) of the
// checksum probes and their answers, inside the overlay.
const ChecksumProbePort = 6785

const (
	csumMagic       = "weftcsum"
	csumKindProbe   = 1
	csumKindGood    = 2 // the probe's checksum was right
	csumKindBad     = 3 // it was wrong
	csumKindControl = 4 // a probe without a checksum
	csumPayloadLen  = 64
	// csumFrameLen is a probe's (and an answer's) Ethernet frame.
	csumFrameLen = EthernetHeaderLen + IPv4HeaderLen + UDPHeaderLen + csumPayloadLen
	// csumStart and csumOffset place the UDP checksum for the device
	// (virtio_net_hdr csum_start, csum_offset).
	csumStart  = EthernetHeaderLen + IPv4HeaderLen
	csumOffset = 6
	protoUDP   = 17
)

// appendCsumFrame appends a probe or an answer (kind) with nonce, from
// srcMAC/src to dstMAC/dst. A probe's UDP checksum field holds the
// pseudo-header sum, for the device to complete (CHECKSUM_PARTIAL); with
// full set it is completed here, as software would. An answer has no
// checksum (0: none, RFC 768), so that no offload can spoil it.
func appendCsumFrame(b []byte, dstMAC, srcMAC [6]byte, src, dst netip.Addr, kind byte, nonce uint64, full bool) []byte {
	b = append(b, dstMAC[:]...)
	b = append(b, srcMAC[:]...)
	b = binary.BigEndian.AppendUint16(b, 0x0800)
	ip := len(b)
	l4len := UDPHeaderLen + csumPayloadLen
	b = append(b, 0x45, 0)
	b = binary.BigEndian.AppendUint16(b, uint16(IPv4HeaderLen+l4len))
	b = append(b, 0, 0, 0x40, 0, 64, protoUDP, 0, 0) // id 0, DF, TTL 64
	s4, d4 := src.As4(), dst.As4()
	b = append(b, s4[:]...)
	b = append(b, d4[:]...)
	binary.BigEndian.PutUint16(b[ip+10:], checksum(b[ip:ip+IPv4HeaderLen], 0))
	udp := len(b)
	b = binary.BigEndian.AppendUint16(b, ChecksumProbePort)
	b = binary.BigEndian.AppendUint16(b, ChecksumProbePort)
	b = binary.BigEndian.AppendUint16(b, uint16(l4len))
	b = append(b, 0, 0)
	b = append(b, csumMagic...)
	b = append(b, kind, 0, 0, 0)
	b = binary.BigEndian.AppendUint64(b, nonce)
	// The rest: a pattern from the nonce, so that every probe's sum
	// differs.
	for i := len(b) - udp - UDPHeaderLen; i < csumPayloadLen; i++ {
		b = append(b, byte(nonce>>(8*(i%8)))^byte(i))
	}
	if kind == csumKindProbe {
		pseudo := udpPseudoSum(s4, d4, l4len)
		if full {
			c := checksum(b[udp:], pseudo)
			if c == 0 {
				c = 0xffff
			}
			binary.BigEndian.PutUint16(b[udp+6:], c)
		} else {
			binary.BigEndian.PutUint16(b[udp+6:], ^checksum(nil, pseudo))
		}
	}
	return b
}

// udpPseudoSum is the (unfolded) sum of the UDP pseudo-header.
func udpPseudoSum(src, dst [4]byte, l4len int) uint32 {
	return uint32(binary.BigEndian.Uint16(src[0:])) + uint32(binary.BigEndian.Uint16(src[2:])) +
		uint32(binary.BigEndian.Uint16(dst[0:])) + uint32(binary.BigEndian.Uint16(dst[2:])) +
		protoUDP + uint32(l4len)
}

// csumFrame is a parsed probe or answer.
type csumFrame struct {
	dstMAC, srcMAC [6]byte
	src, dst       netip.Addr
	kind           byte
	nonce          uint64
	// sumOK says whether the UDP checksum adds up; hasSum whether there
	// is one (not 0).
	sumOK, hasSum bool
}

// parseCsumFrame reads an Ethernet frame as a checksum probe or answer;
// ok is false for anything else. It never panics.
func parseCsumFrame(b []byte) (f csumFrame, ok bool) {
	if len(b) < EthernetHeaderLen+IPv4HeaderLen || binary.BigEndian.Uint16(b[12:14]) != 0x0800 {
		return f, false
	}
	ip := b[EthernetHeaderLen:]
	ihl := int(ip[0]&0x0f) * 4
	total := int(binary.BigEndian.Uint16(ip[2:4]))
	if ip[0]>>4 != 4 || ihl < IPv4HeaderLen || total < ihl+UDPHeaderLen || total > len(ip) ||
		ip[9] != protoUDP || binary.BigEndian.Uint16(ip[6:8])&0x3fff != 0 {
		return f, false
	}
	ip = ip[:total]
	udp := ip[ihl:]
	l4len := int(binary.BigEndian.Uint16(udp[4:6]))
	if binary.BigEndian.Uint16(udp[0:2]) != ChecksumProbePort || binary.BigEndian.Uint16(udp[2:4]) != ChecksumProbePort ||
		l4len != len(udp) || l4len < UDPHeaderLen+len(csumMagic)+4+8 || string(udp[8:8+len(csumMagic)]) != csumMagic {
		return f, false
	}
	p := udp[8+len(csumMagic):]
	f.kind, f.nonce = p[0], binary.BigEndian.Uint64(p[4:12])
	if f.kind < csumKindProbe || f.kind > csumKindControl {
		return f, false
	}
	f.dstMAC, f.srcMAC = [6]byte(b[0:6]), [6]byte(b[6:12])
	s4, d4 := [4]byte(ip[12:16]), [4]byte(ip[16:20])
	f.src, f.dst = netip.AddrFrom4(s4), netip.AddrFrom4(d4)
	f.hasSum = binary.BigEndian.Uint16(udp[6:8]) != 0
	f.sumOK = f.hasSum && checksum(udp, udpPseudoSum(s4, d4, l4len)) == 0
	return f, true
}
