package crypt

import (
	"errors"
	"testing"
	"time"
)

// forged is a frame of epoch e that nobody sealed: the cost of a forged
// frame is the key derivation for its new key id.
func forged(e uint32) frame {
	return frame{epoch: e, counter: 1, hdr: header(e, 1), body: make([]byte, 64+TagSize)}
}

// TestForgedKeyIDsBudget: frames with ever new key ids cost a key
// derivation each only up to the budget; beyond it they are refused
// unopened, without allocating, while the peer's genuine frames of the
// current epoch, and (refunded) of its next one, still open.
func TestForgedKeyIDsBudget(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	lim := Limits{RekeyAfterMessages: 2}
	a, b := newNode(t, psk, lim), newNode(t, psk, lim)
	ab, ba := session(t, a, b), session(t, b, a)
	if _, err := open(ba, seal(t, ab, t0, "hello"), t0); err != nil {
		t.Fatal(err)
	}
	e := uint32(1000)
	for i := range DefaultKeyBudget {
		e++
		if _, err := open(ba, forged(e), t0); !errors.Is(err, ErrAuth) || errors.Is(err, ErrKeyBudget) {
			t.Fatalf("forged frame %d within the budget: %v, want a failed authentication", i, err)
		}
	}
	if _, err := open(ba, forged(e+1), t0); !errors.Is(err, ErrKeyBudget) {
		t.Fatalf("forged frame beyond the budget: %v, want ErrKeyBudget", err)
	}
	var sc Scratch
	f := forged(e + 2)
	allocs := testing.AllocsPerRun(1000, func() {
		f.epoch++
		if _, err := ba.Open(&sc, f.epoch, f.counter, f.hdr, f.body, t0); !errors.Is(err, ErrKeyBudget) {
			t.Fatalf("forged frame beyond the budget: %v", err)
		}
	})
	if allocs != 0 {
		t.Errorf("a forged key id beyond the budget allocates %v times", allocs)
	}
	// The peer's current epoch is unaffected.
	if _, err := open(ba, seal(t, ab, t0, "still here"), t0); err != nil {
		t.Fatalf("genuine frame while the budget is used up: %v", err)
	}
	// One refill later the peer's next epoch opens, and costs nothing:
	// the forger's frames cannot starve it for more than a refill.
	t1 := t0.Add(DefaultKeyRefill)
	g := seal(t, ab, t0, "x") // epoch 2 (RekeyAfterMessages 2)
	if g.epoch != 2 {
		t.Fatalf("sealed with epoch %d, want 2", g.epoch)
	}
	if _, err := open(ba, g, t1); err != nil {
		t.Fatalf("genuine next epoch after a refill: %v", err)
	}
	if _, err := open(ba, forged(e+5000), t1); !errors.Is(err, ErrAuth) || errors.Is(err, ErrKeyBudget) {
		t.Fatalf("the genuine epoch's derivation was not refunded: %v", err)
	}
}

// TestBudgetRefill checks the refill arithmetic on its own clock.
func TestBudgetRefill(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	a, b := newNode(t, psk, Limits{KeyBudget: 2, KeyRefill: time.Second}), newNode(t, psk, Limits{KeyBudget: 2, KeyRefill: time.Second})
	ba := session(t, b, a)
	spend := func(at time.Duration) bool { ba.recvMu.Lock(); defer ba.recvMu.Unlock(); return ba.spendLocked(t0.Add(at)) }
	for _, tc := range []struct {
		at time.Duration
		ok bool
	}{
		{0, true}, {0, true}, {0, false}, // the burst, then nothing
		{999 * time.Millisecond, false},
		{time.Second, true}, {time.Second, false}, // one refill
		{10 * time.Second, true}, {10 * time.Second, true}, {10 * time.Second, false}, // capped at the burst
		{5 * time.Second, false}, // a clock that went back refills nothing
	} {
		if got := spend(tc.at); got != tc.ok {
			t.Fatalf("spend at %v = %v, want %v", tc.at, got, tc.ok)
		}
	}
}

// TestNoReplayIntoNewSession: frames recorded from a peer cannot be
// replayed into a Session made again for the same key (the tunnel forgot
// the old one): its epochs are refused; the peer's next epoch opens.
func TestNoReplayIntoNewSession(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	lim := Limits{RekeyAfterMessages: 2}
	a, b := newNode(t, psk, lim), newNode(t, psk, lim)
	ab := session(t, a, b)
	recorded := []frame{seal(t, ab, t0, "one"), seal(t, ab, t0, "two")}
	ba := session(t, b, a)
	for _, f := range recorded {
		if _, err := open(ba, f, t0); err != nil {
			t.Fatal(err)
		}
	}
	again := session(t, b, a)
	for i, f := range recorded {
		if _, err := open(again, f, t0); !errors.Is(err, ErrReplay) {
			t.Errorf("recorded frame %d replayed into a new session: %v, want ErrReplay", i, err)
		}
	}
	if _, err := open(again, seal(t, ab, t0, "three"), t0); err != nil {
		t.Errorf("the peer's next epoch in the new session: %v", err)
	}
}

// TestFloorsBounded: Local remembers at most maxFloors remote keys.
func TestFloorsBounded(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	b := newNode(t, psk, Limits{})
	for i := range maxFloors + 10 {
		var k PublicKey
		k[0], k[1], k[2] = byte(i), byte(i>>8), 1
		b.l.raiseFloor(k, 7)
	}
	if len(b.l.floors) != maxFloors || len(b.l.floorOrder) != maxFloors {
		t.Fatalf("%d floors, %d in order; want %d", len(b.l.floors), len(b.l.floorOrder), maxFloors)
	}
	var first PublicKey
	first[2] = 1
	if b.l.floor(first) != 0 {
		t.Error("the oldest floor was kept beyond the bound")
	}
}

// BenchmarkForgedKeyID is the cost of one forged frame with a new key id:
// "derive" with a budget that never runs out (what every such frame cost
// before the budget), "refused" beyond the budget.
func BenchmarkForgedKeyID(b *testing.B) {
	psk := keysOf(b, "correct horse battery staple").PSK
	for _, bc := range []struct {
		name   string
		budget int
	}{{"derive", 1 << 30}, {"refused", 1}} {
		b.Run(bc.name, func(b *testing.B) {
			lim := Limits{KeyBudget: bc.budget}
			x, y := newNode(b, psk, lim), newNode(b, psk, lim)
			yx := session(b, y, x)
			f := forged(1)
			var sc Scratch
			_, _ = yx.Open(&sc, f.epoch, f.counter, f.hdr, f.body, t0) // uses the budget of 1
			b.ReportAllocs()
			for b.Loop() {
				f.epoch++
				_, _ = yx.Open(&sc, f.epoch, f.counter, f.hdr, f.body, t0)
			}
		})
	}
}
