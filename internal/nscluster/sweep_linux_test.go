package nscluster

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

func skipUnlessRoot(t *testing.T) {
	t.Helper()
	if uid := os.Geteuid(); uid != 0 {
		t.Skipf("needs root to make network namespaces (running as uid %d)", uid)
	}
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(&tbWriter{t: t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// fakeRun records a run owned by o under base, with a namespace, a process
// in it and a temporary directory, as a crashed run would leave them.
type fakeRun struct {
	prefix, marker, dir string
	ns                  *Netns
	sleeper             *exec.Cmd
}

func newFakeRun(t *testing.T, base string, o owner) *fakeRun {
	t.Helper()
	ctx := context.Background()
	prefix, err := newPrefix()
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeRun{prefix: prefix, marker: filepath.Join(base, prefix)}
	if err := os.MkdirAll(f.marker, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := writeMarker(f.marker, o); err != nil {
		t.Fatal(err)
	}
	if err := recordDirs(f.marker, filepath.Join(os.TempDir(), prefix+"-*")); err != nil {
		t.Fatal(err)
	}
	if f.dir, err = os.MkdirTemp("", prefix+"-"); err != nil {
		t.Fatal(err)
	}
	if f.ns, err = createNetns(ctx, prefix+"-n0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = deleteNetns(ctx, f.ns, nil)
		_ = os.RemoveAll(f.dir)
	})
	f.sleeper = exec.Command("sleep", "600")
	if err := f.ns.Do(f.sleeper.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = f.sleeper.Process.Kill()
		_ = f.sleeper.Wait()
	})
	return f
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return !errors.Is(err, fs.ErrNotExist)
}

func TestSweepRemovesOnlyDeadRuns(t *testing.T) {
	skipUnlessRoot(t)
	base := t.TempDir()
	me, err := currentOwner()
	if err != nil {
		t.Fatal(err)
	}
	// A pid that no longer runs, and a live pid with another start time
	// (a reused pid): both are dead owners.
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	deadPid := newFakeRun(t, base, owner{pid: gone.Process.Pid, start: 1})
	reused := newFakeRun(t, base, owner{pid: me.pid, start: me.start + 1})
	live := newFakeRun(t, base, me)

	// Not a run: a record with a foreign name, and one whose owner cannot be
	// read; and a recorded glob that reaches outside the run's names.
	foreign := filepath.Join(base, "notours")
	if err := os.MkdirAll(foreign, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := writeMarker(foreign, owner{pid: gone.Process.Pid, start: 1}); err != nil {
		t.Fatal(err)
	}
	unreadable := filepath.Join(base, "wftaaaaa")
	if err := os.MkdirAll(unreadable, 0o700); err != nil {
		t.Fatal(err)
	}
	victim := filepath.Join(base, "victim")
	if err := os.WriteFile(victim, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := recordDirs(deadPid.marker, filepath.Join(base, "*")); err != nil {
		t.Fatal(err)
	}

	if err := sweep(context.Background(), base, testLogger(t)); err != nil {
		t.Fatalf("sweep: %v", err)
	}

	for _, f := range []*fakeRun{deadPid, reused} {
		for _, p := range []string{f.ns.Path, f.dir, f.marker} {
			if exists(p) {
				t.Errorf("dead run %s: %s is still there", f.prefix, p)
			}
		}
		// The process left in the namespace was killed.
		done := make(chan error, 1)
		go func() { done <- f.sleeper.Wait() }()
		select {
		case err := <-done:
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
				t.Errorf("dead run %s: sleeper ended with %v, want SIGKILL", f.prefix, err)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("dead run %s: sleeper still runs", f.prefix)
		}
	}
	for _, p := range []string{live.ns.Path, live.dir, live.marker, foreign, unreadable, victim} {
		if !exists(p) {
			t.Errorf("%s was swept, but it is not a dead run's", p)
		}
	}
	if pids, err := live.ns.Pids(); err != nil || len(pids) != 1 || pids[0] != live.sleeper.Process.Pid {
		t.Errorf("live run's namespace holds %v (%v), want its sleeper %d", pids, err, live.sleeper.Process.Pid)
	}
}

func TestRunCloseTwiceAndDeferAfterClose(t *testing.T) {
	skipUnlessRoot(t)
	r, err := NewRun(Options{Log: testLogger(t), markerBase: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	r.Defer("first", func() error { order = append(order, "first"); return nil })
	r.Defer("second", func() error { order = append(order, "second"); return nil })
	ns, err := r.NewNetns(context.Background(), "x")
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if len(order) != 2 || order[0] != "second" || order[1] != "first" {
		t.Errorf("cleanups ran as %v, want reverse order of registration", order)
	}
	for _, p := range []string{ns.Path, r.Dir(), r.markerDir} {
		if exists(p) {
			t.Errorf("%s left after Close", p)
		}
	}
	ran := false
	r.Defer("late", func() error { ran = true; return nil })
	if !ran {
		t.Error("Defer after Close must run at once")
	}
	if _, err := r.NewNetns(context.Background(), "y"); err == nil {
		t.Error("NewNetns after Close must fail")
	}
}
