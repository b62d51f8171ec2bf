package mesh

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unicode"
	"unicode/utf8"

	"github.com/hashicorp/memberlist"
)

// Meta is the record each peer publishes in its memberlist node metadata.
// The encoding is versioned binary (metaVersion first) and always fits in
// memberlist's 512-byte limit when the field limits hold.
type Meta struct {
	Nickname  string   `json:"nickname,omitempty"`
	DataPort  uint16   `json:"dataPort,omitempty"`
	Encaps    []string `json:"encaps,omitempty"`
	PublicKey []byte   `json:"publicKey,omitempty"`
	Version   string   `json:"version,omitempty"`
}

// metaVersion is the version of the metadata encoding. A decoder accepts
// newer versions and ignores the fields they append, so that a newer peer
// can add fields without breaking older ones.
const metaVersion = 1

// ErrMetaTooLarge says the local metadata does not fit in memberlist's limit.
var ErrMetaTooLarge = errors.New("peer metadata is larger than memberlist's limit")

// Validate checks every field against its limit.
func (md Meta) Validate() error {
	if err := checkText("nickname", md.Nickname, MaxNicknameLen); err != nil {
		return err
	}
	if err := checkText("version", md.Version, MaxVersionLen); err != nil {
		return err
	}
	if len(md.Encaps) > MaxEncaps {
		return fmt.Errorf("%d encapsulations, at most %d allowed", len(md.Encaps), MaxEncaps)
	}
	for _, e := range md.Encaps {
		if e == "" || len(e) > MaxEncapLen {
			return fmt.Errorf("encapsulation %q: give 1 to %d characters", e, MaxEncapLen)
		}
		for _, r := range e {
			if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-') {
				return fmt.Errorf("encapsulation %q: only lower-case letters, digits and '-'", e)
			}
		}
	}
	if len(md.PublicKey) > MaxPublicKey {
		return fmt.Errorf("public key of %d bytes, at most %d allowed", len(md.PublicKey), MaxPublicKey)
	}
	return nil
}

// checkText accepts valid UTF-8 without control characters, at most max bytes.
func checkText(what, s string, max int) error {
	if len(s) > max {
		return fmt.Errorf("%s %q is longer than %d bytes", what, s, max)
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%s %q is not valid UTF-8", what, s)
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return fmt.Errorf("%s %q contains a control character", what, s)
		}
	}
	return nil
}

// encodeMeta validates md and encodes it:
//
//	version:1 nicknameLen:1 nickname dataPort:2(BE) nEncaps:1 (len:1 encap)*
//	keyLen:1 key versionLen:1 version
func encodeMeta(md Meta) ([]byte, error) {
	if err := md.Validate(); err != nil {
		return nil, fmt.Errorf("peer metadata: %w", err)
	}
	b := []byte{metaVersion}
	b = appendShort(b, []byte(md.Nickname))
	b = binary.BigEndian.AppendUint16(b, md.DataPort)
	b = append(b, byte(len(md.Encaps)))
	for _, e := range md.Encaps {
		b = appendShort(b, []byte(e))
	}
	b = appendShort(b, md.PublicKey)
	b = appendShort(b, []byte(md.Version))
	if len(b) > memberlist.MetaMaxSize {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrMetaTooLarge, len(b), memberlist.MetaMaxSize)
	}
	return b, nil
}

// appendShort appends a one-byte length and s; callers keep s under 256 bytes.
func appendShort(b, s []byte) []byte {
	return append(append(b, byte(len(s))), s...)
}

// decodeMeta decodes and validates a peer's metadata. It never panics.
func decodeMeta(b []byte) (Meta, error) {
	var md Meta
	if len(b) == 0 {
		return md, errors.New("empty metadata (not a weft peer?)")
	}
	if len(b) > memberlist.MetaMaxSize {
		return md, fmt.Errorf("metadata of %d bytes, more than the %d allowed", len(b), memberlist.MetaMaxSize)
	}
	r := reader{b: b[1:]}
	v := b[0]
	if v < metaVersion {
		return md, fmt.Errorf("metadata version %d is not supported", v)
	}
	md.Nickname = string(r.short())
	md.DataPort = r.uint16()
	n := int(r.byte())
	if r.err == nil && n > MaxEncaps {
		return md, fmt.Errorf("metadata lists %d encapsulations, at most %d allowed", n, MaxEncaps)
	}
	for i := 0; i < n && r.err == nil; i++ {
		md.Encaps = append(md.Encaps, string(r.short()))
	}
	if key := r.short(); len(key) > 0 {
		md.PublicKey = append([]byte(nil), key...)
	}
	md.Version = string(r.short())
	if r.err != nil {
		return Meta{}, fmt.Errorf("metadata: %w", r.err)
	}
	if v == metaVersion && len(r.b) > 0 {
		return Meta{}, fmt.Errorf("metadata has %d unexpected trailing bytes", len(r.b))
	}
	if err := md.Validate(); err != nil {
		return Meta{}, fmt.Errorf("metadata: %w", err)
	}
	return md, nil
}

// reader reads length-prefixed fields; the first error sticks and every
// later read returns zero values.
type reader struct {
	b   []byte
	err error
}

func (r *reader) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || n > len(r.b) {
		r.err = ErrTruncated
		return nil
	}
	out := r.b[:n]
	r.b = r.b[n:]
	return out
}

func (r *reader) byte() byte {
	if b := r.take(1); b != nil {
		return b[0]
	}
	return 0
}

func (r *reader) uint16() uint16 {
	if b := r.take(2); b != nil {
		return binary.BigEndian.Uint16(b)
	}
	return 0
}

func (r *reader) short() []byte { return r.take(int(r.byte())) }

// uvarint reads a varint no larger than max; a larger one is ErrOversized.
func (r *reader) uvarint(max uint64) uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	switch {
	case n == 0:
		r.err = ErrTruncated
		return 0
	case n < 0:
		r.err = fmt.Errorf("%w: varint overflows", ErrMalformed)
		return 0
	case n != uvarintLen(v):
		r.err = fmt.Errorf("%w: varint not in its shortest form", ErrMalformed)
		return 0
	}
	r.b = r.b[n:]
	if v > max {
		r.err = fmt.Errorf("%w: %d bytes, limit %d", ErrOversized, v, max)
		return 0
	}
	return v
}

func uvarintLen(v uint64) int {
	n := 1
	for ; v >= 0x80; v >>= 7 {
		n++
	}
	return n
}
