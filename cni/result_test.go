package cni

import (
	"bytes"
	"encoding/json"
	"net"
	"net/netip"
	"strings"
	"testing"

	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/weft-net/weft/api"
)

func goodAllocation() *api.Allocation {
	return &api.Allocation{
		Attachment: api.Attachment{ContainerID: "abc", IfName: "eth0"},
		Address:    netip.MustParsePrefix("10.32.0.5/12"), Gateway: netip.MustParseAddr("10.32.0.1"), Bridge: "weft", MTU: 1376, New: true,
	}
}

func TestParseAllocation(t *testing.T) {
	pn, err := parseAllocation(goodAllocation())
	if err != nil {
		t.Fatal(err)
	}
	if pn.Address.String() != "10.32.0.5/12" || pn.Gateway != netip.MustParseAddr("10.32.0.1") || pn.Bridge != "weft" || pn.MTU != 1376 {
		t.Fatalf("got %+v", pn)
	}
	if _, err := parseAllocation(&api.Allocation{Address: netip.MustParsePrefix("fd00::5/64"), Gateway: netip.MustParseAddr("fd00::1"), Bridge: "weft", MTU: 1400}); err != nil {
		t.Fatalf("IPv6: %v", err)
	}
	for _, tt := range []struct {
		name string
		mod  func(a *api.Allocation)
		want string
	}{
		{"no address", func(a *api.Allocation) { a.Address = netip.Prefix{} }, "prefix length"},
		{"no gateway", func(a *api.Allocation) { a.Gateway = netip.Addr{} }, "no gateway"},
		{"mapped gateway", func(a *api.Allocation) { a.Gateway = netip.MustParseAddr("::ffff:10.32.0.1") }, "plain IPv4"},
		{"gateway outside", func(a *api.Allocation) { a.Gateway = netip.MustParseAddr("192.168.0.1") }, "not another address"},
		{"gateway is the pod", func(a *api.Allocation) { a.Gateway = netip.MustParseAddr("10.32.0.5") }, "not another address"},
		{"families differ", func(a *api.Allocation) { a.Gateway = netip.MustParseAddr("fd00::1") }, "IPv6 gateway"},
		{"families differ 6/4", func(a *api.Allocation) {
			a.Address, a.Gateway = netip.MustParsePrefix("fd00::5/64"), netip.MustParseAddr("10.0.0.1")
		}, "IPv4 gateway"},
		{"no bridge", func(a *api.Allocation) { a.Bridge = "" }, "bridge"},
		{"bridge name too long", func(a *api.Allocation) { a.Bridge = "a-bridge-name-too-long" }, "bridge"},
		{"MTU zero", func(a *api.Allocation) { a.MTU = 0 }, "MTU 0"},
		{"MTU huge", func(a *api.Allocation) { a.MTU = 70000 }, "MTU 70000"},
	} {
		a := goodAllocation()
		tt.mod(a)
		if _, err := parseAllocation(a); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: got %v, want an error with %q", tt.name, err, tt.want)
		}
	}
}

// TestResultVersions builds the ADD result and prints it in every version the
// conflist may ask for, then parses it back as a runtime would.
func TestResultVersions(t *testing.T) {
	pn, err := parseAllocation(goodAllocation())
	if err != nil {
		t.Fatal(err)
	}
	res := buildResult(pn, "/var/run/netns/pod",
		linkInfo{Name: "weft538f587a236", Mac: "02:00:00:00:00:01"},
		linkInfo{Name: "eth0", Mac: "02:00:00:00:00:02"})
	for _, v := range specVersions {
		t.Run(v, func(t *testing.T) {
			var buf bytes.Buffer
			if err := printResult(&buf, res, v); err != nil {
				t.Fatal(err)
			}
			var raw map[string]any
			if err := json.Unmarshal(buf.Bytes(), &raw); err != nil {
				t.Fatalf("not JSON: %v\n%s", err, buf.String())
			}
			if raw["cniVersion"] != v {
				t.Errorf("cniVersion %v, want %s", raw["cniVersion"], v)
			}
			ips := raw["ips"].([]any)
			ip0 := ips[0].(map[string]any)
			if strings.HasPrefix(v, "0.") && ip0["version"] != "4" {
				t.Errorf("%s result lacks ips[0].version 4: %s", v, buf.String())
			}
			back, err := version.NewResult(v, buf.Bytes())
			if err != nil {
				t.Fatalf("parsing back: %v", err)
			}
			cur, err := current.NewResultFromResult(back)
			if err != nil {
				t.Fatal(err)
			}
			checkResult(t, cur)
		})
	}
}

func checkResult(t *testing.T, r *current.Result) {
	t.Helper()
	if len(r.Interfaces) != 2 || r.Interfaces[0].Name != "weft538f587a236" || r.Interfaces[0].Sandbox != "" ||
		r.Interfaces[1].Name != "eth0" || r.Interfaces[1].Sandbox != "/var/run/netns/pod" || r.Interfaces[1].Mac != "02:00:00:00:00:02" {
		t.Errorf("interfaces %v", r.Interfaces)
	}
	if len(r.IPs) != 1 || r.IPs[0].Address.String() != "10.32.0.5/12" || r.IPs[0].Gateway.String() != "10.32.0.1" ||
		r.IPs[0].Interface == nil || *r.IPs[0].Interface != 1 {
		t.Errorf("ips %v", r.IPs)
	}
	if len(r.Routes) != 1 || r.Routes[0].Dst.String() != "0.0.0.0/0" || r.Routes[0].GW.String() != "10.32.0.1" {
		t.Errorf("routes %v", r.Routes)
	}
}

func TestPodIPs(t *testing.T) {
	_, a, _ := net.ParseCIDR("10.32.0.5/12")
	prev := &current.Result{
		Interfaces: []*current.Interface{{Name: "weftx"}, {Name: "eth0", Sandbox: "/ns"}, {Name: "eth0", Sandbox: "/other"}},
		IPs: []*current.IPConfig{
			{Address: *a, Interface: current.Int(1)},
			{Address: *a, Interface: current.Int(2)},
			{Address: *a, Interface: current.Int(7)},
			{Address: *a, Interface: current.Int(-1)},
			{Address: *a},
		},
	}
	if got := podIPs(prev, "eth0", "/ns"); len(got) != 1 || got[0] != prev.IPs[0] {
		t.Fatalf("podIPs = %v", got)
	}
}

// prefixOf reads a CNI result's or netlink's net.IPNet however its IP and
// mask are stored (4 or 16 bytes), and refuses a mask that is no prefix.
func TestPrefixOf(t *testing.T) {
	want := netip.MustParsePrefix("10.32.0.5/12")
	for _, n := range []net.IPNet{
		{IP: net.ParseIP("10.32.0.5"), Mask: net.CIDRMask(12, 32)}, // 16-byte IP, 4-byte mask
		{IP: net.ParseIP("10.32.0.5").To4(), Mask: net.CIDRMask(12, 32)},
		{IP: net.ParseIP("10.32.0.5").To4(), Mask: net.CIDRMask(108, 128)},
	} {
		if p, ok := prefixOf(n); !ok || p != want {
			t.Errorf("prefixOf(%v) = %v, %v; want %v", n, p, ok, want)
		}
	}
	if p, ok := prefixOf(net.IPNet{IP: net.ParseIP("10.32.0.5").To4(), Mask: net.CIDRMask(16, 32)}); !ok || p == want {
		t.Errorf("a /16 read as %v, %v", p, ok)
	}
	if _, ok := prefixOf(net.IPNet{IP: net.ParseIP("10.32.0.5").To4(), Mask: net.IPMask{255, 0, 255, 0}}); ok {
		t.Error("a mask that is no prefix accepted")
	}
	if got := ipNet(want); got.String() != "10.32.0.5/12" || len(got.IP) != net.IPv4len {
		t.Errorf("ipNet(%v) = %v (%d bytes)", want, got, len(got.IP))
	}
}
