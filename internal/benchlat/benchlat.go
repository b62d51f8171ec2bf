// Package benchlat measures the latency of an operation that callers run
// at once, for benchmarks: b.N operations in all, shared among the callers,
// each timed, reported as p50, p99 and max in milliseconds and as
// operations a second.
package benchlat

import (
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Concurrent runs op(i) for i in [0, b.N) from callers goroutines at once
// and reports its latency (p50-ms, p99-ms, max-ms) and throughput (unit, a
// second). An error fails b and ends that caller.
func Concurrent(b *testing.B, callers int, unit string, op func(i int) error) {
	b.Helper()
	lat := make([]time.Duration, b.N)
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	for range callers {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(b.N) {
					return
				}
				start := time.Now()
				err := op(int(i))
				lat[i] = time.Since(start)
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	slices.Sort(lat)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(ms(lat[len(lat)/2]), "p50-ms")
	b.ReportMetric(ms(lat[(len(lat)*99)/100]), "p99-ms")
	b.ReportMetric(ms(lat[len(lat)-1]), "max-ms")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), unit+"/s")
}
