package tunnel

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }

func TestPrefixesOf(t *testing.T) {
	for _, tc := range []struct {
		first, last string
		want        []string
	}{
		{"10.32.0.0", "10.47.255.255", []string{"10.32.0.0/12"}},
		{"10.32.0.0", "10.32.0.0", []string{"10.32.0.0/32"}},
		{"10.32.0.1", "10.32.0.6", []string{"10.32.0.1/32", "10.32.0.2/31", "10.32.0.4/31", "10.32.0.6/32"}},
		{"10.32.64.0", "10.32.191.255", []string{"10.32.64.0/18", "10.32.128.0/18"}},
		{"0.0.0.0", "255.255.255.255", []string{"0.0.0.0/0"}},
		{"255.255.255.254", "255.255.255.255", []string{"255.255.255.254/31"}},
		{"10.0.0.2", "10.0.0.1", nil},
	} {
		var got []string
		for _, p := range PrefixesOf(mustAddr(tc.first), mustAddr(tc.last)) {
			got = append(got, p.String())
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("PrefixesOf(%s, %s) = %v, want %v", tc.first, tc.last, got, tc.want)
		}
	}
}

// TestPrefixesOfModel checks random ranges against the naive model: the
// prefixes cover exactly first..last, in order, each aligned, and no two
// neighbours could be merged into one.
func TestPrefixesOfModel(t *testing.T) {
	seed := uint64(rand.Int64())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	for range 2000 {
		a := rng.Uint32() >> rng.IntN(32)
		b := a + rng.Uint32()>>rng.IntN(32)
		if b < a {
			b = 0xffffffff
		}
		ps := PrefixesOf(addrOf(a), addrOf(b))
		next := uint64(a)
		for i, p := range ps {
			if u32(p.Addr()) != uint32(next) || p.Masked() != p {
				t.Fatalf("%s-%s: prefix %d %s does not start at %s or is not aligned", addrOf(a), addrOf(b), i, p, addrOf(uint32(next)))
			}
			next += uint64(1) << (32 - p.Bits())
			// Two neighbours of one size, the first aligned to twice the
			// size, make one prefix: greedy splitting never leaves that.
			if i > 0 && p.Bits() > 0 && ps[i-1].Bits() == p.Bits() &&
				netip.PrefixFrom(ps[i-1].Addr(), p.Bits()-1).Masked().Addr() == ps[i-1].Addr() {
				t.Fatalf("%s-%s: %s and %s could be one prefix", addrOf(a), addrOf(b), ps[i-1], p)
			}
		}
		if next != uint64(b)+1 {
			t.Fatalf("%s-%s: prefixes end at %d, want %d", addrOf(a), addrOf(b), next, uint64(b)+1)
		}
	}
}

func TestWantRoutes(t *testing.T) {
	src := mustAddr("10.32.0.1")
	tunTarget := func(string) (string, netip.Addr) { return "weft-tun", netip.Addr{} }
	ranges := []OwnedRange{
		{mustAddr("10.32.0.0"), mustAddr("10.35.255.255"), "a"},
		{mustAddr("10.36.0.0"), mustAddr("10.39.255.255"), "b"},
		{mustAddr("10.40.0.0"), mustAddr("10.43.255.255"), "c"},
		{mustAddr("10.44.0.0"), mustAddr("10.47.255.255"), "a"},
	}
	for _, tc := range []struct {
		name   string
		self   string
		target RouteTarget
		want   []Route
	}{
		{"udp joins neighbours of different owners", "a", tunTarget, []Route{
			{Dst: pfx("10.36.0.0/14"), Dev: "weft-tun", Src: src},
			{Dst: pfx("10.40.0.0/14"), Dev: "weft-tun", Src: src},
		}},
		{"joined into one prefix where aligned", "c", tunTarget, []Route{
			{Dst: pfx("10.32.0.0/13"), Dev: "weft-tun", Src: src},
			{Dst: pfx("10.44.0.0/14"), Dev: "weft-tun", Src: src},
		}},
		{"own ranges split the rest", "b", tunTarget, []Route{
			{Dst: pfx("10.32.0.0/14"), Dev: "weft-tun", Src: src},
			{Dst: pfx("10.40.0.0/13"), Dev: "weft-tun", Src: src},
		}},
		{"kernel ipip has a gateway per owner", "a", func(p string) (string, netip.Addr) {
			if p == "b" {
				return "weft-ipip", mustAddr("192.168.0.2")
			}
			return "weft-ipip", mustAddr("192.168.0.3")
		}, []Route{
			{Dst: pfx("10.36.0.0/14"), Dev: "weft-ipip", Via: mustAddr("192.168.0.2"), Src: src},
			{Dst: pfx("10.40.0.0/14"), Dev: "weft-ipip", Via: mustAddr("192.168.0.3"), Src: src},
		}},
		{"mixed devices", "a", func(p string) (string, netip.Addr) {
			if p == "b" {
				return "weft-ipip", mustAddr("192.168.0.2")
			}
			return "weft-tun", netip.Addr{}
		}, []Route{
			{Dst: pfx("10.36.0.0/14"), Dev: "weft-ipip", Via: mustAddr("192.168.0.2"), Src: src},
			{Dst: pfx("10.40.0.0/14"), Dev: "weft-tun", Src: src},
		}},
		{"owner of nothing", "z", tunTarget, []Route{
			{Dst: pfx("10.32.0.0/12"), Dev: "weft-tun", Src: src},
		}},
	} {
		got := WantRoutes(ranges, tc.self, src, tc.target)
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s:\n got %v\nwant %v", tc.name, got, tc.want)
		}
	}
	if got := WantRoutes(nil, "a", src, tunTarget); got != nil {
		t.Errorf("no ranges: %v", got)
	}
}

func TestDiffRoutes(t *testing.T) {
	src := mustAddr("10.32.0.1")
	r := func(p, dev string) Route { return Route{Dst: pfx(p), Dev: dev, Src: src} }
	via := func(p, gw string) Route {
		return Route{Dst: pfx(p), Dev: "weft-ipip", Via: mustAddr(gw), Src: src}
	}
	for _, tc := range []struct {
		name            string
		want, have      []Route
		wantAdd, wantDl []Route
	}{
		{"nothing", nil, nil, nil, nil},
		{"first start", []Route{r("10.36.0.0/14", "weft-tun")}, nil, []Route{r("10.36.0.0/14", "weft-tun")}, nil},
		{"converged", []Route{r("10.36.0.0/14", "weft-tun")}, []Route{r("10.36.0.0/14", "weft-tun")}, nil, nil},
		{"stale removed at start", nil, []Route{r("10.36.0.0/14", "weft-tun"), via("10.40.0.0/14", "192.168.0.3")},
			nil, []Route{r("10.36.0.0/14", "weft-tun"), via("10.40.0.0/14", "192.168.0.3")}},
		{"range withdrawn (now ours)", []Route{r("10.36.0.0/14", "weft-tun")},
			[]Route{r("10.36.0.0/14", "weft-tun"), r("10.40.0.0/14", "weft-tun")},
			nil, []Route{r("10.40.0.0/14", "weft-tun")}},
		{"range split by a donation", []Route{r("10.36.0.0/15", "weft-tun")},
			[]Route{r("10.36.0.0/14", "weft-tun")},
			[]Route{r("10.36.0.0/15", "weft-tun")}, []Route{r("10.36.0.0/14", "weft-tun")}},
		{"owner moved: replaced, not removed", []Route{via("10.36.0.0/14", "192.168.0.9")},
			[]Route{via("10.36.0.0/14", "192.168.0.2")},
			[]Route{via("10.36.0.0/14", "192.168.0.9")}, nil},
		{"device changed: replaced", []Route{r("10.36.0.0/14", "weft-tun")},
			[]Route{via("10.36.0.0/14", "192.168.0.2")},
			[]Route{r("10.36.0.0/14", "weft-tun")}, nil},
		{"src changed", []Route{r("10.36.0.0/14", "weft-tun")},
			[]Route{{Dst: pfx("10.36.0.0/14"), Dev: "weft-tun", Src: mustAddr("10.33.0.1")}},
			[]Route{r("10.36.0.0/14", "weft-tun")}, nil},
		{"duplicates in want", []Route{r("10.36.0.0/14", "weft-tun"), r("10.36.0.0/14", "weft-tun")}, nil,
			[]Route{r("10.36.0.0/14", "weft-tun")}, nil},
	} {
		add, del := DiffRoutes(tc.want, tc.have)
		if !slices.Equal(add, tc.wantAdd) || !slices.Equal(del, tc.wantDl) {
			t.Errorf("%s:\n add %v\nwant %v\n del %v\nwant %v", tc.name, add, tc.wantAdd, del, tc.wantDl)
		}
	}
}

func TestCheckWant(t *testing.T) {
	a := Route{Dst: pfx("10.36.0.0/14"), Dev: "weft-tun"}
	b := Route{Dst: pfx("10.36.0.0/14"), Dev: "weft-ipip"}
	if err := checkWant([]Route{a, a}); err != nil {
		t.Errorf("duplicate: %v", err)
	}
	if err := checkWant([]Route{a, b}); err == nil {
		t.Error("two targets for one destination accepted")
	}
}

func TestTable(t *testing.T) {
	tb, err := NewTable([]OwnedRange{
		{mustAddr("10.40.0.0"), mustAddr("10.47.255.255"), "c"},
		{mustAddr("10.32.0.0"), mustAddr("10.35.255.255"), "a"},
		{mustAddr("10.36.0.0"), mustAddr("10.39.255.255"), "b"},
	})
	if err != nil {
		t.Fatal(err)
	}
	for addr, want := range map[string]string{
		"10.32.0.0": "a", "10.35.255.255": "a", "10.36.0.0": "b", "10.39.1.1": "b",
		"10.47.255.255": "c", "10.31.255.255": "", "10.48.0.0": "", "0.0.0.0": "", "255.255.255.255": "",
	} {
		got, ok := tb.Owner(mustAddr(addr))
		if got != want || ok != (want != "") {
			t.Errorf("Owner(%s) = %q, %v; want %q", addr, got, ok, want)
		}
	}
	var empty *Table
	if _, ok := empty.Owner(mustAddr("10.32.0.1")); ok {
		t.Error("nil table owns something")
	}
	for _, bad := range [][]OwnedRange{
		{{mustAddr("10.32.0.0"), mustAddr("10.35.255.255"), "a"}, {mustAddr("10.35.0.0"), mustAddr("10.36.0.0"), "b"}},
		{{mustAddr("10.32.0.9"), mustAddr("10.32.0.1"), "a"}},
		{{mustAddr("::1"), mustAddr("::2"), "a"}},
		{{mustAddr("10.32.0.0"), mustAddr("10.32.0.1"), ""}},
	} {
		if _, err := NewTable(bad); err == nil {
			t.Errorf("NewTable(%v) accepted", bad)
		}
	}
}

func TestChooseMode(t *testing.T) {
	both := []Mode{ModeUDP, ModeIPIP}
	kernel := []Mode{ModeIPIP, ModeUDP}
	for _, tc := range []struct {
		name       string
		configured Mode
		local      []Mode
		remote     []Mode
		want       Mode
	}{
		{"auto, both have both: local order (userspace)", ModeAuto, both, []Mode{ModeIPIP, ModeUDP}, ModeUDP},
		{"auto, both have both: local order (kernel ipip)", ModeAuto, kernel, []Mode{ModeUDP, ModeIPIP}, ModeIPIP},
		{"auto, peer only udp", ModeAuto, kernel, []Mode{ModeUDP}, ModeUDP},
		{"auto, peer only ipip", ModeAuto, both, []Mode{ModeIPIP}, ModeIPIP},
		{"auto, node only udp, peer only ipip", ModeAuto, []Mode{ModeUDP}, []Mode{ModeIPIP}, ""},
		{"auto, peer advertises nothing: udp", ModeAuto, kernel, nil, ModeUDP},
		{"udp, peer has udp", ModeUDP, both, []Mode{ModeIPIP, ModeUDP}, ModeUDP},
		{"udp, peer only ipip", ModeUDP, both, []Mode{ModeIPIP}, ""},
		{"ipip, peer has it", ModeIPIP, both, both, ModeIPIP},
		{"ipip, node cannot", ModeIPIP, []Mode{ModeUDP}, both, ""},
		{"ipip, peer advertises nothing", ModeIPIP, both, nil, ""},
	} {
		got, err := ChooseMode(tc.configured, tc.local, tc.remote)
		if got != tc.want || (err != nil) != (tc.want == "") {
			t.Errorf("%s: ChooseMode = %q, %v; want %q", tc.name, got, err, tc.want)
		}
	}
}

func TestParseEncaps(t *testing.T) {
	got := ParseEncaps([]string{"ipip", "UDP", "wireguard", "udp"})
	if !slices.Equal(got, []Mode{ModeIPIP, ModeUDP}) {
		t.Errorf("ParseEncaps = %v", got)
	}
}

// TestTableOwnerMatchesScan: in random tables (gaps between ranges,
// single addresses, ranges at 0.0.0.0 and 255.255.255.255), Owner agrees
// with a scan of the ranges at every range's bounds, beside them, and at
// random addresses.
func TestTableOwnerMatchesScan(t *testing.T) {
	for seed := range uint64(300) {
		r := rand.New(rand.NewPCG(seed, 7))
		var rs []OwnedRange
		next := uint64(0)
		if r.IntN(2) == 0 {
			next = uint64(r.Uint32N(1 << 20))
		}
		for n := r.IntN(40); len(rs) < n && next <= 0xffffffff; {
			size := uint64(1)
			if r.IntN(3) > 0 {
				size = uint64(1) << r.IntN(24)
			}
			last := min(next+size-1, 0xffffffff)
			rs = append(rs, OwnedRange{addrOf(uint32(next)), addrOf(uint32(last)), fmt.Sprintf("p%d", len(rs))})
			next = last + 1 + uint64(r.IntN(3))*uint64(r.Uint32N(1<<22))
		}
		r.Shuffle(len(rs), func(i, j int) { rs[i], rs[j] = rs[j], rs[i] })
		tb, err := NewTable(rs)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		scan := func(k uint32) (string, bool) {
			for _, x := range rs {
				if u32(x.First) <= k && k <= u32(x.Last) {
					return x.Peer, true
				}
			}
			return "", false
		}
		var probes []uint32
		for _, x := range rs {
			f, l := u32(x.First), u32(x.Last)
			probes = append(probes, f, l, f-1, l+1)
		}
		for range 50 {
			probes = append(probes, r.Uint32())
		}
		for _, k := range append(probes, 0, 0xffffffff) {
			got, ok := tb.Owner(addrOf(k))
			want, wok := scan(k)
			if got != want || ok != wok {
				t.Fatalf("seed %d: Owner(%s) = %q, %v; the scan says %q, %v (ranges %v)", seed, addrOf(k), got, ok, want, wok, rs)
			}
		}
	}
}
