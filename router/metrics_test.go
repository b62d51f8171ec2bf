package router

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/ipalloc"
)

// metricValue is the value of the series of name whose labels include
// labels (counter, gauge, or a histogram's sample count), and whether the
// registry has it.
func metricValue(t *testing.T, r *Router, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	m := series(t, r, name, labels)
	if m == nil {
		return 0, false
	}
	return value(m), true
}

// series is the first series of name whose labels include labels, nil if
// the registry has none.
func series(t *testing.T, r *Router, name string, labels map[string]string) *dto.Metric {
	t.Helper()
	fams, err := r.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue series
				}
			}
			return m
		}
	}
	return nil
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount())
	}
	return 0
}

// TestIPAMLoopMetrics: the allocator loop's saves (a duration histogram,
// its count the saves the service committed), its dropped gossip and its
// refused frames are exported.
func TestIPAMLoopMetrics(t *testing.T) {
	r, cl := newTestRouter(t, "10.32.0.0/12")
	r.setReady(true, "")
	ctx := runAllocator(t, r)

	for i := range 3 {
		att := api.Attachment{ContainerID: fmt.Sprintf("m%d", i), IfName: "eth0"}
		if _, err := cl.Allocate(ctx, api.AllocateRequest{Attachment: att}); err != nil {
			t.Fatal(err)
		}
	}
	saves, ok := metricValue(t, r, "weft_ipam_save_duration_seconds", map[string]string{"result": "ok"})
	if !ok || saves < 3 || saves != float64(r.ipam.Saves()) {
		t.Errorf("weft_ipam_save_duration_seconds{result=ok} count = %v (present %v), want the service's %d saves (at least 3)", saves, ok, r.ipam.Saves())
	}
	if v, ok := metricValue(t, r, "weft_ipam_gossip_dropped_total", nil); !ok || v != float64(r.ipam.Dropped()) {
		t.Errorf("weft_ipam_gossip_dropped_total = %v (present %v), want %d", v, ok, r.ipam.Dropped())
	}

	// A push-pull state frame of a version from the future is refused
	// and counted.
	err := r.gossip.MergeRemoteState([]byte{0xFF, 9, 1, 'x', 0})
	var unknown *ipalloc.UnknownFrameError
	if !errors.As(err, &unknown) {
		t.Fatalf("MergeRemoteState of a version 9 frame: %v, want an UnknownFrameError", err)
	}
	if v, ok := metricValue(t, r, "weft_ipam_gossip_refused_total", nil); !ok || v != 1 {
		t.Errorf("weft_ipam_gossip_refused_total = %v (present %v), want 1", v, ok)
	}
}

// TestObserveSaveResult: a failed save is counted apart from the good ones.
func TestObserveSaveResult(t *testing.T) {
	r, _ := newTestRouter(t, "10.32.0.0/12")
	before, _ := metricValue(t, r, "weft_ipam_save_duration_seconds", map[string]string{"result": "error"})
	r.metrics.observeSave(0, errors.New("disk full"))
	if v, ok := metricValue(t, r, "weft_ipam_save_duration_seconds", map[string]string{"result": "error"}); !ok || v != before+1 {
		t.Errorf("saves with result=error = %v (present %v), want %v", v, ok, before+1)
	}
}

// The heap live after the last collection is exported: it is the figure
// that shows a leak (the heap in use also counts garbage not yet
// collected, and RSS what the runtime has not handed back).
func TestMetricsHeapLive(t *testing.T) {
	r, _ := newTestRouter(t, "10.32.0.0/12")
	v, ok := metricValue(t, r, "go_gc_heap_live_bytes", nil)
	if !ok {
		t.Fatal("/metrics has no go_gc_heap_live_bytes")
	}
	if v <= 0 {
		t.Fatalf("go_gc_heap_live_bytes = %v, want > 0", v)
	}
}

// TestLocalAPILatencyFromAccept: a local API request's latency starts at
// its connection's accept, so that the wait of a connection a busy router
// has accepted but not yet read is in the figure; a second request on the
// same connection starts at its own handler.
//
// The bounds come from clocks that bracket the server's, not from the
// sleep: the first request's time is at least the gap from the moment the
// accept is known to have happened to the moment the request is written,
// and the two together are at most the first request's whole span from
// before the dial plus the second request's round trip. A busy machine
// widens both sides alike.
func TestLocalAPILatencyFromAccept(t *testing.T) {
	r, _ := newTestRouter(t, "10.32.0.0/12")
	r.setReady(true, "")
	sock := t.TempDir() + "/api.sock"
	ln, err := listenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := newLocalAPIServer(r)
	acceptedAt := make(chan time.Time, 1)
	withAccept := srv.ConnContext
	srv.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		ctx = withAccept(ctx, c) // records the accept first
		acceptedAt <- time.Now()
		return ctx
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })

	beforeDial := time.Now()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	get := func() {
		t.Helper()
		if _, err := io.WriteString(c, "GET "+api.PathReady+" HTTP/1.1\r\nHost: weft\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %s", api.PathReady, resp.Status)
		}
	}
	accepted := <-acceptedAt
	time.Sleep(200 * time.Millisecond) // accepted, not yet read: the request's latency has begun
	firstSent := time.Now()
	get()
	firstDone := time.Now()
	get() // on the same connection: from its own start
	secondDone := time.Now()

	h := histogram(t, r, "weft_local_api_request_duration_seconds", map[string]string{"op": "ready"})
	if h.GetSampleCount() != 2 {
		t.Fatalf("ready requests timed: %d, want 2", h.GetSampleCount())
	}
	least := firstSent.Sub(accepted).Seconds()
	most := firstDone.Sub(beforeDial).Seconds() + secondDone.Sub(firstDone).Seconds()
	if sum := h.GetSampleSum(); sum < least || sum > most {
		t.Errorf("the two requests took %.3f s in all; want at least the %.3f s between the first's accept and its request, and at most %.3f s (the first's span from the dial plus the second's round trip: the second request's time starts at its handler, not again at the accept)", sum, least, most)
	}
}

// histogram is the histogram of name whose labels include labels.
func histogram(t *testing.T, r *Router, name string, labels map[string]string) *dto.Histogram {
	t.Helper()
	m := series(t, r, name, labels)
	if m == nil || m.Histogram == nil {
		t.Fatalf("no histogram %s%v", name, labels)
	}
	return m.Histogram
}
