package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/weft-net/weft/e2e"
)

// The pod-path baselines: the same kernel VXLAN between two node
// namespaces as the vxlan baseline, with one pod per node behind it as a
// pod network without weft would attach it, and no router, no nftables
// and the namespaces' default sysctls (bridge-nf-call-iptables is 1 where
// br_netfilter is loaded, as on weft's nodes). What weft's vxlan path costs
// beyond them is what weft's own parts (its bridge setup, the guard's
// rules, the pod MTU) cost; what they cost beyond the node-to-node VXLAN is
// the price of a pod behind a veth, paid by any such network.
//
//   - bridge: the reference bridge plugin with host-local IPAM (a veth into
//     a Linux bridge, the bridge the gateway), the layout weft has too;
//   - routed: a veth routed by its node, no bridge (the host side answers
//     for the gateway, as Calico's veths do).
const (
	podBridgeRow = "reference bridge plugin over kernel VXLAN (pod to pod, no weft)"
	podRoutedRow = "routed veth over kernel VXLAN (pod to pod, no bridge, no weft)"
)

// podBaseSubnet returns node i's pod subnet of the bridge baseline
// (10.252.i.0/24) or the routed one (10.253.i.0/24): apart from weft's pods
// (10.32.0.0/12), the underlay (10.250.0.0/24) and the VXLAN baseline
// (10.251.0.0/24).
func podBaseSubnet(i int, routed bool) netip.Prefix {
	b := byte(252)
	if routed {
		b = 253
	}
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, b, byte(i + 1), 0}), 24)
}

// routedGateway is the link-local gateway the routed baseline's pods use;
// the node's veth end is its neighbour, set by hand.
var routedGateway = netip.MustParseAddr("169.254.1.1")

// podBaselines builds a two-node cluster without routers, a kernel VXLAN
// between its nodes and both pod baselines on it, and returns their paths.
func (b *bench) podBaselines() ([]path, error) {
	ctx, cancel := context.WithTimeout(b.ctx, 2*time.Minute)
	defer cancel()
	r, err := e2e.NewRun(e2e.Options{Log: b.log, BinDir: b.cfg.binDir})
	if err != nil {
		return nil, err
	}
	b.runs = append(b.runs, r)
	c, err := r.NewCluster(ctx, e2e.ClusterOpts{Nodes: 2, CNIPath: []string{e2e.RefPluginDir}})
	if err != nil {
		return nil, err
	}
	vx, err := addBenchVXLAN(ctx, c)
	if err != nil {
		return nil, err
	}
	mtu := e2eUnderlayMTU - 50 // VXLAN over IPv4, as weft's vxlan pods have
	var bridged, routed [2]netip.Addr
	var refPods, routedPods [2]*e2e.Netns
	for i, n := range c.Nodes {
		conf, err := mtuConfList(e2e.RefConfList(podBaseSubnet(i, false), n.Dir+"/ipam", false), mtu)
		if err != nil {
			return nil, err
		}
		if err := n.WriteConfList("10-ref.conflist", conf); err != nil {
			return nil, err
		}
		p, err := n.AddPod(ctx, "ref")
		if err != nil {
			return nil, fmt.Errorf("reference bridge pod on node %s: %w", n.Name, err)
		}
		bridged[i], refPods[i] = p.IP, p.NS
		rp, err := r.NewNetns(ctx, n.Name+"-routed")
		if err != nil {
			return nil, err
		}
		routedPods[i] = rp
		routed[i] = podBaseSubnet(i, true).Addr().Next().Next() // .2
		if err := routedPod(n, rp, mtu, routed[i]); err != nil {
			return nil, fmt.Errorf("routed pod on node %s: %w", n.Name, err)
		}
	}
	for i, n := range c.Nodes {
		other := 1 - i
		for _, routedToo := range []bool{false, true} {
			dst := podBaseSubnet(other, routedToo).String()
			if _, err := n.NS.Exec(ctx, "ip", "route", "add", dst, "via", vx[other].String(), "dev", vxlanDev); err != nil {
				return nil, err
			}
		}
	}
	if err := e2e.Ping(ctx, refPods[0], bridged[1]); err != nil {
		return nil, fmt.Errorf("reference bridge pod to pod over kernel VXLAN: %w", err)
	}
	if err := e2e.Ping(ctx, routedPods[0], routed[1]); err != nil {
		return nil, fmt.Errorf("routed pod to pod over kernel VXLAN: %w", err)
	}
	progress("pod baselines (no router, no nftables, pod MTU %d, over kernel VXLAN %s -> %s): reference bridge plugin %s -> %s, routed veth %s -> %s",
		mtu, vx[0], vx[1], bridged[0], bridged[1], routed[0], routed[1])
	return []path{
		{name: podBridgeRow, run: r, client: refPods[0], server: refPods[1], addr: bridged[1]},
		{name: podRoutedRow, run: r, client: routedPods[0], server: routedPods[1], addr: routed[1]},
	}, nil
}

// mtuConfList sets mtu on the bridge plugin of a reference conflist.
func mtuConfList(conf []byte, mtu int) ([]byte, error) {
	var m map[string]any
	if err := json.Unmarshal(conf, &m); err != nil {
		return nil, err
	}
	plugins, _ := m["plugins"].([]any)
	if len(plugins) == 0 {
		return nil, fmt.Errorf("reference conflist without plugins: %s", conf)
	}
	first, ok := plugins[0].(map[string]any)
	if !ok || first["type"] != "bridge" {
		return nil, fmt.Errorf("reference conflist does not start with the bridge plugin: %s", conf)
	}
	first["mtu"] = mtu
	return json.Marshal(m)
}

// routedPod connects pod to node n with a veth pair (rpod0 in the node,
// eth0 in the pod) of the given MTU, no bridge: ip/32 on eth0, the pod's
// default route via routedGateway on eth0 with rpod0's address as its
// permanent neighbour, and on the node a /32 route to ip through rpod0.
func routedPod(n *e2e.Node, pod *e2e.Netns, mtu int, ip netip.Addr) error {
	podNS, err := netns.GetFromPath(pod.Path)
	if err != nil {
		return err
	}
	defer podNS.Close()
	var hostMAC net.HardwareAddr
	err = n.NS.WithHandle(func(h *netlink.Handle) error {
		v := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: "rpod0", MTU: mtu},
			PeerName:      "eth0",
			PeerMTU:       uint32(mtu),
			PeerNamespace: netlink.NsFd(int(podNS)),
		}
		if err := h.LinkAdd(v); err != nil {
			return fmt.Errorf("veth rpod0: %w", err)
		}
		l, err := h.LinkByName("rpod0")
		if err != nil {
			return err
		}
		hostMAC = l.Attrs().HardwareAddr
		if err := h.LinkSetUp(l); err != nil {
			return err
		}
		return h.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(32, 32)}, Scope: netlink.SCOPE_LINK})
	})
	if err != nil {
		return err
	}
	if _, err := n.NS.Exec(context.Background(), "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"); err != nil {
		return err
	}
	return pod.WithHandle(func(h *netlink.Handle) error {
		if err := addrUp(h, "eth0", netip.PrefixFrom(ip, 32)); err != nil {
			return err
		}
		l, err := h.LinkByName("eth0")
		if err != nil {
			return err
		}
		idx := l.Attrs().Index
		if err := h.NeighAdd(&netlink.Neigh{LinkIndex: idx, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT, IP: routedGateway.AsSlice(), HardwareAddr: hostMAC}); err != nil {
			return fmt.Errorf("neighbour %s: %w", routedGateway, err)
		}
		gw := &net.IPNet{IP: routedGateway.AsSlice(), Mask: net.CIDRMask(32, 32)}
		if err := h.RouteAdd(&netlink.Route{LinkIndex: idx, Dst: gw, Scope: netlink.SCOPE_LINK}); err != nil {
			return fmt.Errorf("route to %s: %w", routedGateway, err)
		}
		return h.RouteAdd(&netlink.Route{LinkIndex: idx, Gw: routedGateway.AsSlice()})
	})
}

// addBenchVXLAN adds the baseline's kernel VXLAN (vxlanDev, vxlanSubnet)
// between the two nodes of c and returns each node's address on it.
func addBenchVXLAN(ctx context.Context, c *e2e.Cluster) ([2]netip.Addr, error) {
	var vx [2]netip.Addr
	for i, n := range c.Nodes {
		if err := vxlanFree(ctx, n); err != nil {
			return vx, err
		}
		other := c.Nodes[1-i]
		vx[i] = netip.AddrFrom4([4]byte{10, 251, 0, byte(i + 1)})
		for _, cmd := range [][]string{
			{"ip", "link", "add", vxlanDev, "type", "vxlan", "id", vxlanID, "local", n.UnderlayIP.String(), "remote", other.UnderlayIP.String(), "dstport", strconv.Itoa(vxlanPort), "dev", "eth0"},
			{"ip", "addr", "add", netip.PrefixFrom(vx[i], vxlanSubnet.Bits()).String(), "dev", vxlanDev},
			{"ip", "link", "set", vxlanDev, "up"},
		} {
			if _, err := n.NS.Exec(ctx, cmd...); err != nil {
				return vx, err
			}
		}
	}
	if err := e2e.Ping(ctx, c.Nodes[0].NS, vx[1]); err != nil {
		return vx, fmt.Errorf("kernel VXLAN between the nodes: %w", err)
	}
	return vx, nil
}
