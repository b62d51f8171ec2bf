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
	report(b, lat)
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), unit+"/s")
}

// Bursts runs op(i) for i in [0, b.N) in bursts of size operations that
// start at once, one goroutine each, released together; the next burst
// starts when the last operation of the one before has ended. It is the
// open case beside Concurrent's closed loop: size pods that a node starts
// at the same moment, not size callers that never stop. It reports the
// latency of every operation (p50-ms, p99-ms, max-ms) and, as
// burst-ms, the median time from a burst's release to its last answer.
// An error fails b.
func Bursts(b *testing.B, size int, op func(i int) error) {
	b.Helper()
	lat := make([]time.Duration, b.N)
	var whole []time.Duration
	b.ResetTimer()
	for first := 0; first < b.N; first += size {
		n := min(size, b.N-first)
		gate := make(chan struct{})
		var ready, wg sync.WaitGroup
		ready.Add(n)
		for i := first; i < first+n; i++ {
			wg.Go(func() {
				ready.Done()
				<-gate
				start := time.Now()
				err := op(i)
				lat[i] = time.Since(start)
				if err != nil {
					b.Error(err)
				}
			})
		}
		ready.Wait() // every goroutine exists and waits: release them together
		start := time.Now()
		close(gate)
		wg.Wait()
		whole = append(whole, time.Since(start))
		if b.Failed() {
			return
		}
	}
	b.StopTimer()
	report(b, lat)
	slices.Sort(whole)
	b.ReportMetric(ms(whole[len(whole)/2]), "burst-ms")
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// report sorts lat and reports its p50, p99 and max in milliseconds.
func report(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	b.ReportMetric(ms(lat[len(lat)/2]), "p50-ms")
	b.ReportMetric(ms(lat[(len(lat)*99)/100]), "p99-ms")
	b.ReportMetric(ms(lat[len(lat)-1]), "max-ms")
}
