package ipalloc

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/weft-net/weft/internal/benchlat"
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

// BenchmarkServiceAllocate20 measures the latency of one allocation by the
// Service alone (no HTTP, no data plane) while 20 callers allocate at
// once, its loop running (Run) and saving to a real bbolt file with fsync:
// p50, p99 and max in milliseconds; b.N allocations in all.
//
//	go test ./ipalloc -run '^$' -bench ServiceAllocate20 -benchtime 2000x
func BenchmarkServiceAllocate20(b *testing.B) {
	const callers = 20
	e := newSvcEnv(b, "10.32.0.0/12")
	svc := e.mustStart()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); svc.Run(ctx, nil) }()
	b.Cleanup(func() { cancel(); <-done })
	benchlat.Concurrent(b, callers, "allocs", func(i int) error {
		_, _, err := svc.Allocate(ctx, Key{ContainerID: fmt.Sprintf("b-%d", i), IfName: "eth0"}, Meta{PodName: "p"})
		return err
	})
}
