package ipalloc

import (
	"context"
	"errors"
	"math"
	"testing"
)

// TestServiceFailedSaveGossipsSavedRing: a Service whose save fails (and
// whose reload fails too) offers in a full-state exchange only the ring on
// disk, never the donation it made in memory and could not save: after a
// restart the disk says the range is still its own.
func TestServiceFailedSaveGossipsSavedRing(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	before, err := DecodeMsg(svc.LocalState())
	if err != nil {
		t.Fatal(err)
	}
	if err := e.db.Close(); err != nil {
		t.Fatal(err)
	}
	if err := svc.Step("other", EncodeMsg(&DonateRequest{ID: 7})); err == nil {
		t.Fatal("a donation was made with the state closed")
	}
	if !errors.Is(svc.Err(), ErrBroken) {
		t.Fatalf("Err() = %v, want ErrBroken", svc.Err())
	}
	got, err := DecodeMsg(svc.LocalState())
	if err != nil {
		t.Fatal(err)
	}
	r := got.(*RingMsg).Ring
	if !r.Equal(before.(*RingMsg).Ring) {
		t.Fatalf("offered a ring that was never saved: %v", r.Entries)
	}
	for _, en := range r.Entries {
		if en.Peer == "other" {
			t.Fatalf("offered an unsaved donation: %v", r.Entries)
		}
	}
	svc = e.mustStart()
	if r2, _ := DecodeMsg(svc.LocalState()); !r2.(*RingMsg).Ring.Equal(r) {
		t.Error("the ring offered after the restart differs from the one offered before it")
	}
}

// TestServiceRemoved: the Service answers ADD on a removed peer with the
// typed error, also for a container it knows, and saves the members and
// the withdrawal.
func TestServiceRemoved(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	e.mustAllocate(key(1))
	if err := svc.AddMembers([]PeerName{"k1", "self"}); err != nil {
		t.Fatal(err)
	}
	if err := svc.Step("r", EncodeMsg(&Remove{Peer: "self"})); err != nil {
		t.Fatal(err)
	}
	for _, k := range []Key{key(1), key(2)} {
		if _, _, err := svc.Allocate(context.Background(), k, Meta{}); !errors.Is(err, ErrRemoved) {
			t.Fatalf("Allocate(%s) on a removed peer: %v", k, err)
		}
	}
	svc = e.restart()
	if _, _, err := svc.Allocate(context.Background(), key(2), Meta{}); !errors.Is(err, ErrRemoved) {
		t.Fatalf("Allocate after a restart of a removed peer: %v", err)
	}
	if got := svc.p.Members(); len(got) != 2 || got[0] != "k1" || got[1] != "r" {
		t.Errorf("members after a restart: %v", got)
	}
	if err := svc.Step("r", EncodeMsg(&Withdraw{Peer: "self"})); err != nil {
		t.Fatal(err)
	}
	svc = e.restart()
	if _, _, err := svc.Allocate(context.Background(), key(2), Meta{}); err != nil {
		t.Fatalf("Allocate after the withdrawal and a restart: %v", err)
	}
}

// TestSetFreeVersionOverflow: a free count is not recorded at the highest
// version: a wrapped version would lose to every older copy of the entry.
func TestSetFreeVersionOverflow(t *testing.T) {
	r := NewRing(rangeOf("10.32.0.0/24"))
	if err := r.ClaimEvenly([]PeerName{"a"}); err != nil {
		t.Fatal(err)
	}
	r.Entries[0].Version = math.MaxUint32
	if r.SetFree("a", func(Range) uint32 { return 7 }) {
		t.Error("SetFree reports a change it could not version")
	}
	if e := r.Entries[0]; e.Version != math.MaxUint32 || e.Free == 7 {
		t.Fatalf("entry after SetFree at the highest version: %+v", e)
	}
	r.Entries[0].Version = math.MaxUint32 - 1
	if !r.SetFree("a", func(Range) uint32 { return 7 }) || r.Entries[0].Version != math.MaxUint32 {
		t.Fatalf("SetFree one below the highest version: %+v", r.Entries[0])
	}
}

// TestServiceReclaimState: the removal's state goes through the real
// database: an open withdrawal and a finished reclaim survive a restart.
func TestServiceReclaimState(t *testing.T) {
	e := newSvcEnv(t, "10.32.0.0/24")
	svc := e.mustStart()
	if err := svc.Step("x", EncodeMsg(&DonateRequest{ID: 1})); err != nil { // x owns a range
		t.Fatal(err)
	}
	if err := svc.AddMembers([]PeerName{"k"}); err != nil { // holds the barrier open
		t.Fatal(err)
	}
	if err := svc.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	if err := svc.Withdraw("x"); err != nil {
		t.Fatal(err)
	}
	svc = e.restart()
	if _, open := svc.p.withdrawing["x"]; !open {
		t.Fatal("the open withdrawal of x was lost in a restart")
	}
	if rec, _ := svc.Reclaiming("x"); rec {
		t.Fatal("x is reclaimed again after a restart")
	}
	if err := svc.PeerGone("x"); err != nil {
		t.Fatal(err)
	}
	if err := svc.PeerGone("k"); err != nil { // k is gone too: x's reclaim completes
		t.Fatal(err)
	}
	if _, done := svc.Reclaiming("x"); !done {
		t.Fatalf("x not reclaimed: %+v", svc.Status().Reclaims)
	}
	svc = e.restart()
	if err := svc.Withdraw("x"); !errors.Is(err, ErrReclaimDone) {
		t.Fatalf("withdrawal after the takeover and a restart: %v", err)
	}
	for _, en := range svc.Ring().Entries {
		if en.Peer == "x" {
			t.Fatalf("x owns %s after the takeover", en.Token)
		}
	}
}
