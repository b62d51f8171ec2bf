package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/weft-net/weft/e2e"
	"github.com/weft-net/weft/tunnel"
)

// library builds the control for mode: the same two-node cluster and
// underlay as the routers', but no router, bridge, CNI or nftables: a
// tunnel.Device runs in this process in each node, as tunnelbench runs it,
// and each pod is a namespace behind a veth routed by its node. The
// difference between this path and the router's is what the product adds
// around the tunnel library.
func (b *bench) library(mode tunnel.Mode) (path, error) {
	ctx, cancel := context.WithTimeout(b.ctx, 2*time.Minute)
	defer cancel()
	r, err := e2e.NewRun(e2e.Options{Log: b.log, BinDir: b.cfg.binDir})
	if err != nil {
		return path{}, err
	}
	b.runs = append(b.runs, r)
	c, err := r.NewCluster(ctx, e2e.ClusterOpts{Nodes: 2})
	if err != nil {
		return path{}, err
	}
	mtu := e2eUnderlayMTU - tunnel.Overhead(mode)
	var pods [2]*e2e.Netns
	var podIPs, gws [2]netip.Addr
	var ring []tunnel.OwnedRange
	var peers []tunnel.Peer
	for i, n := range c.Nodes {
		// Node i owns 10.(32+4i).0.0/14: its gateway is .0.1, its pod .0.2.
		rng := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(32 + 4*i), 0, 0}), 14)
		gws[i] = rng.Addr().Next()
		podIPs[i] = gws[i].Next()
		last := rng.Addr().As4()
		last[1] |= 3
		last[2], last[3] = 255, 255
		ring = append(ring, tunnel.OwnedRange{First: rng.Addr(), Last: netip.AddrFrom4(last), Peer: n.Name})
		if pods[i], err = r.NewNetns(ctx, n.Name+"-lib"); err != nil {
			return path{}, err
		}
		if err := podBehind(ctx, n, pods[i], mtu, gws[i], podIPs[i]); err != nil {
			return path{}, fmt.Errorf("pod of node %s: %w", n.Name, err)
		}
	}
	var devs []*tunnel.Device
	for _, n := range c.Nodes {
		d, err := startDevice(r, n, mode, mtu, b.log)
		if err != nil {
			return path{}, err
		}
		devs = append(devs, d)
		peers = append(peers, tunnel.Peer{Name: n.Name, Underlay: n.UnderlayIP, DataPort: tunnel.DefaultDataPort, Encaps: d.Encaps()})
	}
	for i, d := range devs {
		if err := d.SetPeers(peers); err != nil {
			return path{}, err
		}
		if err := d.SetRing(ring, gws[i]); err != nil {
			return path{}, err
		}
	}
	if err := e2e.Ping(ctx, pods[0], podIPs[1]); err != nil {
		return path{}, fmt.Errorf("library-level %s path: %w", mode, err)
	}
	name := "weft " + string(mode)
	if mode == tunnel.ModeIPIP {
		name += map[bool]string{true: " (kernel IPIP)", false: " (userspace IPIP)"}[devs[0].KernelIPIP()]
	}
	progress("%s: control path: tunnel library in this process, same underlay, pods %s -> %s (pod MTU %d)", mode, podIPs[0], podIPs[1], mtu)
	return path{name: name + ", tunnel library in this process (pod to pod, control)", run: r, client: pods[0], server: pods[1], addr: podIPs[1], self: true}, nil
}

// e2eUnderlayMTU is the MTU of the harness's underlay links (its default).
const e2eUnderlayMTU = 1500

// startDevice opens a tunnel.Device inside node n and runs it until the
// run closes.
func startDevice(r *e2e.Run, n *e2e.Node, mode tunnel.Mode, mtu int, log *slog.Logger) (*tunnel.Device, error) {
	var d *tunnel.Device
	err := n.NS.Do(func() error {
		var err error
		d, err = tunnel.New(tunnel.Config{Self: n.Name, Mode: mode, MTU: mtu, Underlay: n.UnderlayIP, Logger: log.With("node", n.Name)})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("tunnel in node %s: %w", n.Name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	r.Defer("stop the tunnel of node "+n.Name, func() error {
		cancel()
		return <-done
	})
	return d, nil
}

// podBehind connects pod to node n with a veth pair (pod0 in the node,
// eth0 in the pod) of the given MTU: gw/24 on pod0, ip/24 on eth0, the
// pod's default route via gw, and forwarding on in the node.
func podBehind(ctx context.Context, n *e2e.Node, pod *e2e.Netns, mtu int, gw, ip netip.Addr) error {
	if _, err := n.NS.Exec(ctx, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"); err != nil {
		return err
	}
	podNS, err := netns.GetFromPath(pod.Path)
	if err != nil {
		return err
	}
	defer podNS.Close()
	err = n.NS.WithHandle(func(h *netlink.Handle) error {
		v := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: "pod0", MTU: mtu},
			PeerName:      "eth0",
			PeerMTU:       uint32(mtu),
			PeerNamespace: netlink.NsFd(int(podNS)),
		}
		if err := h.LinkAdd(v); err != nil {
			return fmt.Errorf("veth pod0: %w", err)
		}
		return addrUp(h, "pod0", netip.PrefixFrom(gw, 24))
	})
	if err != nil {
		return err
	}
	return pod.WithHandle(func(h *netlink.Handle) error {
		if err := addrUp(h, "eth0", netip.PrefixFrom(ip, 24)); err != nil {
			return err
		}
		l, err := h.LinkByName("eth0")
		if err != nil {
			return err
		}
		return h.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: gw.AsSlice()})
	})
}

// addrUp puts addr on the link named dev and sets it up.
func addrUp(h *netlink.Handle, dev string, addr netip.Prefix) error {
	l, err := h.LinkByName(dev)
	if err != nil {
		return err
	}
	ipn := &net.IPNet{IP: addr.Addr().AsSlice(), Mask: net.CIDRMask(addr.Bits(), 32)}
	if err := h.AddrAdd(l, &netlink.Addr{IPNet: ipn}); err != nil {
		return fmt.Errorf("address %s on %s: %w", addr, dev, err)
	}
	return h.LinkSetUp(l)
}

// selfCPU is the user and system CPU time of this process so far.
func selfCPU() time.Duration {
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
