package main

import (
	"bytes"
	"context"
	"fmt"
	"math"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/weft-net/weft/e2e"
)

// allocMetric is the router's local API latency histogram; its series with
// op="allocate" times the plugin's allocations.
const allocMetric = "weft_local_api_request_duration_seconds"

// allocHist is a reading of that series: the cumulative count at each
// bucket's upper bound, and the count of all.
type allocHist struct {
	bounds []float64 // seconds, ascending, without +Inf
	cum    []uint64
	count  uint64
}

// allocations reads node's router's allocate latency histogram from its
// status server's /metrics.
func allocations(ctx context.Context, node *e2e.Node) (allocHist, error) {
	data, err := node.HTTPGet(ctx, "/metrics")
	if err != nil {
		return allocHist{}, err
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(data))
	if err != nil {
		return allocHist{}, fmt.Errorf("%s /metrics: %w", node.Name, err)
	}
	f, ok := fams[allocMetric]
	if !ok {
		return allocHist{}, fmt.Errorf("%s /metrics has no %s", node.Name, allocMetric)
	}
	for _, m := range f.GetMetric() {
		if !hasLabel(m, "op", "allocate") || m.GetHistogram() == nil {
			continue
		}
		h := allocHist{count: m.GetHistogram().GetSampleCount()}
		for _, b := range m.GetHistogram().GetBucket() {
			if math.IsInf(b.GetUpperBound(), +1) {
				continue
			}
			h.bounds = append(h.bounds, b.GetUpperBound())
			h.cum = append(h.cum, b.GetCumulativeCount())
		}
		return h, nil
	}
	// No allocation yet: the series appears with the first.
	return allocHist{}, nil
}

func hasLabel(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// since is h less an earlier reading of the same series (empty before the
// first allocation).
func (h allocHist) since(before allocHist) allocHist {
	d := allocHist{bounds: h.bounds, cum: make([]uint64, len(h.cum)), count: h.count - before.count}
	for i := range h.cum {
		d.cum[i] = h.cum[i]
		if i < len(before.cum) {
			d.cum[i] -= before.cum[i]
		}
	}
	return d
}

// quantile is the q-quantile, interpolated linearly within its bucket as
// Prometheus's histogram_quantile does; +Inf when it lies beyond the last
// bound.
func (h allocHist) quantile(q float64) float64 {
	rank := q * float64(h.count)
	lower, below := 0.0, uint64(0)
	for i, b := range h.bounds {
		if float64(h.cum[i]) >= rank {
			in := h.cum[i] - below
			if in == 0 {
				return b
			}
			return lower + (b-lower)*(rank-float64(below))/float64(in)
		}
		lower, below = b, h.cum[i]
	}
	return math.Inf(+1)
}

// atMost is the share of the allocations that took at most bound seconds,
// which must be one of the buckets' bounds (exact, not interpolated).
func (h allocHist) atMost(bound float64) (float64, bool) {
	for i, b := range h.bounds {
		if b == bound {
			return float64(h.cum[i]) / float64(h.count), true
		}
	}
	return 0, false
}

// maxBucket is the upper bound of the highest bucket with an allocation
// in it: the slowest allocation took at most that.
func (h allocHist) maxBucket() float64 {
	for i := range h.bounds {
		if h.cum[i] == h.count {
			return h.bounds[i]
		}
	}
	return math.Inf(+1)
}

// row is h's markdown row.
func (h allocHist) row(label string, c int) string {
	if h.count == 0 {
		return fmt.Sprintf("| %s | 0 | %d | | | | |", label, c)
	}
	msf := func(s float64) string { return fmt.Sprintf("%.2f ms", s*1000) }
	share := "?"
	if v, ok := h.atMost(0.005); ok {
		share = fmt.Sprintf("%.1f %%", 100*v)
	}
	return fmt.Sprintf("| %s | %d | %d | %s | %s | ≤ %s | %s |", label, h.count, c, msf(h.quantile(0.5)), msf(h.quantile(0.99)), msf(h.maxBucket()), share)
}
