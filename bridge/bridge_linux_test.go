package bridge

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/containernetworking/plugins/pkg/utils/sysctl"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Everything here runs in namespaces the test makes (testutils.NewNS); the
// test goroutine's thread never leaves the root namespace, and nothing in the
// root namespace is changed.

func skipUnlessRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root to create network namespaces, links and nftables tables")
	}
}

// env is one test namespace with a netlink handle in it and a unique bridge
// name.
type env struct {
	ns   ns.NetNS
	h    *netlink.Handle
	name string
	cfg  Config
	log  *slog.Logger
}

// newNS makes a network namespace that is removed when the test ends.
func newNS(t testing.TB) ns.NetNS {
	t.Helper()
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatalf("create test namespace: %v", err)
	}
	t.Cleanup(func() {
		_ = n.Close()
		if err := testutils.UnmountNS(n); err != nil {
			t.Errorf("remove test namespace: %v", err)
		}
	})
	return n
}

func newEnv(t testing.TB) *env {
	t.Helper()
	skipUnlessRoot(t)
	n := newNS(t)
	fd, err := netns.GetFromPath(n.Path())
	if err != nil {
		t.Fatalf("open test namespace: %v", err)
	}
	defer fd.Close()
	h, err := netlink.NewHandleAt(fd)
	if err != nil {
		t.Fatalf("netlink handle in test namespace: %v", err)
	}
	t.Cleanup(h.Close)

	name := uniqueName(t, "wt-")
	t.Cleanup(func() { assertRootUntouched(t, name) })
	return &env{
		ns: n, h: h, name: name,
		cfg: Config{
			Name:     name,
			MTU:      1400,
			Gateway:  netip.MustParsePrefix("10.32.0.1/12"),
			PodRange: netip.MustParsePrefix("10.32.0.0/12"),
		},
		log: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
}

// uniqueName is prefix plus random hex, 15 characters in all.
func uniqueName(t testing.TB, prefix string) string {
	t.Helper()
	b := make([]byte, (MaxNameLen-len(prefix))/2)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return prefix + hex.EncodeToString(b)
}

// assertRootUntouched checks, read-only, that the root namespace has neither
// a link named like the test bridge nor a weft nftables table.
func assertRootUntouched(t testing.TB, name string) {
	t.Helper()
	_, err := netlink.LinkByName(name)
	if !isNotFound(err) {
		t.Errorf("root namespace: link %q: got err %v, want not found", name, err)
	}
	c, err := nftables.New()
	if err != nil {
		t.Errorf("nftables in root namespace: %v", err)
		return
	}
	if _, err := c.ListTableOfFamily(TableName, nftables.TableFamilyIPv4); err == nil {
		t.Errorf("root namespace has an nftables table ip %s", TableName)
	}
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func (e *env) ensure(t testing.TB) *Info {
	t.Helper()
	info, err := Ensure(e.ns.Path(), e.cfg, e.log)
	if err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	return info
}

func (e *env) link(t testing.TB, name string) netlink.Link {
	t.Helper()
	l, err := e.h.LinkByName(name)
	if err != nil {
		t.Fatalf("look up %q: %v", name, err)
	}
	return l
}

func (e *env) addrs(t testing.TB, l netlink.Link) []netip.Prefix {
	t.Helper()
	list, err := e.h.AddrList(l, netlink.FAMILY_V4)
	if err != nil {
		t.Fatalf("list addresses: %v", err)
	}
	var out []netip.Prefix
	for _, a := range list {
		ip, _ := netip.AddrFromSlice(a.IP)
		ones, _ := a.Mask.Size()
		out = append(out, netip.PrefixFrom(ip.Unmap(), ones))
	}
	return out
}

func (e *env) addAddr(t testing.TB, l netlink.Link, p string) {
	t.Helper()
	if err := e.h.AddrAdd(l, toAddr(netip.MustParsePrefix(p))); err != nil {
		t.Fatalf("add address %s: %v", p, err)
	}
}

// veth makes a veth pair inside the test namespace and returns the end
// named name and the name of its peer.
func (e *env) veth(t testing.TB, name string, mac net.HardwareAddr) (netlink.Link, string) {
	t.Helper()
	attrs := netlink.NewLinkAttrs()
	attrs.Name = name
	attrs.HardwareAddr = mac
	attrs.MTU = e.cfg.MTU
	peer := uniqueName(t, "wp-")
	if err := e.h.LinkAdd(&netlink.Veth{LinkAttrs: attrs, PeerName: peer}); err != nil {
		t.Fatalf("create veth %q: %v", name, err)
	}
	return e.link(t, name), peer
}

func (e *env) sysctl(t testing.TB, key string, value ...string) string {
	t.Helper()
	var got string
	err := e.ns.Do(func(ns.NetNS) (err error) {
		got, err = sysctl.Sysctl(key, value...)
		return err
	})
	if err != nil {
		t.Fatalf("sysctl %s: %v", key, err)
	}
	return got
}

// checkBridge asserts that the bridge is as configured and returns it.
func (e *env) checkBridge(t testing.TB) netlink.Link {
	t.Helper()
	l := e.link(t, e.name)
	if l.Type() != "bridge" {
		t.Fatalf("link %q is a %s, want a bridge", e.name, l.Type())
	}
	a := l.Attrs()
	if a.MTU != e.cfg.MTU {
		t.Errorf("MTU = %d, want %d", a.MTU, e.cfg.MTU)
	}
	if a.Flags&net.FlagUp == 0 {
		t.Errorf("bridge is down")
	}
	if addrs := e.addrs(t, l); !slices.Contains(addrs, e.cfg.Gateway) {
		t.Errorf("addresses = %v, want %s among them", addrs, e.cfg.Gateway)
	}
	for _, s := range sysctls(e.name) {
		if got := e.sysctl(t, s.Key); got != s.Want {
			t.Errorf("sysctl %s = %q, want %s", s.Key, got, s.Want)
		}
	}
	e.checkNFT(t)
	return l
}

// checkNFT asserts that weft's table has exactly one masquerade rule and the
// two forward rules.
func (e *env) checkNFT(t testing.TB) {
	t.Helper()
	fd, err := netns.GetFromPath(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(fd)))
	if err != nil {
		t.Fatal(err)
	}
	table, err := c.ListTableOfFamily(TableName, nftables.TableFamilyIPv4)
	if err != nil {
		t.Fatalf("nftables table ip %s: %v", TableName, err)
	}
	nat, err := c.ListChain(table, natChain)
	if err != nil {
		t.Fatalf("chain %s: %v", natChain, err)
	}
	if nat.Type != nftables.ChainTypeNAT || nat.Hooknum == nil || *nat.Hooknum != *nftables.ChainHookPostrouting ||
		nat.Priority == nil || *nat.Priority != *nftables.ChainPriorityNATSource {
		t.Errorf("chain %s: type %s hook %v priority %v, want nat postrouting srcnat", natChain, nat.Type, nat.Hooknum, nat.Priority)
	}
	natRules, err := c.GetRules(table, nat)
	if err != nil {
		t.Fatalf("rules of %s: %v", natChain, err)
	}
	if len(natRules) != 1 {
		t.Fatalf("chain %s has %d rules, want exactly 1", natChain, len(natRules))
	}
	r := natRules[0]
	if _, ok := r.Exprs[len(r.Exprs)-1].(*expr.Masq); !ok {
		t.Errorf("rule ends in %T, want masquerade", r.Exprs[len(r.Exprs)-1])
	}
	var cmps []expr.CmpOp
	for _, x := range r.Exprs {
		if c, ok := x.(*expr.Cmp); ok {
			cmps = append(cmps, c.Op)
			if want := e.cfg.PodRange.Addr().AsSlice(); !bytes.Equal(c.Data, want) {
				t.Errorf("masquerade rule compares with %v, want %v", c.Data, want)
			}
		}
	}
	if !slices.Equal(cmps, []expr.CmpOp{expr.CmpOpEq, expr.CmpOpNeq}) {
		t.Errorf("masquerade rule compares %v, want saddr == pods, daddr != pods", cmps)
	}

	fwd, err := c.ListChain(table, forwardChain)
	if err != nil {
		t.Fatalf("chain %s: %v", forwardChain, err)
	}
	if fwd.Policy == nil || *fwd.Policy != nftables.ChainPolicyAccept || *fwd.Hooknum != *nftables.ChainHookForward {
		t.Errorf("chain %s: hook %v policy %v, want forward accept", forwardChain, fwd.Hooknum, fwd.Policy)
	}
	fwdRules, err := c.GetRules(table, fwd)
	if err != nil {
		t.Fatalf("rules of %s: %v", forwardChain, err)
	}
	if len(fwdRules) != 2 {
		t.Errorf("chain %s has %d rules, want 2", forwardChain, len(fwdRules))
	}
}

func TestEnsureCreatesAndIsIdempotent(t *testing.T) {
	e := newEnv(t)
	info := e.ensure(t)
	if len(info.Changes) == 0 {
		t.Errorf("first Ensure reported no changes")
	}
	l := e.checkBridge(t)
	if info.Index != l.Attrs().Index || info.MTU != e.cfg.MTU || !bytes.Equal(info.MAC, StableMAC(e.name)) {
		t.Errorf("Info = %+v, want index %d, MTU %d, MAC %s", info, l.Attrs().Index, e.cfg.MTU, StableMAC(e.name))
	}
	if !bytes.Equal(l.Attrs().HardwareAddr, StableMAC(e.name)) {
		t.Errorf("MAC = %s, want %s", l.Attrs().HardwareAddr, StableMAC(e.name))
	}

	again := e.ensure(t)
	if len(again.Changes) != 0 {
		t.Errorf("second Ensure changed %q, want nothing", again.Changes)
	}
	if again.Index != info.Index {
		t.Errorf("second Ensure: index %d, want %d (the same bridge)", again.Index, info.Index)
	}
	e.checkBridge(t) // still exactly one masquerade rule
}

// TestEnsureInCurrentNamespace runs Ensure as the daemon does: from a thread
// that is already inside the node namespace, with nsPath "".
func TestEnsureInCurrentNamespace(t *testing.T) {
	e := newEnv(t)
	var info *Info
	err := e.ns.Do(func(ns.NetNS) (err error) {
		info, err = Ensure("", e.cfg, e.log)
		return err
	})
	if err != nil {
		t.Fatalf("Ensure in the current namespace: %v", err)
	}
	if l := e.checkBridge(t); l.Attrs().Index != info.Index {
		t.Errorf("Info.Index = %d, want %d", info.Index, l.Attrs().Index)
	}
	err = e.ns.Do(func(ns.NetNS) error {
		if err := Teardown("", e.name, e.log); err != nil {
			return err
		}
		if name, _, _, err := DefaultRouteMTU(""); err == nil {
			return fmt.Errorf("DefaultRouteMTU found a default route via %s in an empty namespace", name)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("in the current namespace: %v", err)
	}
	if _, err := e.h.LinkByName(e.name); !isNotFound(err) {
		t.Errorf("bridge after Teardown: err %v, want not found", err)
	}
}

func TestEnsureKeepsAttachedVeth(t *testing.T) {
	e := newEnv(t)
	info := e.ensure(t)
	br := e.link(t, e.name)

	// A port whose MAC is lower than the bridge's: an unpinned bridge would
	// take it over.
	low := net.HardwareAddr{0x00, 0x00, 0x5e, 0x00, 0x53, 0x01}
	vethName := uniqueName(t, "wv-")
	v, _ := e.veth(t, vethName, low)
	// And a larger MTU: an unpinned bridge would follow it.
	if err := e.h.LinkSetMTU(v, 1500); err != nil {
		t.Fatal(err)
	}
	if err := e.h.LinkSetMaster(v, br); err != nil {
		t.Fatalf("attach veth: %v", err)
	}
	if err := e.h.LinkSetUp(v); err != nil {
		t.Fatal(err)
	}
	after := e.link(t, e.name).Attrs()
	if !bytes.Equal(after.HardwareAddr, StableMAC(e.name)) {
		t.Errorf("bridge MAC changed to %s when a port joined, want %s", after.HardwareAddr, StableMAC(e.name))
	}
	if after.MTU != e.cfg.MTU {
		t.Errorf("bridge MTU changed to %d when a port joined, want %d", after.MTU, e.cfg.MTU)
	}

	again := e.ensure(t)
	if len(again.Changes) != 0 || again.Index != info.Index {
		t.Errorf("second Ensure: changes %q index %d, want none and index %d", again.Changes, again.Index, info.Index)
	}
	v2 := e.link(t, vethName)
	if v2.Attrs().Index != v.Attrs().Index || v2.Attrs().MasterIndex != info.Index {
		t.Errorf("veth: index %d master %d, want index %d master %d",
			v2.Attrs().Index, v2.Attrs().MasterIndex, v.Attrs().Index, info.Index)
	}
	e.checkBridge(t)
}

func TestEnsureRepairs(t *testing.T) {
	tests := []struct {
		name    string
		breakIt func(t *testing.T, e *env, br netlink.Link)
		check   func(t *testing.T, e *env, br netlink.Link)
	}{
		{
			name: "wrong MTU",
			breakIt: func(t *testing.T, e *env, br netlink.Link) {
				if err := e.h.LinkSetMTU(br, 1500); err != nil {
					t.Fatal(err)
				}
			},
		},
		{
			name: "down",
			breakIt: func(t *testing.T, e *env, br netlink.Link) {
				if err := e.h.LinkSetDown(br); err != nil {
					t.Fatal(err)
				}
			},
		},
		{
			name: "bridge forwarding off",
			breakIt: func(t *testing.T, e *env, br netlink.Link) {
				e.sysctl(t, "net/ipv4/conf/"+e.name+"/forwarding", "0")
			},
		},
		{
			name: "proxy ARP off",
			breakIt: func(t *testing.T, e *env, br netlink.Link) {
				e.sysctl(t, "net/ipv4/conf/"+e.name+"/proxy_arp", "0")
			},
		},
		{
			name: "nftables table gone",
			breakIt: func(t *testing.T, e *env, br netlink.Link) {
				// Teardown of a bridge that does not exist removes just the table.
				if err := Teardown(e.ns.Path(), "wt-unrelated", e.log); err != nil {
					t.Fatal(err)
				}
			},
		},
		{
			name: "stale pod-range addresses",
			breakIt: func(t *testing.T, e *env, br netlink.Link) {
				e.addAddr(t, br, "10.32.0.9/12")
				e.addAddr(t, br, "10.40.0.1/24")
				e.addAddr(t, br, "192.168.77.1/24")
			},
			check: func(t *testing.T, e *env, br netlink.Link) {
				got := e.addrs(t, br)
				slices.SortFunc(got, netip.Prefix.Compare)
				want := []netip.Prefix{e.cfg.Gateway, netip.MustParsePrefix("192.168.77.1/24")}
				if !slices.Equal(got, want) {
					t.Errorf("addresses = %v, want %v", got, want)
				}
			},
		},
		{
			// The stale address is the primary one, the gateway its
			// secondary: removing the stale one takes the gateway with it.
			name: "stale primary, gateway secondary",
			breakIt: func(t *testing.T, e *env, br netlink.Link) {
				if err := e.h.AddrDel(br, toAddr(e.cfg.Gateway)); err != nil {
					t.Fatal(err)
				}
				e.addAddr(t, br, "10.33.0.1/12")
				e.addAddr(t, br, e.cfg.Gateway.String())
			},
			check: func(t *testing.T, e *env, br netlink.Link) {
				if got, want := e.addrs(t, br), []netip.Prefix{e.cfg.Gateway}; !slices.Equal(got, want) {
					t.Errorf("addresses = %v, want %v", got, want)
				}
			},
		},
		{
			name: "gateway with the wrong length",
			breakIt: func(t *testing.T, e *env, br netlink.Link) {
				if err := e.h.AddrDel(br, toAddr(e.cfg.Gateway)); err != nil {
					t.Fatal(err)
				}
				e.addAddr(t, br, "10.32.0.1/16")
			},
			check: func(t *testing.T, e *env, br netlink.Link) {
				if got, want := e.addrs(t, br), []netip.Prefix{e.cfg.Gateway}; !slices.Equal(got, want) {
					t.Errorf("addresses = %v, want %v", got, want)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			first := e.ensure(t)
			br := e.link(t, e.name)
			tt.breakIt(t, e, br)

			info := e.ensure(t)
			if len(info.Changes) == 0 {
				t.Errorf("Ensure reported no changes after %s", tt.name)
			}
			if info.Index != first.Index {
				t.Errorf("bridge index %d, want %d: the bridge was recreated, not repaired", info.Index, first.Index)
			}
			e.checkBridge(t)
			if tt.check != nil {
				tt.check(t, e, e.link(t, e.name))
			}
			if again := e.ensure(t); len(again.Changes) != 0 {
				t.Errorf("Ensure after the repair changed %q, want nothing", again.Changes)
			}
		})
	}
}

func TestEnsureReplacesNonBridge(t *testing.T) {
	e := newEnv(t)
	v, _ := e.veth(t, e.name, nil)
	info := e.ensure(t)
	if len(info.Changes) == 0 || !strings.Contains(info.Changes[0], "not a bridge") {
		t.Errorf("changes %q, want the first to say the link was not a bridge", info.Changes)
	}
	br := e.checkBridge(t)
	if br.Attrs().Index == v.Attrs().Index {
		t.Errorf("bridge has the veth's index %d", v.Attrs().Index)
	}
}

func TestEnsureAdoptsForeignBridge(t *testing.T) {
	e := newEnv(t)
	attrs := netlink.NewLinkAttrs()
	attrs.Name = e.name
	if err := e.h.LinkAdd(&netlink.Bridge{LinkAttrs: attrs}); err != nil {
		t.Fatalf("create bridge: %v", err)
	}
	br := e.link(t, e.name)
	v, _ := e.veth(t, uniqueName(t, "wv-"), nil)
	if err := e.h.LinkSetMaster(v, br); err != nil {
		t.Fatal(err)
	}
	mac := e.link(t, e.name).Attrs().HardwareAddr

	info := e.ensure(t)
	if info.Index != br.Attrs().Index {
		t.Errorf("index %d, want %d: the bridge was recreated", info.Index, br.Attrs().Index)
	}
	if !bytes.Equal(info.MAC, mac) {
		t.Errorf("MAC %s, want the existing %s kept (ports are attached)", info.MAC, mac)
	}
	if got := e.link(t, v.Attrs().Name).Attrs().MasterIndex; got != info.Index {
		t.Errorf("veth master %d, want %d", got, info.Index)
	}
	e.checkBridge(t)
}

func TestTeardown(t *testing.T) {
	e := newEnv(t)
	e.ensure(t)
	if err := Teardown(e.ns.Path(), e.name, e.log); err != nil {
		t.Fatalf("Teardown: %v", err)
	}
	if _, err := e.h.LinkByName(e.name); !isNotFound(err) {
		t.Errorf("bridge after Teardown: err %v, want not found", err)
	}
	fd, err := netns.GetFromPath(e.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(fd)))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ListTableOfFamily(TableName, nftables.TableFamilyIPv4); err == nil {
		t.Errorf("table ip %s still exists after Teardown", TableName)
	}
	if err := Teardown(e.ns.Path(), e.name, e.log); err != nil {
		t.Errorf("second Teardown: %v, want nil", err)
	}
}

func TestTeardownLeavesNonBridge(t *testing.T) {
	e := newEnv(t)
	e.veth(t, e.name, nil)
	if err := Teardown(e.ns.Path(), e.name, e.log); err != nil {
		t.Fatalf("Teardown: %v", err)
	}
	if l := e.link(t, e.name); l.Type() != "veth" {
		t.Errorf("link is a %s, want the veth left alone", l.Type())
	}
}

func TestEnsureBadInput(t *testing.T) {
	skipUnlessRoot(t)
	cfg := Config{Name: "wt-bad", MTU: 1400,
		Gateway: netip.MustParsePrefix("10.32.0.1/12"), PodRange: netip.MustParsePrefix("10.32.0.0/12")}
	_, err := Ensure("/nonexistent/netns/weft-test", cfg, nil)
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/netns/weft-test") {
		t.Errorf("Ensure in a missing namespace: %v, want an error naming the path", err)
	}
	cfg.MTU = 10
	if _, err := Ensure("/nonexistent", cfg, nil); err == nil || !strings.Contains(err.Error(), "MTU 10") {
		t.Errorf("Ensure with MTU 10: %v, want a config error", err)
	}
}

func TestDefaultRouteMTU(t *testing.T) {
	e := newEnv(t)
	_, _, _, err := DefaultRouteMTU(e.ns.Path())
	if err == nil || !strings.Contains(err.Error(), "no default route in this namespace: set --host") {
		t.Errorf("DefaultRouteMTU without a route: %v", err)
	}

	up, peer := e.veth(t, uniqueName(t, "wu-"), nil)
	if err := e.h.LinkSetMTU(up, 1450); err != nil {
		t.Fatal(err)
	}
	e.addAddr(t, up, "192.0.2.2/24")
	e.addAddr(t, up, "198.51.100.2/24")
	if err := e.h.LinkSetUp(up); err != nil {
		t.Fatal(err)
	}
	if err := e.h.LinkSetUp(e.link(t, peer)); err != nil {
		t.Fatal(err)
	}
	// A worse default route on another link must lose.
	other, _ := e.veth(t, uniqueName(t, "wo-"), nil)
	e.addAddr(t, other, "203.0.113.2/24")
	if err := e.h.LinkSetUp(other); err != nil {
		t.Fatal(err)
	}
	routes := []*netlink.Route{
		{LinkIndex: up.Attrs().Index, Gw: net.ParseIP("192.0.2.1"), Priority: 10},
		{LinkIndex: other.Attrs().Index, Gw: net.ParseIP("203.0.113.1"), Priority: 100},
	}
	for _, r := range routes {
		if err := e.h.RouteAdd(r); err != nil {
			t.Fatalf("add default route %v: %v", r, err)
		}
	}
	name, mtu, addr, err := DefaultRouteMTU(e.ns.Path())
	if err != nil {
		t.Fatalf("DefaultRouteMTU: %v", err)
	}
	if name != up.Attrs().Name || mtu != 1450 || addr != netip.MustParseAddr("192.0.2.2") {
		t.Errorf("DefaultRouteMTU = %s %d %s, want %s 1450 192.0.2.2", name, mtu, addr, up.Attrs().Name)
	}
}
