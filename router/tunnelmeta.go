package router

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/weft-net/weft/mesh"
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
