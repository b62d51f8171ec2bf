package kube

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/ipalloc"
)

func testClaim(by string, peers ...string) Claim {
	u, _ := ipalloc.ParseUniverse("10.32.0.0/12")
	r := ipalloc.RangeOf(u)
	var ps []ipalloc.PeerName
	for _, p := range peers {
		ps = append(ps, ipalloc.PeerName(p))
	}
	return Claim{Seed: ipalloc.SeedOf(r, ps), Universe: u, Peers: peers, By: by,
		Time: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func TestClaimJSON(t *testing.T) {
	c := testClaim("a", "a", "b")
	b, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"seed":"` + c.Seed.String() + `","universe":"10.32.0.0/12","peers":["a","b"],"by":"a","time":"2025-01-02T03:04:05Z"}`
	if string(b) != want {
		t.Errorf("JSON %s\nwant %s", b, want)
	}
	var back Claim
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back.Seed != c.Seed || back.Universe != c.Universe || back.By != "a" || !back.Time.Equal(c.Time) || len(back.Peers) != 2 {
		t.Errorf("round trip %+v, want %+v", back, c)
	}
	for _, bad := range []string{
		`{"seed":"0000000000000000","universe":"10.32.0.0/12","by":"a"}`,
		`{"seed":"12","universe":"10.32.0.0/12","by":"a"}`,
		`{"seed":"zzzzzzzzzzzzzzzz","universe":"10.32.0.0/12","by":"a"}`,
		`{"seed":"0123456789abcdef","universe":"10.32.0.1/12","by":"a"}`,
		`{"seed":"0123456789abcdef","universe":"fd00::/64","by":"a"}`,
		`{"seed":"0123456789abcdef","universe":"10.32.0.0/12","by":""}`,
		`{"seed":"0123456789abcdef","universe":"10.32.0.0/12","by":"a","peers":["x y"]}`,
		`[]`,
	} {
		if err := json.Unmarshal([]byte(bad), &back); err == nil {
			t.Errorf("%s: decoded without error", bad)
		}
	}
}

func TestClaimRecord(t *testing.T) {
	f := newCASFake()
	ctx := context.Background()
	k := newTestKube(t, f, "a", "pa")
	if _, ok, err := k.ClaimRecord(ctx); ok || err != nil {
		t.Fatalf("ClaimRecord without a ConfigMap = %v, %v", ok, err)
	}
	c := testClaim("pa", "pa", "pb")
	got, err := k.RecordClaim(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if got.Seed != c.Seed || got.By != "pa" {
		t.Errorf("RecordClaim = %v, want ours", got)
	}
	rec, ok, err := k.ClaimRecord(ctx)
	if err != nil || !ok || rec.Seed != c.Seed || rec.Universe != c.Universe {
		t.Errorf("ClaimRecord = %v, %v, %v", rec, ok, err)
	}

	// Another claim later: the first stays, and is returned.
	other := testClaim("pc", "pc")
	got, err = k.RecordClaim(ctx, other)
	if err != nil || got.Seed != c.Seed {
		t.Errorf("second RecordClaim = %v, %v; want the first claim", got, err)
	}
	if k.log.count("another first claim of the ring is recorded") != 1 {
		t.Errorf("log:\n%s", k.log)
	}
	if _, err := k.RecordClaim(ctx, Claim{By: "pa"}); err == nil || !strings.Contains(err.Error(), "no seed") {
		t.Errorf("RecordClaim of an invalid claim = %v", err)
	}
}

// TestClaimRace: routers that claimed apart race to record; exactly one
// claim is recorded and every one of them is told which.
func TestClaimRace(t *testing.T) {
	for round := range 10 {
		f := newCASFake()
		ctx := context.Background()
		names := []string{"pa", "pb", "pc", "pd"}
		got := make([]Claim, len(names))
		var wg sync.WaitGroup
		for i, p := range names {
			k := newTestKube(t, f, "n"+p, p)
			wg.Go(func() {
				c, err := k.RecordClaim(ctx, testClaim(p, p))
				if err != nil {
					t.Errorf("%s: %v", p, err)
				}
				got[i] = c
			})
		}
		wg.Wait()
		rec, ok, err := newTestKube(t, f, "x", "px").ClaimRecord(ctx)
		if !ok || err != nil {
			t.Fatalf("round %d: nothing recorded: %v", round, err)
		}
		for i, c := range got {
			if c.Seed != rec.Seed || c.By != rec.By {
				t.Errorf("round %d: %s was told %v; recorded is %v", round, names[i], c, rec)
			}
		}
	}
}

func TestClaimCorrupt(t *testing.T) {
	f := newCASFake()
	f.putConfigMap(t, map[string]string{KeyClaim: `{"seed":"nope"}`})
	k := newTestKube(t, f, "a", "pa")
	ctx := context.Background()
	_, _, err := k.ClaimRecord(ctx)
	var ce *CorruptError
	if !errors.As(err, &ce) || ce.Key != KeyClaim || !strings.Contains(err.Error(), `ConfigMap kube-system/weft, key "claim"`) {
		t.Errorf("ClaimRecord = %v; want a CorruptError naming the key", err)
	}
	if _, err := k.RecordClaim(ctx, testClaim("pa", "pa")); !errors.As(err, &ce) {
		t.Errorf("RecordClaim over a corrupt claim = %v; want a CorruptError", err)
	}
	if got := f.configMap(t)[KeyClaim]; got != `{"seed":"nope"}` {
		t.Errorf("the corrupt claim was overwritten: %s", got)
	}
	// A corrupt claim does not stop registration (another key).
	if err := k.RegisterPeer(ctx, "pa", "a"); err != nil {
		t.Errorf("RegisterPeer beside a corrupt claim: %v", err)
	}
}

// TestConsensusRecord: the first router's node count is the consensus size
// of every router; a later one that saw another count adopts it.
func TestConsensusRecord(t *testing.T) {
	f := newCASFake()
	ctx := context.Background()
	a := newTestKube(t, f, "a", "pa")
	if n, err := a.RecordConsensus(ctx, 3); err != nil || n != 3 {
		t.Fatalf("first RecordConsensus = %d, %v", n, err)
	}
	b := newTestKube(t, f, "b", "pb")
	if n, err := b.RecordConsensus(ctx, 5); err != nil || n != 3 {
		t.Fatalf("second RecordConsensus = %d, %v; want the recorded 3", n, err)
	}
	if _, err := b.RecordConsensus(ctx, 0); err == nil {
		t.Error("RecordConsensus(0) accepted")
	}
}
