package router

import (
	"bytes"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/weft-net/weft/mesh"
	"github.com/weft-net/weft/tunnel"
)

func TestTunnelRecordRoundTrip(t *testing.T) {
	for _, rec := range []tunnelRecord{
		{},
		{DataPort: 6784, Encaps: []string{"udp", "ipip"}},
		{DataPort: 65535, Encaps: []string{strings.Repeat("e", maxTunnelEncapLen)}, PublicKey: bytes.Repeat([]byte{1}, maxTunnelKey)},
	} {
		b, err := encodeTunnelRecord(rec)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) > maxTunnelRecord {
			t.Fatalf("%d bytes, bound %d", len(b), maxTunnelRecord)
		}
		got, err := decodeTunnelRecord(tunnelVersion, b)
		if err != nil || !reflect.DeepEqual(got, rec) {
			t.Errorf("round trip of %+v: %+v, %v", rec, got, err)
		}
	}
	for name, rec := range map[string]tunnelRecord{
		"upper case": {Encaps: []string{"UDP"}},
		"empty":      {Encaps: []string{""}},
		"too many":   {Encaps: make([]string, 9)},
		"long key":   {PublicKey: make([]byte, 65)},
	} {
		if _, err := encodeTunnelRecord(rec); err == nil {
			t.Errorf("%s: encoded", name)
		}
	}
	good, _ := encodeTunnelRecord(tunnelRecord{DataPort: 1, Encaps: []string{"udp"}})
	for name, b := range map[string][]byte{"truncated": good[:len(good)-1], "trailing": append(bytes.Clone(good), 0), "nothing": nil} {
		if _, err := decodeTunnelRecord(tunnelVersion, b); err == nil {
			t.Errorf("%s: decoded", name)
		}
	}
	if _, err := decodeTunnelRecord(2, good); err == nil {
		t.Error("version 2 decoded as version 1")
	}
}

// The record is exactly main's version-1 metadata between the nickname and
// the version string: these bytes are what a router of main published for
// nickname "h", data port 6784, encapsulations udp and ipip, a 2-byte key
// and version "v1" (mesh/meta.go on main, encodeMeta).
func TestTunnelRecordIsMainsLayout(t *testing.T) {
	main := []byte{1, 1, 'h', 0x1a, 0x80, 2, 3, 'u', 'd', 'p', 4, 'i', 'p', 'i', 'p', 2, 0xab, 0xcd, 2, 'v', '1'}
	rec, n, err := splitTunnelRecord(main[3:])
	if err != nil {
		t.Fatal(err)
	}
	want := tunnelRecord{DataPort: 6784, Encaps: []string{"udp", "ipip"}, PublicKey: []byte{0xab, 0xcd}}
	if !reflect.DeepEqual(rec, want) || n != len(main)-3-3 {
		t.Errorf("split %+v (%d bytes), want %+v (%d bytes)", rec, n, want, len(main)-6)
	}
	enc, _ := encodeTunnelRecord(want)
	if !bytes.Equal(enc, main[3:3+n]) {
		t.Errorf("encoded %x, main's %x", enc, main[3:3+n])
	}
}

// A peer's tunnel record reaches the data plane; a peer without one, or
// with one the mesh refused, is left out, the others kept.
func TestTunnelPeersFromComponents(t *testing.T) {
	good, _ := encodeTunnelRecord(tunnelRecord{DataPort: 7000, Encaps: []string{"udp"}, PublicKey: []byte{1}})
	peer := func(name string, cs map[string]mesh.Blob) mesh.Peer {
		return mesh.Peer{Name: mesh.PeerName(name), Addr: netip.MustParseAddrPort("10.0.0.1:6783"), State: mesh.StateAlive, Meta: mesh.Meta{Components: cs}}
	}
	got := tunnelPeers([]mesh.Peer{
		peer("a", map[string]mesh.Blob{"tunnel": {Version: 1, Data: good}, "ipam": {Version: 9, Data: []byte("x")}}),
		peer("b", nil),
		peer("c", map[string]mesh.Blob{"tunnel": {Version: 1, Data: good[:2]}}),
	})
	if len(got) != 1 || got[0].Name != "a" || got[0].DataPort != 7000 || !bytes.Equal(got[0].PublicKey, []byte{1}) {
		t.Errorf("tunnel peers: %+v, want a alone with its record", got)
	}
}

func FuzzTunnelRecord(f *testing.F) {
	good, _ := encodeTunnelRecord(tunnelRecord{DataPort: 6784, Encaps: []string{"udp", "ipip"}, PublicKey: []byte{1, 2}})
	f.Add(good)
	f.Add([]byte{0, 0, 9})
	f.Fuzz(func(t *testing.T, b []byte) {
		rec, n, err := splitTunnelRecord(b)
		if err != nil {
			return
		}
		if n > len(b) {
			t.Fatalf("split %d of %d bytes", n, len(b))
		}
		enc, err := encodeTunnelRecord(rec)
		if err != nil || !bytes.Equal(enc, b[:n]) {
			t.Fatalf("%x accepted as %+v, re-encoded %x, %v", b, rec, enc, err)
		}
	})
}

func TestVXLANRecordRoundTrip(t *testing.T) {
	v := &tunnel.VTEP{MAC: tunnel.VTEPMAC("a"), Addr: netip.MustParseAddr("192.0.2.1"), Port: 4789, VNI: tunnel.MaxVNI}
	b, err := encodeVXLANRecord(v)
	if err != nil || len(b) != vxlanRecordLen {
		t.Fatalf("encode: %x, %v", b, err)
	}
	got, err := decodeVXLANRecord(vxlanVersion, b)
	if err != nil || *got != *v {
		t.Fatalf("round trip: %+v, %v; want %+v", got, err, v)
	}
	if b, err := encodeVXLANRecord(nil); err != nil || len(b) != 0 {
		t.Fatalf("no VTEP encodes %x, %v; want nothing", b, err)
	}
	if got, err := decodeVXLANRecord(vxlanVersion, nil); got != nil || err != nil {
		t.Fatalf("empty record: %v, %v; want no VTEP", got, err)
	}
	bad := *v
	bad.MAC[0] |= 1
	if _, err := encodeVXLANRecord(&bad); err == nil {
		t.Error("a multicast MAC encoded")
	}
	mcast, _ := encodeVXLANRecord(v)
	mcast[6] = 239 // the address 239.0.2.1
	for name, b := range map[string][]byte{"short": b[:14], "long": append(bytes.Clone(b), 0), "multicast address": mcast, "vni 0": append(bytes.Clone(b[:12]), 0, 0, 0)} {
		if _, err := decodeVXLANRecord(vxlanVersion, b); err == nil {
			t.Errorf("%s: decoded", name)
		}
	}
	if _, err := decodeVXLANRecord(2, b); err == nil {
		t.Error("version 2 decoded as version 1")
	}
}

// A peer's VTEP reaches the data plane; a peer that left is kept only if
// it has one (its kernel goes on carrying its pods' traffic).
func TestTunnelPeersVTEP(t *testing.T) {
	rec, _ := encodeTunnelRecord(tunnelRecord{DataPort: 6784, Encaps: []string{"vxlan"}})
	v := &tunnel.VTEP{MAC: tunnel.VTEPMAC("a"), Addr: netip.MustParseAddr("10.0.0.1"), Port: 4789, VNI: 1}
	vx, _ := encodeVXLANRecord(v)
	peer := func(name string, state mesh.PeerState, vxlan []byte) mesh.Peer {
		cs := map[string]mesh.Blob{"tunnel": {Version: 1, Data: rec}}
		if vxlan != nil {
			cs["vxlan"] = mesh.Blob{Version: vxlanVersion, Data: vxlan}
		}
		return mesh.Peer{Name: mesh.PeerName(name), Addr: netip.MustParseAddrPort("10.0.0.1:6783"), State: state, Meta: mesh.Meta{Components: cs}}
	}
	got := tunnelPeers([]mesh.Peer{
		peer("a", mesh.StateAlive, vx),
		peer("b", mesh.StateLeft, vx),
		peer("c", mesh.StateLeft, nil),
		peer("d", mesh.StateAlive, []byte{}),
		peer("e", mesh.StateUnreachable, vx[:3]),
	})
	var names []string
	for _, p := range got {
		names = append(names, p.Name)
		switch {
		case (p.Name == "a" || p.Name == "b") && (p.VTEP == nil || *p.VTEP != *v):
			t.Errorf("%s: VTEP %v, want %v", p.Name, p.VTEP, v)
		case (p.Name == "d" || p.Name == "e") && p.VTEP != nil:
			t.Errorf("%s: VTEP %v, want none", p.Name, p.VTEP)
		}
	}
	if strings.Join(names, ",") != "a,b,d,e" {
		t.Errorf("tunnel peers %v, want a,b,d,e (c left without a VTEP)", names)
	}
}

func FuzzVXLANRecord(f *testing.F) {
	good, _ := encodeVXLANRecord(&tunnel.VTEP{MAC: tunnel.VTEPMAC("a"), Addr: netip.MustParseAddr("192.0.2.1"), Port: 4789, VNI: 6784})
	f.Add(good)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := decodeVXLANRecord(vxlanVersion, b)
		if err != nil || v == nil {
			return
		}
		if err := v.Validate(); err != nil {
			t.Fatalf("%x accepted as %v: %v", b, v, err)
		}
		enc, err := encodeVXLANRecord(v)
		if err != nil || !bytes.Equal(enc, b) {
			t.Fatalf("%x accepted as %v, re-encoded %x, %v", b, v, enc, err)
		}
	})
}
