package tunnel

import (
	"encoding/binary"
	"net/netip"
	"testing"
)

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

func TestDecTTL(t *testing.T) {
	for _, ttl := range []byte{2, 64, 255, 0x80, 0x81} {
		p := ipv4Packet("10.32.0.1", "10.32.64.1", 8, false)
		p[8] = ttl
		p[10], p[11] = 0, 0
		binary.BigEndian.PutUint16(p[10:12], checksum(p[:20], 0))
		if !decTTL(p) {
			t.Fatalf("decTTL(ttl %d) = false", ttl)
		}
		if p[8] != ttl-1 {
			t.Errorf("ttl %d → %d", ttl, p[8])
		}
		if c := checksum(p[:20], 0); c != 0 {
			t.Errorf("ttl %d: header checksum does not verify after decTTL (%#04x)", ttl, c)
		}
	}
	for _, ttl := range []byte{0, 1} {
		p := ipv4Packet("10.32.0.1", "10.32.64.1", 8, false)
		p[8] = ttl
		if decTTL(p) || p[8] != ttl {
			t.Errorf("decTTL(ttl %d) went ahead", ttl)
		}
	}
}

func TestFragNeeded(t *testing.T) {
	orig := ipv4Packet("10.32.0.5", "10.32.64.9", 1460, true)
	out := make([]byte, maxFragNeededLen)
	n := fragNeeded(out, orig, mustAddr("10.32.0.1"), 1440)
	msg := out[:n]
	pkt, err := checkIPv4(msg)
	if err != nil {
		t.Fatalf("ICMP message: %v", err)
	}
	if len(pkt) != 20+8+20+8 {
		t.Errorf("length %d, want 56", len(pkt))
	}
	if checksum(pkt[:20], 0) != 0 {
		t.Error("IP header checksum wrong")
	}
	if pkt[9] != 1 || ipv4Src(pkt) != mustAddr("10.32.0.1") || ipv4Dst(pkt) != mustAddr("10.32.0.5") {
		t.Errorf("header: proto %d %s -> %s", pkt[9], ipv4Src(pkt), ipv4Dst(pkt))
	}
	icmp := pkt[20:]
	if icmp[0] != 3 || icmp[1] != 4 || binary.BigEndian.Uint16(icmp[6:8]) != 1440 {
		t.Errorf("ICMP type %d code %d mtu %d, want 3 4 1440", icmp[0], icmp[1], binary.BigEndian.Uint16(icmp[6:8]))
	}
	if checksum(icmp, 0) != 0 {
		t.Error("ICMP checksum wrong")
	}
	if string(icmp[8:36]) != string(orig[:28]) {
		t.Error("the original header and 8 bytes are not quoted")
	}
}

func TestIPv4Check(t *testing.T) {
	p := ipv4Packet("10.0.0.1", "10.0.0.2", 10, false)
	if got, r := ipv4Check(p); r != dropNone || len(got) != 30 {
		t.Fatalf("good packet: %d bytes, reason %d", len(got), r)
	}
	for _, tc := range []struct {
		name string
		p    []byte
		want dropReason
	}{
		{"empty", nil, dropTruncated},
		{"short", p[:19], dropTruncated},
		{"cut", p[:25], dropTruncated},
		{"v6", append([]byte{0x60}, p[1:]...), dropNotIPv4},
		{"ihl", append([]byte{0x44}, p[1:]...), dropMalformed},
	} {
		if _, r := ipv4Check(tc.p); r != tc.want {
			t.Errorf("%s: reason %s, want %s", tc.name, dropReasonNames[r], dropReasonNames[tc.want])
		}
	}
}
