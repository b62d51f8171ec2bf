package nscluster

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"
)

// TB is the part of testing.TB that NewTestRun uses; *testing.T and
// *testing.B satisfy it. (The package does not import testing, so that
// programs can use it.)
type TB interface {
	Helper()
	Logf(format string, args ...any)
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	Skipf(format string, args ...any)
	Cleanup(func())
	Failed() bool
}

// NewTestRun starts a Run for a test: it skips the test when not root, logs
// to t.Log, and closes the run in t.Cleanup, after showing the tail of every
// router and CNI log if the test failed. A failed Close fails the test.
func NewTestRun(t TB) *Run {
	t.Helper()
	if uid := os.Geteuid(); uid != 0 {
		t.Skipf("e2e: needs root to make network namespaces (running as uid %d)", uid)
	}
	w := &tbWriter{t: t}
	log := slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{
		Level: slog.LevelDebug,
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) == 0 && a.Key == slog.TimeKey {
				return slog.Attr{} // t.Log output is short enough without
			}
			return a
		},
	}))
	r, err := NewRun(Options{Log: log})
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			r.DumpLogs(t.Logf)
		}
		if err := r.Close(); err != nil {
			t.Errorf("%v", err)
		}
		// Race-built daemons (make test-race-e2e) report a data race on
		// their stderr, into their log, and go on: any such report fails
		// the test, whatever else it checked.
		for _, f := range r.LogFiles() {
			if race := RaceReport(f); race != "" {
				t.Errorf("e2e: a data race in a daemon, reported in %s:\n%s", f, race)
			}
		}
		w.stop()
	})
	return r
}

// raceMarker starts the race detector's report of a data race.
const raceMarker = "WARNING: DATA RACE"

// RaceReport returns the first data race report in a log file (the
// report of a race-built daemon), or "" if it has none.
func RaceReport(path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	s := string(data)
	i := strings.Index(s, raceMarker)
	if i < 0 {
		return ""
	}
	s = s[i:]
	if j := strings.Index(s, "\n==================\n"); j >= 0 {
		s = s[:j]
	}
	const max = 8000
	if len(s) > max {
		s = s[:max] + "\n..."
	}
	return s
}

// DumpLogs passes the tail of every non-empty log of the run to logf.
func (r *Run) DumpLogs(logf func(format string, args ...any)) {
	for _, f := range r.LogFiles() {
		if st, err := os.Stat(f); err != nil || st.Size() == 0 {
			continue
		}
		logf("--- last %d lines of %s ---\n%s", logTailLines, f, tailFile(f, logTailLines))
	}
}

// tbWriter passes slog lines to t.Logf until the test ends; after that,
// t.Logf would panic, so lines from late goroutines are dropped.
type tbWriter struct {
	mu      sync.Mutex
	t       TB
	stopped bool
}

func (w *tbWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.stopped {
		w.t.Logf("%s", strings.TrimRight(string(b), "\n"))
	}
	return len(b), nil
}

func (w *tbWriter) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
}

// WaitUntil polls cond every 200ms until it holds, and fails the test when
// ctx ends first, with what it waited for and the last state cond gave.
func WaitUntil(t TB, ctx context.Context, what string, cond func() (ok bool, state string)) {
	t.Helper()
	last := ""
	for {
		ok, state := cond()
		if ok {
			return
		}
		last = state
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s; last seen: %s", what, last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
