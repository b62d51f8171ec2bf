package ipalloc

import (
	"encoding/json"
	"errors"
)

// The ring on disk (bucket "ipalloc", key "ring"). It is written in the
// wire encoding (EncodeRing: a format byte, 1, then the ring; for a ring
// of 100 peers' entries 1.4 kB against 6.3 kB of JSON).
// State files written before it hold the ring as JSON, which starts with
// '{'; they are still read, and the first save of the ring rewrites it.
// Every other record is as it was: the allocations each under their own
// key in bucket "ipalloc-allocations", the consensus state, the removals
// and the members as JSON.

func encodeSavedRing(r *Ring) []byte { return EncodeRing(r) }

// decodeSavedRing reads a saved ring in either format. The ring is not
// validated here (load does, with the state file's name in the error).
func decodeSavedRing(data []byte) (*Ring, error) {
	if len(data) == 0 {
		return nil, errors.New("empty record")
	}
	if data[0] == '{' { // written before the wire encoding was used on disk
		var r Ring
		if err := json.Unmarshal(data, &r); err != nil {
			return nil, err
		}
		return &r, nil
	}
	return DecodeRing(data)
}
