package bridge

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"github.com/mdlayher/netlink"
)

// sampleMsg is an nfnetlink_log packet message as the kernel sends it:
// the nfgenmsg, the packet header, the prefix and the payload.
func sampleMsg(t testing.TB, prefix string, payload []byte) []byte {
	ae := netlink.NewAttributeEncoder()
	ae.Bytes(1, []byte{0x08, 0x00, 2, 0}) // NFULA_PACKET_HDR: IPv4, hook forward
	ae.String(nfulaPrefix, prefix)        // (nul-terminated)
	ae.Bytes(nfulaPayload, payload)
	b, err := ae.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return append([]byte{2, 0, 0x1a, 0x80}, b...) // AF_INET, v0, group 6784
}

// ipv4 is the start of an IPv4 packet with ports after its header.
func ipv4(proto byte, src, dst string, ihl int, frag uint16, sport, dport uint16) []byte {
	p := make([]byte, ihl*4+8)
	p[0] = 0x40 | byte(ihl)
	binary.BigEndian.PutUint16(p[6:8], frag)
	p[9] = proto
	s, d := netip.MustParseAddr(src).As4(), netip.MustParseAddr(dst).As4()
	copy(p[12:], s[:])
	copy(p[16:], d[:])
	binary.BigEndian.PutUint16(p[ihl*4:], sport)
	binary.BigEndian.PutUint16(p[ihl*4+2:], dport)
	return p
}

func TestParsePolicySample(t *testing.T) {
	for _, c := range []struct {
		name, prefix string
		payload      []byte
		want         string // Direction() + " " + String(); "" = an error
	}{
		{"tcp ingress", "weft-policy ingress", ipv4(6, "10.32.0.5", "10.40.0.2", 5, 0, 41234, 80), "ingress TCP 10.32.0.5:41234 -> 10.40.0.2:80"},
		{"udp egress", "weft-policy egress", ipv4(17, "10.32.0.5", "8.8.8.8", 5, 0x4000, 5353, 53), "egress UDP 10.32.0.5:5353 -> 8.8.8.8:53"},
		{"sctp with options", "weft-policy ingress", ipv4(132, "10.32.0.5", "10.40.0.2", 7, 0, 1, 2), "ingress SCTP 10.32.0.5:1 -> 10.40.0.2:2"},
		{"icmp", "weft-policy ingress", ipv4(1, "10.32.0.5", "10.40.0.2", 5, 0, 0x0800, 0), "ingress ICMP 10.32.0.5 -> 10.40.0.2"},
		{"a later fragment has no ports", "weft-policy ingress", ipv4(17, "10.32.0.5", "10.40.0.2", 5, 0x00b9, 1, 2), "ingress UDP 10.32.0.5 -> 10.40.0.2"},
		{"gre", "weft-policy egress", ipv4(47, "10.32.0.5", "10.40.0.2", 5, 0, 1, 2), "egress protocol 47 10.32.0.5 -> 10.40.0.2"},
		{"ports cut off", "weft-policy ingress", ipv4(6, "10.32.0.5", "10.40.0.2", 5, 0, 1, 2)[:22], "ingress TCP 10.32.0.5 -> 10.40.0.2"},
		{"another prefix", "firewall", ipv4(6, "10.32.0.5", "10.40.0.2", 5, 0, 1, 2), ""},
		{"IPv6", "weft-policy ingress", append([]byte{0x60}, make([]byte, 39)...), ""},
		{"short header", "weft-policy ingress", ipv4(6, "10.32.0.5", "10.40.0.2", 5, 0, 1, 2)[:19], ""},
		{"header length 4", "weft-policy ingress", ipv4(6, "10.32.0.5", "10.40.0.2", 4, 0, 1, 2), ""},
		{"no payload", "weft-policy ingress", nil, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			b, err := parsePolicySample(sampleMsg(t, c.prefix, c.payload))
			if c.want == "" {
				if err == nil {
					t.Fatalf("got %s %s, want an error", b.Direction(), b)
				}
				if c.prefix == "firewall" && !errors.Is(err, errNotPolicySample) {
					t.Errorf("another prefix: %v, want errNotPolicySample", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := b.Direction() + " " + b.String(); got != c.want {
				t.Errorf("got %q, want %q", got, c.want)
			}
		})
	}
	for _, bad := range [][]byte{nil, {1, 2, 3}, {2, 0, 0, 0, 5, 0}, {2, 0, 0, 0, 200, 0, 9, 0}} {
		if _, err := parsePolicySample(bad); err == nil {
			t.Errorf("parsePolicySample(%x) decoded", bad)
		}
	}
}

// FuzzParsePolicySample: no message panics the decoder, and what decodes
// has IPv4 addresses and ports only where the protocol has them.
func FuzzParsePolicySample(f *testing.F) {
	f.Add(sampleMsg(f, "weft-policy ingress", ipv4(6, "10.32.0.5", "10.40.0.2", 5, 0, 41234, 80)))
	f.Add(sampleMsg(f, "weft-policy egress", ipv4(1, "10.32.0.5", "10.40.0.2", 6, 0, 0, 0)))
	f.Add([]byte{2, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := parsePolicySample(data)
		if err != nil {
			return
		}
		if !b.Src.Is4() || !b.Dst.Is4() {
			t.Fatalf("decoded %+v: addresses not IPv4", b)
		}
		if !hasPorts(b.Protocol) && (b.SrcPort != 0 || b.DstPort != 0) {
			t.Fatalf("decoded %+v: ports for protocol %d", b, b.Protocol)
		}
	})
}
