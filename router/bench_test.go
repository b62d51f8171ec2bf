package router

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/weft-net/weft/api"
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
