package crypt

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/ecdh"
	"crypto/hkdf"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/chacha20poly1305"
)

// Sizes of the sealed frame.
const (
	PublicKeySize = 32
	TagSize       = 16 // appended to every sealed frame
	NonceSize     = 12
)

// AEADName names the AEAD that seals data frames.
const AEADName = "AES-256-GCM"

// infoData starts the HKDF info of every data key.
const infoData = "weft data v1"

// Defaults of Limits.
const (
	// DefaultRekeyAfterMessages is far below 2^64, so the counter never
	// wraps, and far above what a link sends in an epoch: in practice
	// the time limit rekeys.
	DefaultRekeyAfterMessages = 1 << 60
	// DefaultRekeyAfterTime is WireGuard's REKEY_AFTER_TIME.
	DefaultRekeyAfterTime = 2 * time.Minute
	// DefaultKeepPrevious is how long the previous epoch is still
	// accepted once a newer one has authenticated: frames of the old
	// epoch still in flight (other queues, reordering) arrive well
	// within it.
	DefaultKeepPrevious = 30 * time.Second
	// DefaultKeyBudget is how many key ids of a peer that never
	// authenticate this node derives keys for, at most, in a burst; one
	// more each DefaultKeyRefill. A genuine new epoch costs nothing (its
	// derivation is refunded once a frame authenticates with it), and a
	// peer makes one every two minutes, so only forged frames use the
	// budget up: beyond it their key ids are refused before any key is
	// derived, in constant time and without allocating.
	DefaultKeyBudget = 4
	DefaultKeyRefill = time.Second
)

// maxFloors bounds the remote keys whose newest epoch Local remembers
// after their Session is gone; beyond it the oldest entry is forgotten.
const maxFloors = 4096

// Errors of Open and Next.
var (
	// ErrAuth: the frame did not authenticate (wrong key, tampered, or
	// not from the peer); it must be dropped.
	ErrAuth = errors.New("frame failed authentication")
	// ErrReplay: an authentic frame seen before, or one too old for the
	// replay window or of an epoch no longer accepted.
	ErrReplay = errors.New("replayed or too old frame")
	// ErrEpochsExhausted: this key pair has used every epoch (after 2^32
	// rekeys); a restart makes a new key pair.
	ErrEpochsExhausted = errors.New("this node's key pair has used up its key ids: restart to make a new one")

	// ErrKeyBudget: a frame of a new key id while the peer's budget of
	// key derivations is used up; it was refused unopened. It is an
	// ErrAuth: such a frame is forged, or its key id was.
	ErrKeyBudget = fmt.Errorf("%w: too many new key ids from this peer", ErrAuth)

	// errOldEpoch is made once: a flood of such frames allocates nothing.
	errOldEpoch = fmt.Errorf("%w: its key id is older than the ones in use", ErrReplay)
)

// PublicKey is an X25519 public key, as published in the mesh metadata.
type PublicKey [PublicKeySize]byte

// ParsePublicKey checks and copies a public key from the mesh metadata.
func ParsePublicKey(b []byte) (PublicKey, error) {
	var k PublicKey
	if len(b) != PublicKeySize {
		return k, fmt.Errorf("public key of %d bytes, want %d", len(b), PublicKeySize)
	}
	copy(k[:], b)
	if k == (PublicKey{}) {
		return k, errors.New("public key is all zeros")
	}
	return k, nil
}

// String is the key in base64, as WireGuard shows keys.
func (k PublicKey) String() string { return base64.StdEncoding.EncodeToString(k[:]) }

// KeyPair is a node's X25519 key pair: made at start, never stored.
type KeyPair struct {
	priv *ecdh.PrivateKey
	pub  PublicKey
}

// GenerateKeyPair makes a fresh key pair from the system's secure random
// source.
func GenerateKeyPair() (*KeyPair, error) {
	priv, err := ecdh.X25519().GenerateKey(nil)
	if err != nil {
		return nil, fmt.Errorf("generating an X25519 key pair: %w", err)
	}
	return newKeyPair(priv), nil
}

// NewKeyPair makes the key pair of a given 32-byte private key: for tests
// and known-answer checks; a node uses GenerateKeyPair.
func NewKeyPair(private []byte) (*KeyPair, error) {
	priv, err := ecdh.X25519().NewPrivateKey(private)
	if err != nil {
		return nil, fmt.Errorf("X25519 private key: %w", err)
	}
	return newKeyPair(priv), nil
}

func newKeyPair(priv *ecdh.PrivateKey) *KeyPair {
	kp := &KeyPair{priv: priv}
	copy(kp.pub[:], priv.PublicKey().Bytes())
	return kp
}

// Public is the key pair's public key.
func (kp *KeyPair) Public() PublicKey { return kp.pub }

// Limits say when a sender moves to a new epoch and how long a receiver
// keeps the previous one. Zero fields take the defaults.
type Limits struct {
	RekeyAfterMessages uint64
	RekeyAfterTime     time.Duration
	KeepPrevious       time.Duration
	// KeyBudget and KeyRefill bound the key derivations for new key ids
	// that do not authenticate (DefaultKeyBudget, DefaultKeyRefill).
	KeyBudget int
	KeyRefill time.Duration
}

func (l Limits) withDefaults() Limits {
	if l.RekeyAfterMessages == 0 || l.RekeyAfterMessages > DefaultRekeyAfterMessages {
		l.RekeyAfterMessages = DefaultRekeyAfterMessages
	}
	if l.RekeyAfterTime <= 0 {
		l.RekeyAfterTime = DefaultRekeyAfterTime
	}
	if l.KeepPrevious <= 0 {
		l.KeepPrevious = DefaultKeepPrevious
	}
	if l.KeyBudget <= 0 {
		l.KeyBudget = DefaultKeyBudget
	}
	if l.KeyRefill <= 0 {
		l.KeyRefill = DefaultKeyRefill
	}
	return l
}

// Local is this node's side of every session: its key pair, the PSK, and
// the epochs it has handed out. It is safe for concurrent use.
type Local struct {
	kp      *KeyPair
	psk     [KeySize]byte
	limits  Limits
	newAEAD func(key []byte) (cipher.AEAD, error)
	epoch   atomic.Uint32 // the last epoch handed out

	floorMu sync.Mutex // guards the fields below
	// floors is, per remote key, the newest epoch any Session accepted
	// from it, so that a Session made again for that key (the tunnel
	// forgot the old one) refuses the epochs the old one saw: frames
	// recorded then cannot be replayed into the new one.
	floors     map[PublicKey]uint32
	floorOrder []PublicKey // oldest first, for maxFloors
}

// NewLocal returns the local side for key pair kp and the password's PSK.
func NewLocal(kp *KeyPair, psk [KeySize]byte, l Limits) *Local {
	return &Local{kp: kp, psk: psk, limits: l.withDefaults(), newAEAD: newAESGCM, floors: map[PublicKey]uint32{}}
}

// Public is this node's public key.
func (l *Local) Public() PublicKey { return l.kp.pub }

// floor is the newest epoch accepted from remote by any Session (0: none).
func (l *Local) floor(remote PublicKey) uint32 {
	l.floorMu.Lock()
	defer l.floorMu.Unlock()
	return l.floors[remote]
}

// raiseFloor records that a Session accepted epoch e from remote.
func (l *Local) raiseFloor(remote PublicKey, e uint32) {
	l.floorMu.Lock()
	defer l.floorMu.Unlock()
	old, ok := l.floors[remote]
	if ok && old >= e {
		return
	}
	if !ok {
		if len(l.floorOrder) >= maxFloors {
			delete(l.floors, l.floorOrder[0])
			l.floorOrder = append(l.floorOrder[:0], l.floorOrder[1:]...)
		}
		l.floorOrder = append(l.floorOrder, remote)
	}
	l.floors[remote] = e
}

// nextEpoch hands out an epoch that this key pair has never used.
func (l *Local) nextEpoch() (uint32, error) {
	for {
		e := l.epoch.Load()
		if e == math.MaxUint32 {
			return 0, ErrEpochsExhausted
		}
		if l.epoch.CompareAndSwap(e, e+1) {
			return e + 1, nil
		}
	}
}

// Session is the pair of directions between this node and one peer (one
// peer public key: a restarted peer has a new key and needs a new
// Session). Next and Seal may be called from many goroutines; Open is
// serialised inside.
type Session struct {
	l      *Local
	remote PublicKey
	prk    []byte // HKDF-Extract of the shared secret and the PSK

	send   atomic.Pointer[SendKey]
	sendMu sync.Mutex // serialises the move to a new epoch

	recvMu    sync.Mutex // guards the fields below
	cur, prev *recvKey   // the newest authenticated epoch and the one before
	prevUntil time.Time  // prev is refused from then on
	trial     *recvKey   // keys of a newer epoch, kept until a frame authenticates with them
	// floor: epochs up to it are refused (those an earlier Session with
	// the same remote key accepted); 0 for a remote key never heard.
	floor uint32
	// budget is how many derivations of keys for new epochs are left;
	// it grows by one every KeyRefill since budgetAt, up to KeyBudget.
	budget   int
	budgetAt time.Time
}

// SendKey is the key of one send epoch.
type SendKey struct {
	epoch   uint32
	aead    cipher.AEAD
	next    atomic.Uint64 // the next counter to hand out
	limit   uint64
	rekeyAt time.Time
}

type recvKey struct {
	epoch uint32
	aead  cipher.AEAD
	win   Window
}

// Session sets up the session with the peer whose public key is remote.
// It fails for an invalid key (one whose exchange with ours yields the
// all-zero value) and for this node's own key.
func (l *Local) Session(remote PublicKey) (*Session, error) {
	if remote == l.kp.pub {
		return nil, errors.New("the peer publishes this node's own public key")
	}
	rpub, err := ecdh.X25519().NewPublicKey(remote[:])
	if err != nil {
		return nil, fmt.Errorf("peer public key: %w", err)
	}
	shared, err := l.kp.priv.ECDH(rpub)
	if err != nil {
		return nil, fmt.Errorf("peer public key %s: %w", remote, err)
	}
	defer clear(shared)
	ikm := append(shared, l.psk[:]...)
	defer clear(ikm)
	lo, hi := l.kp.pub, remote
	if bytes.Compare(lo[:], hi[:]) > 0 {
		lo, hi = hi, lo
	}
	salt := append(lo[:], hi[:]...)
	prk, err := hkdf.Extract(sha256.New, ikm, salt)
	if err != nil {
		return nil, fmt.Errorf("deriving session keys: %w", err)
	}
	return &Session{l: l, remote: remote, prk: prk, floor: l.floor(remote), budget: l.limits.KeyBudget}, nil
}

// Remote is the peer's public key.
func (s *Session) Remote() PublicKey { return s.remote }

// key derives the key of direction from → to in epoch e.
func (s *Session) key(from, to PublicKey, e uint32) (cipher.AEAD, error) {
	info := make([]byte, 0, len(infoData)+2*PublicKeySize+4)
	info = append(info, infoData...)
	info = append(info, from[:]...)
	info = append(info, to[:]...)
	info = binary.BigEndian.AppendUint32(info, e)
	k, err := hkdf.Expand(sha256.New, s.prk, string(info), KeySize)
	if err != nil {
		return nil, fmt.Errorf("deriving a session key: %w", err)
	}
	defer clear(k)
	return s.l.newAEAD(k)
}

// Next hands out the key and the counter for one frame to the peer,
// moving to a new epoch first when the current one is used up or older
// than RekeyAfterTime at now. Each counter is handed out once.
func (s *Session) Next(now time.Time) (*SendKey, uint64, error) {
	for {
		k := s.send.Load()
		if k != nil && now.Before(k.rekeyAt) {
			if c := k.next.Add(1) - 1; c < k.limit {
				return k, c, nil
			}
		}
		if err := s.rekey(k, now); err != nil {
			return nil, 0, err
		}
	}
}

// rekey moves to a new send epoch, unless another goroutine already
// replaced old.
func (s *Session) rekey(old *SendKey, now time.Time) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	if s.send.Load() != old {
		return nil
	}
	e, err := s.l.nextEpoch()
	if err != nil {
		return err
	}
	aead, err := s.key(s.l.kp.pub, s.remote, e)
	if err != nil {
		return err
	}
	s.send.Store(&SendKey{epoch: e, aead: aead, limit: s.l.limits.RekeyAfterMessages, rekeyAt: now.Add(s.l.limits.RekeyAfterTime)})
	return nil
}

// Epoch is the key's epoch: the frame's key id, never 0.
func (k *SendKey) Epoch() uint32 { return k.epoch }

// Scratch is one goroutine's scratch space for Seal and Open, so that
// neither allocates. The zero value is ready; do not share one between
// goroutines.
type Scratch struct {
	nonce [NonceSize]byte
}

func (sc *Scratch) nonceFor(counter uint64) []byte {
	binary.BigEndian.PutUint64(sc.nonce[4:], counter)
	return sc.nonce[:]
}

// Seal encrypts plaintext in place with the given counter (from Next)
// and authenticates it together with ad (the frame header), and returns
// the sealed bytes: plaintext's memory extended by TagSize, which must be
// within its capacity.
func (k *SendKey) Seal(sc *Scratch, counter uint64, ad, plaintext []byte) []byte {
	if cap(plaintext)-len(plaintext) < TagSize {
		panic("crypt: Seal without room for the tag") // a broken local invariant
	}
	return k.aead.Seal(plaintext[:0], sc.nonceFor(counter), plaintext, ad)
}

// Open authenticates a frame of the peer's epoch with the given counter,
// its header ad and ciphertext (the tag at its end), decrypts it in place
// and returns the plaintext. Only then does the counter pass the replay
// window of its epoch, and a newer epoch replace the current one (which
// is still accepted for KeepPrevious from now on). It returns ErrAuth or
// ErrReplay (wrapped) for a frame to drop.
func (s *Session) Open(sc *Scratch, epoch uint32, counter uint64, ad, ciphertext []byte, now time.Time) ([]byte, error) {
	if epoch == 0 || counter >= s.l.limits.RekeyAfterMessages || len(ciphertext) < TagSize {
		return nil, ErrAuth // a sender never makes these
	}
	s.recvMu.Lock()
	defer s.recvMu.Unlock()
	k, err := s.recvKeyLocked(epoch, now)
	if err != nil {
		return nil, err
	}
	pt, err := k.aead.Open(ciphertext[:0], sc.nonceFor(counter), ciphertext, ad)
	if err != nil {
		return nil, ErrAuth
	}
	if !k.win.Accept(counter) {
		return nil, ErrReplay
	}
	if k == s.trial {
		s.prev, s.cur, s.trial = s.cur, k, nil
		s.prevUntil = now.Add(s.l.limits.KeepPrevious)
		s.budget = min(s.budget+1, s.l.limits.KeyBudget) // a genuine epoch costs nothing
		s.l.raiseFloor(s.remote, k.epoch)
	}
	return pt, nil
}

// recvKeyLocked finds the key for a received epoch: the current one, the
// previous one while it is kept, or (for a newer epoch) a trial key.
func (s *Session) recvKeyLocked(epoch uint32, now time.Time) (*recvKey, error) {
	switch {
	case s.cur != nil && epoch == s.cur.epoch:
		return s.cur, nil
	case s.prev != nil && epoch == s.prev.epoch && now.Before(s.prevUntil):
		return s.prev, nil
	case s.cur != nil && epoch < s.cur.epoch, epoch <= s.floor:
		return nil, errOldEpoch
	case s.trial != nil && epoch == s.trial.epoch:
		return s.trial, nil
	}
	if !s.spendLocked(now) {
		return nil, ErrKeyBudget
	}
	aead, err := s.key(s.remote, s.l.kp.pub, epoch)
	if err != nil {
		return nil, err
	}
	s.trial = &recvKey{epoch: epoch, aead: aead}
	return s.trial, nil
}

// spendLocked takes one key derivation from the budget, refilled by one
// every KeyRefill; it reports false, taking nothing, when none is left.
func (s *Session) spendLocked(now time.Time) bool {
	lim := s.l.limits
	if s.budget < lim.KeyBudget {
		if s.budgetAt.IsZero() || now.Before(s.budgetAt) {
			s.budgetAt = now // the first spend, or a clock that went back
		}
		if n := now.Sub(s.budgetAt) / lim.KeyRefill; n > 0 {
			s.budget = int(min(int64(lim.KeyBudget), int64(s.budget)+int64(n)))
			s.budgetAt = s.budgetAt.Add(n * lim.KeyRefill)
		}
	}
	if s.budget == 0 {
		return false
	}
	if s.budget == lim.KeyBudget {
		s.budgetAt = now // the refill clock starts at the first spend from full
	}
	s.budget--
	return true
}

// newAESGCM is the AEAD of data frames.
func newAESGCM(key []byte) (cipher.AEAD, error) {
	b, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(b)
}

// newChaCha20Poly1305 is the alternative, measured in BenchmarkSeal; it
// would be the better choice on CPUs without AES instructions.
func newChaCha20Poly1305(key []byte) (cipher.AEAD, error) { return chacha20poly1305.New(key) }
