package router

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/weft-net/weft/mesh"
	"github.com/weft-net/weft/tunnel"
)

// The tunnel's record in the mesh metadata: what a peer needs to send to
// this one's data plane. The mesh carries it as an opaque blob (component
// "tunnel", version 1); this file alone knows its fields. Its layout is
// main's version-1 node metadata between the nickname and the version, so
// the blob also takes that place (mesh.Component.Legacy), and routers of
// main read it during a rolling upgrade:
//
//	dataPort:2(BE) nEncaps:1 (len:1 encap)* keyLen:1 key
//
// The layout is frozen: a field the tunnel needs later goes in a blob of
// version 2, which the mesh carries in its component list.
const (
	tunnelComponent = "tunnel"
	tunnelVersion   = mesh.LegacyVersion

	maxTunnelEncaps   = 8  // encapsulations in the record
	maxTunnelEncapLen = 16 // bytes of one encapsulation name
	maxTunnelKey      = 64 // bytes of the public key
	// maxTunnelRecord bounds the record: every field at its limit.
	maxTunnelRecord = 2 + 1 + maxTunnelEncaps*(1+maxTunnelEncapLen) + 1 + maxTunnelKey
)

// tunnelRecord is a peer's tunnel record, decoded.
type tunnelRecord struct {
	DataPort  uint16
	Encaps    []string
	PublicKey []byte
}

var errTunnelRecord = errors.New("tunnel record")

func (t tunnelRecord) validate() error {
	if len(t.Encaps) > maxTunnelEncaps {
		return fmt.Errorf("%w: %d encapsulations, at most %d allowed", errTunnelRecord, len(t.Encaps), maxTunnelEncaps)
	}
	for _, e := range t.Encaps {
		if e == "" || len(e) > maxTunnelEncapLen {
			return fmt.Errorf("%w: encapsulation %q: give 1 to %d characters", errTunnelRecord, e, maxTunnelEncapLen)
		}
		for _, r := range e {
			if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-') {
				return fmt.Errorf("%w: encapsulation %q: only lower-case letters, digits and '-'", errTunnelRecord, e)
			}
		}
	}
	if len(t.PublicKey) > maxTunnelKey {
		return fmt.Errorf("%w: public key of %d bytes, at most %d allowed", errTunnelRecord, len(t.PublicKey), maxTunnelKey)
	}
	return nil
}

// encodeTunnelRecord validates and encodes t.
func encodeTunnelRecord(t tunnelRecord) ([]byte, error) {
	if err := t.validate(); err != nil {
		return nil, err
	}
	b := binary.BigEndian.AppendUint16(nil, t.DataPort)
	b = append(b, byte(len(t.Encaps)))
	for _, e := range t.Encaps {
		b = append(append(b, byte(len(e))), e...)
	}
	b = append(append(b, byte(len(t.PublicKey))), t.PublicKey...)
	return b, nil
}

// splitTunnelRecord returns the record at the start of b and its length.
// It never panics.
func splitTunnelRecord(b []byte) (tunnelRecord, int, error) {
	var t tunnelRecord
	i := 0
	short := func() ([]byte, error) {
		if i >= len(b) || i+1+int(b[i]) > len(b) {
			return nil, fmt.Errorf("%w: truncated", errTunnelRecord)
		}
		s := b[i+1 : i+1+int(b[i])]
		i += 1 + int(b[i])
		return s, nil
	}
	if len(b) < 3 {
		return t, 0, fmt.Errorf("%w: truncated", errTunnelRecord)
	}
	t.DataPort = binary.BigEndian.Uint16(b)
	n := int(b[2])
	i = 3
	if n > maxTunnelEncaps {
		return t, 0, fmt.Errorf("%w: %d encapsulations, at most %d allowed", errTunnelRecord, n, maxTunnelEncaps)
	}
	for range n {
		e, err := short()
		if err != nil {
			return t, 0, err
		}
		t.Encaps = append(t.Encaps, string(e))
	}
	key, err := short()
	if err != nil {
		return t, 0, err
	}
	if len(key) > 0 {
		t.PublicKey = append([]byte(nil), key...)
	}
	if err := t.validate(); err != nil {
		return tunnelRecord{}, 0, err
	}
	return t, i, nil
}

// decodeTunnelRecord decodes a peer's tunnel blob; all of it must be the
// record.
func decodeTunnelRecord(version uint8, data []byte) (tunnelRecord, error) {
	if version != tunnelVersion {
		return tunnelRecord{}, fmt.Errorf("%w: version %d, this router reads version %d", errTunnelRecord, version, tunnelVersion)
	}
	t, n, err := splitTunnelRecord(data)
	if err != nil {
		return tunnelRecord{}, err
	}
	if n != len(data) {
		return tunnelRecord{}, fmt.Errorf("%w: %d unexpected trailing bytes", errTunnelRecord, len(data)-n)
	}
	return t, nil
}

// tunnelMetaComponent is the tunnel's registration in the mesh metadata.
func tunnelMetaComponent(t tunnelRecord) (mesh.Component, error) {
	data, err := encodeTunnelRecord(t)
	if err != nil {
		return mesh.Component{}, err
	}
	return mesh.Component{
		Name: tunnelComponent, Version: tunnelVersion, Data: data, Max: maxTunnelRecord,
		Check: func(version uint8, data []byte) error {
			_, err := decodeTunnelRecord(version, data)
			return err
		},
		Legacy: func(b []byte) (int, error) {
			_, n, err := splitTunnelRecord(b)
			return n, err
		},
	}, nil
}

// peerTunnelRecord is a peer's tunnel record from its metadata; false if
// it publishes none that this router accepted.
func peerTunnelRecord(p mesh.Peer) (tunnelRecord, bool) {
	b, ok := p.Meta.Component(tunnelComponent)
	if !ok {
		return tunnelRecord{}, false
	}
	t, err := decodeTunnelRecord(b.Version, b.Data)
	return t, err == nil
}

// The vxlan record in the mesh metadata (component "vxlan", version 1):
// this node's end of the vxlan overlay (tunnel.VTEP), which a peer needs
// for its neighbour and FDB entry towards this node:
//
//	mac:6 addr:4 port:2(BE) vni:3(BE)
//
// A node without vxlan publishes the component empty. The tunnel record's
// layout is frozen (see above), so the VTEP travels in its own component.
const (
	vxlanComponent = "vxlan"
	vxlanVersion   = 1
	vxlanRecordLen = 6 + 4 + 2 + 3
)

var errVXLANRecord = errors.New("vxlan record")

// encodeVXLANRecord encodes v; nil encodes "no vxlan".
func encodeVXLANRecord(v *tunnel.VTEP) ([]byte, error) {
	if v == nil {
		return nil, nil
	}
	if err := v.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", errVXLANRecord, err)
	}
	b := append([]byte(nil), v.MAC[:]...)
	a := v.Addr.As4()
	b = append(b, a[:]...)
	b = binary.BigEndian.AppendUint16(b, v.Port)
	return append(b, byte(v.VNI>>16), byte(v.VNI>>8), byte(v.VNI)), nil
}

// decodeVXLANRecord decodes a peer's vxlan blob: nil for an empty one
// (the peer has no vxlan). It never panics.
func decodeVXLANRecord(version uint8, data []byte) (*tunnel.VTEP, error) {
	if version != vxlanVersion {
		return nil, fmt.Errorf("%w: version %d, this router reads version %d", errVXLANRecord, version, vxlanVersion)
	}
	if len(data) == 0 {
		return nil, nil
	}
	if len(data) != vxlanRecordLen {
		return nil, fmt.Errorf("%w: %d bytes, want %d", errVXLANRecord, len(data), vxlanRecordLen)
	}
	v := &tunnel.VTEP{
		MAC:  [6]byte(data[:6]),
		Addr: netip.AddrFrom4([4]byte(data[6:10])),
		Port: binary.BigEndian.Uint16(data[10:12]),
		VNI:  uint32(data[12])<<16 | uint32(data[13])<<8 | uint32(data[14]),
	}
	if err := v.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", errVXLANRecord, err)
	}
	return v, nil
}

// vxlanMetaComponent is the vxlan record's registration in the mesh
// metadata; v is this node's VTEP, nil without vxlan.
func vxlanMetaComponent(v *tunnel.VTEP) (mesh.Component, error) {
	data, err := encodeVXLANRecord(v)
	if err != nil {
		return mesh.Component{}, err
	}
	return mesh.Component{
		Name: vxlanComponent, Version: vxlanVersion, Data: data, Max: vxlanRecordLen,
		Check: func(version uint8, data []byte) error {
			_, err := decodeVXLANRecord(version, data)
			return err
		},
	}, nil
}

// peerVTEP is a peer's VTEP from its metadata; nil if it publishes none
// that this router accepted.
func peerVTEP(p mesh.Peer) *tunnel.VTEP {
	b, ok := p.Meta.Component(vxlanComponent)
	if !ok {
		return nil
	}
	v, err := decodeVXLANRecord(b.Version, b.Data)
	if err != nil {
		return nil
	}
	return v
}
