package router

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"
)

// recorder notes what the components did, in order.
type recorder struct {
	mu  sync.Mutex
	got []string
}

func (r *recorder) note(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, s)
}

func (r *recorder) events() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// waiter runs until ctx ends and notes its start and its end.
func waiter(rec *recorder, name string) component {
	return component{name: name, run: func(ctx context.Context) error {
		rec.note("run " + name)
		<-ctx.Done()
		rec.note("end " + name)
		return nil
	}}
}

func TestSuperviseStopsInReverseOrder(t *testing.T) {
	rec := &recorder{}
	ctx, cancel := context.WithCancel(context.Background())
	comps := []component{
		{name: "a", start: func(context.Context) error { rec.note("start a"); return nil },
			stop: func(context.Context) error { rec.note("stop a"); return nil }},
		waiter(rec, "b"),
		waiter(rec, "c"),
	}
	done := make(chan error, 1)
	go func() { done <- supervise(ctx, quiet(), comps) }()
	deadline := time.Now().Add(10 * time.Second)
	for len(rec.events()) < 3 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("supervise after ctx ended: %v, want nil", err)
	}
	got := rec.events()
	// The runs may start in any order, but "start a" is before both, and
	// the ends are c, b, then a's stop.
	if got[0] != "start a" || !slices.Equal(got[3:], []string{"end c", "end b", "stop a"}) {
		t.Fatalf("events %q", got)
	}
}

func TestSuperviseFirstErrorStopsAll(t *testing.T) {
	rec := &recorder{}
	boom := errors.New("boom")
	comps := []component{
		waiter(rec, "a"),
		{name: "failing", run: func(context.Context) error { return boom }},
		{name: "also failing", run: func(ctx context.Context) error {
			<-ctx.Done()
			return errors.New("late error at shutdown: logged, not returned")
		}},
		waiter(rec, "c"),
	}
	err := supervise(context.Background(), quiet(), comps)
	if !errors.Is(err, boom) || err.Error() != "failing: boom" {
		t.Fatalf("supervise: %v, want failing: boom", err)
	}
	if got := rec.events(); !slices.Contains(got, "end a") || !slices.Contains(got, "end c") {
		t.Fatalf("not every component stopped: %q", got)
	}
}

func TestSuperviseStartErrorStopsWhatStarted(t *testing.T) {
	rec := &recorder{}
	comps := []component{
		waiter(rec, "a"),
		{name: "b", start: func(context.Context) error { return errors.New("cannot") }},
		waiter(rec, "never"),
	}
	err := supervise(context.Background(), quiet(), comps)
	if err == nil || err.Error() != "b: cannot" {
		t.Fatalf("supervise: %v", err)
	}
	got := rec.events()
	if slices.Contains(got, "run never") || !slices.Contains(got, "end a") {
		t.Fatalf("events %q", got)
	}
}

func TestSuperviseStopRequestIsNotAFailure(t *testing.T) {
	stopped := fmt.Errorf("asked to: %w", errStop)
	err := supervise(context.Background(), quiet(), []component{
		{name: "x", run: func(context.Context) error { return stopped }},
	})
	if err != stopped {
		t.Fatalf("supervise: %v, want %v unwrapped by the component's name", err, stopped)
	}
}

func TestSuperviseBoundsAStuckComponent(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	rec := &recorder{}
	ctx, cancel := context.WithCancel(context.Background())
	comps := []component{
		waiter(rec, "first"),
		{name: "stuck", run: func(context.Context) error { <-release; return nil }, within: 50 * time.Millisecond},
	}
	cancel()
	if err := supervise(ctx, quiet(), comps); err != nil {
		t.Fatal(err)
	}
	// The stuck one was given up on, and the one before it still stopped.
	if got := rec.events(); !slices.Contains(got, "end first") {
		t.Fatalf("events %q", got)
	}
}

func TestSuperviseDoneComponentLeavesOthersRunning(t *testing.T) {
	rec := &recorder{}
	ctx, cancel := context.WithCancel(context.Background())
	comps := []component{
		{name: "once", run: func(context.Context) error { rec.note("once"); return nil }},
		waiter(rec, "long"),
	}
	done := make(chan error, 1)
	go func() { done <- supervise(ctx, quiet(), comps) }()
	deadline := time.Now().Add(10 * time.Second)
	for len(rec.events()) < 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("supervise returned %v when one component finished its work", err)
	default:
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
