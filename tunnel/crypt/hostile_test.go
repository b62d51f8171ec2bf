package crypt

import (
	"bytes"
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
	spend := func(at time.Duration) bool {
		ba.recvMu.Lock()
		defer ba.recvMu.Unlock()
		return ba.spendLocked(t0.Add(at))
	}
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

// FuzzSessionRekeys drives a sender and a receiver through rekeys, time,
// reordering, replays, forged key ids and receive sessions made again for
// the same key, as the fuzzer's bytes choose. Throughout: no frame opens
// twice (in any receive session), no forged frame opens, and a fresh epoch
// one refill after anything else always opens.
func FuzzSessionRekeys(f *testing.F) {
	f.Add([]byte{0, 0, 1, 2, 2, 3, 4, 5, 0, 6, 2})
	f.Add([]byte{0, 1, 0, 1, 5, 2, 2, 2, 3, 3, 0})
	f.Add([]byte{3, 3, 3, 3, 3, 3, 0, 2, 6, 2, 1, 0})
	f.Add([]byte{0, 5, 2, 0}) // a replay into a session made again
	psk := keysOf(f, "correct horse battery staple").PSK
	lim := Limits{RekeyAfterMessages: 3, RekeyAfterTime: 10 * time.Second, KeepPrevious: 5 * time.Second, KeyBudget: 2, KeyRefill: time.Second}
	ka, _ := NewKeyPair(bytes.Repeat([]byte{1}, 32))
	kb, _ := NewKeyPair(bytes.Repeat([]byte{2}, 32))
	f.Fuzz(func(t *testing.T, ops []byte) {
		a, b := NewLocal(ka, psk, lim), NewLocal(kb, psk, lim)
		ab, _ := a.Session(kb.Public())
		ba, _ := b.Session(ka.Public())
		now := t0
		var sent []frame
		opened := map[[2]uint64]bool{}
		var sc Scratch
		try := func(fr frame, genuine bool) {
			body := bytes.Clone(fr.body)
			_, err := ba.Open(&sc, fr.epoch, fr.counter, fr.hdr, body, now)
			if err == nil {
				id := [2]uint64{uint64(fr.epoch), fr.counter}
				switch {
				case !genuine:
					t.Fatalf("a forged frame of epoch %d opened", fr.epoch)
				case opened[id]:
					t.Fatalf("frame %d/%d opened twice", fr.epoch, fr.counter)
				}
				opened[id] = true
			} else if !errors.Is(err, ErrAuth) && !errors.Is(err, ErrReplay) {
				t.Fatalf("error %v is neither ErrAuth nor ErrReplay", err)
			}
		}
		for i := 0; i < len(ops); i++ {
			switch op := ops[i] % 7; op {
			case 0: // the sender seals one and it arrives
				fr := sealFrame(t, ab, now)
				sent = append(sent, fr)
				try(fr, true)
			case 1: // sealed but lost (or delayed)
				sent = append(sent, sealFrame(t, ab, now))
			case 2: // an earlier frame arrives (again, or late)
				if len(sent) > 0 && i+1 < len(ops) {
					i++
					try(sent[int(ops[i])%len(sent)], true)
				}
			case 3: // a forged frame with a key id of the fuzzer's
				if i+1 < len(ops) {
					i++
					e := uint32(ops[i]) * 7
					try(frame{e, 1, header(e, 1), make([]byte, 32+TagSize)}, false)
				}
			case 4: // time passes
				now = now.Add(3 * time.Second)
			case 5: // the receiver forgets its session and makes it again
				ba, _ = b.Session(ka.Public())
			case 6: // the sender's clock makes it rekey
				now = now.Add(lim.RekeyAfterTime)
			}
		}
		// Liveness: the sender's next epoch, a refill later, opens.
		now = now.Add(lim.RekeyAfterTime + lim.KeyRefill)
		fr := sealFrame(t, ab, now)
		body := bytes.Clone(fr.body)
		if _, err := ba.Open(&sc, fr.epoch, fr.counter, fr.hdr, body, now); err != nil {
			t.Fatalf("the sender's fresh epoch %d does not open: %v", fr.epoch, err)
		}
	})
}

// sealFrame seals one 32-byte test frame.
func sealFrame(t *testing.T, s *Session, now time.Time) frame {
	t.Helper()
	k, c, err := s.Next(now)
	if err != nil {
		t.Fatal(err)
	}
	h := header(k.Epoch(), c)
	var sc Scratch
	return frame{k.Epoch(), c, h, bytes.Clone(k.Seal(&sc, c, h, make([]byte, 32, 32+TagSize)))}
}
