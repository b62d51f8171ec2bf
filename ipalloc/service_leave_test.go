package ipalloc

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/state"
)

// openDB opens e's state, closed when the test ends.
func (e *svcEnv) openDB() *state.DB {
	e.t.Helper()
	db, err := state.Open(e.dir)
	if err != nil {
		e.t.Fatal(err)
	}
	e.db = db
	e.t.Cleanup(func() { db.Close() })
	return db
}

func TestServiceHoldFound(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	gw, pod := netip.MustParseAddr("10.32.0.9"), netip.MustParseAddr("10.32.0.20")
	podAddr, _ := AddressFrom(pod)
	rk := ReclaimedKey("weft", podAddr)
	if !rk.Internal() || !rk.Reclaimed() || GatewayKey("weft").Reclaimed() || rk.ContainerID != "_weft_reclaimed_10.32.0.20" {
		t.Fatalf("ReclaimedKey = %v", rk)
	}
	if err := svc.HoldFound(map[Key]netip.Addr{GatewayKey("weft"): gw, rk: pod}); err != nil {
		t.Fatal(err)
	}
	if got := e.mustAllocate(GatewayKey("weft")); got != gw {
		t.Errorf("gateway: %s, want the one found, %s", got, gw)
	}
	for i := range 30 {
		if got := e.mustAllocate(key(i)); got == gw || got == pod {
			t.Fatalf("%s got %s, which is in use", key(i), got)
		}
	}
	if !strings.Contains(e.log.String(), "re-claimed 10.32.0.20, in use on this node but unknown to its state: held as _weft_reclaimed_10.32.0.20/weft") {
		t.Errorf("log: %s", e.log.String())
	}
	// Saved: a restart keeps it.
	svc = e.restart()
	if got, ok := svc.Lookup(rk); !ok || got != pod {
		t.Fatalf("after restart: %s, %v", got, ok)
	}
	// GC keeps it while the runtime lists an attachment unknown here...
	valid := []Key{key(0), {ContainerID: "unknown", IfName: "eth0"}}
	dropped, err := svc.GC(valid)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := svc.Lookup(rk); !ok || len(dropped) != 29 {
		t.Fatalf("GC with an unknown valid attachment dropped %d, re-claimed held %v", len(dropped), ok)
	}
	// ...and drops it once every listed attachment is known.
	if dropped, err := svc.GC(valid[:1]); err != nil || len(dropped) != 1 || dropped[0].Key != rk {
		t.Fatalf("second GC = %v, %v", dropped, err)
	}
	if _, ok := svc.Lookup(GatewayKey("weft")); !ok {
		t.Error("GC dropped the gateway")
	}
	// ReleaseReclaimed frees only re-claimed addresses.
	if err := svc.HoldFound(map[Key]netip.Addr{rk: pod}); err != nil {
		t.Fatal(err)
	}
	if ok, err := svc.ReleaseReclaimed(gw); ok || err != nil {
		t.Errorf("ReleaseReclaimed of the gateway = %v, %v", ok, err)
	}
	if ok, err := svc.ReleaseReclaimed(pod); !ok || err != nil {
		t.Errorf("ReleaseReclaimed = %v, %v", ok, err)
	}
	if _, ok := svc.Lookup(rk); ok {
		t.Error("still held after ReleaseReclaimed")
	}
}

// fakeTransport hands every message to the peer service it is addressed to.
type fakeTransport struct {
	self PeerName
	to   map[PeerName]*Service
}

func (f fakeTransport) Broadcast(data []byte) error {
	for n, s := range f.to {
		if n != f.self {
			_ = s.Step(f.self, data)
		}
	}
	return nil
}

func (f fakeTransport) SendTo(p PeerName, data []byte) error {
	if s := f.to[p]; s != nil {
		go s.Step(f.self, data) // off the sender's goroutine, as the mesh does
	}
	return nil
}

func TestServiceLeave(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	names := []PeerName{"a", "b"}
	svcs := map[PeerName]*Service{}
	envs := map[PeerName]*svcEnv{}
	for _, n := range names {
		e := newSvcEnv(t, "10.32.0.0/24")
		db := e.openDB()
		svc, err := NewService(ServiceConfig{Self: n, Universe: netip.MustParsePrefix(e.universe), Init: Init{Seeds: names}, DB: db, Log: e.logger()})
		if err != nil {
			t.Fatal(err)
		}
		svcs[n], envs[n] = svc, e
	}
	var wg sync.WaitGroup
	runCtx, stop := context.WithCancel(ctx)
	defer func() { stop(); wg.Wait() }()
	for _, n := range names {
		wg.Go(func() { svcs[n].Run(runCtx, fakeTransport{self: n, to: svcs}) })
	}
	a := svcs["a"]
	a.AddPeer("b")
	if _, _, err := a.Allocate(ctx, key(1), Meta{}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Leave(ctx, func(PeerName) bool { return true }, false); !errors.Is(err, ErrPodsHeld) {
		t.Fatalf("Leave with a pod: %v", err)
	}
	res, err := a.Leave(ctx, func(q PeerName) bool { return q == "b" }, true)
	if err != nil || res.Heir != "b" || res.Size != 128 {
		t.Fatalf("Leave = %+v, %v", res, err)
	}
	if st := a.Status(); st.String() != "left the cluster (weft reset): ranges handed to b" {
		t.Errorf("status: %s", st)
	}
	if got := svcs["b"].Snapshot().Ring.Shares(); len(got) != 1 || got[0].Peer != "b" {
		t.Errorf("b's ring: %+v", got)
	}
	// The departure is on disk: a restart stays left.
	stop()
	wg.Wait()
	if err := envs["a"].db.Close(); err != nil {
		t.Fatal(err)
	}
	db := envs["a"].openDB()
	again, err := NewService(ServiceConfig{Self: "a", Universe: netip.MustParsePrefix("10.32.0.0/24"), Init: Init{Seeds: names}, DB: db})
	if err != nil {
		t.Fatal(err)
	}
	if st := again.Status(); !st.Left || st.Heir != "b" {
		t.Errorf("after restart: %+v", st)
	}
	if _, _, err := again.Allocate(ctx, key(2), Meta{}); !errors.Is(err, ErrLeft) {
		t.Errorf("allocate after leaving: %v", err)
	}
}
