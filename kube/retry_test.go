package kube

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func TestBackoffDelay(t *testing.T) {
	b := DefaultBackoff
	var got []time.Duration
	for i := range 8 {
		got = append(got, b.Delay(i, 0))
	}
	want := []time.Duration{1, 2, 4, 8, 16, 30, 30, 30}
	for i := range want {
		if got[i] != want[i]*time.Second {
			t.Fatalf("Delay without jitter = %v; want 1s 2s 4s 8s 16s 30s 30s 30s", got)
		}
	}
	for i := range 40 {
		for _, u := range []float64{0, 0.5, 0.9999} {
			d := b.Delay(i, u)
			base := b.Delay(i, 0)
			if d > b.Max || d > base || float64(d) < 0.8*float64(base)-1 {
				t.Errorf("Delay(%d, %v) = %v: outside [0.8, 1] of %v or above the cap", i, u, d, base)
			}
		}
	}
	if d := b.Delay(10000, 0); d != b.Max {
		t.Errorf("Delay(10000) = %v, want the cap", d)
	}
	if z := (Backoff{}).withDefaults(DefaultBackoff); z != DefaultBackoff {
		t.Errorf("zero Backoff with defaults = %+v", z)
	}
}

// TestRetryBackoff: failing calls are retried on the backoff schedule
// (through the injected timer), the streak is logged once, its end once,
// and each failure is counted.
func TestRetryBackoff(t *testing.T) {
	f := newCASFake()
	n := f.failN("get", "configmaps", 7, apierrors.NewServiceUnavailable("apiserver is restarting"))
	k := newTestKube(t, f, "a", "pa", func(c *Config) { c.Backoff.Jitter = 0.0001 })
	if err := k.RegisterPeer(context.Background(), "pa", "a"); err != nil {
		t.Fatal(err)
	}
	if *n != 7 {
		t.Fatalf("%d failures injected, want 7", *n)
	}
	want := []time.Duration{1, 2, 4, 8, 16, 30, 30}
	got := k.delays.get()
	if len(got) != len(want) {
		t.Fatalf("waits %v, want %v s", got, want)
	}
	for i := range want {
		if d := want[i] * time.Second; got[i] > d || got[i] < d-d/1000 {
			t.Errorf("wait %d = %v, want about %v", i, got[i], d)
		}
	}
	if c := k.log.count("kubernetes API call failed; retrying with backoff"); c != 1 {
		t.Errorf("%d streak lines, want 1; log:\n%s", c, k.log)
	}
	if c := k.log.count("kubernetes API call works again"); c != 1 || !strings.Contains(k.log.String(), "failures=7") {
		t.Errorf("want one recovery line with failures=7; log:\n%s", k.log)
	}
	if v := counterValue(t, k.metrics.apiErrors.WithLabelValues("get configmaps")); v != 7 {
		t.Errorf("api errors = %v, want 7", v)
	}
}

// TestRetryStopsWithContext: an API server that never answers is retried
// until the context ends, and the error says so.
func TestRetryStopsWithContext(t *testing.T) {
	f := newCASFake()
	f.failN("get", "configmaps", 1<<30, errors.New("dial tcp 10.96.0.1:443: connect: connection refused"))
	ctx, cancel := context.WithCancel(context.Background())
	k := newTestKube(t, f, "a", "pa", func(c *Config) {
		c.After = func(time.Duration) <-chan time.Time {
			cancel() // the first wait: the router is shutting down
			return make(chan time.Time)
		}
	})
	err := k.RegisterPeer(ctx, "pa", "a")
	if !errors.Is(err, context.Canceled) {
		t.Errorf("RegisterPeer = %v, want context.Canceled", err)
	}
}

func TestForbiddenMessage(t *testing.T) {
	o := op{verb: "patch", resource: "nodes/status", name: "n1"}
	err := apierrors.NewForbidden(schema.GroupResource{Resource: "nodes"}, "n1",
		errors.New(`User "system:serviceaccount:kube-system:weft" cannot patch resource "nodes/status" in API group "" at the cluster scope`))
	want := "kubernetes API refused patch nodes/status (n1): the weft ServiceAccount needs that permission — check deploy/weft.yaml's ClusterRole/Role"
	if got := forbiddenMessage(o, err); got != want {
		t.Errorf("forbiddenMessage =\n%s\nwant\n%s", got, want)
	}

	// Without the reason text: the details' resource, our verb.
	o = op{verb: "update", resource: "configmaps", name: "weft", ns: "kube-system"}
	err = apierrors.NewForbidden(schema.GroupResource{Resource: "configmaps"}, "weft", errors.New("no"))
	want = "kubernetes API refused update configmaps (weft, kube-system)"
	if got := forbiddenMessage(o, err); !strings.HasPrefix(got, want) {
		t.Errorf("forbiddenMessage = %s\nwant prefix %s", got, want)
	}
}

// TestForbiddenLogged: a Forbidden answer is logged once, naming the verb
// and resource, and retried until RBAC is fixed.
func TestForbiddenLogged(t *testing.T) {
	f := newCASFake()
	f.failN("create", "configmaps", 3, apierrors.NewForbidden(schema.GroupResource{Resource: "configmaps"}, "weft",
		errors.New(`User "system:serviceaccount:kube-system:weft" cannot create resource "configmaps" in API group "" in the namespace "kube-system"`)))
	k := newTestKube(t, f, "a", "pa")
	if err := k.RegisterPeer(context.Background(), "pa", "a"); err != nil {
		t.Fatal(err)
	}
	line := "kubernetes API refused create configmaps (weft, kube-system): the weft ServiceAccount needs that permission — check deploy/weft.yaml's ClusterRole/Role"
	if c := k.log.count(line); c != 1 {
		t.Errorf("%d lines %q, want 1; log:\n%s", c, line, k.log)
	}
	if f.configMap(t) == nil {
		t.Error("the ConfigMap was not created once permitted")
	}
}

// TestPermanentError: a request the server calls invalid is not retried.
func TestPermanentError(t *testing.T) {
	f := newCASFake()
	f.failN("create", "configmaps", 1, apierrors.NewInvalid(schema.GroupKind{Kind: "ConfigMap"}, "weft", nil))
	k := newTestKube(t, f, "a", "pa")
	err := k.RegisterPeer(context.Background(), "pa", "a")
	if err == nil || !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), `create configmaps "weft" in namespace "kube-system"`) {
		t.Errorf("RegisterPeer = %v; want the Invalid error naming the call", err)
	}
	if n := f.countActions("create", "configmaps"); n != 1 {
		t.Errorf("%d creates, want 1 (no retry)", n)
	}
}

// TestForbiddenWithdrawn: a permission that worked before and is then
// refused (an uninstall deletes the RBAC objects before the DaemonSet) is
// a warning, not an error, for WithdrawnGrace; refused longer, one error.
// A permission that never worked stays an error at once
// (TestForbiddenLogged).
func TestForbiddenWithdrawn(t *testing.T) {
	forbidden := apierrors.NewForbidden(schema.GroupResource{Resource: "configmaps"}, "weft",
		errors.New(`User "system:serviceaccount:kube-system:weft" cannot get resource "configmaps" in API group "" in the namespace "kube-system"`))
	for _, tc := range []struct {
		name      string
		failures  int
		step      time.Duration // the clock's advance per reading
		wantError int
	}{
		{"brief, as in an uninstall", 3, time.Second, 0},
		{"for good", 8, 20 * time.Second, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newCASFake()
			var mu sync.Mutex
			now := time.Date(2026, 12, 4, 19, 0, 0, 0, time.UTC)
			k := newTestKube(t, f, "a", "pa", func(c *Config) {
				c.Now = func() time.Time {
					mu.Lock()
					defer mu.Unlock()
					now = now.Add(tc.step)
					return now
				}
			})
			ctx := context.Background()
			if err := k.RegisterPeer(ctx, "pa", "a"); err != nil {
				t.Fatal(err)
			}
			f.failN("get", "configmaps", tc.failures, forbidden)
			if err := k.RegisterPeer(ctx, "pa", "a"); err != nil {
				t.Fatal(err)
			}
			if c := k.log.count("level=WARN msg=\"kubernetes API refused get configmaps (weft, kube-system)"); c != 1 {
				t.Errorf("%d warnings of the withdrawn permission, want 1; log:\n%s", c, k.log)
			}
			if !strings.Contains(k.log.String(), "it was allowed before") {
				t.Errorf("the warning does not say the permission worked before; log:\n%s", k.log)
			}
			if c := k.log.count("level=ERROR"); c != tc.wantError {
				t.Errorf("%d errors, want %d; log:\n%s", c, tc.wantError, k.log)
			}
			if tc.wantError == 1 && !strings.Contains(k.log.String(), "has been refused since") {
				t.Errorf("the error does not say since when; log:\n%s", k.log)
			}
			if c := k.log.count("kubernetes API call works again"); c != 1 {
				t.Errorf("%d recovery lines, want 1; log:\n%s", c, k.log)
			}
		})
	}
}
