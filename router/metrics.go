package router

import (
	"regexp"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

type metrics struct {
	reg         *prometheus.Registry
	apiRequests *prometheus.CounterVec
	apiDuration *prometheus.HistogramVec
	ipamSaves   *prometheus.HistogramVec // by result; its _count is the saves
}

// observeSave records one save of the allocator's loop
// (ipalloc.ServiceConfig.OnSave).
func (m *metrics) observeSave(took time.Duration, err error) {
	if m == nil {
		return
	}
	result := "ok"
	if err != nil {
		result = "error"
	}
	m.ipamSaves.WithLabelValues(result).Observe(took.Seconds())
}

// apiBuckets are the local API's latency buckets, in seconds: fine from
// 1 to 10 ms, where an allocation's answer lies and where its goal (p99
// under 5 ms while 20 ADDs run) is judged, then up to allocateWait.
var apiBuckets = []float64{.0001, .0002, .0005, .001, .002, .003, .004, .005, .0075, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 20}

func newMetrics(r *Router) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		apiRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_local_api_requests_total",
			Help: "Requests to the local API (CNI plugin) by operation and HTTP status code.",
		}, []string{"op", "code"}),
		apiDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "weft_local_api_request_duration_seconds",
			Help:    "Time to answer a local API request, by operation: from the accept of its connection (for the first request of a connection; a later one from the start of its handler) to the end of the handler, which writes the answer.",
			Buckets: apiBuckets,
		}, []string{"op"}),
		ipamSaves: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "weft_ipam_save_duration_seconds",
			Help:    "Time of each save of the allocator's state (one bbolt transaction and fsync per step of its loop), by result (ok, error); its _count is the number of saves.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}, []string{"result"}),
	}
	ipam := func(state string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "weft_ipam_addresses", Help: "Addresses of the ranges this peer owns, by state.",
			ConstLabels: prometheus.Labels{"state": state},
		}, f)
	}
	m.reg.MustRegister(
		// With the heap live after the last collection
		// (go_gc_heap_live_bytes): what the heap holds, unlike the heap
		// in use, which also counts garbage not yet collected, so a leak
		// shows as a rising line.
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(
			collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/gc/heap/live:bytes$`)})),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.apiRequests, m.apiDuration, m.ipamSaves,
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "weft_ipam_gossip_dropped_total",
			Help: "IPAM gossip messages and peer joins dropped because the allocator's inbox was full (gossip and retries recover them).",
		}, func() float64 {
			if r.ipam == nil {
				return 0
			}
			return float64(r.ipam.Dropped())
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "weft_ipam_gossip_refused_total",
			Help: "IPAM gossip frames and messages refused as of an unknown frame version (a peer running a newer weft).",
		}, func() float64 {
			if r.gossip == nil {
				return 0
			}
			return float64(r.gossip.Refused())
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "weft_build_info", Help: "Version of this weft router.",
			ConstLabels: prometheus.Labels{"version": Version, "goversion": runtime.Version()},
		}, func() float64 { return 1 }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "weft_ready", Help: "1 when this peer can attach pods.",
		}, func() float64 {
			if ok, _ := r.Ready(); ok {
				return 1
			}
			return 0
		}),
		ipam("owned", func() float64 { return float64(r.ipam.Stats().Owned) }),
		ipam("allocated", func() float64 { return float64(r.ipam.Stats().Allocated) }),
		ipam("free", func() float64 { return float64(r.ipam.Stats().Free) }),
		ipam("reserved", func() float64 { return float64(r.ipam.Stats().Reserved) }),
	)
	return m
}
