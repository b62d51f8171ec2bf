package router

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/internal/benchlat"
)

// BenchmarkLocalAPIAllocate measures allocations per second through the
// local API as the CNI plugin makes them: a new attachment per request,
// over the unix socket (a new connection each, as the plugin's client
// does), each saved to bbolt with fsync before the answer; one client at a
// time, then 8 at once. The state is in the test's temporary directory:
// run it on a real disk (TMPDIR=/dev/shm shows the cost without fsync).
//
//	go test ./router -run '^$' -bench LocalAPIAllocate -benchtime 2000x
func BenchmarkLocalAPIAllocate(b *testing.B) {
	for _, tc := range []struct {
		name     string
		parallel bool
	}{{"sequential", false}, {"parallel", true}} {
		b.Run(tc.name, func(b *testing.B) {
			r, cl := newTestRouter(b, "10.32.0.0/12")
			r.setReady(true, "")
			ctx := context.Background()
			var next atomic.Int64
			alloc := func() {
				att := api.Attachment{ContainerID: fmt.Sprintf("bench-%d", next.Add(1)), IfName: "eth0"}
				if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att, PodNamespace: "default", PodName: att.ContainerID}); err != nil {
					b.Error(err)
				}
			}
			b.ResetTimer()
			if tc.parallel {
				b.SetParallelism(4) // 4 per CPU: a burst of pods starting at once
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						alloc()
					}
				})
			} else {
				for b.Loop() {
					alloc()
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "allocs/s")
		})
	}
}

// BenchmarkLocalAPIAllocate20 measures the latency of one allocation
// through the local API while 20 CNI ADDs run at once (a node starting a
// burst of pods): 20 clients, each with a new connection per request over
// the unix socket, against a router whose allocator runs (Service.Run)
// and saves to a real bbolt file with fsync. It reports p50, p99 and max
// in milliseconds; b.N is the number of allocations in all.
//
//	go test ./router -run '^$' -bench LocalAPIAllocate20 -benchtime 2000x
func BenchmarkLocalAPIAllocate20(b *testing.B) {
	r, cl := newTestRouter(b, "10.32.0.0/12")
	allocate20(b, r, cl)
}

// allocate20 runs r's allocator and times b.N ADDs through cl, 20 at
// once, as the CNI plugins of a node that starts many pods send them.
func allocate20(b *testing.B, r *Router, cl *api.Client) {
	const clients = 20
	r.setReady(true, "")
	ctx := runAllocator(b, r)

	benchlat.Concurrent(b, clients, "allocs", func(i int) error {
		att := api.Attachment{ContainerID: fmt.Sprintf("bench-%d", i), IfName: "eth0"}
		_, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att, PodNamespace: "default", PodName: att.ContainerID})
		return err
	})
}

// BenchmarkLocalAPIAllocateBurst20 measures the latency of one allocation
// through the local API when 20 CNI ADDs start at once: bursts of 20
// requests released together (a node that starts 20 pods at the same
// moment: a Deployment scaled up, a node drained onto this one), the next
// burst when the last of the one before was answered. Each request is a
// new connection over the unix socket, as the plugin makes them, against a
// router whose allocator runs and saves to a real bbolt file with fsync.
// BenchmarkLocalAPIAllocate20 is the closed loop beside it: 20 callers
// that never pause, thousands of allocations a second, which no node
// makes. It reports p50, p99 and max of every allocation, and the median
// time of a whole burst (burst-ms).
//
//	go test ./router -run '^$' -bench LocalAPIAllocateBurst20 -benchtime 4000x
func BenchmarkLocalAPIAllocateBurst20(b *testing.B) {
	r, cl := newTestRouter(b, "10.32.0.0/12")
	r.setReady(true, "")
	ctx := runAllocator(b, r)

	benchlat.Bursts(b, 20, func(i int) error {
		att := api.Attachment{ContainerID: fmt.Sprintf("burst-%d", i), IfName: "eth0"}
		_, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att, PodNamespace: "default", PodName: att.ContainerID})
		return err
	})
}

// BenchmarkLocalAPIAddDel runs pod ADD/DEL cycles through the local API
// (allocate, then release, a new attachment each, as membench does against
// a router process) after a warm-up of 1,000, and reports what each cycle
// leaves behind: the live heap after a full collection, the heap's objects
// and the goroutines, before and after, and the state file's size. A leak
// shows as a live heap that grows with b.N.
//
//	go test ./router -run '^$' -bench LocalAPIAddDel -benchtime 10000x
func BenchmarkLocalAPIAddDel(b *testing.B) {
	r, cl := newTestRouter(b, "10.32.0.0/12")
	r.setReady(true, "")
	ctx := context.Background()
	next := 0
	cycle := func() {
		att := api.Attachment{ContainerID: fmt.Sprintf("cycle-%d", next), IfName: "eth0"}
		next++
		if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att, PodNamespace: "default", PodName: att.ContainerID}); err != nil {
			b.Fatal(err)
		}
		if _, err := cl.Release(ctx, att); err != nil {
			b.Fatal(err)
		}
	}
	type reading struct {
		live, objects uint64
		goroutines    int
		db            int64
	}
	read := func() reading {
		runtime.GC()
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		st, err := os.Stat(r.db.Path())
		if err != nil {
			b.Fatal(err)
		}
		return reading{m.HeapAlloc, m.HeapObjects, runtime.NumGoroutine(), st.Size()}
	}
	for range 1000 {
		cycle()
	}
	before := read()
	b.ResetTimer()
	for b.Loop() {
		cycle()
	}
	b.StopTimer()
	after := read()
	b.ReportMetric(float64(int64(after.live)-int64(before.live))/float64(b.N), "live-heap-B/cycle")
	b.ReportMetric(float64(before.live)/(1<<20), "live-heap-MiB-before")
	b.ReportMetric(float64(after.live)/(1<<20), "live-heap-MiB-after")
	b.ReportMetric(float64(int64(after.objects)-int64(before.objects)), "heap-objects-added")
	b.ReportMetric(float64(after.goroutines-before.goroutines), "goroutines-added")
	b.ReportMetric(float64(after.db-before.db), "state-file-B-added")
}
