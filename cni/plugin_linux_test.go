//go:build linux

package cni

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/cni/routertest"
)

const (
	testBridge = "weft"
	testMTU    = 1376
)

func skipUnlessRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the test makes network namespaces, veths and a bridge")
	}
}

// kernelEnv is a "node" namespace with the bridge, a pod namespace and a
// fake router. Everything lives in namespaces the test made and goes with them.
type kernelEnv struct {
	t      *testing.T
	node   ns.NetNS
	pod    ns.NetNS
	router *routertest.Router
	plugin *Plugin
	stdout *bytes.Buffer
}

// newNS makes a namespace that is removed when the test ends.
func newNS(t *testing.T) ns.NetNS {
	t.Helper()
	n, err := testutils.NewNS()
	if err != nil {
		t.Fatalf("making a network namespace: %v", err)
	}
	t.Cleanup(func() {
		n.Close()
		if _, err := os.Stat(n.Path()); errors.Is(err, os.ErrNotExist) {
			return // the test removed it already
		}
		if err := testutils.UnmountNS(n); err != nil {
			t.Errorf("removing namespace %s: %v", n.Path(), err)
		}
	})
	return n
}

func newKernelEnv(t *testing.T) *kernelEnv {
	t.Helper()
	skipUnlessRoot(t)
	e := &kernelEnv{t: t, node: newNS(t), pod: newNS(t)}
	// The bridge the router would make (package bridge does it for real).
	err := e.node.Do(func(ns.NetNS) error {
		attrs := netlink.NewLinkAttrs()
		attrs.Name = testBridge
		br := &netlink.Bridge{LinkAttrs: attrs}
		if err := netlink.LinkAdd(br); err != nil {
			return err
		}
		addr, err := netlink.ParseAddr("10.32.0.1/12")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(br, addr); err != nil {
			return err
		}
		return netlink.LinkSetUp(br)
	})
	if err != nil {
		t.Fatalf("making the bridge: %v", err)
	}
	e.router = routertest.Start(t, testBridge, testMTU)
	e.plugin, e.stdout, _ = testPlugin(t)
	return e
}

// randomID is a container id like cnitool's, sharing a long prefix.
func randomID(t *testing.T) string {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return "cnitool-77383ca0a0715733ca6f" + hex.EncodeToString(b)
}

func (e *kernelEnv) args(id string, extra string) *skel.CmdArgs {
	return &skel.CmdArgs{
		ContainerID: id,
		Netns:       e.pod.Path(),
		IfName:      "eth0",
		Args:        "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0",
		StdinData:   confFor(e.router.Socket, "1.0.0", extra),
	}
}

// inNode runs a plugin command the way a runtime does: from the node's namespace.
func (e *kernelEnv) inNode(cmd func(*skel.CmdArgs) error, args *skel.CmdArgs) error {
	return e.node.Do(func(ns.NetNS) error { return cmd(args) })
}

// add runs ADD and parses its result.
func (e *kernelEnv) add(args *skel.CmdArgs) (*current.Result, []byte) {
	e.t.Helper()
	e.stdout.Reset()
	if err := e.inNode(e.plugin.Add, args); err != nil {
		e.t.Fatalf("ADD: %v", err)
	}
	out := bytes.Clone(e.stdout.Bytes())
	r, err := version.NewResult("1.0.0", out)
	if err != nil {
		e.t.Fatalf("ADD printed %q: %v", out, err)
	}
	res, err := current.NewResultFromResult(r)
	if err != nil {
		e.t.Fatal(err)
	}
	return res, out
}

// podState is what the pod namespace holds for eth0.
type podState struct {
	link   netlink.Link
	addrs  []netlink.Addr
	routes []netlink.Route
}

func (e *kernelEnv) podState(ifName string) (podState, error) {
	var s podState
	err := e.pod.Do(func(ns.NetNS) error {
		var err error
		if s.link, err = netlinksafe.LinkByName(ifName); err != nil {
			return err
		}
		if s.addrs, err = netlinksafe.AddrList(s.link, netlink.FAMILY_V4); err != nil {
			return err
		}
		s.routes, err = netlinksafe.RouteList(nil, netlink.FAMILY_V4)
		return err
	})
	return s, err
}

// hostLink looks up a link in the node namespace.
func (e *kernelEnv) hostLink(name string) (netlink.Link, netlink.Protinfo, error) {
	var l netlink.Link
	var pi netlink.Protinfo
	err := e.node.Do(func(ns.NetNS) error {
		var err error
		if l, err = netlinksafe.LinkByName(name); err != nil {
			return err
		}
		pi, err = netlinksafe.LinkGetProtinfo(l)
		return err
	})
	return l, pi, err
}

func (e *kernelEnv) bridgeIndex() int {
	var index int
	err := e.node.Do(func(ns.NetNS) error {
		br, err := netlinksafe.LinkByName(testBridge)
		if err == nil {
			index = br.Attrs().Index
		}
		return err
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return index
}

// checkWired asserts the whole kernel state of one attachment.
func (e *kernelEnv) checkWired(id string, res *current.Result, wantAddr string) {
	e.t.Helper()
	hostName := HostVethName(id, "eth0")
	if len(res.Interfaces) != 2 || res.Interfaces[0].Name != hostName || res.Interfaces[1].Name != "eth0" ||
		res.Interfaces[1].Sandbox != e.pod.Path() || len(res.IPs) != 1 || res.IPs[0].Address.String() != wantAddr ||
		len(res.Routes) != 1 || res.Routes[0].Dst.String() != "0.0.0.0/0" || res.Routes[0].GW.String() != "10.32.0.1" {
		e.t.Fatalf("result %+v", res)
	}

	s, err := e.podState("eth0")
	if err != nil {
		e.t.Fatalf("pod eth0: %v", err)
	}
	if s.link.Type() != "veth" || s.link.Attrs().MTU != testMTU || s.link.Attrs().Flags&net.FlagUp == 0 ||
		s.link.Attrs().HardwareAddr.String() != res.Interfaces[1].Mac {
		e.t.Errorf("pod eth0: type %s mtu %d flags %v mac %s (result says %s)", s.link.Type(), s.link.Attrs().MTU,
			s.link.Attrs().Flags, s.link.Attrs().HardwareAddr, res.Interfaces[1].Mac)
	}
	if len(s.addrs) != 1 || s.addrs[0].IPNet.String() != wantAddr {
		e.t.Errorf("pod eth0 addresses %v, want only %s", s.addrs, wantAddr)
	}
	var dflt, connected int
	for _, r := range s.routes {
		switch {
		case r.Dst == nil || r.Dst.String() == "0.0.0.0/0":
			if r.Gw.String() == "10.32.0.1" && r.LinkIndex == s.link.Attrs().Index {
				dflt++
			}
		case r.Dst.String() == "10.32.0.0/12":
			connected++
		default:
			e.t.Errorf("pod has an unexpected route %v", r)
		}
	}
	if dflt != 1 || connected != 1 || len(s.routes) != 2 {
		e.t.Errorf("pod routes %v: want the default via 10.32.0.1 and the connected one", s.routes)
	}

	host, pi, err := e.hostLink(hostName)
	if err != nil {
		e.t.Fatalf("host veth %s: %v", hostName, err)
	}
	if host.Attrs().MasterIndex != e.bridgeIndex() || !pi.Hairpin || host.Attrs().MTU != testMTU ||
		host.Attrs().Flags&net.FlagUp == 0 || host.Attrs().HardwareAddr.String() != res.Interfaces[0].Mac {
		e.t.Errorf("host veth %s: master %d (bridge %d) hairpin %v mtu %d flags %v mac %s (result %s)", hostName,
			host.Attrs().MasterIndex, e.bridgeIndex(), pi.Hairpin, host.Attrs().MTU, host.Attrs().Flags,
			host.Attrs().HardwareAddr, res.Interfaces[0].Mac)
	}
}

// checkGone asserts that nothing of the attachment is left in either namespace.
func (e *kernelEnv) checkGone(id string) {
	e.t.Helper()
	if _, err := e.podState("eth0"); !isLinkNotFound(err) && !nsGone(err) {
		e.t.Errorf("pod eth0 still there (%v)", err)
	}
	if _, _, err := e.hostLink(HostVethName(id, "eth0")); !isLinkNotFound(err) {
		e.t.Errorf("host veth still there (%v)", err)
	}
}

// udpReaches sends a datagram from the pod to the bridge address and waits
// for it on the node side: the veth and the bridge carry traffic.
func (e *kernelEnv) udpReaches() error {
	var l net.PacketConn
	if err := e.node.Do(func(ns.NetNS) error {
		var err error
		l, err = net.ListenPacket("udp4", "10.32.0.1:0")
		return err
	}); err != nil {
		return err
	}
	defer l.Close()
	var c net.Conn
	if err := e.pod.Do(func(ns.NetNS) error {
		var err error
		c, err = net.Dial("udp4", l.LocalAddr().String())
		return err
	}); err != nil {
		return err
	}
	defer c.Close()
	buf := make([]byte, 16)
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) { // the first datagram can be lost while ARP resolves
		if _, err := c.Write([]byte("weft")); err != nil {
			return err
		}
		_ = l.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		n, _, err := l.ReadFrom(buf)
		if err == nil && string(buf[:n]) == "weft" {
			return nil
		}
	}
	return errors.New("no datagram from the pod reached the bridge address")
}

func withPrevResult(t *testing.T, args *skel.CmdArgs, result []byte) *skel.CmdArgs {
	t.Helper()
	a := *args
	conf := bytes.TrimSuffix(bytes.TrimSpace(args.StdinData), []byte("}"))
	a.StdinData = fmt.Appendf(nil, `%s,"prevResult":%s}`, conf, result)
	return &a
}

func TestAddCheckDel(t *testing.T) {
	e := newKernelEnv(t)
	id := randomID(t)
	args := e.args(id, "")
	att := api.Attachment{ContainerID: id, IfName: "eth0"}

	res, out := e.add(args)
	alloc, ok := e.router.Allocation(att)
	if !ok || alloc.Address != netip.MustParsePrefix("10.32.0.2/12") {
		t.Fatalf("router holds %v %v", alloc, ok)
	}
	e.checkWired(id, res, alloc.Address.String())
	if err := e.udpReaches(); err != nil {
		t.Fatal(err)
	}
	if r := e.router.Requests()[0]; r.Netns != e.pod.Path() || r.PodNamespace != "default" || r.PodName != "web-0" {
		t.Errorf("allocate request %+v lacks netns or pod", r)
	}

	// ADD again: same address and interfaces, nothing doubled.
	_, out2 := e.add(args)
	if !bytes.Equal(out2, out) {
		t.Errorf("second ADD printed\n%s\nfirst printed\n%s", out2, out)
	}
	e.checkWired(id, res, alloc.Address.String())

	// CHECK passes; then fails once the default route is gone; a repeated ADD repairs it.
	check := withPrevResult(t, args, out)
	if err := e.inNode(e.plugin.Check, check); err != nil {
		t.Fatalf("CHECK: %v", err)
	}
	if err := e.pod.Do(func(ns.NetNS) error {
		_, dflt, _ := net.ParseCIDR("0.0.0.0/0")
		return netlink.RouteDel(&netlink.Route{Dst: dflt, Gw: net.ParseIP("10.32.0.1")})
	}); err != nil {
		t.Fatal(err)
	}
	if err := e.inNode(e.plugin.Check, check); err == nil || !strings.Contains(err.Error(), "Route") {
		t.Fatalf("CHECK without the default route: %v, want a route error", err)
	}
	e.add(args)
	if err := e.inNode(e.plugin.Check, check); err != nil {
		t.Fatalf("CHECK after the repairing ADD: %v", err)
	}
	// CHECK also fails for a wrong MTU, and when the router lost the address.
	if err := e.pod.Do(func(ns.NetNS) error {
		l, err := netlinksafe.LinkByName("eth0")
		if err != nil {
			return err
		}
		return netlink.LinkSetMTU(l, 1300)
	}); err != nil {
		t.Fatal(err)
	}
	if err := e.inNode(e.plugin.Check, check); err == nil || !strings.Contains(err.Error(), "MTU is 1300") {
		t.Fatalf("CHECK with a wrong MTU: %v", err)
	}
	e.add(args)
	if err := e.inNode(e.plugin.Check, withPrevResult(t, args, bytes.ReplaceAll(out, []byte("10.32.0.2/12"), []byte("10.32.0.9/12")))); err == nil ||
		!strings.Contains(err.Error(), "allocated 10.32.0.2/12") {
		t.Fatalf("CHECK with a prevResult address the router did not give: %v", err)
	}
	if err := e.inNode(e.plugin.Check, args); cniCode(err) != types.ErrInvalidNetworkConfig {
		t.Fatalf("CHECK without prevResult: %v", err)
	}

	// DEL removes everything and releases, passing the prevResult's
	// address along; again and again.
	for i := range 2 {
		if err := e.inNode(e.plugin.Del, check); err != nil {
			t.Fatalf("DEL #%d: %v", i+1, err)
		}
		e.checkGone(id)
		if _, ok := e.router.Allocation(att); ok {
			t.Fatalf("DEL #%d left the allocation", i+1)
		}
	}
	if prevs := e.router.ReleasePrevs(); len(prevs) != 2 || prevs[0] != "10.32.0.2" {
		t.Errorf("DEL sent the prevResult addresses %q, want 10.32.0.2 twice", prevs)
	}
	if err := e.inNode(e.plugin.Check, check); err == nil || !strings.Contains(err.Error(), "holds no address") {
		t.Fatalf("CHECK after DEL: %v", err)
	}
	if e.stdout.Len() != 0 && !bytes.Equal(e.stdout.Bytes(), out) {
		t.Errorf("commands other than ADD wrote to stdout: %q", e.stdout)
	}
}

func TestDelAfterNetnsGone(t *testing.T) {
	e := newKernelEnv(t)
	id := randomID(t)
	args := e.args(id, "")
	e.add(args)

	podPath := e.pod.Path()
	e.pod.Close()
	if err := testutils.UnmountNS(e.pod); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := e.inNode(e.plugin.Del, args); err != nil {
			t.Fatalf("DEL #%d with the netns %s gone: %v", i+1, podPath, err)
		}
	}
	if _, ok := e.router.Allocation(api.Attachment{ContainerID: id, IfName: "eth0"}); ok {
		t.Fatal("address not released")
	}
	if _, _, err := e.hostLink(HostVethName(id, "eth0")); !isLinkNotFound(err) {
		t.Fatalf("host veth still there: %v", err)
	}
	// And with no netns path at all.
	noNS := *args
	noNS.Netns = ""
	if err := e.inNode(e.plugin.Del, &noNS); err != nil {
		t.Fatalf("DEL without CNI_NETNS: %v", err)
	}
}

func TestDelRouterUnreachable(t *testing.T) {
	e := newKernelEnv(t)
	id := randomID(t)
	args := e.args(id, "")
	e.add(args)

	away := *args
	away.StdinData = confFor(e.router.Socket+".gone", "1.0.0", "")
	err := e.inNode(e.plugin.Del, &away)
	if cniCode(err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), "retry DEL") {
		t.Fatalf("DEL with the router away: %v, want code 11 asking for a retry", err)
	}
	e.checkGone(id)
	if _, ok := e.router.Allocation(api.Attachment{ContainerID: id, IfName: "eth0"}); !ok {
		t.Fatal("the address went away without the router")
	}
	if err := e.inNode(e.plugin.Del, args); err != nil {
		t.Fatalf("retried DEL: %v", err)
	}
	if _, ok := e.router.Allocation(api.Attachment{ContainerID: id, IfName: "eth0"}); ok {
		t.Fatal("retried DEL did not release the address")
	}
}

// TestAddRollback: a failure after the allocation (the bridge is missing, so
// the veth cannot join it) releases a new address and deletes the veth.
func TestAddRollback(t *testing.T) {
	e := newKernelEnv(t)
	e.router.Bridge = "weftmissing" // before any request: no lock needed yet
	id := randomID(t)
	args := e.args(id, "")
	att := api.Attachment{ContainerID: id, IfName: "eth0"}

	err := e.inNode(e.plugin.Add, args)
	if err == nil || !strings.Contains(err.Error(), "weftmissing") || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("ADD without the bridge: %v, want an error naming the bridge", err)
	}
	if _, ok := e.router.Allocation(att); ok {
		t.Error("the new address was not released")
	}
	e.checkGone(id)
	if e.stdout.Len() != 0 {
		t.Errorf("failed ADD printed %q", e.stdout)
	}

	// An attachment that already held its address keeps it: a repeated ADD
	// must not release the address of a running pod.
	if _, err := api.NewClient(e.router.Socket).Allocate(t.Context(), api.AllocateRequest{Attachment: att}); err != nil {
		t.Fatal(err)
	}
	if err := e.inNode(e.plugin.Add, args); err == nil {
		t.Fatal("ADD without the bridge succeeded")
	}
	if _, ok := e.router.Allocation(att); !ok {
		t.Error("a failed repeated ADD released the address")
	}
	e.checkGone(id)
}

// TestAddForeignInterface: an eth0 in the pod that is not weft's veth is
// refused with a clear error and left alone.
func TestAddForeignInterface(t *testing.T) {
	e := newKernelEnv(t)
	if err := e.pod.Do(func(ns.NetNS) error {
		attrs := netlink.NewLinkAttrs()
		attrs.Name = "eth0"
		return netlink.LinkAdd(&netlink.Bridge{LinkAttrs: attrs})
	}); err != nil {
		t.Fatal(err)
	}
	id := randomID(t)
	err := e.inNode(e.plugin.Add, e.args(id, ""))
	if err == nil || !strings.Contains(err.Error(), "not weft's veth") {
		t.Fatalf("ADD over a foreign eth0: %v", err)
	}
	s, err := e.podState("eth0")
	if err != nil || s.link.Type() != "bridge" {
		t.Fatalf("the foreign eth0 was touched: %v %v", s.link, err)
	}
	if _, ok := e.router.Allocation(api.Attachment{ContainerID: id, IfName: "eth0"}); ok {
		t.Error("address not released")
	}
}

// TestAddStaleHostVeth: a host veth of the same attachment whose pod end is
// in another namespace (a leftover) is replaced, not an error.
func TestAddStaleHostVeth(t *testing.T) {
	e := newKernelEnv(t)
	id := randomID(t)
	other := newNS(t)
	hostName := HostVethName(id, "eth0")
	if err := e.node.Do(func(ns.NetNS) error {
		attrs := netlink.NewLinkAttrs()
		attrs.Name = hostName
		return netlink.LinkAdd(&netlink.Veth{LinkAttrs: attrs, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(other.Fd()))})
	}); err != nil {
		t.Fatal(err)
	}
	res, _ := e.add(e.args(id, ""))
	e.checkWired(id, res, "10.32.0.2/12")
}

func TestAddRefusals(t *testing.T) {
	e := newKernelEnv(t)
	id := randomID(t)
	for _, tt := range []struct {
		name string
		mod  func(a *skel.CmdArgs)
		code uint
		msg  string
	}{
		{"no netns", func(a *skel.CmdArgs) { a.Netns = "" }, types.ErrInvalidEnvironmentVariables, "CNI_NETNS is empty"},
		{"netns missing", func(a *skel.CmdArgs) { a.Netns = "/var/run/netns/weft-no-such-ns" }, types.ErrInvalidNetNS, "cannot open"},
		{"the node's own netns", func(a *skel.CmdArgs) { a.Netns = e.node.Path() }, types.ErrInvalidNetNS, "plugin's own"},
		{"bad container id", func(a *skel.CmdArgs) { a.ContainerID = "-x" }, types.ErrInvalidEnvironmentVariables, "container id"},
		{"bad ifname", func(a *skel.CmdArgs) { a.IfName = "a/b" }, types.ErrInvalidEnvironmentVariables, "interface name"},
		{"bad CNI_ARGS", func(a *skel.CmdArgs) { a.Args = "x" }, types.ErrInvalidEnvironmentVariables, "CNI_ARGS"},
		{"bad config", func(a *skel.CmdArgs) { a.StdinData = []byte(`{"cniVersion":"1.0.0"}`) }, types.ErrInvalidNetworkConfig, "name"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			args := e.args(id, "")
			tt.mod(args)
			err := e.inNode(e.plugin.Add, args)
			if cniCode(err) != tt.code || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("got %v (code %d), want code %d with %q", err, cniCode(err), tt.code, tt.msg)
			}
		})
	}
	if reqs := e.router.Requests(); len(reqs) != 0 {
		t.Errorf("refused ADDs reached the router: %v", reqs)
	}

	// A router that is not ready: try again later, nothing made.
	e.router.Set(func(f *routertest.Router) { f.NotReady = "claiming the address range" })
	err := e.inNode(e.plugin.Add, e.args(id, ""))
	var te *types.Error
	if !errors.As(err, &te) || te.Code != types.ErrTryAgainLater || te.Msg != "weft router not ready: claiming the address range; try again later" {
		t.Fatalf("ADD with the router not ready: %v", err)
	}
	e.checkGone(id)
}

// TestManyPods attaches several pods whose ids share a long prefix and
// detaches them: no name collides, every address differs.
func TestManyPods(t *testing.T) {
	e := newKernelEnv(t)
	seen := map[string]bool{}
	var all []*skel.CmdArgs
	for i := range 4 {
		pod := newNS(t)
		args := e.args(fmt.Sprintf("cnitool-%040d", i), "")
		args.Netns = pod.Path()
		e.stdout.Reset()
		if err := e.inNode(e.plugin.Add, args); err != nil {
			t.Fatalf("ADD %d: %v", i, err)
		}
		r, err := version.NewResult("1.0.0", e.stdout.Bytes())
		if err != nil {
			t.Fatal(err)
		}
		res, _ := current.NewResultFromResult(r)
		addr := res.IPs[0].Address.String()
		if seen[addr] || seen[res.Interfaces[0].Name] {
			t.Fatalf("pod %d got %s / %s again", i, addr, res.Interfaces[0].Name)
		}
		seen[addr], seen[res.Interfaces[0].Name] = true, true
		all = append(all, args)
	}
	for _, args := range all {
		if err := e.inNode(e.plugin.Del, args); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDelOwnNetns: a DEL whose CNI_NETNS is the plugin's own namespace (a
// runtime bug, or a path reused for the node's namespace) never deletes the
// node's interface of that name; it removes the host veth and releases the
// address as usual, and succeeds.
func TestDelOwnNetns(t *testing.T) {
	e := newKernelEnv(t)
	id := randomID(t)
	args := e.args(id, "")
	e.add(args)
	// The node's own "eth0" (a veth: this kernel has no dummy links).
	err := e.node.Do(func(ns.NetNS) error {
		return netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "eth0-peer"})
	})
	if err != nil {
		t.Fatal(err)
	}
	own := *args
	own.Netns = e.node.Path()
	for i := range 2 {
		if err := e.inNode(e.plugin.Del, &own); err != nil {
			t.Fatalf("DEL #%d with the node's own netns: %v", i+1, err)
		}
	}
	err = e.node.Do(func(ns.NetNS) error {
		_, err := netlinksafe.LinkByName("eth0")
		return err
	})
	if err != nil {
		t.Fatalf("DEL deleted the node's own eth0: %v", err)
	}
	if _, _, err := e.hostLink(HostVethName(id, "eth0")); !isLinkNotFound(err) {
		t.Fatalf("host veth still there: %v", err)
	}
	if _, ok := e.router.Allocation(api.Attachment{ContainerID: id, IfName: "eth0"}); ok {
		t.Fatal("address not released")
	}
}
