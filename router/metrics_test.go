package router

import "testing"

// The heap live after the last collection is exported: it is the figure
// that shows a leak (the heap in use also counts garbage not yet
// collected, and RSS what the runtime has not handed back).
func TestMetricsHeapLive(t *testing.T) {
	r, _ := newTestRouter(t, "10.32.0.0/12")
	mfs, err := r.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "go_gc_heap_live_bytes" {
			if v := mf.GetMetric()[0].GetGauge().GetValue(); v <= 0 {
				t.Fatalf("go_gc_heap_live_bytes = %v, want > 0", v)
			}
			return
		}
	}
	t.Fatal("/metrics has no go_gc_heap_live_bytes")
}
