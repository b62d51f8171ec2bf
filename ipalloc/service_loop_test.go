package ipalloc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"
)

// withLoop makes svcEnv run each service's owner loop (Service.Run), so
// that a test written for the service runs through it. Tests that set it
// do not run in parallel.
var withLoop bool

// runLoop runs svc's owner loop until the returned stop (also the test's
// cleanup) ends it; stop returns once Run has.
func runLoop(t testing.TB, svc *Service) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); svc.Run(ctx, nil) }()
	for !svc.running.Load() { // then every call goes through the loop
		runtime.Gosched()
	}
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// lockedBuffer is a bytes.Buffer that the loop's goroutine may log into
// while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *lockedBuffer) Reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.Reset()
}

// TestServiceUnderLoop runs the service's tests with its owner loop
// running, so that every call goes through it (the other tests call a
// service without a loop, as Build does before Run).
func TestServiceUnderLoop(t *testing.T) {
	withLoop = true
	defer func() { withLoop = false }()
	for _, tc := range []struct {
		name string
		f    func(*testing.T)
	}{
		{"FirstStart", TestServiceFirstStart},
		{"Persistence", TestServicePersistence},
		{"Release", TestServiceRelease},
		{"GC", TestServiceGC},
		{"Exhausted", TestServiceExhausted},
		{"SaveFails", TestServiceSaveFails},
		{"Concurrent", TestServiceConcurrent},
		{"FailedSaveGossipsSavedRing", TestServiceFailedSaveGossipsSavedRing},
		{"CorruptAllocation", TestServiceCorruptAllocation},
	} {
		t.Run(tc.name, tc.f)
	}
}

// holdLoop makes svc's loop run a request that blocks until release is
// called, and returns once the loop is inside it.
func holdLoop(t *testing.T, svc *Service) (release func()) {
	t.Helper()
	in, out := make(chan struct{}), make(chan struct{})
	go svc.read(func() { close(in); <-out })
	<-in
	var once sync.Once
	release = func() { once.Do(func() { close(out) }) }
	t.Cleanup(release)
	return release
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestServiceLoopOneSavePerStep: allocations that wait for the loop
// together are made in one step and saved in one transaction, and each
// caller has its own address, on disk.
func TestServiceLoopOneSavePerStep(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	runLoop(t, svc)
	release := holdLoop(t, svc)
	const n = 20
	got := make([]netip.Addr, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], _, errs[i] = svc.Allocate(context.Background(), key(i), Meta{PodName: "p"})
		}()
	}
	waitFor(t, "20 callers waiting for the loop", func() bool { return svc.calling.Load() == n })
	before := svc.Saves()
	release()
	wg.Wait()
	if d := svc.Saves() - before; d != 1 {
		t.Errorf("%d allocations waiting together took %d saves, want 1", n, d)
	}
	seen := map[netip.Addr]bool{}
	for i, a := range got {
		if errs[i] != nil {
			t.Fatalf("Allocate(%s): %v", key(i), errs[i])
		}
		if seen[a] {
			t.Fatalf("%s handed out twice", a)
		}
		seen[a] = true
	}
	svc = e.restart()
	for i, a := range got {
		if b, ok := svc.Lookup(key(i)); !ok || b != a {
			t.Errorf("after a restart %s holds %s, %v; want %s", key(i), b, ok, a)
		}
	}
}

// TestServiceLoopGossipDoesNotWait: what memberlist calls (Deliver,
// AddPeer, LocalState) returns while the loop is busy; the loop applies
// it afterwards; a full inbox drops and counts.
func TestServiceLoopGossipDoesNotWait(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	runLoop(t, svc)
	release := holdLoop(t, svc)
	returned := make(chan error, 1)
	go func() {
		svc.AddPeer("other")
		_ = svc.LocalState()
		returned <- svc.Deliver("other", EncodeMsg(&DonateRequest{ID: 1}))
	}()
	select {
	case err := <-returned:
		if err != nil {
			t.Fatalf("Deliver: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("gossip callbacks waited for a busy loop")
	}
	if err := svc.Deliver("other", []byte{9, 9}); !errors.Is(err, ErrBadMessage) {
		t.Errorf("Deliver of a bad message: %v, want ErrBadMessage", err)
	}
	var full error
	for range inboxSize + 1 {
		if err := svc.Deliver("other", EncodeMsg(&DonateRequest{ID: 2})); err != nil {
			full = err
			break
		}
	}
	if !errors.Is(full, ErrInboxFull) || svc.Dropped() == 0 {
		t.Fatalf("a full inbox: %v, dropped %d; want ErrInboxFull, counted", full, svc.Dropped())
	}
	release()
	waitFor(t, "the donation to other", func() bool { return slices.Contains(svc.Ring().Peers(), "other") })
	// What LocalState offers is what was saved: the donation, once its
	// step committed.
	waitFor(t, "LocalState with the donation", func() bool {
		m, err := DecodeMsg(svc.LocalState())
		return err == nil && slices.Contains(m.(*RingMsg).Ring.Peers(), "other")
	})
}

// TestServiceLoopTypedErrors: the core's typed errors reach the callers
// through the loop.
func TestServiceLoopTypedErrors(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	runLoop(t, svc)
	if err := svc.AddMembers([]PeerName{"x", "r", "self"}); err != nil {
		t.Fatal(err)
	}
	if err := svc.Step("r", EncodeMsg(&Remove{Peer: "x"})); err != nil {
		t.Fatal(err)
	}
	var re *ReclaimingError
	if err := svc.PeerGone("x"); !errors.As(err, &re) || re.Peer != "x" || re.By != "r" {
		t.Fatalf("PeerGone(x) while r reclaims it: %v, want a ReclaimingError", err)
	}
	if err := svc.Step("r", EncodeMsg(&Remove{Peer: "self"})); err != nil {
		t.Fatal(err)
	}
	_, _, err := svc.Allocate(context.Background(), key(1), Meta{})
	var rm *RemovedError
	if !errors.Is(err, ErrRemoved) || !errors.As(err, &rm) || rm.By != "r" {
		t.Fatalf("Allocate on a removed peer: %v, want ErrRemoved and a RemovedError by r", err)
	}
}

// TestServiceLoopEnds: Run returns when its ctx ends, and the service
// goes on answering (shutdown: the local API may still drain).
func TestServiceLoopEnds(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	stop := runLoop(t, svc)
	a := e.mustAllocate(key(1))
	stop()
	if b, ok := svc.Lookup(key(1)); !ok || b != a {
		t.Fatalf("after the loop ended: Lookup = %s, %v", b, ok)
	}
	if _, ok, err := svc.Release(key(1)); err != nil || !ok {
		t.Fatalf("Release after the loop ended: %v, %v", ok, err)
	}
}

// TestServiceLoopAllocateCanceled: a caller whose ctx ends before the
// busy loop takes its request gets ctx's error, and nothing is allocated.
func TestServiceLoopAllocateCanceled(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	runLoop(t, svc)
	release := holdLoop(t, svc)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, err := svc.Allocate(ctx, key(1), Meta{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Allocate with an ended ctx on a busy loop: %v", err)
	}
	release()
	if _, ok := svc.Lookup(key(1)); ok {
		t.Fatal("a canceled Allocate allocated")
	}
}

// recordingTransport records what the loop's sender sends.
type recordingTransport struct {
	mu   sync.Mutex
	sent []PeerName // "" for a broadcast
}

func (r *recordingTransport) Broadcast([]byte) error { return r.SendTo("", nil) }

func (r *recordingTransport) SendTo(p PeerName, _ []byte) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sent = append(r.sent, p)
	return nil
}

func (r *recordingTransport) sentTo(p PeerName) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Contains(r.sent, p)
}

// TestServiceLoopPersistBeforeSend: a donation asked for by gossip is
// sent once its step saved it, and never when that save failed.
func TestServiceLoopPersistBeforeSend(t *testing.T) {
	for _, failing := range []bool{false, true} {
		e := newSvcEnv(t, "10.32.0.0/24")
		svc := e.mustStart()
		tr := &recordingTransport{}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); svc.Run(ctx, tr) }()
		waitFor(t, "the loop", svc.running.Load)
		if failing {
			if err := e.db.Close(); err != nil {
				t.Fatal(err)
			}
		}
		if err := svc.Deliver("other", EncodeMsg(&DonateRequest{ID: 1})); err != nil {
			t.Fatal(err)
		}
		if failing {
			waitFor(t, "the failed save", func() bool { return errors.Is(svc.Err(), ErrBroken) })
			svc.read(func() {}) // a step after it: its sends were queued by now
		} else {
			waitFor(t, "the donation sent", func() bool { return tr.sentTo("other") })
		}
		cancel()
		<-done // the sender has stopped: what it took is recorded, the rest still queued
		if failing && (tr.sentTo("other") || len(svc.out) > 0) {
			t.Fatalf("a donation whose save failed was sent (%v) or queued (%d)", tr.sent, len(svc.out))
		}
	}
}

// blockingTransport holds every unicast to one peer until released, and
// records the others with their data.
type blockingTransport struct {
	slow    PeerName
	release chan struct{}
	mu      sync.Mutex
	sent    map[PeerName][]string
}

func (b *blockingTransport) Broadcast(data []byte) error { return b.SendTo("", data) }

func (b *blockingTransport) SendTo(p PeerName, data []byte) error {
	if p == b.slow {
		<-b.release
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.sent[p] = append(b.sent[p], string(data))
	return nil
}

func (b *blockingTransport) got(p PeerName) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.sent[p])
}

// TestServiceSendSlowPeerHoldsNoOther: a unicast to a peer that does not
// take it (a stream to a black-holed node waits out the mesh's TCP
// timeout) holds neither the broadcasts nor the messages to other peers,
// and each peer's messages arrive in the order sent.
func TestServiceSendSlowPeerHoldsNoOther(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	tr := &blockingTransport{slow: "slow", release: make(chan struct{}), sent: map[PeerName][]string{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); svc.Run(ctx, tr) }()
	defer func() { cancel(); <-done }()
	defer close(tr.release)
	waitFor(t, "the loop", svc.running.Load)

	// Peers on another lane than slow's (one on its lane waits, in order).
	var others []PeerName
	for i := 0; len(others) < 5; i++ {
		if i > 1000 {
			t.Fatalf("every peer name is on slow's lane (%d lanes)", sendLanes)
		}
		if p := PeerName(fmt.Sprintf("peer-%d", i)); laneOf(p) != laneOf("slow") {
			others = append(others, p)
		}
	}
	svc.queue(outgoing{to: "slow", data: []byte("first")})
	svc.queue(outgoing{to: "slow", data: []byte("second")})
	for _, p := range others {
		for i := range 3 {
			svc.queue(outgoing{to: p, data: []byte(fmt.Sprint(i))})
		}
	}
	svc.queue(outgoing{broadcast: []byte("news")})
	waitFor(t, "the other peers' messages and the broadcast", func() bool {
		for _, p := range others {
			if len(tr.got(p)) < 3 {
				return false
			}
		}
		return len(tr.got("")) == 1
	})
	for _, p := range others {
		if got := tr.got(p); !slices.Equal(got, []string{"0", "1", "2"}) {
			t.Errorf("%s got %q, want them in order", p, got)
		}
	}
	if got := tr.got("slow"); len(got) != 0 {
		t.Fatalf("the slow peer took %q while held", got)
	}
	tr.release <- struct{}{}
	tr.release <- struct{}{}
	waitFor(t, "the slow peer's messages", func() bool { return len(tr.got("slow")) == 2 })
	if got := tr.got("slow"); !slices.Equal(got, []string{"first", "second"}) {
		t.Errorf("the slow peer got %q, want them in order", got)
	}
}
