package mesh

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"unicode"
	"unicode/utf8"

	"github.com/hashicorp/memberlist"
)

// Meta is the record each peer publishes in its memberlist node metadata:
// the mesh's own fields (nickname, version) and one opaque blob per
// component that registered one (Config.Components): the mesh knows
// their names, versions and sizes, never what is in them.
type Meta struct {
	Nickname string `json:"nickname,omitempty"`
	Version  string `json:"version,omitempty"`
	// Components holds the blobs this peer accepted from the peer, by
	// component name: those whose registered Check passed, and those of
	// components this peer does not know (kept, never read).
	Components map[string]Blob `json:"components,omitempty"`
	// Refused says, by component name, why a blob was refused (its Check
	// failed, it was too large or it appeared twice); the peer's other
	// components are still used.
	Refused map[string]string `json:"refused,omitempty"`
}

// Blob is one component's record: its own version and bytes.
type Blob struct {
	Version uint8  `json:"version"`
	Data    []byte `json:"data,omitempty"`
}

// Component registers a component's blob in this peer's metadata, and
// how the blobs of the same component from peers are read.
type Component struct {
	// Name names the component: 1 to MaxComponentName characters, lower
	// case letters, digits and '-'.
	Name string
	// Version and Data are this peer's blob.
	Version uint8
	Data    []byte
	// Max bounds the blob, this peer's and its peers' (a larger one from
	// a peer is refused); at most MaxComponentData.
	Max int
	// Check validates a peer's blob; an error refuses it for this
	// component only. Nil accepts any blob within Max. It must not keep
	// data and must not panic on any input.
	Check func(version uint8, data []byte) error
	// Legacy, for the one component whose record main's version-1
	// metadata carried between the nickname and the version (the
	// tunnel's), returns the length of that record at the start of b. The
	// component's blob is then written in that place too, so that peers
	// of version 1 still read it during a rolling upgrade, and their
	// records are read back into it (as blob version LegacyVersion).
	Legacy func(b []byte) (int, error)
}

// LegacyVersion is the blob version of a record read from a peer's
// version-1 metadata, and the only version written in its place.
const LegacyVersion = 1

// Limits of the component registry.
const (
	MaxComponents    = 8
	MaxComponentName = 16
	MaxComponentData = 255
)

// The metadata encoding's version is its first byte. Version 1 (main
// before components):
//
//	1 nickLen:1 nickname dataPort:2 nEncaps:1 (len:1 encap)* keyLen:1 key versionLen:1 version
//
// Version 2 keeps that layout up to the version string, with the legacy
// component's blob (Component.Legacy) in the place of dataPort..key, and
// appends the other components and, last, the length of the legacy blob:
//
//	2 nickLen:1 nickname legacy versionLen:1 version n:1 (nameLen:1 name blobVersion:1 len:1 blob)* legacyLen:1
//
// A version-1 decoder accepts any newer version and ignores what follows
// the version string, so main's peers keep reading the tunnel's fields
// during a rolling upgrade. A decoder of version 2 reads any version >= 2
// the same way: later versions may only add components.
const (
	metaVersion1 = 1
	metaVersion  = 2
)

// ErrMetaTooLarge says the local metadata does not fit in memberlist's limit.
var ErrMetaTooLarge = errors.New("peer metadata is larger than memberlist's limit")

// validateMeta checks the mesh's own fields against their limits.
func validateMeta(nickname, version string) error {
	if err := checkText("nickname", nickname, MaxNicknameLen); err != nil {
		return err
	}
	return checkText("version", version, MaxVersionLen)
}

// checkComponentName accepts 1 to MaxComponentName of [a-z0-9-].
func checkComponentName(n string) error {
	if n == "" || len(n) > MaxComponentName {
		return fmt.Errorf("component name %q: give 1 to %d characters", n, MaxComponentName)
	}
	for _, r := range n {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-') {
			return fmt.Errorf("component name %q: only lower-case letters, digits and '-'", n)
		}
	}
	return nil
}

// validateComponents checks this peer's registrations.
func validateComponents(cs []Component) error {
	if len(cs) > MaxComponents {
		return fmt.Errorf("%d metadata components, at most %d allowed", len(cs), MaxComponents)
	}
	seen := map[string]bool{}
	legacy := 0
	for _, c := range cs {
		if err := checkComponentName(c.Name); err != nil {
			return err
		}
		if seen[c.Name] {
			return fmt.Errorf("metadata component %q registered twice", c.Name)
		}
		seen[c.Name] = true
		if c.Max < 0 || c.Max > MaxComponentData {
			return fmt.Errorf("metadata component %q: bound of %d bytes, give 0 to %d", c.Name, c.Max, MaxComponentData)
		}
		if len(c.Data) > c.Max {
			return fmt.Errorf("metadata component %q: blob of %d bytes, more than its bound of %d", c.Name, len(c.Data), c.Max)
		}
		if c.Legacy != nil {
			legacy++
			if c.Version != LegacyVersion {
				return fmt.Errorf("metadata component %q: a legacy component's blob is version %d, not %d", c.Name, LegacyVersion, c.Version)
			}
			if n, err := c.Legacy(c.Data); err != nil || n != len(c.Data) {
				return fmt.Errorf("metadata component %q: its own blob is not a legacy record of itself (length %d of %d, %v)", c.Name, n, len(c.Data), err)
			}
		}
		if c.Check != nil {
			if err := c.Check(c.Version, c.Data); err != nil {
				return fmt.Errorf("metadata component %q: its own blob is refused by its check: %w", c.Name, err)
			}
		}
	}
	if legacy > 1 {
		return errors.New("more than one metadata component has a legacy place")
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

// encodeMeta validates this peer's fields and components and encodes them
// (version 2, see metaVersion).
func encodeMeta(nickname, version string, cs []Component) ([]byte, error) {
	if err := validateMeta(nickname, version); err != nil {
		return nil, fmt.Errorf("peer metadata: %w", err)
	}
	if err := validateComponents(cs); err != nil {
		return nil, fmt.Errorf("peer metadata: %w", err)
	}
	var legacy []byte
	var rest []Component
	for _, c := range cs {
		if c.Legacy != nil {
			legacy = c.Data
		} else {
			rest = append(rest, c)
		}
	}
	b := []byte{metaVersion}
	b = appendShort(b, []byte(nickname))
	b = append(b, legacy...)
	b = appendShort(b, []byte(version))
	b = append(b, byte(len(rest)))
	for _, c := range rest {
		b = appendShort(b, []byte(c.Name))
		b = append(b, c.Version)
		b = appendShort(b, c.Data)
	}
	b = append(b, byte(len(legacy)))
	if len(b) > memberlist.MetaMaxSize {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrMetaTooLarge, len(b), memberlist.MetaMaxSize)
	}
	return b, nil
}

// appendShort appends a one-byte length and s; callers keep s under 256 bytes.
func appendShort(b, s []byte) []byte {
	return append(append(b, byte(len(s))), s...)
}

// decodeMeta decodes a peer's metadata and checks each blob with the
// registered components cs. An error refuses the whole record: the mesh's
// own fields are wrong or the framing does not hold together. A blob that
// is refused is named in Meta.Refused and left out of Meta.Components. It
// never panics, whatever b and whatever the components' checks return.
func decodeMeta(b []byte, cs []Component) (Meta, error) {
	var md Meta
	if len(b) == 0 {
		return md, errors.New("empty metadata (not a weft peer?)")
	}
	if len(b) > memberlist.MetaMaxSize {
		return md, fmt.Errorf("metadata of %d bytes, more than the %d allowed", len(b), memberlist.MetaMaxSize)
	}
	var legacy *Component
	for i := range cs {
		if cs[i].Legacy != nil {
			legacy = &cs[i]
		}
	}
	v := b[0]
	if v < metaVersion1 {
		return md, fmt.Errorf("metadata version %d is not supported", v)
	}
	var body []byte // after the nickname
	var legacyLen int
	r := reader{b: b[1:]}
	md.Nickname = string(r.short())
	if r.err != nil {
		return Meta{}, fmt.Errorf("metadata: %w", r.err)
	}
	if v == metaVersion1 {
		// Main's record: the tunnel's fields in the legacy place,
		// nothing after the version string.
		if legacy == nil {
			return Meta{}, errors.New("metadata version 1 carries a record of a component this peer does not register")
		}
		n, err := legacy.Legacy(r.b)
		if err != nil {
			return Meta{}, fmt.Errorf("metadata version 1: the %s record: %w", legacy.Name, err)
		}
		if n < 0 || n > len(r.b) {
			return Meta{}, fmt.Errorf("metadata version 1: the %s record: %w", legacy.Name, ErrTruncated)
		}
		legacyLen, body = n, r.b
	} else {
		if len(r.b) < 1 {
			return Meta{}, fmt.Errorf("metadata: %w", ErrTruncated)
		}
		legacyLen, body = int(r.b[len(r.b)-1]), r.b[:len(r.b)-1]
		if legacyLen > len(body) {
			return Meta{}, fmt.Errorf("metadata: legacy record of %d bytes: %w", legacyLen, ErrTruncated)
		}
	}
	legacyData := body[:legacyLen]
	r = reader{b: body[legacyLen:]}
	md.Version = string(r.short())
	if r.err != nil {
		return Meta{}, fmt.Errorf("metadata: %w", r.err)
	}
	if err := validateMeta(md.Nickname, md.Version); err != nil {
		return Meta{}, fmt.Errorf("metadata: %w", err)
	}
	type entry struct {
		name    string
		version uint8
		data    []byte
		legacy  bool // from the legacy place
	}
	var entries []entry
	if v == metaVersion1 {
		if len(r.b) > 0 {
			return Meta{}, fmt.Errorf("metadata has %d unexpected trailing bytes", len(r.b))
		}
	} else {
		n := int(r.byte())
		if r.err == nil && n > MaxComponents {
			return Meta{}, fmt.Errorf("metadata lists %d components, at most %d allowed", n, MaxComponents)
		}
		for i := 0; i < n && r.err == nil; i++ {
			e := entry{name: string(r.short()), version: r.byte()}
			e.data = r.short()
			entries = append(entries, e)
		}
		if r.err != nil {
			return Meta{}, fmt.Errorf("metadata components: %w", r.err)
		}
		if len(r.b) > 0 {
			return Meta{}, fmt.Errorf("metadata has %d unexpected bytes after its components", len(r.b))
		}
	}
	if legacy != nil && (legacyLen > 0 || v == metaVersion1) {
		// Without a legacy component (a mesh without a tunnel) the
		// record in the legacy place is skipped: its length is known.
		// Last: an entry of the same name in the list (a newer version
		// of the component) takes its place.
		entries = append(entries, entry{name: legacy.Name, version: LegacyVersion, data: legacyData, legacy: true})
	}
	byName := map[string]*Component{}
	for i := range cs {
		byName[cs[i].Name] = &cs[i]
	}
	seen := map[string]bool{}
	for _, e := range entries {
		if err := checkComponentName(e.name); err != nil {
			return Meta{}, fmt.Errorf("metadata: %w", err)
		}
		if seen[e.name] {
			if !e.legacy {
				md.refuse(e.name, "appears twice in the metadata")
			}
			continue
		}
		seen[e.name] = true
		if c := byName[e.name]; c != nil {
			if len(e.data) > c.Max {
				md.refuse(e.name, fmt.Sprintf("blob of %d bytes, more than the %d allowed", len(e.data), c.Max))
				continue
			}
			if c.Check != nil {
				if err := c.Check(e.version, e.data); err != nil {
					md.refuse(e.name, err.Error())
					continue
				}
			}
		}
		if md.Components == nil {
			md.Components = map[string]Blob{}
		}
		md.Components[e.name] = Blob{Version: e.version, Data: slices.Clone(e.data)}
	}
	return md, nil
}

// refuse notes a refused blob; a refused component stays refused even if
// a later entry of the same name checks.
func (md *Meta) refuse(name, why string) {
	if md.Refused == nil {
		md.Refused = map[string]string{}
	}
	if _, ok := md.Refused[name]; !ok {
		md.Refused[name] = why
	}
	delete(md.Components, name)
}

// Component returns the peer's accepted blob of a component.
func (md Meta) Component(name string) (Blob, bool) {
	b, ok := md.Components[name]
	return b, ok
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
