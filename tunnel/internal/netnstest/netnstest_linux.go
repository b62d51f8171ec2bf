// Package netnstest builds the network namespaces that the tunnel's root
// tests and its benchmark run in: two "node" namespaces joined by a veth
// underlay, each with a "pod" namespace behind a veth. Every name starts
// with a per-run prefix, nothing is made in the caller's own namespace,
// and Close removes everything.
package netnstest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/weft-net/weft/internal/nscluster"
)

// NS is a named network namespace (ip netns add).
type NS struct {
	Name string
	Path string
}

// Prefix returns a fresh per-run prefix for namespace names, claimed in
// the e2e run registry (nscluster.ClaimPrefix): namespaces that a killed
// test leaves behind are swept by the next run. The claim is released
// when tb's test ends (after the cleanups that remove its namespaces,
// registered later, have run).
func Prefix(tb testing.TB) string {
	tb.Helper()
	prefix, release, err := Claim()
	if err != nil {
		tb.Fatalf("claiming a namespace prefix: %v", err)
	}
	tb.Cleanup(func() {
		if err := release(); err != nil {
			tb.Errorf("releasing namespace prefix %s: %v", prefix, err)
		}
	})
	return prefix
}

// Claim is Prefix for a program: it returns the prefix and the release to
// call once its namespaces are gone.
func Claim() (prefix string, release func() error, err error) {
	return nscluster.ClaimPrefix()
}

// Add makes the namespace name with ip netns add and brings its loopback
// up.
func Add(name string) (*NS, error) {
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("ip netns add %s: %w: %s", name, err, bytes.TrimSpace(out))
	}
	n := &NS{Name: name, Path: "/run/netns/" + name}
	if _, err := n.Exec(context.Background(), "ip", "link", "set", "lo", "up"); err != nil {
		n.Del()
		return nil, err
	}
	return n, nil
}

// Del removes the namespace (processes still inside keep it alive until
// they exit).
func (n *NS) Del() error {
	if out, err := exec.Command("ip", "netns", "del", n.Name).CombinedOutput(); err != nil {
		if _, serr := os.Stat(n.Path); errors.Is(serr, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("ip netns del %s: %w: %s", n.Name, err, bytes.TrimSpace(out))
	}
	return nil
}

// Do runs fn on a thread inside the namespace; what fn opens (sockets,
// TUN devices) stays in it.
func (n *NS) Do(fn func() error) error {
	return ns.WithNetNSPath(n.Path, func(ns.NetNS) error { return fn() })
}

// Handle returns a netlink handle that acts inside the namespace.
func (n *NS) Handle() (*netlink.Handle, error) {
	fd, err := netns.GetFromPath(n.Path)
	if err != nil {
		return nil, fmt.Errorf("opening netns %s: %w", n.Name, err)
	}
	defer fd.Close()
	h, err := netlink.NewHandleAt(fd)
	if err != nil {
		return nil, fmt.Errorf("netlink in netns %s: %w", n.Name, err)
	}
	return h, nil
}

// Command is argv run inside the namespace (ip netns exec).
func (n *NS) Command(ctx context.Context, argv ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", n.Name}, argv...)...)
}

// Exec runs argv inside the namespace and returns its output.
func (n *NS) Exec(ctx context.Context, argv ...string) ([]byte, error) {
	out, err := n.Command(ctx, argv...).CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s in netns %s: %w: %s", strings.Join(argv, " "), n.Name, err, bytes.TrimSpace(out))
	}
	return out, nil
}

// Node is one node namespace with a pod namespace behind it.
type Node struct {
	Name     string
	NS, Pod  *NS
	Underlay netip.Addr   // on the underlay veth "ul0"
	Range    netip.Prefix // the pod range this node owns
	Gateway  netip.Addr   // the node's address toward its pod (the "bridge" address)
	PodAddr  netip.Addr
}

// Pair is two nodes on one underlay.
type Pair struct {
	Prefix string
	Nodes  [2]*Node
	all    []*NS
}

// UnderlayMTU is the MTU of the underlay veth.
const UnderlayMTU = 1500

// NewPair builds two nodes, "a" and "b": underlay 192.0.2.1 and .2 on
// the veth ul0; a owns 10.32.0.0/14 (pod 10.32.0.2 behind 10.32.0.1), b
// 10.36.0.0/14 (pod 10.36.0.2 behind 10.36.0.1); forwarding on in the
// nodes; pods with podMTU and a default route to their node. On failure
// it removes what it made.
func NewPair(prefix string, podMTU int) (p *Pair, err error) {
	p = &Pair{Prefix: prefix}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	for i, name := range []string{"a", "b"} {
		n := &Node{
			Name:     name,
			Underlay: netip.AddrFrom4([4]byte{192, 0, 2, byte(i + 1)}),
			Range:    netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(32 + 4*i), 0, 0}), 14),
		}
		n.Gateway = n.Range.Addr().Next()
		n.PodAddr = n.Gateway.Next()
		if n.NS, err = Add(prefix + "-" + name); err != nil {
			return p, err
		}
		p.all = append(p.all, n.NS)
		if n.Pod, err = Add(prefix + "-" + name + "pod"); err != nil {
			return p, err
		}
		p.all = append(p.all, n.Pod)
		p.Nodes[i] = n
	}
	a, b := p.Nodes[0], p.Nodes[1]
	if err := veth(a.NS, "ul0", b.NS, "ul0", UnderlayMTU); err != nil {
		return p, err
	}
	for _, n := range p.Nodes {
		if err := addrUp(n.NS, "ul0", netip.PrefixFrom(n.Underlay, 24)); err != nil {
			return p, err
		}
		if err := veth(n.NS, "pod0", n.Pod, "eth0", podMTU); err != nil {
			return p, err
		}
		if err := addrUp(n.NS, "pod0", netip.PrefixFrom(n.Gateway, 24)); err != nil {
			return p, err
		}
		if err := addrUp(n.Pod, "eth0", netip.PrefixFrom(n.PodAddr, 24)); err != nil {
			return p, err
		}
		if _, err := n.Pod.Exec(context.Background(), "ip", "route", "add", "default", "via", n.Gateway.String()); err != nil {
			return p, err
		}
		if _, err := n.NS.Exec(context.Background(), "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"); err != nil {
			return p, err
		}
	}
	return p, nil
}

// veth makes a veth pair with one end in each namespace, without
// touching the caller's namespace.
func veth(a *NS, aName string, b *NS, bName string, mtu int) error {
	h, err := a.Handle()
	if err != nil {
		return err
	}
	defer h.Close()
	bfd, err := netns.GetFromPath(b.Path)
	if err != nil {
		return err
	}
	defer bfd.Close()
	v := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: aName, MTU: mtu},
		PeerName:      bName,
		PeerNamespace: netlink.NsFd(bfd),
	}
	if err := h.LinkAdd(v); err != nil {
		return fmt.Errorf("veth %s/%s - %s/%s: %w", a.Name, aName, b.Name, bName, err)
	}
	return nil
}

func addrUp(n *NS, dev string, addr netip.Prefix) error {
	h, err := n.Handle()
	if err != nil {
		return err
	}
	defer h.Close()
	l, err := h.LinkByName(dev)
	if err != nil {
		return fmt.Errorf("%s in %s: %w", dev, n.Name, err)
	}
	if l.Attrs().MTU == 0 {
		return fmt.Errorf("%s in %s has no MTU", dev, n.Name)
	}
	ipn := &net.IPNet{IP: addr.Addr().AsSlice(), Mask: net.CIDRMask(addr.Bits(), 32)}
	if err := h.AddrAdd(l, &netlink.Addr{IPNet: ipn}); err != nil {
		return fmt.Errorf("address %s on %s in %s: %w", addr, dev, n.Name, err)
	}
	if err := h.LinkSetUp(l); err != nil {
		return fmt.Errorf("%s up in %s: %w", dev, n.Name, err)
	}
	return nil
}

// Close removes every namespace of the pair.
func (p *Pair) Close() error {
	var errs []error
	for _, n := range p.all {
		errs = append(errs, n.Del())
	}
	p.all = nil
	return errors.Join(errs...)
}

// Leftovers lists the namespaces whose names start with prefix, for a
// test to check that none survive it.
func Leftovers(prefix string) []string {
	entries, _ := os.ReadDir("/run/netns")
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			out = append(out, e.Name())
		}
	}
	return out
}
