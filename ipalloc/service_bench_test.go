package ipalloc

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/internal/benchlat"
	"github.com/weft-net/weft/state"
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
// p50, p99 and max in milliseconds; b.N allocations in all. It reports the
// loop's saves too (their p50, p99 and max, and the allocations each
// carried): an allocation that arrives during a save waits for it and
// then for its own, so the saves' tail is the floor of the allocations'.
//
//	go test ./ipalloc -run '^$' -bench ServiceAllocate20 -benchtime 2000x
func BenchmarkServiceAllocate20(b *testing.B) {
	const callers = 20
	db, err := state.Open(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { db.Close() })
	var mu sync.Mutex
	var saves []time.Duration
	svc, err := NewService(ServiceConfig{
		Self:     "self",
		Universe: netip.MustParsePrefix("10.32.0.0/12"),
		DB:       db,
		Log:      slog.New(slog.DiscardHandler),
		Now:      time.Now, // OnSave's durations need a clock that moves
		OnSave: func(d time.Duration, err error) {
			mu.Lock()
			defer mu.Unlock()
			saves = append(saves, d)
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); svc.Run(ctx, nil) }()
	b.Cleanup(func() { cancel(); <-done })
	mu.Lock()
	saves = saves[:0]
	mu.Unlock()
	benchlat.Concurrent(b, callers, "allocs", func(i int) error {
		_, _, err := svc.Allocate(ctx, Key{ContainerID: fmt.Sprintf("b-%d", i), IfName: "eth0"}, Meta{PodName: "p"})
		return err
	})
	mu.Lock()
	defer mu.Unlock()
	if len(saves) == 0 {
		b.Fatal("no save was reported")
	}
	slices.Sort(saves)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(ms(saves[len(saves)/2]), "save-p50-ms")
	b.ReportMetric(ms(saves[(len(saves)*99)/100]), "save-p99-ms")
	b.ReportMetric(ms(saves[len(saves)-1]), "save-max-ms")
	b.ReportMetric(float64(b.N)/float64(len(saves)), "allocs/save")
}
