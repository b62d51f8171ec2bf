package tunnel

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/weft-net/weft/tunnel/tun/tuntest"
)

// fakeVTEPs is a VTEPApplier over a map, with DiffVTEPs as the kernel's.
type fakeVTEPs struct {
	mu      sync.Mutex
	have    []VTEPEntry
	applies int // calls of Apply: each reads the device back
}

func (f *fakeVTEPs) Apply(want []VTEPEntry, keep bool) (added, removed []VTEPEntry, err error) {
	if err := checkVTEPs(want); err != nil {
		return nil, nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.applies++
	add, del := DiffVTEPs(want, f.have)
	if keep {
		del = nil
	}
	next := slices.DeleteFunc(slices.Clone(f.have), func(h VTEPEntry) bool {
		if slices.Contains(del, h) {
			return true
		}
		for _, a := range add {
			if a.Addr == h.Addr || a.MAC == h.MAC {
				return true // replaced
			}
		}
		return false
	})
	f.have = append(next, add...)
	slices.SortFunc(f.have, compareVTEPEntries)
	return add, del, nil
}

func (f *fakeVTEPs) Close() error { return nil }

func (f *fakeVTEPs) entries() []VTEPEntry {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.have)
}

// newVXLANNode is a Device in the vxlan mode over the fakes, not run
// (nothing here moves packets: the kernel would).
func newVXLANNode(t *testing.T, name string, psk []byte, trusted []netip.Prefix) (*Device, *fakeVTEPs, *fakeRouting) {
	t.Helper()
	v, rt := &fakeVTEPs{}, &fakeRouting{}
	d, err := New(Config{Self: name, Mode: ModeVXLAN, MTU: 1450, Underlay: underlayOf(name), TUN: tuntest.New("weft-tun", 1450),
		Routing: rt, VTEPs: v, PSK: psk, TrustedSubnets: trusted, Logger: testLogger(t, name)})
	if err != nil {
		t.Fatalf("New(%s): %v", name, err)
	}
	t.Cleanup(func() { d.Close() })
	return d, v, rt
}

func vtepPeer(name string) Peer {
	v := VTEP{MAC: VTEPMAC(name), Addr: underlayOf(name), Port: DefaultVXLANPort, VNI: DefaultVNI}
	return Peer{Name: name, Underlay: underlayOf(name), DataPort: DefaultDataPort, Encaps: []Mode{ModeVXLAN}, VTEP: &v}
}

func entryOf(name string) VTEPEntry {
	return VTEPEntry{Addr: underlayOf(name), MAC: VTEPMAC(name), Dst: underlayOf(name)}
}

// TestVXLANEntriesFollowPeers: every vxlan peer gets its neighbour and FDB
// entry and a route via its VTEP address on the VXLAN device; while held
// (before Settle) nothing is removed, after it the entries and routes of a
// peer that is gone are.
func TestVXLANEntriesFollowPeers(t *testing.T) {
	d, v, rt := newVXLANNode(t, "a", nil, nil)
	if got := d.Encaps(); !slices.Equal(got, []Mode{ModeVXLAN}) {
		t.Fatalf("Encaps = %v, want [vxlan]", got)
	}
	if err := d.SetPeers([]Peer{vtepPeer("b"), vtepPeer("c")}); err != nil {
		t.Fatal(err)
	}
	if err := d.SetRing(ring, gatewayOf("a")); err != nil {
		t.Fatal(err)
	}
	if got, want := v.entries(), []VTEPEntry{entryOf("b"), entryOf("c")}; !slices.Equal(got, want) {
		t.Fatalf("entries = %v, want %v", got, want)
	}
	wantRoute := func(dst string, dev string, via netip.Addr) {
		t.Helper()
		for _, r := range rt.current() {
			if r.Dst.String() == dst {
				if r.Dev != dev || r.Via != via {
					t.Errorf("route %s, want dev %s via %v", r, dev, via)
				}
				return
			}
		}
		t.Errorf("no route to %s in %v", dst, rt.current())
	}
	wantRoute("10.36.0.0/14", DefaultVXLANName, underlayOf("b"))
	wantRoute("10.40.0.0/13", DefaultVXLANName, underlayOf("c"))

	// Held: c gone from the list keeps its entry.
	if err := d.SetPeers([]Peer{vtepPeer("b")}); err != nil {
		t.Fatal(err)
	}
	if got := v.entries(); len(got) != 2 {
		t.Fatalf("held, entries = %v, want b's and c's", got)
	}
	if err := d.Settle(); err != nil {
		t.Fatal(err)
	}
	if got, want := v.entries(), []VTEPEntry{entryOf("b")}; !slices.Equal(got, want) {
		t.Fatalf("settled, entries = %v, want %v", got, want)
	}
	wantRoute("10.40.0.0/13", "weft-tun", netip.Addr{})

	// b moves to another underlay address: its entry follows.
	moved := vtepPeer("b")
	moved.Underlay = netip.MustParseAddr("192.0.2.99")
	moved.VTEP.Addr = moved.Underlay
	if err := d.SetPeers([]Peer{moved}); err != nil {
		t.Fatal(err)
	}
	want := VTEPEntry{Addr: moved.Underlay, MAC: VTEPMAC("b"), Dst: moved.Underlay}
	if got := v.entries(); !slices.Equal(got, []VTEPEntry{want}) {
		t.Fatalf("after b moved, entries = %v, want %v", got, want)
	}
	wantRoute("10.36.0.0/14", DefaultVXLANName, moved.Underlay)
}

// TestVXLANPeerErrors: a peer that advertises vxlan without a VTEP, with
// another port or VNI, or two peers with one VTEP address, get no vxlan
// entries and say why in Connections.
func TestVXLANPeerErrors(t *testing.T) {
	d, v, _ := newVXLANNode(t, "a", nil, nil)
	noVTEP := vtepPeer("b")
	noVTEP.VTEP = nil
	port := vtepPeer("c")
	port.VTEP.Port = 8472
	vni := vtepPeer("d")
	vni.VTEP.VNI = 1
	twin1, twin2 := vtepPeer("e"), vtepPeer("f")
	twin2.VTEP.Addr = twin1.VTEP.Addr
	good := vtepPeer("g")
	if err := d.SetPeers([]Peer{noVTEP, port, vni, twin1, twin2, good}); err != nil {
		t.Fatal(err)
	}
	if got := v.entries(); !slices.Equal(got, []VTEPEntry{entryOf("g")}) {
		t.Errorf("entries = %v, want g's only", got)
	}
	want := map[string]string{"b": "without its VTEP", "c": "--vxlan-port", "d": "--vxlan-vni", "e": "same VTEP address", "f": "same VTEP address"}
	for _, c := range d.Connections() {
		w, ok := want[c.Peer]
		switch {
		case !ok && c.Mode != ModeVXLAN:
			t.Errorf("%s: mode %q (%s), want vxlan", c.Peer, c.Mode, c.Error)
		case ok && (c.Mode != "" || !strings.Contains(c.Error, w)):
			t.Errorf("%s: mode %q, error %q; want none, and an error with %q", c.Peer, c.Mode, c.Error, w)
		}
	}
}

func (f *fakeVTEPs) calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.applies
}

// drop takes e out of the device, as an operator's "bridge fdb del"
// would, behind weft's back.
func (f *fakeVTEPs) drop(e VTEPEntry) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.have = slices.DeleteFunc(f.have, func(h VTEPEntry) bool { return h == e })
}

// TestVXLANEntriesAppliedOnChange: SetPeers (every mesh event) reads the
// device's entries back only when the wanted ones changed; SetRing (the
// resync) always does, and repairs an entry removed behind weft's back.
func TestVXLANEntriesAppliedOnChange(t *testing.T) {
	d, v, _ := newVXLANNode(t, "a", nil, nil)
	peers := []Peer{vtepPeer("b"), vtepPeer("c")}
	if err := d.SetPeers(peers); err != nil {
		t.Fatal(err)
	}
	n := v.calls()
	for range 3 {
		if err := d.SetPeers(peers); err != nil {
			t.Fatal(err)
		}
	}
	if got := v.calls(); got != n {
		t.Errorf("SetPeers with the same peers applied the entries %d more times, want none", got-n)
	}
	if err := d.SetPeers(peers[:1]); err != nil {
		t.Fatal(err)
	}
	if got := v.calls(); got != n+1 {
		t.Errorf("SetPeers with c gone applied the entries %d times, want once", got-n)
	}
	if err := d.Settle(); err != nil {
		t.Fatal(err)
	}
	if got, want := v.entries(), []VTEPEntry{entryOf("b")}; !slices.Equal(got, want) {
		t.Fatalf("entries after Settle = %v, want %v", got, want)
	}
	v.drop(entryOf("b"))
	if err := d.SetPeers(peers[:1]); err != nil {
		t.Fatal(err)
	}
	if err := d.SetRing(ring, gatewayOf("a")); err != nil {
		t.Fatal(err)
	}
	if got, want := v.entries(), []VTEPEntry{entryOf("b")}; !slices.Equal(got, want) {
		t.Errorf("entries after SetRing = %v, want %v (the resync repairs)", got, want)
	}
}

// TestVXLANRefusedWithPassword: with a password and no trusted subnets,
// --encap vxlan is refused before anything is made, with what to do; with
// trusted subnets, only the peers inside them get vxlan (plaintext), the
// others none (never plaintext outside).
func TestVXLANRefusedWithPassword(t *testing.T) {
	psk := make([]byte, 32)
	// The seams are set: a New that got past the check would open
	// nothing in the test's own namespace.
	_, err := New(Config{Self: "a", Mode: ModeVXLAN, MTU: 1450, PSK: psk, TUN: tuntest.New("t", 1450), VTEPs: &fakeVTEPs{}})
	if !errors.Is(err, ErrVXLANUnencrypted) || !strings.Contains(err.Error(), "--trusted-subnets") {
		t.Fatalf("New(vxlan, a password) = %v, want ErrVXLANUnencrypted naming --trusted-subnets", err)
	}

	d, v, _ := newVXLANNode(t, "a", psk, []netip.Prefix{netip.MustParsePrefix("192.0.2.2/32")})
	inside, outside := vtepPeer("b"), vtepPeer("c") // 192.0.2.2 and .3
	if err := d.SetPeers([]Peer{inside, outside}); err != nil {
		t.Fatal(err)
	}
	if got := v.entries(); !slices.Equal(got, []VTEPEntry{entryOf("b")}) {
		t.Errorf("entries = %v, want b's only (c is outside the trusted subnets)", got)
	}
	for _, c := range d.Connections() {
		switch c.Peer {
		case "b":
			if c.Mode != ModeVXLAN || !c.Trusted || c.Encrypted {
				t.Errorf("b: %+v, want vxlan, trusted, unencrypted", c)
			}
		case "c":
			if c.Mode != "" || !strings.Contains(c.Error, "cannot be encrypted") {
				t.Errorf("c: %+v, want no mode: vxlan cannot be encrypted", c)
			}
		}
	}
}

func TestVTEPMAC(t *testing.T) {
	seen := map[[6]byte]string{}
	for _, name := range []string{"a", "b", "node-1", "node-2", "5a:1b:2c:3d:4e:5f"} {
		m := VTEPMAC(name)
		if m != VTEPMAC(name) {
			t.Fatalf("VTEPMAC(%q) is not stable", name)
		}
		if m[0]&1 != 0 || m[0]&2 == 0 {
			t.Errorf("VTEPMAC(%q) = % x: want unicast, locally administered", name, m)
		}
		if o, ok := seen[m]; ok {
			t.Errorf("VTEPMAC(%q) = VTEPMAC(%q)", name, o)
		}
		seen[m] = name
		v := VTEP{MAC: m, Addr: underlayOf("a"), Port: 4789, VNI: 1}
		if err := v.Validate(); err != nil {
			t.Errorf("VTEP %s: %v", v, err)
		}
	}
}

func TestVTEPValidate(t *testing.T) {
	ok := VTEP{MAC: VTEPMAC("a"), Addr: underlayOf("a"), Port: 4789, VNI: 1}
	for name, mutate := range map[string]func(*VTEP){
		"zero mac":      func(v *VTEP) { v.MAC = [6]byte{} },
		"multicast mac": func(v *VTEP) { v.MAC[0] |= 1 },
		"no address":    func(v *VTEP) { v.Addr = netip.Addr{} },
		"ipv6":          func(v *VTEP) { v.Addr = netip.MustParseAddr("fd00::1") },
		"unspecified":   func(v *VTEP) { v.Addr = netip.IPv4Unspecified() },
		"multicast":     func(v *VTEP) { v.Addr = netip.MustParseAddr("239.1.1.1") },
		"loopback":      func(v *VTEP) { v.Addr = netip.MustParseAddr("127.0.0.1") },
		"broadcast":     func(v *VTEP) { v.Addr = netip.MustParseAddr("255.255.255.255") },
		"port 0":        func(v *VTEP) { v.Port = 0 },
		"vni 0":         func(v *VTEP) { v.VNI = 0 },
		"vni too big":   func(v *VTEP) { v.VNI = MaxVNI + 1 },
	} {
		v := ok
		mutate(&v)
		if err := v.Validate(); err == nil {
			t.Errorf("%s: %s accepted", name, v)
		}
	}
}

func TestDiffVTEPs(t *testing.T) {
	b, c := entryOf("b"), entryOf("c")
	bMoved := b
	bMoved.Dst = netip.MustParseAddr("192.0.2.99")
	cNewMAC := c
	cNewMAC.MAC = VTEPMAC("c2")
	stray := VTEPEntry{MAC: VTEPMAC("x"), Dst: underlayOf("x")} // an FDB entry without neighbour
	for _, tc := range []struct {
		name       string
		want, have []VTEPEntry
		add, del   []VTEPEntry
	}{
		{"empty", nil, nil, nil, nil},
		{"add", []VTEPEntry{b, c}, nil, []VTEPEntry{b, c}, nil},
		{"same", []VTEPEntry{c, b, b}, []VTEPEntry{b, c}, nil, nil},
		{"gone", []VTEPEntry{b}, []VTEPEntry{b, c}, nil, []VTEPEntry{c}},
		{"moved is replaced, not removed", []VTEPEntry{bMoved}, []VTEPEntry{b}, []VTEPEntry{bMoved}, nil},
		{"new MAC replaces the neighbour", []VTEPEntry{cNewMAC}, []VTEPEntry{c}, []VTEPEntry{cNewMAC}, nil},
		{"stray half entry removed", []VTEPEntry{b}, []VTEPEntry{b, stray}, nil, []VTEPEntry{stray}},
	} {
		add, del := DiffVTEPs(tc.want, tc.have)
		if !slices.Equal(add, tc.add) || !slices.Equal(del, tc.del) {
			t.Errorf("%s: DiffVTEPs = +%v -%v, want +%v -%v", tc.name, add, del, tc.add, tc.del)
		}
	}
	if err := checkVTEPs([]VTEPEntry{b, bMoved}); err == nil {
		t.Error("checkVTEPs accepted one address with two destinations")
	}
}

func TestKeptVia(t *testing.T) {
	vx := DefaultVXLANName
	via := underlayOf("b")
	kept := []Route{
		{Dst: netip.MustParsePrefix("10.36.0.0/15"), Dev: vx, Via: via},
		{Dst: netip.MustParsePrefix("10.38.0.0/15"), Dev: vx, Via: via},
	}
	if got, ok := keptVia(kept, vx, ring, "b"); !ok || got != via {
		t.Errorf("keptVia(b) = %v, %v; want %v", got, ok, via)
	}
	if _, ok := keptVia(kept[:1], vx, ring, "b"); ok {
		t.Error("keptVia with half of b's range covered: want false")
	}
	if _, ok := keptVia(kept, vx, ring, "c"); ok {
		t.Error("keptVia(c) without any route: want false")
	}
	split := slices.Clone(kept)
	split[1].Via = underlayOf("c")
	if _, ok := keptVia(split, vx, ring, "b"); ok {
		t.Error("keptVia with two gateways for b: want false")
	}
	big := []Route{{Dst: netip.MustParsePrefix("10.32.0.0/12"), Dev: vx, Via: via}}
	if got, ok := keptVia(big, vx, ring, "b"); !ok || got != via {
		t.Errorf("keptVia(b) under one wider route = %v, %v", got, ok)
	}
}
