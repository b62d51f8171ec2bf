package mesh

import (
	"bytes"
	"reflect"
	"testing"
)

// The decoders of bytes from peers never panic, and what they accept
// encodes back to an equivalent frame.

func FuzzDecodeMessage(f *testing.F) {
	f.Add(encodeMessage(kindBroadcast, "ipalloc", "ab:cd:ef:01:02:03", []byte("delta")))
	f.Add(encodeMessage(kindUnicast, "_topology", "node1", nil))
	f.Add([]byte{wireVersion, kindBroadcast, 1, 'a', 1, 'b', 0x80})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMessage(b)
		if err != nil {
			return
		}
		again := encodeMessage(m.kind, m.channel, m.from, m.payload)
		if !bytes.Equal(again, b) {
			t.Fatalf("re-encoding %x gave %x", b, again)
		}
	})
}

func FuzzDecodeState(f *testing.F) {
	f.Add(encodeState([]channelState{{"_topology", encodeReports([]report{{Origin: "n1", Version: 9}})}, {"ipalloc", []byte("ring")}}))
	f.Add(encodeState(nil))
	f.Add([]byte{wireVersion, kindState, 1, 1, 'a', 0x80})
	f.Fuzz(func(t *testing.T, b []byte) {
		parts, err := decodeState(b)
		if err != nil {
			return
		}
		got, err := decodeState(encodeState(parts))
		if err != nil || len(got) != len(parts) {
			t.Fatalf("re-decoding %x: %v", b, err)
		}
	})
}

func FuzzDecodeMeta(f *testing.F) {
	good, _ := encodeMeta(Meta{Nickname: "host1", DataPort: 6784, Encaps: []string{"udp", "ipip"}, Version: "v1"})
	f.Add(good)
	f.Add([]byte{1})
	f.Add([]byte{2, 0, 0, 0, 0, 0, 0, 9})
	f.Fuzz(func(t *testing.T, b []byte) {
		md, err := decodeMeta(b)
		if err != nil {
			return
		}
		enc, err := encodeMeta(md)
		if err != nil {
			t.Fatalf("accepted %x as %+v, which does not encode: %v", b, md, err)
		}
		again, err := decodeMeta(enc)
		if err != nil || !reflect.DeepEqual(again, md) {
			t.Fatalf("round trip of %+v: %+v, %v", md, again, err)
		}
	})
}

func FuzzDecodeReports(f *testing.F) {
	f.Add(encodeReports([]report{{Origin: "node1", Version: 3, Leaving: true}, {Origin: "node2", Unreachable: []PeerName{"node3"}}}))
	f.Add(encodeReport(report{Origin: "x", Version: 1}))
	f.Fuzz(func(t *testing.T, b []byte) {
		if reps, err := decodeReports(b); err == nil {
			if again, err := decodeReports(encodeReports(reps)); err != nil || !reflect.DeepEqual(again, reps) {
				t.Fatalf("round trip of %+v: %+v, %v", reps, again, err)
			}
		}
		if rep, err := decodeReport(b); err == nil {
			if again, err := decodeReport(encodeReport(rep)); err != nil || !reflect.DeepEqual(again, rep) {
				t.Fatalf("round trip of %+v: %+v, %v", rep, again, err)
			}
		}
	})
}
