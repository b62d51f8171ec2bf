package scale

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"testing"

	"github.com/weft-net/weft/ipalloc"
)

// BenchmarkRing measures what one ring change costs each node at 10, 100
// and 1,000 owners of 10.32.0.0/12: the size of the ring message the core
// broadcasts on every change (ipalloc.EncodeMsg of a RingMsg: the whole
// ring), decoding it, merging it (one entry newer), and encoding it as the
// Service persists it (JSON, one bbolt value).
//
//	go test ./internal/scale -run '^$' -bench Ring
func BenchmarkRing(b *testing.B) {
	for _, owners := range []int{10, 100, 1000} {
		base := ring(b, owners)
		newer := base.Clone()
		newer.SetFree(newer.Entries[0].Peer, func(ipalloc.Range) uint32 { return 1 })
		msg := ipalloc.EncodeMsg(&ipalloc.RingMsg{Ring: newer})
		b.Run(fmt.Sprintf("owners=%d/decode+merge", owners), func(b *testing.B) {
			for b.Loop() {
				m, err := ipalloc.DecodeMsg(msg)
				if err != nil {
					b.Fatal(err)
				}
				r := base.Clone()
				if changed, err := r.Merge(m.(*ipalloc.RingMsg).Ring); err != nil || !changed {
					b.Fatalf("merge: changed %v, %v", changed, err)
				}
			}
			b.ReportMetric(float64(len(msg)), "msg-bytes")
		})
		b.Run(fmt.Sprintf("owners=%d/persist-encode", owners), func(b *testing.B) {
			var n int
			for b.Loop() {
				data, err := json.Marshal(newer)
				if err != nil {
					b.Fatal(err)
				}
				n = len(data)
			}
			b.ReportMetric(float64(n), "json-bytes")
		})
	}
}

func ring(b *testing.B, owners int) *ipalloc.Ring {
	r := ipalloc.NewRing(ipalloc.RangeOf(netip.MustParsePrefix("10.32.0.0/12")))
	var names []ipalloc.PeerName
	for i := range owners {
		names = append(names, ipalloc.PeerName(fmt.Sprintf("node%04d", i)))
	}
	if err := r.ClaimEvenly(names); err != nil {
		b.Fatal(err)
	}
	return r
}
