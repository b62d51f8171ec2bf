package bridge

// The samples of packets dropped by NetworkPolicy (issue 15): each pod
// chain of table ip weft-policy sends a rate-limited sample of its drops
// to nfnetlink_log group PolicyLogGroup (see policy.go). This file decodes
// the kernel's messages; policylog_linux.go reads them from the socket.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/mdlayher/netlink"
)

// nfnetlink_log's message types and attributes
// (include/uapi/linux/netfilter/nfnetlink_log.h).
const (
	nfnlSubsysULOG  = 4
	nfulnlMsgPacket = 0
	nfulnlMsgConfig = 1

	nfulaPayload = 9
	nfulaPrefix  = 10

	nfulaCfgCmd  = 1
	nfulaCfgMode = 2

	nfulnlCfgCmdBind = 1
	nfulnlCopyPacket = 2
)

// BlockedPacket is one sampled packet that a NetworkPolicy chain dropped.
type BlockedPacket struct {
	// Egress: dropped leaving its source pod (the source is this node's);
	// else entering its destination pod.
	Egress   bool
	Protocol uint8 // the IP protocol number
	Src, Dst netip.Addr
	// SrcPort and DstPort are those of TCP, UDP and SCTP; zero for other
	// protocols and for fragments after the first.
	SrcPort, DstPort uint16
}

// Direction is "ingress" or "egress".
func (b BlockedPacket) Direction() string { return dirName(b.Egress) }

// protoNames name the protocols of BlockedPacket.String.
var protoNames = map[uint8]string{1: "ICMP", 6: "TCP", 17: "UDP", 132: "SCTP"}

// hasPorts reports whether the protocol has 16-bit ports first in its
// header.
func hasPorts(p uint8) bool { return p == 6 || p == 17 || p == 132 }

// String is the connection as an operator reads it:
// "TCP 10.32.0.5:41234 -> 10.40.0.2:80", "ICMP 10.32.0.5 -> 10.40.0.2".
func (b BlockedPacket) String() string {
	name, ok := protoNames[b.Protocol]
	if !ok {
		name = fmt.Sprintf("protocol %d", b.Protocol)
	}
	if hasPorts(b.Protocol) && (b.SrcPort != 0 || b.DstPort != 0) {
		return fmt.Sprintf("%s %s -> %s", name, netip.AddrPortFrom(b.Src, b.SrcPort), netip.AddrPortFrom(b.Dst, b.DstPort))
	}
	return fmt.Sprintf("%s %s -> %s", name, b.Src, b.Dst)
}

// errNotPolicySample: a message of the group that is not a sample of
// weft's policy chains (another prefix, or not a packet).
var errNotPolicySample = errors.New("not a weft-policy sample")

// parsePolicySample decodes one nfnetlink_log packet message (its data,
// after the netlink header: the nfgenmsg, then attributes). The data come
// from the kernel, but a message that does not decode is an error, never
// a panic.
func parsePolicySample(data []byte) (BlockedPacket, error) {
	if len(data) < 4 {
		return BlockedPacket{}, fmt.Errorf("nflog message of %d bytes, shorter than its header", len(data))
	}
	ad, err := netlink.NewAttributeDecoder(data[4:])
	if err != nil {
		return BlockedPacket{}, fmt.Errorf("nflog message: %w", err)
	}
	var prefix string
	var payload []byte
	for ad.Next() {
		switch ad.Type() {
		case nfulaPrefix:
			prefix = strings.TrimRight(string(ad.Bytes()), "\x00")
		case nfulaPayload:
			payload = ad.Bytes()
		}
	}
	if err := ad.Err(); err != nil {
		return BlockedPacket{}, fmt.Errorf("nflog message: %w", err)
	}
	var b BlockedPacket
	switch prefix {
	case policyLogPrefix(false):
	case policyLogPrefix(true):
		b.Egress = true
	default:
		return BlockedPacket{}, fmt.Errorf("%w: prefix %q", errNotPolicySample, prefix)
	}
	if err := b.parseIPv4(payload); err != nil {
		return BlockedPacket{}, err
	}
	return b, nil
}

// parseIPv4 reads the addresses, the protocol and the ports from the
// start of an IPv4 packet.
func (b *BlockedPacket) parseIPv4(p []byte) error {
	if len(p) < 20 {
		return fmt.Errorf("nflog payload of %d bytes, shorter than an IPv4 header", len(p))
	}
	if v := p[0] >> 4; v != 4 {
		return fmt.Errorf("nflog payload is IP version %d, not 4", v)
	}
	ihl := int(p[0]&0x0f) * 4
	if ihl < 20 {
		return fmt.Errorf("nflog payload has an IPv4 header length of %d bytes", ihl)
	}
	b.Protocol = p[9]
	b.Src = netip.AddrFrom4([4]byte(p[12:16]))
	b.Dst = netip.AddrFrom4([4]byte(p[16:20]))
	fragOffset := binary.BigEndian.Uint16(p[6:8]) & 0x1fff
	if hasPorts(b.Protocol) && fragOffset == 0 && len(p) >= ihl+4 {
		b.SrcPort = binary.BigEndian.Uint16(p[ihl : ihl+2])
		b.DstPort = binary.BigEndian.Uint16(p[ihl+2 : ihl+4])
	}
	return nil
}
