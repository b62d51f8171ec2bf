package crypt

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"
)

// derived caches DeriveKeys of the passwords the tests use: each call
// costs Argon2id's fraction of a second.
var derived sync.Map // string -> Keys

func keysOf(t testing.TB, password string) Keys {
	t.Helper()
	if k, ok := derived.Load(password); ok {
		return k.(Keys)
	}
	k, err := DeriveKeys([]byte(password))
	if err != nil {
		t.Fatal(err)
	}
	derived.Store(password, k)
	return k
}

func TestDeriveKeys(t *testing.T) {
	a := keysOf(t, "correct horse battery staple")
	again, err := DeriveKeys([]byte("correct horse battery staple"))
	if err != nil {
		t.Fatal(err)
	}
	if again != a {
		t.Error("the same password gave different keys")
	}
	b := keysOf(t, "correct horse battery stapler")
	if b.Gossip == a.Gossip || b.PSK == a.PSK {
		t.Error("different passwords gave the same key")
	}
	if a.Gossip == a.PSK {
		t.Error("gossip key and PSK are the same: no domain separation")
	}
	// Known answer, checked against an independent implementation
	// (Python's cryptography: Argon2id, then HKDF-Expand). A change of the KDF, its parameters, salt or infos
	// changes every key, which would split a cluster on upgrade. If this
	// fails on purpose, it is a new protocol version.
	const wantGossip = "45f2ed47dc65c86fb93e1cd1f5a3170befea0dbe79cc64c07e5cb5e27888d280"
	const wantPSK = "6e5f47c72e912cfb46b49cc43ce98d4363136f52ced826dba8ec875e9810617b"
	if got := hex.EncodeToString(a.Gossip[:]); got != wantGossip {
		t.Errorf("gossip key %s, want %s", got, wantGossip)
	}
	if got := hex.EncodeToString(a.PSK[:]); got != wantPSK {
		t.Errorf("PSK %s, want %s", got, wantPSK)
	}
}

func TestDeriveKeysRefusesShortPasswords(t *testing.T) {
	for _, p := range []string{"", "x", "1234567"} {
		_, err := DeriveKeys([]byte(p))
		if !errors.Is(err, ErrPasswordTooShort) {
			t.Errorf("password of %d bytes: error %v", len(p), err)
		}
		if p != "" && strings.Contains(err.Error(), p) {
			t.Errorf("the error shows the password: %v", err)
		}
	}
}

func TestTrimPassword(t *testing.T) {
	for in, want := range map[string]string{
		"secret\n": "secret", "secret\r\n": "secret", "secret": "secret",
		"secret\n\n": "secret\n", " secret \n": " secret ", "secret\r": "secret\r",
	} {
		if got := string(TrimPassword([]byte(in))); got != want {
			t.Errorf("TrimPassword(%q) = %q, want %q", in, got, want)
		}
	}
}

// node is one side: its key pair and Local.
type node struct {
	kp *KeyPair
	l  *Local
}

func newNode(t testing.TB, psk [KeySize]byte, lim Limits) *node {
	t.Helper()
	kp, err := GenerateKeyPair()
	if err != nil {
		t.Fatal(err)
	}
	return &node{kp: kp, l: NewLocal(kp, psk, lim)}
}

func session(t testing.TB, from, to *node) *Session {
	t.Helper()
	s, err := from.l.Session(to.kp.Public())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// frame is a sealed test frame: its header (the associated data) and the
// sealed payload.
type frame struct {
	epoch   uint32
	counter uint64
	hdr     []byte
	body    []byte
}

func header(epoch uint32, counter uint64) []byte {
	h := make([]byte, 16)
	h[0], h[1], h[2] = 1, 1, 2
	binary.BigEndian.PutUint32(h[4:8], epoch)
	binary.BigEndian.PutUint64(h[8:16], counter)
	return h
}

func seal(t testing.TB, s *Session, now time.Time, payload string) frame {
	t.Helper()
	k, c, err := s.Next(now)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(payload), len(payload)+TagSize)
	copy(buf, payload)
	h := header(k.Epoch(), c)
	var sc Scratch
	return frame{k.Epoch(), c, h, k.Seal(&sc, c, h, buf)}
}

func open(s *Session, f frame, now time.Time) (string, error) {
	var sc Scratch
	body := append([]byte(nil), f.body...)
	pt, err := s.Open(&sc, f.epoch, f.counter, f.hdr, body, now)
	return string(pt), err
}

var t0 = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)

func TestSessionBothDirections(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	a, b := newNode(t, psk, Limits{}), newNode(t, psk, Limits{})
	ab, ba := session(t, a, b), session(t, b, a)
	for i := range 3 {
		f := seal(t, ab, t0, "hello b")
		if f.epoch != 1 || f.counter != uint64(i) {
			t.Errorf("frame %d: epoch %d counter %d", i, f.epoch, f.counter)
		}
		if bytes.Contains(f.body, []byte("hello")) {
			t.Error("plaintext visible in the sealed frame")
		}
		if got, err := open(ba, f, t0); err != nil || got != "hello b" {
			t.Fatalf("b opened %q, %v", got, err)
		}
		g := seal(t, ba, t0, "hello a")
		if got, err := open(ab, g, t0); err != nil || got != "hello a" {
			t.Fatalf("a opened %q, %v", got, err)
		}
		// A frame is not accepted back by its own sender: the two
		// directions have different keys (no reflection).
		if _, err := open(ab, f, t0); !errors.Is(err, ErrAuth) {
			t.Fatalf("a accepted its own frame reflected back: %v", err)
		}
	}
}

// TestOutsidersCannotOpen: a node with the public keys and its own key
// pair but another PSK, or the PSK but not the sender's or receiver's
// private key, cannot open a frame; nor can the right receiver with the
// wrong PSK.
func TestOutsidersCannotOpen(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	other := keysOf(t, "wrong password!").PSK
	a, b := newNode(t, psk, Limits{}), newNode(t, psk, Limits{})
	f := seal(t, session(t, a, b), t0, "secret")

	insider := newNode(t, psk, Limits{}) // has the password, not b's private key
	if _, err := open(session(t, insider, a), f, t0); !errors.Is(err, ErrAuth) {
		t.Errorf("another peer opened a's frame to b: %v", err)
	}
	bWrongPSK := &node{kp: b.kp, l: NewLocal(b.kp, other, Limits{})} // b's private key, the wrong password
	if _, err := open(session(t, bWrongPSK, a), f, t0); !errors.Is(err, ErrAuth) {
		t.Errorf("b with the wrong PSK opened the frame: %v", err)
	}
	outsider := newNode(t, other, Limits{})
	if _, err := open(session(t, outsider, a), f, t0); !errors.Is(err, ErrAuth) {
		t.Errorf("an outsider opened the frame: %v", err)
	}
	// And b itself still can.
	if _, err := open(session(t, b, a), f, t0); err != nil {
		t.Errorf("b: %v", err)
	}
}

// TestTamperedFramesRefused: flipping any bit of the header, the
// ciphertext or the tag, or cutting the frame, makes it fail.
func TestTamperedFramesRefused(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	a, b := newNode(t, psk, Limits{}), newNode(t, psk, Limits{})
	ab, ba := session(t, a, b), session(t, b, a)
	f := seal(t, ab, t0, "a payload of some length")
	for i := range len(f.hdr) + len(f.body) {
		for _, bit := range []byte{0x01, 0x80} {
			g := frame{f.epoch, f.counter, bytes.Clone(f.hdr), bytes.Clone(f.body)}
			if i < len(g.hdr) {
				g.hdr[i] ^= bit
			} else {
				g.body[i-len(g.hdr)] ^= bit
			}
			if _, err := open(ba, g, t0); !errors.Is(err, ErrAuth) {
				t.Fatalf("byte %d ^ %#x: %v", i, bit, err)
			}
		}
	}
	for _, g := range []frame{
		{f.epoch, f.counter + 1, f.hdr, f.body}, // another nonce
		{f.epoch + 1, f.counter, f.hdr, f.body}, // another key
		{0, f.counter, f.hdr, f.body},           // key id 0
		{f.epoch, f.counter, f.hdr, f.body[:len(f.body)-1]},
		{f.epoch, f.counter, f.hdr, f.body[:TagSize-1]},
		{f.epoch, f.counter, f.hdr, nil},
	} {
		if _, err := open(ba, g, t0); !errors.Is(err, ErrAuth) {
			t.Errorf("frame %d/%d of %d bytes: %v", g.epoch, g.counter, len(g.body), err)
		}
	}
	// None of that moved anything: the genuine frame still opens, once.
	if _, err := open(ba, f, t0); err != nil {
		t.Fatal(err)
	}
	if _, err := open(ba, f, t0); !errors.Is(err, ErrReplay) {
		t.Errorf("second time: %v", err)
	}
}

// TestRekeyByCounter: after RekeyAfterMessages frames the sender moves to
// a new epoch with counters from 0; the receiver follows, keeps the
// previous epoch for KeepPrevious, then refuses it; older epochs are
// refused outright.
func TestRekeyByCounter(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	lim := Limits{RekeyAfterMessages: 4, KeepPrevious: 10 * time.Second}
	a, b := newNode(t, psk, lim), newNode(t, psk, lim)
	ab, ba := session(t, a, b), session(t, b, a)
	var fs []frame
	for range 9 {
		fs = append(fs, seal(t, ab, t0, "x"))
	}
	for i, f := range fs {
		if want := uint32(1 + i/4); f.epoch != want || f.counter != uint64(i%4) {
			t.Errorf("frame %d: epoch %d counter %d, want %d/%d", i, f.epoch, f.counter, want, i%4)
		}
	}
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	// Epoch 1 but its last frame, then epoch 2: epoch 1's straggler is
	// still accepted within the grace period.
	for _, i := range []int{0, 1, 2, 4, 5, 3} {
		if _, err := open(ba, fs[i], at(1)); err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
	}
	// Epoch 3 moves the receiver on: epoch 2 is the previous one now,
	// epoch 1 is refused.
	if _, err := open(ba, fs[8], at(2)); err != nil {
		t.Fatal(err)
	}
	if _, err := open(ba, fs[7], at(3)); err != nil {
		t.Errorf("epoch 2 within the grace period: %v", err)
	}
	old := seal(t, session(t, a, b), t0, "x") // an unseen frame...
	old.epoch = 1                             // ...claiming epoch 1
	if _, err := open(ba, old, at(3)); !errors.Is(err, ErrReplay) {
		t.Errorf("epoch 1 after epoch 3: %v", err)
	}
	// After the grace period epoch 2 is refused; epoch 3 goes on.
	if _, err := open(ba, fs[6], at(20)); !errors.Is(err, ErrReplay) {
		t.Errorf("epoch 2 after its grace period: %v", err)
	}
	if _, err := open(ba, seal(t, ab, at(20), "y"), at(20)); err != nil {
		t.Errorf("epoch 3 after the grace period: %v", err)
	}
}

// TestRekeyByTime: the sender moves to a new epoch once the current one
// is RekeyAfterTime old.
func TestRekeyByTime(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	a, b := newNode(t, psk, Limits{}), newNode(t, psk, Limits{})
	ab, ba := session(t, a, b), session(t, b, a)
	for _, tc := range []struct {
		after   time.Duration
		epoch   uint32
		counter uint64
	}{
		{0, 1, 0}, {time.Minute, 1, 1}, {DefaultRekeyAfterTime - time.Nanosecond, 1, 2},
		{DefaultRekeyAfterTime, 2, 0}, {DefaultRekeyAfterTime + time.Second, 2, 1},
		{2*DefaultRekeyAfterTime + time.Second, 3, 0},
	} {
		now := t0.Add(tc.after)
		f := seal(t, ab, now, "x")
		if f.epoch != tc.epoch || f.counter != tc.counter {
			t.Errorf("after %s: epoch %d counter %d, want %d/%d", tc.after, f.epoch, f.counter, tc.epoch, tc.counter)
		}
		if _, err := open(ba, f, now); err != nil {
			t.Errorf("after %s: %v", tc.after, err)
		}
	}
}

// TestNewSessionNewEpochs: a session made again with the same peer (it
// left the peer list and came back) never reuses an epoch, and the
// receiver's existing session accepts it.
func TestNewSessionNewEpochs(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	a, b := newNode(t, psk, Limits{}), newNode(t, psk, Limits{})
	ba := session(t, b, a)
	f1 := seal(t, session(t, a, b), t0, "first")
	f2 := seal(t, session(t, a, b), t0, "second")
	if f1.epoch == f2.epoch {
		t.Fatalf("two sessions to the same peer both used epoch %d", f1.epoch)
	}
	for _, f := range []frame{f1, f2} {
		if _, err := open(ba, f, t0); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRestartedPeer: a peer that restarts has a new key pair; the new
// session with it accepts its counters from 0 again.
func TestRestartedPeer(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	a, b := newNode(t, psk, Limits{}), newNode(t, psk, Limits{})
	ba := session(t, b, a)
	for range 3 {
		if _, err := open(ba, seal(t, session(t, a, b), t0, "x"), t0); err != nil {
			t.Fatal(err)
		}
	}
	a2 := newNode(t, psk, Limits{}) // a restarted
	f := seal(t, session(t, a2, b), t0, "again")
	if f.epoch != 1 || f.counter != 0 {
		t.Fatalf("restarted peer sends epoch %d counter %d", f.epoch, f.counter)
	}
	if _, err := open(ba, f, t0); err == nil {
		t.Error("the old session opened the new key's frame")
	}
	if got, err := open(session(t, b, a2), f, t0); err != nil || got != "again" {
		t.Errorf("new session: %q, %v", got, err)
	}
}

func TestEpochsExhausted(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	a, b := newNode(t, psk, Limits{RekeyAfterMessages: 1}), newNode(t, psk, Limits{})
	a.l.epoch.Store(math.MaxUint32 - 1)
	ab := session(t, a, b)
	if k, _, err := ab.Next(t0); err != nil || k.Epoch() != math.MaxUint32 {
		t.Fatalf("last epoch: %v", err)
	}
	if _, _, err := ab.Next(t0); !errors.Is(err, ErrEpochsExhausted) {
		t.Errorf("after the last epoch: %v", err)
	}
}

func TestBadPublicKeys(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	a := newNode(t, psk, Limits{})
	if _, err := a.l.Session(a.kp.Public()); err == nil {
		t.Error("a session with this node's own key")
	}
	// A low-order point: the exchange yields all zeros.
	var low PublicKey
	low[0] = 1
	if _, err := a.l.Session(low); err == nil {
		t.Error("a session with a low-order point")
	}
	for _, b := range [][]byte{nil, make([]byte, 31), make([]byte, 33), make([]byte, 32)} {
		if _, err := ParsePublicKey(b); err == nil {
			t.Errorf("ParsePublicKey accepted %d bytes %x", len(b), b)
		}
	}
	pub := a.kp.Public()
	if k, err := ParsePublicKey(pub[:]); err != nil || k != pub {
		t.Errorf("ParsePublicKey: %v", err)
	}
}

// TestKnownSessionKey pins the session derivation with fixed private keys:
// both sides derive the same direction key, and the frame it seals is the
// one an independent implementation (Python's cryptography: X25519,
// HMAC-SHA256 as HKDF-Extract, HKDF-Expand, AES-GCM) seals.
func TestKnownSessionKey(t *testing.T) {
	priv := func(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }
	ka, _ := NewKeyPair(priv(1))
	kb, _ := NewKeyPair(priv(2))
	var psk [KeySize]byte
	copy(psk[:], "0123456789abcdef0123456789abcdef")
	a, b := NewLocal(ka, psk, Limits{}), NewLocal(kb, psk, Limits{})
	ab, _ := a.Session(kb.Public())
	ba, _ := b.Session(ka.Public())
	k, c, err := ab.Next(t0)
	if err != nil {
		t.Fatal(err)
	}
	var sc Scratch
	body := k.Seal(&sc, c, header(k.Epoch(), c), make([]byte, 8, 8+TagSize))
	const want = "fde106730c23c8af09c14a2574db070ea83150f97e62dc40"
	if got := hex.EncodeToString(body); got != want {
		t.Errorf("sealed zeros %s, want %s", got, want)
	}
	if _, err := ba.Open(&sc, k.Epoch(), c, header(k.Epoch(), c), body, t0); err != nil {
		t.Error(err)
	}
}

// TestConcurrentNext: counters handed out to many goroutines at once are
// unique, across rekeys.
func TestConcurrentNext(t *testing.T) {
	psk := keysOf(t, "correct horse battery staple").PSK
	a, b := newNode(t, psk, Limits{RekeyAfterMessages: 100}), newNode(t, psk, Limits{})
	ab := session(t, a, b)
	type nonce struct {
		e uint32
		c uint64
	}
	var mu sync.Mutex
	seen := map[nonce]bool{}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 1000 {
				k, c, err := ab.Next(t0)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if seen[nonce{k.Epoch(), c}] {
					t.Errorf("epoch %d counter %d handed out twice", k.Epoch(), c)
				}
				seen[nonce{k.Epoch(), c}] = true
				mu.Unlock()
			}
		})
	}
	wg.Wait()
}

// FuzzOpen: no bytes from the network make Open panic, and only the
// genuine frame opens.
func FuzzOpen(f *testing.F) {
	psk := keysOf(f, "correct horse battery staple").PSK
	ka, _ := NewKeyPair(bytes.Repeat([]byte{1}, 32))
	kb, _ := NewKeyPair(bytes.Repeat([]byte{2}, 32))
	a, b := NewLocal(ka, psk, Limits{}), NewLocal(kb, psk, Limits{})
	ab, _ := a.Session(kb.Public())
	k, c, _ := ab.Next(t0)
	var sc Scratch
	hdr := header(k.Epoch(), c)
	genuine := append(bytes.Clone(hdr), k.Seal(&sc, c, hdr, append(make([]byte, 0, 64), "a genuine payload"...))...)
	f.Add(uint32(1), uint64(0), genuine)
	f.Add(uint32(2), uint64(7), genuine[:20])
	f.Add(uint32(0), uint64(0), []byte{})
	f.Add(uint32(math.MaxUint32), uint64(math.MaxUint64), bytes.Repeat([]byte{0xff}, 100))
	f.Fuzz(func(t *testing.T, epoch uint32, counter uint64, frame []byte) {
		ba, err := b.Session(ka.Public())
		if err != nil {
			t.Fatal(err)
		}
		hdr, body := frame[:min(16, len(frame))], bytes.Clone(frame[min(16, len(frame)):])
		var sc Scratch
		pt, err := ba.Open(&sc, epoch, counter, hdr, body, t0)
		if err == nil && (epoch != k.Epoch() || counter != c || !bytes.Equal(frame, genuine) || string(pt) != "a genuine payload") {
			t.Fatalf("opened a frame that a never sealed: epoch %d counter %d %x", epoch, counter, frame)
		}
		if err != nil && !errors.Is(err, ErrAuth) && !errors.Is(err, ErrReplay) {
			t.Fatalf("error %v is neither ErrAuth nor ErrReplay", err)
		}
	})
}
