package crypt

import (
	"bytes"
	"crypto/hkdf"
	"crypto/sha256"
	"errors"
	"fmt"

	"golang.org/x/crypto/argon2"
)

// KeySize is the size of every symmetric key here.
const KeySize = 32

// MinPasswordLen is the shortest password DeriveKeys accepts.
const MinPasswordLen = 8

// The Argon2id parameters, fixed: every peer must derive the same keys
// from the same password. They are RFC 9106's second recommended setting
// (t=3, 64 MiB, 4 lanes), which costs about 0.3 s and 64 MiB once at start
// (docs/security.md). Changing any of them (or the salt) changes every
// key: it is a new protocol version.
const (
	argonTime    = 3
	argonMemory  = 64 * 1024 // KiB
	argonThreads = 4
	// argonSalt is fixed and domain-separated: the password is the only
	// secret, and peers cannot agree on a random salt before they can
	// authenticate each other.
	argonSalt = "weft mesh v1"
)

// HKDF infos of the keys derived from the password.
const (
	infoGossip = "weft gossip key v1"
	infoPSK    = "weft data psk v1"
)

// Keys are what the password yields.
type Keys struct {
	// Gossip is memberlist's keyring key (mesh.Config.SecretKey).
	Gossip [KeySize]byte
	// PSK is the data plane's pre-shared key (tunnel.Config.PSK), mixed
	// into every session key.
	PSK [KeySize]byte
}

// ErrPasswordTooShort is returned by DeriveKeys for an empty or short password.
var ErrPasswordTooShort = errors.New("password too short")

// DeriveKeys derives the gossip key and the data-plane PSK from the
// password. The same password gives the same keys on every peer. A
// password shorter than MinPasswordLen bytes is refused (it would fall to
// a dictionary search of captured gossip). The password is never part of
// an error.
func DeriveKeys(password []byte) (Keys, error) {
	var k Keys
	if len(password) == 0 {
		return k, fmt.Errorf("%w: the password is empty: put at least %d random characters in the password file, e.g. `head -c 24 /dev/urandom | base64`", ErrPasswordTooShort, MinPasswordLen)
	}
	if len(password) < MinPasswordLen {
		return k, fmt.Errorf("%w: the password has %d bytes, at least %d are needed: e.g. `head -c 24 /dev/urandom | base64`", ErrPasswordTooShort, len(password), MinPasswordLen)
	}
	master := argon2.IDKey(password, []byte(argonSalt), argonTime, argonMemory, argonThreads, KeySize)
	defer clear(master)
	for _, o := range []struct {
		info string
		out  *[KeySize]byte
	}{{infoGossip, &k.Gossip}, {infoPSK, &k.PSK}} {
		b, err := hkdf.Expand(sha256.New, master, o.info, KeySize)
		if err != nil {
			return Keys{}, fmt.Errorf("deriving keys: %w", err)
		}
		copy(o.out[:], b)
		clear(b)
	}
	return k, nil
}

// TrimPassword cuts one trailing line ending ("\n" or "\r\n") off the
// contents of a password file, as editors and `echo` add one. Other
// white space is part of the password.
func TrimPassword(b []byte) []byte {
	if t, ok := bytes.CutSuffix(b, []byte("\n")); ok {
		return bytes.TrimSuffix(t, []byte("\r"))
	}
	return b
}
