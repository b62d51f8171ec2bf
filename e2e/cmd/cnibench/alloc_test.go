package main

import (
	"math"
	"testing"
)

// The router's histogram, read twice: the figures of what happened in
// between, interpolated within a bucket as histogram_quantile does.
func TestAllocHist(t *testing.T) {
	bounds := []float64{.001, .002, .005, .01}
	before := allocHist{bounds: bounds, cum: []uint64{5, 5, 5, 5}, count: 5}
	after := allocHist{bounds: bounds, cum: []uint64{15, 65, 103, 105}, count: 105}
	d := after.since(before)
	if d.count != 100 {
		t.Fatalf("count %d, want 100", d.count)
	}
	// 10 at most 1 ms, 50 in (1, 2] ms, 38 in (2, 5], 2 in (5, 10].
	for _, tc := range []struct{ q, want float64 }{
		{0.10, .001},
		{0.50, .001 + .001*40/50},
		{0.98, .005},
		{0.99, .005 + .005*1/2},
		{1.00, .01},
	} {
		if got := d.quantile(tc.q); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("quantile(%v) = %v, want %v", tc.q, got, tc.want)
		}
	}
	if v, ok := d.atMost(.005); !ok || v != 0.98 {
		t.Errorf("atMost(5 ms) = %v, %v; want 0.98", v, ok)
	}
	if _, ok := d.atMost(.003); ok {
		t.Error("atMost of a value that is no bucket's bound: want not ok")
	}
	if got := d.maxBucket(); got != .01 {
		t.Errorf("maxBucket = %v, want 0.01", got)
	}
	// Beyond the last bound: +Inf, as Prometheus says.
	beyond := allocHist{bounds: bounds, cum: []uint64{0, 0, 0, 9}, count: 10}
	if got := beyond.quantile(0.99); !math.IsInf(got, +1) {
		t.Errorf("quantile past the last bound = %v, want +Inf", got)
	}
	// The first reading before any allocation has no series.
	if got := after.since(allocHist{}); got.count != 105 || got.cum[3] != 105 {
		t.Errorf("since an empty reading: %+v", got)
	}
}
