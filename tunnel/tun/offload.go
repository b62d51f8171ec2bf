package tun

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
)

// TCP segmentation and receive offload for a TUN device opened with
// IFF_VNET_HDR. The kernel hands the device TCP "super-packets" of up to
// 64 KiB (TSO), each behind a virtio_net_hdr that says how to cut it; a
// reader cuts them into packets of the pod MTU (split). A writer does the
// reverse for the kernel: runs of consecutive segments of one TCP flow are
// joined into one super-packet (coalesce), which the kernel then handles
// as one. One super-packet through the kernel costs about what one packet
// does, which is where the tunnel's throughput comes from. IPv4 only: the
// pod network is IPv4.

// VirtioNetHdrLen is the size of the header in front of every packet on an
// offloading TUN device. Writes need that much room in front of the
// packet (the offset of Queue.Write).
const VirtioNetHdrLen = 10

// virtio_net_hdr, from include/uapi/linux/virtio_net.h.
const (
	vnetFlagNeedsCsum = 1    // VIRTIO_NET_HDR_F_NEEDS_CSUM
	vnetGSONone       = 0    // VIRTIO_NET_HDR_GSO_NONE
	vnetGSOTCPv4      = 1    // VIRTIO_NET_HDR_GSO_TCPV4
	vnetGSOECN        = 0x80 // VIRTIO_NET_HDR_GSO_ECN
)

type virtioNetHdr struct {
	flags      uint8
	gsoType    uint8
	hdrLen     uint16
	gsoSize    uint16
	csumStart  uint16
	csumOffset uint16
}

// The header is in the machine's byte order (the TUN device's default).
func (h *virtioNetHdr) decode(b []byte) {
	h.flags, h.gsoType = b[0], b[1]
	h.hdrLen = binary.NativeEndian.Uint16(b[2:])
	h.gsoSize = binary.NativeEndian.Uint16(b[4:])
	h.csumStart = binary.NativeEndian.Uint16(b[6:])
	h.csumOffset = binary.NativeEndian.Uint16(b[8:])
}

func (h *virtioNetHdr) encode(b []byte) {
	b[0], b[1] = h.flags, h.gsoType
	binary.NativeEndian.PutUint16(b[2:], h.hdrLen)
	binary.NativeEndian.PutUint16(b[4:], h.gsoSize)
	binary.NativeEndian.PutUint16(b[6:], h.csumStart)
	binary.NativeEndian.PutUint16(b[8:], h.csumOffset)
}

const (
	protoTCP    = 6
	tcpFlagFIN  = 0x01
	tcpFlagPSH  = 0x08
	tcpFlagACK  = 0x10
	tcpFlagCWR  = 0x80
	tcpCsumOffs = 16
	maxIPv4Len  = 65535
)

// sum32 adds b to a running Internet checksum sum (RFC 1071): 64-bit
// big-endian words, their carries counted apart and added back at the end
// (2^64 = 1 modulo 2^64-1, which 2^16-1 divides). Folded to 16 bits it is
// the one's complement sum of b's 16-bit words, a shorter tail padded with
// zeros; acc is such a sum too.
func sum32(b []byte, acc uint64) uint64 {
	var carries uint64
	for len(b) >= 32 {
		var c0, c1, c2, c3 uint64
		acc, c0 = bits.Add64(acc, binary.BigEndian.Uint64(b), 0)
		acc, c1 = bits.Add64(acc, binary.BigEndian.Uint64(b[8:]), 0)
		acc, c2 = bits.Add64(acc, binary.BigEndian.Uint64(b[16:]), 0)
		acc, c3 = bits.Add64(acc, binary.BigEndian.Uint64(b[24:]), 0)
		carries += c0 + c1 + c2 + c3
		b = b[32:]
	}
	for len(b) >= 8 {
		var c uint64
		acc, c = bits.Add64(acc, binary.BigEndian.Uint64(b), 0)
		carries += c
		b = b[8:]
	}
	var tail uint64
	if len(b) >= 4 {
		tail += uint64(binary.BigEndian.Uint32(b))
		b = b[4:]
	}
	if len(b) >= 2 {
		tail += uint64(binary.BigEndian.Uint16(b))
		b = b[2:]
	}
	if len(b) == 1 {
		tail += uint64(b[0]) << 8
	}
	var c uint64
	acc, c = bits.Add64(acc, carries+tail, 0)
	return acc + c
}

// fold folds a sum to 16 bits (not complemented).
func fold(acc uint64) uint16 {
	acc = acc&0xffffffff + acc>>32
	acc = acc&0xffffffff + acc>>32
	acc = acc&0xffff + acc>>16
	acc = acc&0xffff + acc>>16
	return uint16(acc)
}

// pseudoSum is the sum of the TCP/UDP pseudo-header of an IPv4 packet.
func pseudoSum(ip []byte, proto uint8, l4len int) uint64 {
	return uint64(binary.BigEndian.Uint32(ip[12:16])) + uint64(binary.BigEndian.Uint32(ip[16:20])) +
		uint64(proto) + uint64(l4len)
}

// ipv4HeaderChecksum sets the header checksum of an IPv4 header.
func ipv4HeaderChecksum(h []byte) {
	h[10], h[11] = 0, 0
	binary.BigEndian.PutUint16(h[10:], ^fold(sum32(h, 0)))
}

// tcpChecksumOK checks the TCP checksum of an IPv4 packet with header length iphLen.
func tcpChecksumOK(p []byte, iphLen int) bool {
	return ^fold(sum32(p[iphLen:], pseudoSum(p, protoTCP, len(p)-iphLen))) == 0
}

// errBadGSO is returned for a super-packet whose header does not add up.
var errBadGSO = errors.New("malformed GSO packet from the TUN device")

// finishChecksum completes the checksum of a packet that the kernel left
// partial (VIRTIO_NET_HDR_F_NEEDS_CSUM): the field holds the
// pseudo-header sum; the rest is summed from csumStart to the end.
func finishChecksum(p []byte, h *virtioNetHdr) error {
	at := int(h.csumStart) + int(h.csumOffset)
	if int(h.csumStart) > len(p) || at+2 > len(p) {
		return fmt.Errorf("%w: checksum at %d beyond %d bytes", errBadGSO, at, len(p))
	}
	initial := uint64(binary.BigEndian.Uint16(p[at:]))
	p[at], p[at+1] = 0, 0
	binary.BigEndian.PutUint16(p[at:], ^fold(sum32(p[h.csumStart:], initial)))
	return nil
}

// splitter cuts one TCP/IPv4 super-packet into segments, one per call, so
// that a batch that ends mid-way carries on into the next read.
type splitter struct {
	in      []byte // the super-packet; nil when done
	iphLen  int
	hdrLen  int
	gsoSize int
	next    int    // where the next segment's payload starts
	seq     uint32 // of the first segment
	id      uint16 // IP id of the first segment
	i       int    // segments cut so far
}

// start checks the super-packet in with header h and prepares to cut it.
func (s *splitter) start(in []byte, h *virtioNetHdr) error {
	if h.gsoType&^vnetGSOECN != vnetGSOTCPv4 {
		return fmt.Errorf("%w: GSO type %d (only TCP/IPv4 is enabled)", errBadGSO, h.gsoType)
	}
	if len(in) < 20 || in[0]>>4 != 4 || in[9] != protoTCP {
		return fmt.Errorf("%w: not TCP/IPv4", errBadGSO)
	}
	iphLen := int(in[0]&0x0f) * 4
	if iphLen < 20 || iphLen+20 > len(in) || int(h.csumStart) != iphLen {
		return fmt.Errorf("%w: IP header length %d, checksum start %d", errBadGSO, iphLen, h.csumStart)
	}
	tcphLen := int(in[iphLen+12]>>4) * 4
	if tcphLen < 20 || iphLen+tcphLen > len(in) || h.gsoSize == 0 {
		return fmt.Errorf("%w: TCP header length %d, segment size %d", errBadGSO, tcphLen, h.gsoSize)
	}
	if iphLen+tcphLen == len(in) {
		return fmt.Errorf("%w: no payload", errBadGSO)
	}
	*s = splitter{
		in: in, iphLen: iphLen, hdrLen: iphLen + tcphLen, gsoSize: int(h.gsoSize), next: iphLen + tcphLen,
		seq: binary.BigEndian.Uint32(in[iphLen+4:]), id: binary.BigEndian.Uint16(in[4:]),
	}
	return nil
}

func (s *splitter) done() bool { return s.in == nil }

// cut writes the next segment into out and returns its length; out must
// hold hdrLen+gsoSize bytes.
func (s *splitter) cut(out []byte) (int, error) {
	end := min(s.next+s.gsoSize, len(s.in))
	n := s.hdrLen + end - s.next
	if n > len(out) {
		s.in = nil
		return 0, fmt.Errorf("%w: segment of %d bytes does not fit a buffer of %d", errBadGSO, n, len(out))
	}
	copy(out, s.in[:s.hdrLen])
	copy(out[s.hdrLen:], s.in[s.next:end])
	p := out[:n]
	binary.BigEndian.PutUint16(p[2:], uint16(n))
	binary.BigEndian.PutUint16(p[4:], s.id+uint16(s.i))
	ipv4HeaderChecksum(p[:s.iphLen])
	tcp := p[s.iphLen:]
	binary.BigEndian.PutUint32(tcp[4:], s.seq+uint32(s.next-s.hdrLen))
	last := end == len(s.in)
	if !last {
		tcp[13] &^= tcpFlagFIN | tcpFlagPSH
	}
	if s.i > 0 {
		tcp[13] &^= tcpFlagCWR
	}
	tcp[tcpCsumOffs], tcp[tcpCsumOffs+1] = 0, 0
	binary.BigEndian.PutUint16(tcp[tcpCsumOffs:], ^fold(sum32(tcp, pseudoSum(p, protoTCP, len(tcp)))))
	s.i++
	s.next = end
	if last {
		s.in = nil
	}
	return n, nil
}

// tcpSeg describes a packet that may join a coalesced run.
type tcpSeg struct {
	ok      bool // a TCP/IPv4 segment with payload, ACK or ACK|PSH only, no fragment
	iphLen  int
	tcphLen int
	payload int
	seq     uint32
	psh     bool
}

func parseSeg(p []byte) tcpSeg {
	if len(p) < 40 || p[0]>>4 != 4 || p[9] != protoTCP || int(binary.BigEndian.Uint16(p[2:])) != len(p) {
		return tcpSeg{}
	}
	if p[6]&0x3f != 0 || p[7] != 0 { // MF or a fragment offset
		return tcpSeg{}
	}
	iphLen := int(p[0]&0x0f) * 4
	if iphLen < 20 || iphLen+20 > len(p) {
		return tcpSeg{}
	}
	tcphLen := int(p[iphLen+12]>>4) * 4
	if tcphLen < 20 || iphLen+tcphLen >= len(p) {
		return tcpSeg{}
	}
	flags := p[iphLen+13]
	if flags != tcpFlagACK && flags != tcpFlagACK|tcpFlagPSH {
		return tcpSeg{}
	}
	return tcpSeg{ok: true, iphLen: iphLen, tcphLen: tcphLen, payload: len(p) - iphLen - tcphLen,
		seq: binary.BigEndian.Uint32(p[iphLen+4:]), psh: flags&tcpFlagPSH != 0}
}

// follows reports whether q (described by sq) continues the run that
// starts with packet p (sp) and whose next byte is seq: the same flow,
// addresses, ports, ack, options, TOS, TTL and DF.
func follows(p []byte, sp tcpSeg, q []byte, sq tcpSeg, seq uint32) bool {
	if !sq.ok || sq.iphLen != sp.iphLen || sq.tcphLen != sp.tcphLen || sq.seq != seq || sq.payload > sp.payload {
		return false
	}
	h := sp.iphLen
	switch {
	case p[1] != q[1] || p[8] != q[8] || p[6]&0x40 != q[6]&0x40: // TOS, TTL, DF
		return false
	case string(p[12:20]) != string(q[12:20]): // addresses
		return false
	case string(p[20:h]) != string(q[20:h]): // IP options
		return false
	case string(p[h:h+4]) != string(q[h:h+4]): // ports
		return false
	case string(p[h+8:h+12]) != string(q[h+8:h+12]): // ack
		return false
	case string(p[h+20:h+sp.tcphLen]) != string(q[h+20:h+sq.tcphLen]): // TCP options
		return false
	}
	return true
}

// runLength is how many packets from bufs[i] on (packets at offset) make
// one coalesced run: consecutive segments of one flow, all but the last of
// the first one's size, only the last with PSH, their checksums right,
// 64 KiB at most. A run of 1 is written as it is.
func runLength(bufs [][]byte, i, offset int) int {
	p := bufs[i][offset:]
	sp := parseSeg(p)
	if !sp.ok || sp.psh || !tcpChecksumOK(p, sp.iphLen) {
		return 1
	}
	seq := sp.seq + uint32(sp.payload)
	total := len(p)
	n := 1
	for j := i + 1; j < len(bufs); j++ {
		q := bufs[j][offset:]
		sq := parseSeg(q)
		if !follows(p, sp, q, sq, seq) || total+sq.payload > maxIPv4Len || !tcpChecksumOK(q, sq.iphLen) {
			break
		}
		n++
		total += sq.payload
		seq += uint32(sq.payload)
		if sq.psh || sq.payload < sp.payload {
			break // nothing may follow a PSH or a short segment
		}
	}
	return n
}

// coalesce joins the run bufs[i:i+n] (packets at offset) into out, behind
// a virtio_net_hdr, and returns the length written (header included).
// out must hold VirtioNetHdrLen + 64 KiB.
func coalesce(out []byte, bufs [][]byte, offset int) int {
	first := bufs[0][offset:]
	sp := parseSeg(first)
	hdrLen := sp.iphLen + sp.tcphLen
	w := VirtioNetHdrLen + copy(out[VirtioNetHdrLen:], first)
	psh := false
	for _, b := range bufs[1:] {
		q := b[offset:]
		w += copy(out[w:], q[hdrLen:])
		psh = q[sp.iphLen+13]&tcpFlagPSH != 0
	}
	p := out[VirtioNetHdrLen:w]
	binary.BigEndian.PutUint16(p[2:], uint16(len(p)))
	ipv4HeaderChecksum(p[:sp.iphLen])
	tcp := p[sp.iphLen:]
	if psh {
		tcp[13] |= tcpFlagPSH
	}
	// The kernel finishes the checksum (CHECKSUM_PARTIAL): the field
	// holds the pseudo-header sum.
	binary.BigEndian.PutUint16(tcp[tcpCsumOffs:], fold(pseudoSum(p, protoTCP, len(tcp))))
	h := virtioNetHdr{
		flags: vnetFlagNeedsCsum, gsoType: vnetGSOTCPv4, hdrLen: uint16(hdrLen), gsoSize: uint16(sp.payload),
		csumStart: uint16(sp.iphLen), csumOffset: tcpCsumOffs,
	}
	h.encode(out)
	return w
}
