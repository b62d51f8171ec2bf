// Package crypt is weft's cryptography, kept pure: no goroutines, sockets,
// clocks or logging; time comes in as an argument. It turns the shared
// password into keys, and seals and opens the data plane's udp frames.
//
// # Keys from the password
//
// DeriveKeys stretches the password with Argon2id (fixed parameters and a
// fixed, domain-separated salt, so that every peer derives the same keys
// without an exchange) and expands the result with HKDF-SHA256 into two
// independent 32-byte keys: the memberlist gossip key and the data plane's
// pre-shared key (PSK).
//
// # Data-plane sessions
//
// Every node makes a fresh X25519 key pair at start (never stored) and
// publishes its public key in the mesh metadata, which travels only over
// the password-authenticated gossip. For two nodes A and B:
//
//	prk           = HKDF-Extract(SHA-256, salt = min(pubA,pubB) || max(pubA,pubB),
//	                             ikm  = X25519(a, B) || psk)
//	key(A→B, e)   = HKDF-Expand(prk, "weft data v1" || pubA || pubB || e (4 bytes BE), 32)
//
// Each direction has its own keys; e is the epoch, carried as the frame's
// key id. A sender takes its epochs from one counter per Local (per key
// pair), so that no two sessions, and no session made again after a peer
// came back, ever use the same key; within an epoch, the frame counter is
// the nonce (96 bits: four zero bytes, then the 64-bit counter, big
// endian), starting at 0 and never repeating. A sender moves to a new
// epoch after RekeyAfterTime or RekeyAfterMessages, whichever comes first.
//
// A receiver keeps, per sender, the current epoch and the one before it
// (for KeepPrevious after the newer one first authenticated), each with
// its own replay window. A frame of a newer epoch is tried with keys
// derived on the spot and moves the receiver forward only once it has
// authenticated; older epochs are refused. Replay windows (RFC 6479,
// Window) move only on authentic frames.
//
// The AEAD is AES-256-GCM (AEADName): on this project's machines, with
// AES-NI, it measured several times faster than ChaCha20-Poly1305 (see
// docs/security.md and BenchmarkSeal).
package crypt
