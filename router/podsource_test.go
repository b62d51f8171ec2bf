package router

import (
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/weft-net/weft/bridge"
)

// gatedKernel counts the pod-source batches and can hold the first one
// until the test lets it go.
type gatedKernel struct {
	*fakeKernel
	calls atomic.Int32
	gate  chan struct{} // the first AddPodSources waits for it to close
}

func (k *gatedKernel) AddPodSources(ps []bridge.PodSource) error {
	if k.calls.Add(1) == 1 {
		<-k.gate
	}
	return k.fakeKernel.AddPodSources(ps)
}

func (k *gatedKernel) has(p bridge.PodSource) bool {
	_, _, pods, _ := k.state()
	return slices.Contains(pods, p)
}

// TestAllowPodSourceBatches: an ADD's pod source is in the guard's set
// when allowPodSource returns (the pod may send from then on), ADDs that
// wait meanwhile share one kernel batch, nothing else is removed, and a
// DEL withdraws only its own entry.
func TestAllowPodSourceBatches(t *testing.T) {
	k := &gatedKernel{fakeKernel: &fakeKernel{}, gate: make(chan struct{})}
	if err := k.EnsureBridge(bridge.Config{}, nil); err != nil {
		t.Fatal(err)
	}
	other := bridge.PodSource{Veth: "vethwe-other", Addr: netip.MustParseAddr("10.32.9.9")}
	k.pods[other] = true // an entry no ADD here knows: kept
	r := &Router{kernel: k, log: slog.New(slog.NewTextHandler(io.Discard, nil))}

	const n = 20
	src := func(i int) bridge.PodSource {
		return bridge.PodSource{Veth: fmt.Sprintf("vethwe-p%d", i), Addr: netip.AddrFrom4([4]byte{10, 32, 0, byte(10 + i)})}
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	missing := make([]bool, n)
	add := func(i int) {
		defer wg.Done()
		errs[i] = r.allowPodSource(src(i))
		missing[i] = !k.has(src(i)) // checked the moment it returns
	}
	wg.Add(1)
	go add(0)
	waitUntil(t, "the first batch to reach the kernel", func() bool { return k.calls.Load() == 1 })
	for i := 1; i < n; i++ {
		wg.Add(1)
		go add(i)
	}
	waitUntil(t, "the other ADDs to queue in the next batch", func() bool {
		r.guard.batchMu.Lock()
		defer r.guard.batchMu.Unlock()
		return r.guard.next != nil && len(r.guard.next.pods) == n-1
	})
	close(k.gate)
	wg.Wait()
	for i := range n {
		if errs[i] != nil || missing[i] {
			t.Errorf("ADD %d: allowPodSource = %v; its source in the set on return: %v", i, errs[i], !missing[i])
		}
	}
	if c := k.calls.Load(); c != 2 {
		t.Errorf("%d kernel batches for %d concurrent ADDs, want 2 (the first, then the %d that waited)", c, n, n-1)
	}
	if !k.has(other) {
		t.Error("an ADD removed another pod's source")
	}

	if err := r.withdrawPodSource(src(3)); err != nil {
		t.Fatal(err)
	}
	_, _, pods, _ := k.state()
	if len(pods) != n || slices.Contains(pods, src(3)) || !k.has(other) {
		t.Errorf("after withdrawing %v: %v, want every other source kept", src(3), pods)
	}
}

// TestAllowPodSourceBeforeGuard: before the bridge's guard exists an ADD
// is not refused (syncGuard writes the whole set after Ensure).
func TestAllowPodSourceBeforeGuard(t *testing.T) {
	r := &Router{kernel: &fakeKernel{}, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	done := make(chan error, 1)
	go func() {
		done <- r.allowPodSource(bridge.PodSource{Veth: "vethwe-x", Addr: netip.MustParseAddr("10.32.0.2")})
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("allowPodSource without a guard: %v, want nil", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("allowPodSource without a guard did not return")
	}
	if err := r.withdrawPodSource(bridge.PodSource{Veth: "vethwe-x", Addr: netip.MustParseAddr("10.32.0.2")}); err != nil {
		t.Errorf("withdrawPodSource without a guard: %v, want nil", err)
	}
}
