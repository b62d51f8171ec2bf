package bridge

import (
	"bytes"
	"net"
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

func validConfig() Config {
	return Config{
		Name:     "weft",
		MTU:      1376,
		Gateway:  netip.MustParsePrefix("10.32.0.1/12"),
		PodRange: netip.MustParsePrefix("10.32.0.0/12"),
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name    string
		change  func(*Config)
		wantErr string // substring; "" means valid
	}{
		{"valid", func(*Config) {}, ""},
		{"gateway with a longer prefix", func(c *Config) { c.Gateway = netip.MustParsePrefix("10.32.0.1/24") }, ""},
		{"15 character name", func(c *Config) { c.Name = "abcdefghijklmno" }, ""},
		{"empty name", func(c *Config) { c.Name = "" }, "bridge name is empty"},
		{"16 character name", func(c *Config) { c.Name = "abcdefghijklmnop" }, "at most 15"},
		{"name with slash", func(c *Config) { c.Name = "a/b" }, "contains"},
		{"name with space", func(c *Config) { c.Name = "a b" }, "contains"},
		{"name dot", func(c *Config) { c.Name = "." }, "not allowed"},
		{"MTU too small", func(c *Config) { c.MTU = 67 }, "MTU 67 is out of range"},
		{"MTU zero", func(c *Config) { c.MTU = 0 }, "MTU 0 is out of range"},
		{"MTU too large", func(c *Config) { c.MTU = 65536 }, "MTU 65536 is out of range"},
		{"MTU min", func(c *Config) { c.MTU = 68 }, ""},
		{"MTU max", func(c *Config) { c.MTU = 65535 }, ""},
		{"no pod range", func(c *Config) { c.PodRange = netip.Prefix{} }, "pod range is not set"},
		{"IPv6 pod range", func(c *Config) { c.PodRange = netip.MustParsePrefix("fd00::/64") }, "not IPv4"},
		{"4in6 pod range", func(c *Config) { c.PodRange = netip.MustParsePrefix("::ffff:10.32.0.0/108") }, "not IPv4"},
		{"pod range /0", func(c *Config) { c.PodRange = netip.MustParsePrefix("0.0.0.0/0") }, "between /1 and /30"},
		{"pod range /31", func(c *Config) { c.PodRange = netip.MustParsePrefix("10.32.0.0/31") }, "between /1 and /30"},
		{"pod range host bits", func(c *Config) { c.PodRange = netip.MustParsePrefix("10.32.0.1/12") }, "did you mean 10.32.0.0/12"},
		{"no gateway", func(c *Config) { c.Gateway = netip.Prefix{} }, "gateway is not set"},
		{"IPv6 gateway", func(c *Config) { c.Gateway = netip.MustParsePrefix("fd00::1/64") }, "not IPv4"},
		{"gateway outside range", func(c *Config) { c.Gateway = netip.MustParsePrefix("10.48.0.1/12") }, "outside the pod range"},
		{"gateway shorter prefix", func(c *Config) { c.Gateway = netip.MustParsePrefix("10.32.0.1/8") }, "shorter prefix"},
		{"gateway network address", func(c *Config) { c.Gateway = netip.MustParsePrefix("10.32.0.0/12") }, "network address"},
		{"gateway broadcast address", func(c *Config) { c.Gateway = netip.MustParsePrefix("10.47.255.255/12") }, "broadcast address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := validConfig()
			tt.change(&cfg)
			err := cfg.Validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("Validate() = %v, want nil", err)
			case tt.wantErr != "" && err == nil:
				t.Fatalf("Validate() = nil, want an error containing %q", tt.wantErr)
			case tt.wantErr != "" && !strings.Contains(err.Error(), tt.wantErr):
				t.Fatalf("Validate() = %q, want it to contain %q", err, tt.wantErr)
			}
		})
	}
}

func TestStableMAC(t *testing.T) {
	a, b := StableMAC("weft"), StableMAC("weft")
	if !bytes.Equal(a, b) {
		t.Fatalf("StableMAC is not deterministic: %s != %s", a, b)
	}
	if len(a) != 6 {
		t.Fatalf("StableMAC(weft) = %s, want 6 bytes", a)
	}
	if a[0]&0x01 != 0 || a[0]&0x02 == 0 {
		t.Fatalf("StableMAC(weft) = %s, want a unicast, locally administered address", a)
	}
	if bytes.Equal(a, StableMAC("weft2")) {
		t.Fatalf("StableMAC gives %s for two names", a)
	}
}

func TestCompare(t *testing.T) {
	cfg := validConfig()
	mac := StableMAC(cfg.Name)
	otherMAC := net.HardwareAddr{0x02, 0, 0, 0, 0, 0x42}
	gw := cfg.Gateway
	p := netip.MustParsePrefix
	good := func() *Link {
		return &Link{Kind: "bridge", MTU: cfg.MTU, Up: true, MAC: mac, Addrs: []netip.Prefix{gw}}
	}
	with := func(f func(*Link)) *Link { l := good(); f(l); return l }

	tests := []struct {
		name string
		have *Link
		want Plan
	}{
		{"missing", nil, Plan{Create: true, Reason: "no link named weft"}},
		{"veth", &Link{Kind: "veth", MTU: cfg.MTU, Up: true},
			Plan{Create: true, Delete: true, Reason: `link "weft" is a veth, not a bridge`}},
		{"unknown kind", &Link{},
			Plan{Create: true, Delete: true, Reason: `link "weft" is a link of unknown type, not a bridge`}},
		{"compatible", good(), Plan{}},
		{"compatible with an address outside the range",
			with(func(l *Link) { l.Addrs = append(l.Addrs, p("192.168.1.1/24"), p("10.0.0.1/8")) }), Plan{}},
		{"wrong MTU", with(func(l *Link) { l.MTU = 1500 }), Plan{MTU: cfg.MTU}},
		{"down", with(func(l *Link) { l.Up = false }), Plan{Up: true}},
		{"no addresses", with(func(l *Link) { l.Addrs = nil }), Plan{AddGateway: true}},
		{"stale gateway in range",
			with(func(l *Link) { l.Addrs = []netip.Prefix{p("10.33.0.1/12"), p("192.168.1.1/24")} }),
			Plan{AddGateway: true, RemoveAddrs: []netip.Prefix{p("10.33.0.1/12")}}},
		{"gateway with the wrong length",
			with(func(l *Link) { l.Addrs = []netip.Prefix{p("10.32.0.1/16")} }),
			Plan{AddGateway: true, RemoveAddrs: []netip.Prefix{p("10.32.0.1/16")}}},
		{"extra in-range address besides the gateway",
			with(func(l *Link) { l.Addrs = append(l.Addrs, p("10.32.0.9/12"), p("10.40.1.1/24")) }),
			Plan{RemoveAddrs: []netip.Prefix{p("10.32.0.9/12"), p("10.40.1.1/24")}}},
		{"other MAC, no ports: set the stable one", with(func(l *Link) { l.MAC = otherMAC }), Plan{MAC: mac}},
		{"other MAC, ports attached: pin it",
			with(func(l *Link) { l.MAC = otherMAC; l.Ports = 2 }), Plan{MAC: otherMAC}},
		{"stable MAC with ports", with(func(l *Link) { l.Ports = 3 }), Plan{}},
		{"everything wrong",
			&Link{Kind: "bridge", MTU: 9000, MAC: otherMAC, Addrs: []netip.Prefix{p("10.32.0.2/12")}},
			Plan{MTU: cfg.MTU, MAC: mac, Up: true, AddGateway: true, RemoveAddrs: []netip.Prefix{p("10.32.0.2/12")}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Compare(cfg, tt.have)
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("Compare() = %+v, want %+v", got, tt.want)
			}
			if got.IsZero() != reflect.DeepEqual(tt.want, Plan{}) {
				t.Fatalf("IsZero() = %v for %+v", got.IsZero(), got)
			}
			if changes := got.Changes(cfg, tt.have); len(changes) == 0 != got.IsZero() {
				t.Fatalf("Changes() = %q for plan %+v", changes, got)
			}
		})
	}
}

func TestPlanChanges(t *testing.T) {
	cfg := validConfig()
	have := &Link{Kind: "bridge", MTU: 1500, MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, Ports: 1,
		Addrs: []netip.Prefix{netip.MustParsePrefix("10.33.0.1/12")}}
	got := Compare(cfg, have).Changes(cfg, have)
	want := []string{
		"set MTU 1376 (was 1500)",
		"pin MAC 02:00:00:00:00:01 (ports are attached, keep it)",
		"remove stale pod-range address 10.33.0.1/12",
		"add gateway address 10.32.0.1/12",
		"set up",
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Changes() =\n%q\nwant\n%q", got, want)
	}
}

func TestLastAddr(t *testing.T) {
	for in, want := range map[string]string{
		"10.32.0.1/12":   "10.47.255.255",
		"10.32.0.0/30":   "10.32.0.3",
		"192.168.1.7/24": "192.168.1.255",
		"1.2.3.4/32":     "1.2.3.4",
	} {
		if got := lastAddr(netip.MustParsePrefix(in)); got.String() != want {
			t.Errorf("lastAddr(%s) = %s, want %s", in, got, want)
		}
	}
}
