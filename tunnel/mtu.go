// This file holds what the rest of weft needs before any packet moves: the
// encapsulation modes and their overhead, from which the pod MTU is derived.

package tunnel

import (
	"fmt"
	"slices"
	"strings"
)

// Mode is an encapsulation mode.
type Mode string

// The encapsulation modes. Auto picks the fastest that both ends support.
const (
	ModeUDP  Mode = "udp"
	ModeIPIP Mode = "ipip"
	// ModeVXLAN is the kernel's VXLAN device (vxlan.go): plaintext, and
	// it keeps carrying pod traffic while no router runs.
	ModeVXLAN Mode = "vxlan"
	ModeAuto  Mode = "auto"
)

// Sizes of the udp frame. The header is versioned and has room for the
// security issue's key id and nonce; the AEAD tag is reserved even when
// encryption is off, so that turning it on never changes the pod MTU.
const (
	IPv4HeaderLen  = 20
	UDPHeaderLen   = 8
	FrameHeaderLen = 16 // version, type, flags, key id, 64-bit counter
	AEADTagLen     = 16
)

// overheads is the bytes each mode adds to an inner packet on the underlay.
var overheads = map[Mode]int{
	ModeUDP:  IPv4HeaderLen + UDPHeaderLen + FrameHeaderLen + AEADTagLen,
	ModeIPIP: IPv4HeaderLen,
	// Outer IPv4 and UDP, the VXLAN header, the inner Ethernet header.
	ModeVXLAN: IPv4HeaderLen + UDPHeaderLen + VXLANHeaderLen + EthernetHeaderLen,
}

// Sizes of the vxlan encapsulation.
const (
	VXLANHeaderLen    = 8
	EthernetHeaderLen = 14
)

// ParseMode validates an --encap value.
func ParseMode(s string) (Mode, error) {
	m := Mode(strings.ToLower(strings.TrimSpace(s)))
	if _, ok := overheads[m]; ok || m == ModeAuto {
		return m, nil
	}
	return "", fmt.Errorf("unknown --encap %q: use one of udp, vxlan, ipip, auto", s)
}

// Overhead is the bytes mode adds; for auto, the largest of the modes it may
// pick, so that the pod MTU fits whichever is chosen.
func Overhead(m Mode) int {
	if m == ModeAuto {
		return slices.Max([]int{overheads[ModeUDP], overheads[ModeIPIP], overheads[ModeVXLAN]})
	}
	return overheads[m]
}

// MinMTU is the smallest pod MTU weft accepts (the IPv4 minimum).
const MinMTU = 68

// PodMTU derives the pod MTU from the underlay's MTU, or checks an explicit one.
func PodMTU(underlayMTU, explicit int, m Mode) (int, error) {
	if explicit != 0 {
		if explicit < MinMTU || explicit > 65535 {
			return 0, fmt.Errorf("--mtu %d is out of range: give %d..65535, or 0 to derive it from the underlay", explicit, MinMTU)
		}
		return explicit, nil
	}
	mtu := underlayMTU - Overhead(m)
	if mtu < MinMTU {
		return 0, fmt.Errorf("the underlay MTU %d leaves %d for pods after the %s overhead of %d bytes; set --mtu", underlayMTU, mtu, m, Overhead(m))
	}
	return mtu, nil
}
