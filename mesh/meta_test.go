package mesh

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/memberlist"
)

// The tests' tunnel component: the router's record (router/tunnelmeta.go)
// in main's version-1 layout, written again here so that the mesh's tests
// do not depend on the router: dataPort:2 nEncaps:1 (len:1 encap)* keyLen:1 key.

func testTunnel(port uint16, encaps ...string) Component {
	return testTunnelKey(port, nil, encaps...)
}

func testTunnelKey(port uint16, key []byte, encaps ...string) Component {
	b := binary.BigEndian.AppendUint16(nil, port)
	b = append(b, byte(len(encaps)))
	for _, e := range encaps {
		b = appendShort(b, []byte(e))
	}
	b = appendShort(b, key)
	return Component{Name: "tunnel", Version: LegacyVersion, Data: b, Max: 204,
		Check: func(v uint8, data []byte) error {
			if v != LegacyVersion {
				return fmt.Errorf("version %d", v)
			}
			n, err := testTunnelSplit(data)
			if err == nil && n != len(data) {
				err = errors.New("trailing bytes")
			}
			return err
		},
		Legacy: testTunnelSplit}
}

func testTunnelSplit(b []byte) (int, error) {
	r := reader{b: b}
	r.uint16()
	n := int(r.byte())
	if n > 8 {
		return 0, errors.New("too many encapsulations")
	}
	for range n {
		e := r.short()
		if len(e) == 0 || bytes.ContainsFunc(e, func(c rune) bool { return c < 'a' || c > 'z' }) {
			if r.err == nil {
				return 0, fmt.Errorf("bad encapsulation %q", e)
			}
		}
	}
	r.short()
	if r.err != nil {
		return 0, r.err
	}
	return len(b) - len(r.b), nil
}

// ipamTest is an opaque component that accepts blobs starting with 'i'.
func ipamTest(data string) Component {
	return Component{Name: "ipam", Version: 3, Data: []byte(data), Max: 32,
		Check: func(v uint8, d []byte) error {
			if len(d) == 0 || d[0] != 'i' {
				return errors.New("not an ipam blob")
			}
			return nil
		}}
}

// mainMeta, mainEncode and mainDecode are main's version-1 metadata codec
// (mesh/meta.go before components), kept to show a rolling upgrade.
type mainMeta struct {
	Nickname  string
	DataPort  uint16
	Encaps    []string
	PublicKey []byte
	Version   string
}

func mainEncode(md mainMeta) []byte {
	b := []byte{1}
	b = appendShort(b, []byte(md.Nickname))
	b = binary.BigEndian.AppendUint16(b, md.DataPort)
	b = append(b, byte(len(md.Encaps)))
	for _, e := range md.Encaps {
		b = appendShort(b, []byte(e))
	}
	b = appendShort(b, md.PublicKey)
	return appendShort(b, []byte(md.Version))
}

func mainDecode(b []byte) (mainMeta, error) {
	var md mainMeta
	if len(b) == 0 || b[0] < 1 {
		return md, errors.New("bad version")
	}
	r := reader{b: b[1:]}
	md.Nickname = string(r.short())
	md.DataPort = r.uint16()
	n := int(r.byte())
	for i := 0; i < n && r.err == nil; i++ {
		md.Encaps = append(md.Encaps, string(r.short()))
	}
	if key := r.short(); len(key) > 0 {
		md.PublicKey = append([]byte(nil), key...)
	}
	md.Version = string(r.short())
	if r.err != nil {
		return mainMeta{}, r.err
	}
	if b[0] == 1 && len(r.b) > 0 {
		return mainMeta{}, errors.New("trailing bytes")
	}
	return md, nil
}

func TestMetaRoundTrip(t *testing.T) {
	key := bytes.Repeat([]byte{7}, 32)
	for _, tc := range []struct {
		nick, version string
		cs            []Component
	}{
		{"", "", nil},
		{"host1", "v1.2.3", []Component{testTunnel(6784, "udp", "ipip")}},
		{"ünïcode", "v2", []Component{ipamTest("ipam!"), testTunnelKey(6784, key, "udp")}},
		{"h", "v", []Component{ipamTest("i")}},
	} {
		b, err := encodeMeta(tc.nick, tc.version, tc.cs)
		if err != nil {
			t.Fatal(err)
		}
		got, err := decodeMeta(b, tc.cs)
		if err != nil {
			t.Fatalf("decode %+v: %v", tc, err)
		}
		want := Meta{Nickname: tc.nick, Version: tc.version}
		for _, c := range tc.cs {
			if want.Components == nil {
				want.Components = map[string]Blob{}
			}
			want.Components[c.Name] = Blob{Version: c.Version, Data: c.Data}
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("round trip: got %+v, want %+v", got, want)
		}
	}
}

// A rolling upgrade, one way: a router of main publishes version 1; this
// mesh reads its tunnel fields back into the tunnel's blob.
func TestMetaFromMain(t *testing.T) {
	key := bytes.Repeat([]byte{9}, 32)
	b := mainEncode(mainMeta{Nickname: "old", DataPort: 7000, Encaps: []string{"udp", "ipip"}, PublicKey: key, Version: "v0.9"})
	tun := testTunnelKey(7000, key, "udp", "ipip")
	md, err := decodeMeta(b, []Component{tun, ipamTest("i")})
	if err != nil {
		t.Fatal(err)
	}
	want := Meta{Nickname: "old", Version: "v0.9", Components: map[string]Blob{"tunnel": {Version: LegacyVersion, Data: tun.Data}}}
	if !reflect.DeepEqual(md, want) {
		t.Errorf("main's metadata read as %+v, want %+v", md, want)
	}
	// Main's record is refused whole when the tunnel fields do not hold
	// together (main refused it too), and so is trailing junk.
	if _, err := decodeMeta(append(bytes.Clone(b), 0), []Component{tun}); err == nil {
		t.Error("version 1 with trailing bytes accepted")
	}
	if _, err := decodeMeta([]byte{1, 1, 'h', 0, 1, 9}, []Component{tun}); err == nil {
		t.Error("version 1 with a truncated tunnel record accepted")
	}
}

// The other way: main's decoder reads this mesh's version 2 and finds the
// tunnel's fields where it always did, ignoring the components after them.
func TestMetaToMain(t *testing.T) {
	key := bytes.Repeat([]byte{5}, 32)
	b, err := encodeMeta("new", "v1.0", []Component{ipamTest("ipam-blob"), testTunnelKey(6784, key, "udp"), {Name: "other", Version: 1, Data: []byte{1, 2, 3}, Max: 3}})
	if err != nil {
		t.Fatal(err)
	}
	md, err := mainDecode(b)
	if err != nil {
		t.Fatalf("main's decoder refuses version 2: %v", err)
	}
	want := mainMeta{Nickname: "new", DataPort: 6784, Encaps: []string{"udp"}, PublicKey: key, Version: "v1.0"}
	if !reflect.DeepEqual(md, want) {
		t.Errorf("main read %+v, want %+v", md, want)
	}
}

// Unknown components are kept and ignored; a blob that its component
// refuses is refused for that component only; so is one over the bound
// or one that appears twice.
func TestMetaComponentsRefusedAlone(t *testing.T) {
	tun := testTunnel(6784, "udp")
	mine := []Component{tun, ipamTest("i")}
	b, err := encodeMeta("h", "v", []Component{tun, {Name: "ipam", Version: 3, Data: []byte("bad"), Max: 3}, {Name: "future", Version: 7, Data: []byte("?"), Max: 1}})
	if err != nil {
		t.Fatal(err)
	}
	md, err := decodeMeta(b, mine)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := md.Component("tunnel"); !ok {
		t.Error("the tunnel's blob was dropped with the ipam one")
	}
	if _, ok := md.Component("ipam"); ok || !strings.Contains(md.Refused["ipam"], "not an ipam blob") {
		t.Errorf("ipam: %+v, want refused with its check's reason", md)
	}
	if f, ok := md.Component("future"); !ok || f.Version != 7 || string(f.Data) != "?" {
		t.Errorf("unknown component not kept: %+v", md)
	}

	big, _ := encodeMeta("h", "v", []Component{tun, {Name: "ipam", Version: 3, Data: []byte("i" + strings.Repeat("x", 40)), Max: 41}})
	if md, err := decodeMeta(big, mine); err != nil || !strings.Contains(md.Refused["ipam"], "more than the 32 allowed") || md.Components["tunnel"].Data == nil {
		t.Errorf("oversized ipam blob: %+v, %v", md, err)
	}

	// Two ipam entries: hand-made (encodeMeta refuses the registration).
	twice := []byte{2, 1, 'h'}
	twice = append(twice, tun.Data...)
	twice = appendShort(twice, []byte("v"))
	twice = append(twice, 2)
	for range 2 {
		twice = appendShort(twice, []byte("ipam"))
		twice = append(twice, 3)
		twice = appendShort(twice, []byte("i"))
	}
	twice = append(twice, byte(len(tun.Data)))
	if md, err := decodeMeta(twice, mine); err != nil || md.Refused["ipam"] == "" || md.Components["ipam"].Data != nil || md.Components["tunnel"].Data == nil {
		t.Errorf("ipam twice: %+v, %v", md, err)
	}

	// A tunnel blob that does not decode, in the legacy place of a
	// version 2 record: the tunnel is refused, ipam still used.
	badTun := []byte{2, 1, 'h', 0xff}
	badTun = appendShort(badTun, []byte("v"))
	badTun = append(badTun, 1)
	badTun = appendShort(badTun, []byte("ipam"))
	badTun = append(badTun, 3)
	badTun = appendShort(badTun, []byte("i"))
	badTun = append(badTun, 1)
	md, err = decodeMeta(badTun, mine)
	if err != nil || md.Refused["tunnel"] == "" || md.Components["ipam"].Data == nil {
		t.Errorf("bad tunnel blob: %+v, %v", md, err)
	}
}

// The largest metadata the tunnel's limits allow, with the longest
// nickname and version, fits memberlist's 512 bytes; what is over is
// refused at New with ErrMetaTooLarge.
func TestMetaMaxFits(t *testing.T) {
	encaps := make([]string, 8)
	for i := range encaps {
		encaps[i] = strings.Repeat("e", 16)
	}
	tun := testTunnelKey(65535, make([]byte, 64), encaps...)
	if len(tun.Data) != tun.Max {
		t.Fatalf("largest tunnel record %d bytes, bound %d", len(tun.Data), tun.Max)
	}
	b, err := encodeMeta(strings.Repeat("n", MaxNicknameLen), strings.Repeat("v", MaxVersionLen), []Component{tun})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("largest metadata with the tunnel alone: %d bytes", len(b))
	room := memberlist.MetaMaxSize - len(b)
	huge := Component{Name: "x", Version: 1, Data: make([]byte, 255), Max: 255}
	if _, err := encodeMeta(strings.Repeat("n", MaxNicknameLen), "v", []Component{tun, huge}); !errors.Is(err, ErrMetaTooLarge) {
		t.Errorf("metadata over the limit (room %d, blob 255): %v, want ErrMetaTooLarge", room, err)
	}
}

func TestDecodeMetaRejects(t *testing.T) {
	tun := testTunnel(6784, "udp")
	mine := []Component{tun}
	good, _ := encodeMeta("h", "v", []Component{tun, {Name: "z", Version: 1, Data: []byte{1}, Max: 1}})
	for name, b := range map[string][]byte{
		"empty":               nil,
		"version 0":           {0},
		"truncated":           good[:len(good)-1],
		"trailing":            append(bytes.Clone(good), 0),
		"legacy too long":     {2, 0, 1, 0, 0, 200},
		"too many components": {2, 0, 0, 9, 0},
		"bad component name":  {2, 0, 0, 1, 1, 'Z', 1, 0, 0},
		"control char":        {2, 1, '\n', 0, 0, 0},
		"huge":                make([]byte, 600),
	} {
		if md, err := decodeMeta(b, mine); err == nil {
			t.Errorf("%s: decoded %+v", name, md)
		}
	}
	// A legacy record to a mesh that registers no legacy component is
	// skipped; the listed components are kept.
	if md, err := decodeMeta(good, nil); err != nil || len(md.Components) != 1 || md.Components["z"].Data == nil {
		t.Errorf("legacy record without a legacy component: %+v, %v", md, err)
	}
	// Later versions read as 2.
	newer := append([]byte{3}, good[1:]...)
	if _, err := decodeMeta(newer, mine); err != nil {
		t.Errorf("newer metadata version: %v", err)
	}
}

// FuzzDecodeMeta: decoding never panics; what it accepts keeps only blobs
// that pass their component's check and bound, never a refused one, and
// encodes back to the same components.
func FuzzDecodeMeta(f *testing.F) {
	mine := []Component{testTunnel(6784, "udp"), ipamTest("i")}
	good, _ := encodeMeta("host1", "v1", []Component{testTunnel(6784, "udp", "ipip"), ipamTest("ipam"), {Name: "y", Version: 2, Data: []byte("x"), Max: 1}})
	f.Add(good)
	f.Add(mainEncode(mainMeta{Nickname: "h", DataPort: 1, Encaps: []string{"udp"}, Version: "v"}))
	f.Add([]byte{1})
	f.Add([]byte{2, 0, 0, 0, 0, 0, 0, 9})
	f.Fuzz(func(t *testing.T, b []byte) {
		md, err := decodeMeta(b, mine)
		if err != nil {
			return
		}
		byName := map[string]Component{}
		for _, c := range mine {
			byName[c.Name] = c
		}
		var again []Component
		for _, name := range slices.Sorted(maps.Keys(md.Components)) {
			blob := md.Components[name]
			if _, refused := md.Refused[name]; refused {
				t.Fatalf("%x: %q both accepted and refused", b, name)
			}
			c, known := byName[name]
			if known {
				if len(blob.Data) > c.Max || c.Check(blob.Version, blob.Data) != nil {
					t.Fatalf("%x: %q accepted a blob its component refuses: %+v", b, name, blob)
				}
				c.Version, c.Data = blob.Version, blob.Data
				if blob.Version != LegacyVersion {
					c.Legacy = nil
				}
			} else {
				c = Component{Name: name, Version: blob.Version, Data: blob.Data, Max: MaxComponentData}
			}
			again = append(again, c)
		}
		enc, err := encodeMeta(md.Nickname, md.Version, again)
		if errors.Is(err, ErrMetaTooLarge) {
			return // a version-1 record near the limit grows by two bytes
		}
		if err != nil {
			t.Fatalf("accepted %x as %+v, which does not encode: %v", b, md, err)
		}
		back, err := decodeMeta(enc, mine)
		if err != nil || !reflect.DeepEqual(back.Components, md.Components) || back.Nickname != md.Nickname || back.Version != md.Version {
			t.Fatalf("round trip of %+v: %+v, %v", md, back, err)
		}
	})
}

// Two live meshes: node2 publishes an ipam blob that node1's ipam
// component refuses, and a component node1 does not know. node1 keeps
// node2 (alive, its tunnel blob used, the unknown one kept), refuses the
// ipam blob alone, logs it once with the component's name, and counts it.
func TestMeshRefusesOneComponent(t *testing.T) {
	c := newCluster(t)
	p1 := c.start(1, Config{Components: []Component{testTunnel(6784, "udp"), ipamTest("i1")}})
	p2 := c.start(2, Config{Peers: []string{addrOf(1)}, Components: []Component{
		testTunnel(7000, "udp"),
		{Name: "ipam", Version: 3, Data: []byte("not ipam"), Max: 32},
		{Name: "future", Version: 1, Data: []byte{1}, Max: 1},
	}})
	defer closeAll(t, p1, p2)
	waitStates(t, converge, []*peer{p1, p2}, aliveAll([]*peer{p1, p2}))
	q, _ := p1.m.Peer("node2")
	if q.MetaError != "" || !strings.Contains(q.Meta.Refused["ipam"], "not an ipam blob") {
		t.Fatalf("node2 as node1 sees it: %+v", q)
	}
	if b, ok := q.Meta.Component("tunnel"); !ok || !bytes.Equal(b.Data, testTunnel(7000, "udp").Data) {
		t.Errorf("node2's tunnel blob: %+v", q.Meta)
	}
	if _, ok := q.Meta.Component("future"); !ok {
		t.Errorf("node2's unknown component not kept: %+v", q.Meta)
	}
	waitFor(t, converge, "the refusal in node1's log", func() bool {
		return p1.log.contains(`its \"ipam\" metadata is refused (not an ipam blob)`)
	})
	if n := strings.Count(p1.log.String(), `its \"ipam\" metadata is refused`); n != 1 {
		t.Errorf("the refusal logged %d times, want once", n)
	}
	// node2 reads node1's ipam blob: it registers no ipam component, so
	// the blob is kept and not checked.
	if q, _ := p2.m.Peer("node1"); q.Meta.Refused != nil || string(q.Meta.Components["ipam"].Data) != "i1" {
		t.Errorf("node1 as node2 sees it: %+v", q.Meta)
	}
}
