package crypt

import (
	"crypto/cipher"
	"testing"
)

// The AEADs measured against each other: the one in use (AES-256-GCM)
// and the alternative.
var aeads = []struct {
	name string
	new  func([]byte) (cipher.AEAD, error)
}{
	{"AES-256-GCM", newAESGCM},
	{"ChaCha20-Poly1305", newChaCha20Poly1305},
}

// benchPair is a session each way with the given AEAD.
func benchPair(b *testing.B, newAEAD func([]byte) (cipher.AEAD, error)) (ab, ba *Session) {
	var psk [KeySize]byte
	a, c := newNode(b, psk, Limits{}), newNode(b, psk, Limits{})
	a.l.newAEAD, c.l.newAEAD = newAEAD, newAEAD
	return session(b, a, c), session(b, c, a)
}

// BenchmarkSeal seals one 1400-byte packet (a frame of the default pod
// MTU), and a 64 KiB GSO batch: 46 such packets sealed one by one, each
// a datagram of its own.
func BenchmarkSeal(b *testing.B) {
	for _, a := range aeads {
		for _, n := range []int{1, 46} {
			b.Run(a.name+"/"+sizeName(n), func(b *testing.B) {
				ab, _ := benchPair(b, a.new)
				bufs := make([][]byte, n)
				for i := range bufs {
					bufs[i] = make([]byte, 1400, 1400+TagSize)
				}
				hdr := header(1, 0)
				var sc Scratch
				b.SetBytes(int64(n * 1400))
				b.ReportAllocs()
				for b.Loop() {
					for _, buf := range bufs {
						k, c, err := ab.Next(t0)
						if err != nil {
							b.Fatal(err)
						}
						k.Seal(&sc, c, hdr, buf)
					}
				}
			})
		}
	}
}

// BenchmarkOpen opens what BenchmarkSeal seals, replay window included.
func BenchmarkOpen(b *testing.B) {
	for _, a := range aeads {
		for _, n := range []int{1, 46} {
			b.Run(a.name+"/"+sizeName(n), func(b *testing.B) {
				ab, ba := benchPair(b, a.new)
				const pool = 4096 // frames sealed ahead, opened in turn
				type sealed struct {
					hdr, body []byte
					e         uint32
					c         uint64
				}
				var sc Scratch
				frames := make([]sealed, pool)
				for i := range frames {
					k, c, _ := ab.Next(t0)
					h := header(k.Epoch(), c)
					frames[i] = sealed{h, k.Seal(&sc, c, h, make([]byte, 1400, 1400+TagSize)), k.Epoch(), c}
				}
				work := make([]byte, 1400+TagSize)
				b.SetBytes(int64(n * 1400))
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					for range n {
						if i%pool == 0 && i > 0 {
							// Round again over the same frames: a new
							// window, as if for the next epoch.
							ba.recvMu.Lock()
							ba.cur.win = Window{}
							ba.recvMu.Unlock()
						}
						f := &frames[i%pool]
						copy(work, f.body)
						if _, err := ba.Open(&sc, f.e, f.c, f.hdr, work, t0); err != nil {
							b.Fatal(err)
						}
						i++
					}
				}
			})
		}
	}
}

func sizeName(n int) string {
	if n == 1 {
		return "1400B"
	}
	return "64KiB-batch"
}
