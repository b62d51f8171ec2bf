package router

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/weft-net/weft/internal/syncbuf"
	"github.com/weft-net/weft/kube"
)

// TestPolicyWatchForbiddenWithdrawn: a list of pods refused after pods
// were listed (an uninstall deletes weft's RBAC before its DaemonSet) is a
// warning, and one error only once it has lasted kube.WithdrawnGrace; a
// permission that never worked is an error at once, as before. CI saw the
// same for the router's other API calls (TestForbiddenWithdrawn in kube).
func TestPolicyWatchForbiddenWithdrawn(t *testing.T) {
	forbidden := apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "",
		errors.New(`User "system:serviceaccount:kube-system:weft" cannot list resource "pods"`))
	levels := func(log *syncbuf.Buffer) (warn, errs int) {
		return strings.Count(log.String(), "level=WARN"), strings.Count(log.String(), "level=ERROR")
	}
	type step struct {
		after      time.Duration // since the start
		err        error
		warn, errs int // lines at those levels logged so far
	}
	other := errors.New("connection refused")
	for _, tc := range []struct {
		name   string
		worked bool
		steps  []step
	}{
		{"never worked: an error at once", false, []step{
			{0, forbidden, 0, 1},
			{10 * time.Second, forbidden, 0, 1}, // the same error is not repeated
		}},
		{"withdrawn: a warning, one error after the grace", true, []step{
			{0, forbidden, 1, 0},
			{30 * time.Second, forbidden, 1, 0},
			{kube.WithdrawnGrace - time.Second, forbidden, 1, 0},
			{kube.WithdrawnGrace, forbidden, 1, 1},
			{kube.WithdrawnGrace + 30*time.Second, forbidden, 1, 1},
		}},
		{"withdrawn, then quiet longer than the grace: a new run", true, []step{
			{0, forbidden, 1, 0},
			{2*kube.WithdrawnGrace + time.Second, forbidden, 2, 0},
		}},
		{"withdrawn, then another error: the run ends", true, []step{
			{0, forbidden, 1, 0},
			{20 * time.Second, other, 1, 1},
			{40 * time.Second, forbidden, 2, 1},
			{40*time.Second + kube.WithdrawnGrace, forbidden, 2, 2},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log := &syncbuf.Buffer{}
			w, err := newPolicyWatch(fake.NewClientset(), "n1", newFakeEnforcer(), slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})), nil, time.Millisecond)
			if err != nil {
				t.Fatal(err)
			}
			start := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
			var now time.Time
			w.now = func() time.Time { return now }
			h := w.watchError("pods", func() bool { return tc.worked })
			for i, s := range tc.steps {
				now = start.Add(s.after)
				h(context.Background(), nil, s.err)
				if warn, errs := levels(log); warn != s.warn || errs != s.errs {
					t.Fatalf("after step %d (%v, %v): %d warnings and %d errors, want %d and %d; log:\n%s", i, s.after, s.err, warn, errs, s.warn, s.errs, log.String())
				}
			}
			if !strings.Contains(log.String(), "cannot list resource") {
				t.Errorf("the log does not say which permission was refused:\n%s", log.String())
			}
			if tc.worked && !strings.Contains(log.String(), "expected while weft is being uninstalled") {
				t.Errorf("the warning does not say it is expected during an uninstall:\n%s", log.String())
			}
		})
	}
}
