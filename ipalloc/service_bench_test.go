package ipalloc

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
)

// BenchmarkServiceSave measures one save of the allocator's state to a real
// bbolt file (with fsync): one allocation, made and saved, per op, in a
// ring of 100 peers' entries (a mid-size cluster), one caller at a time.
//
//	go test ./ipalloc -run '^$' -bench ServiceSave
func BenchmarkServiceSave(b *testing.B) {
	e := newSvcEnv(b, "10.32.0.0/12")
	svc := e.mustStart()
	names := peerNames(99)
	ring := NewRing(rangeOf("10.32.0.0/12"))
	if err := ring.ClaimEvenly(append(names, "self")); err != nil {
		b.Fatal(err)
	}
	data, err := json.Marshal(ring)
	if err != nil {
		b.Fatal(err)
	}
	_ = svc
	if err := e.db.Put(bucketIPAM, keyRing, data); err != nil {
		b.Fatal(err)
	}
	svc = e.restart()
	i := 0
	for b.Loop() {
		k := Key{ContainerID: fmt.Sprintf("save-%d", i), IfName: "eth0"}
		i++
		if _, _, err := svc.Allocate(context.Background(), k, Meta{PodName: "p"}); err != nil {
			b.Fatal(err)
		}
	}
}
