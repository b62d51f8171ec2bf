package tunnel

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/weft-net/weft/tunnel/conn"
	"github.com/weft-net/weft/tunnel/tun"
)

// openKernel opens the kernel side in the calling thread's network
// namespace: the TUN device, the udp socket, IPIP (the kernel's device if
// the kernel has the ipip link type, else a raw socket) and a netlink
// handle for the routes. On failure it closes what it opened.
func (d *Device) openKernel() (err error) {
	cfg := d.cfg
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("opening netlink: %w", err)
	}
	routing := NewRouteApplier(h, cfg.TUNName, cfg.IPIPName, cfg.VXLANName)
	d.routing = routing
	defer func() {
		if err != nil {
			d.Close()
		}
	}()
	open := tun.Open
	if cfg.NoOffload {
		open = tun.OpenPlain
	}
	if d.tun, err = open(cfg.TUNName, cfg.MTU, cfg.Queues); err != nil {
		return err
	}
	if cfg.Mode != ModeIPIP {
		o := conn.UDPOptions{MaxDatagram: d.bufSize, MaxSegment: cfg.UnderlayMTU - IPv4HeaderLen - UDPHeaderLen, NoOffload: cfg.NoOffload}
		if d.binds[idxUDP], err = conn.ListenUDP(cfg.Listen, o); err != nil {
			return err
		}
	}
	switch {
	case cfg.Mode == ModeVXLAN:
		return d.openVXLAN()
	case cfg.Mode == ModeAuto && d.noVXLAN == "":
		// auto: the VXLAN device for the peers it may be used with. A
		// node that cannot have one uses udp with every peer.
		if verr := d.openVXLAN(); verr != nil {
			d.noVXLAN = verr.Error()
			if err := RemoveKernelVXLAN(cfg.VXLANName); err != nil {
				return fmt.Errorf("removing the VXLAN device that auto could not set up (%v): %w", verr, err)
			}
			d.log.Warn("auto: no vxlan on this node; its peers get udp (or ipip)", "reason", verr)
		}
	default:
		// A VXLAN device left from a run in the vxlan mode (or auto)
		// would go on taking plaintext packets: remove it.
		if err := RemoveKernelVXLAN(cfg.VXLANName); err != nil {
			return fmt.Errorf("removing the VXLAN device of an earlier vxlan run: %w", err)
		}
		if cfg.Mode == ModeAuto {
			d.log.Info("auto: no vxlan on this node", "reason", d.noVXLAN)
		}
	}
	if cfg.Mode == ModeUDP {
		return nil
	}
	if !d.ipipOK {
		// A password without trusted subnets: ipip is never used, and a
		// kernel IPIP device left from a run without a password would
		// let anyone inject plaintext packets: remove it.
		if err := RemoveKernelIPIP(cfg.IPIPName); err != nil {
			return fmt.Errorf("a password is set and ipip cannot be encrypted: %w", err)
		}
		d.log.Info("ipip is off: it cannot be encrypted, and no --trusted-subnets are given")
		return nil
	}
	kerr := EnsureKernelIPIP(h, cfg.IPIPName, cfg.Underlay, cfg.UnderlayMTU-IPv4HeaderLen)
	if kerr == nil {
		d.kernel = true
		return nil
	}
	raw, rerr := conn.ListenIPIP(d.bufSize + IPv4HeaderLen)
	if rerr == nil {
		d.binds[idxIPIP] = raw
		d.log.Info("no kernel IPIP here; ipip runs in userspace over the TUN device and a raw socket", "device", cfg.TUNName, "reason", kerr)
		return nil
	}
	if cfg.Mode == ModeIPIP {
		return fmt.Errorf("this node cannot do --encap ipip: no kernel IPIP (%v) and no raw IPIP socket (%v): use --encap udp", kerr, rerr)
	}
	d.log.Warn("this node cannot do ipip; auto uses udp only", "kernel", kerr, "userspace", rerr)
	return nil
}

// openVXLAN makes (or adopts and repairs) the VXLAN device and the
// applier of its neighbours and FDB entries.
func (d *Device) openVXLAN() error {
	cfg := d.cfg
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("opening netlink: %w", err)
	}
	mac := VTEPMAC(cfg.Self)
	idx, err := EnsureKernelVXLAN(h, VXLANLink{Name: cfg.VXLANName, VNI: cfg.VNI, Port: cfg.VXLANPort, Local: cfg.Underlay, MTU: cfg.MTU, MAC: mac})
	if err != nil {
		h.Close()
		if cfg.Mode == ModeAuto {
			return err
		}
		return fmt.Errorf("this node cannot do --encap vxlan: %w", err)
	}
	d.vteps = NewVTEPApplier(h, cfg.VXLANName)
	d.vtep = &VTEP{MAC: mac, Addr: cfg.Underlay, Port: cfg.VXLANPort, VNI: cfg.VNI}
	p, err := NewARPProber(idx, cfg.VXLANName, mac, cfg.Underlay)
	if err != nil {
		// vxlan works without; only a path that stops carrying goes
		// unnoticed.
		d.log.Warn("the vxlan paths are not probed: a path that stops carrying is not noticed", "err", err)
		return nil
	}
	d.prober = p
	if p.CsumErr != nil {
		d.log.Warn("the vxlan paths' checksums are not probed: a network device that completes inner checksums wrongly is not noticed", "err", p.CsumErr)
	}
	if p.AnswersItself() {
		d.log.Info("arp_ignore is above 0 on this node, so its kernel does not answer the peers' vxlan path probes: the router answers them (while it runs)")
	}
	p.OnAnswerChange = func(answers bool, v int) {
		if answers {
			d.log.Info("arp_ignore changed to above 0 on this node, so its kernel no longer answers the peers' vxlan path probes: the router answers them (while it runs)", "arp_ignore", v)
		} else {
			d.log.Info("arp_ignore changed to 0 on this node: its kernel answers the peers' vxlan path probes again, also while the router is down", "arp_ignore", v)
		}
	}
	return nil
}

// ErrNoKernelIPIP says that the kernel has no ipip link type (the module
// is neither built in nor loadable).
var ErrNoKernelIPIP = errors.New("the kernel has no ipip link type")

// EnsureKernelIPIP makes the kernel IPIP device name, with local end
// local, any remote end, the given MTU, and up, adopting a compatible
// device of that name and replacing an incompatible one. It returns
// ErrNoKernelIPIP (wrapped) where the kernel cannot make one.
func EnsureKernelIPIP(h *netlink.Handle, name string, local netip.Addr, mtu int) error {
	if !local.Is4() {
		return errors.New("kernel IPIP needs this node's underlay address (--host) as its local end")
	}
	want := &netlink.Iptun{
		LinkAttrs: netlink.LinkAttrs{Name: name, MTU: mtu},
		Local:     net.IP(local.AsSlice()),
		PMtuDisc:  1,
	}
	if l, err := h.LinkByName(name); err == nil {
		if why := ipipIncompatible(l, want); why != "" {
			if err := h.LinkDel(l); err != nil {
				return fmt.Errorf("replacing %s (%s): %w", name, why, err)
			}
		} else {
			if l.Attrs().MTU != mtu {
				if err := h.LinkSetMTU(l, mtu); err != nil {
					return fmt.Errorf("setting the MTU of %s: %w", name, err)
				}
			}
			return setUp(h, l)
		}
	}
	if err := h.LinkAdd(want); err != nil {
		if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENODEV) {
			return fmt.Errorf("%w: %w", ErrNoKernelIPIP, err)
		}
		return fmt.Errorf("creating kernel IPIP device %s: %w", name, err)
	}
	l, err := h.LinkByName(name)
	if err != nil {
		return fmt.Errorf("reading back %s: %w", name, err)
	}
	return setUp(h, l)
}

func setUp(h *netlink.Handle, l netlink.Link) error {
	if err := h.LinkSetUp(l); err != nil {
		return fmt.Errorf("bringing %s up: %w", l.Attrs().Name, err)
	}
	return nil
}

// ipipIncompatible says why an existing link cannot serve as the IPIP
// device, or "" if it can.
func ipipIncompatible(l netlink.Link, want *netlink.Iptun) string {
	t, ok := l.(*netlink.Iptun)
	switch {
	case !ok:
		return fmt.Sprintf("it is a %s link", l.Type())
	case !t.Local.Equal(want.Local):
		return fmt.Sprintf("its local address is %v, want %v", t.Local, want.Local)
	case t.Remote != nil && !t.Remote.IsUnspecified():
		return fmt.Sprintf("it has a fixed remote %v", t.Remote)
	}
	return ""
}

// NetlinkRoutes applies tunnel routes through a netlink handle: the
// routes of the main table whose device is one of the tunnel devices are
// weft's, and only those are touched.
type NetlinkRoutes struct {
	h    *netlink.Handle
	devs []string
}

// NewRouteApplier returns the applier for the routes on devs, through h
// (which it closes on Close).
func NewRouteApplier(h *netlink.Handle, devs ...string) *NetlinkRoutes {
	return &NetlinkRoutes{h: h, devs: devs}
}

// Close closes the netlink handle.
func (a *NetlinkRoutes) Close() error {
	a.h.Close()
	return nil
}

// SetSourceAddr gives dev the address a as a /32 (no route of the range
// comes with it), and removes its other IPv4 addresses. Traffic that leaves
// through dev and that the kernel's NAT gives the device's own address
// (kube-proxy's masquerade of a node's own traffic to a Service whose
// endpoint is a pod on another node) then carries this node's bridge
// address, which the peers accept as this node's, and not the node's
// underlay address, which they drop as a spoofed source (found by make
// conformance). It reports whether it changed anything.
func (a *NetlinkRoutes) SetSourceAddr(dev string, addr netip.Addr) (changed bool, err error) {
	l, err := a.h.LinkByName(dev)
	if err != nil {
		return false, fmt.Errorf("looking up %s: %w", dev, err)
	}
	have, err := a.h.AddrList(l, netlink.FAMILY_V4)
	if err != nil {
		return false, fmt.Errorf("listing the addresses of %s: %w", dev, err)
	}
	found := false
	for _, h := range have {
		ip, _ := netip.AddrFromSlice(h.IP)
		ones, _ := h.Mask.Size()
		if ip.Unmap() == addr && ones == 32 {
			found = true
			continue
		}
		if err := a.h.AddrDel(l, &h); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
			return changed, fmt.Errorf("removing %s from %s: %w", h.IPNet, dev, err)
		}
		changed = true
	}
	if found || !addr.Is4() {
		return changed, nil
	}
	nl := &netlink.Addr{IPNet: &net.IPNet{IP: addr.AsSlice(), Mask: net.CIDRMask(32, 32)}, Scope: unix.RT_SCOPE_UNIVERSE}
	if err := a.h.AddrAdd(l, nl); err != nil && !errors.Is(err, unix.EEXIST) {
		return changed, fmt.Errorf("giving %s the address %s: %w", dev, addr, err)
	}
	return true, nil
}

// Routes lists the IPv4 routes of the main table on the tunnel devices
// that exist.
func (a *NetlinkRoutes) Routes() ([]Route, error) {
	var out []Route
	for _, dev := range a.devs {
		l, err := a.h.LinkByName(dev)
		if err != nil {
			var nf netlink.LinkNotFoundError
			if errors.As(err, &nf) {
				continue
			}
			return nil, fmt.Errorf("looking up %s: %w", dev, err)
		}
		rs, err := a.h.RouteListFiltered(netlink.FAMILY_V4,
			&netlink.Route{LinkIndex: l.Attrs().Index, Table: unix.RT_TABLE_MAIN},
			netlink.RT_FILTER_OIF|netlink.RT_FILTER_TABLE)
		if err != nil {
			return nil, fmt.Errorf("listing the routes on %s: %w", dev, err)
		}
		for _, r := range rs {
			if r.Dst == nil || r.Protocol == unix.RTPROT_KERNEL || r.Type != unix.RTN_UNICAST {
				continue
			}
			out = append(out, fromNetlink(r, dev))
		}
	}
	return out, nil
}

func fromNetlink(r netlink.Route, dev string) Route {
	ip, _ := netip.AddrFromSlice(r.Dst.IP)
	ones, _ := r.Dst.Mask.Size()
	out := Route{Dst: netip.PrefixFrom(ip.Unmap(), ones), Dev: dev}
	if a, ok := netip.AddrFromSlice(r.Gw); ok {
		out.Via = a.Unmap()
	}
	if a, ok := netip.AddrFromSlice(r.Src); ok {
		out.Src = a.Unmap()
	}
	return out
}

func (a *NetlinkRoutes) toNetlink(r Route, index map[string]int) (*netlink.Route, error) {
	idx, ok := index[r.Dev]
	if !ok {
		l, err := a.h.LinkByName(r.Dev)
		if err != nil {
			return nil, fmt.Errorf("route %s: %w", r, err)
		}
		idx = l.Attrs().Index
		index[r.Dev] = idx
	}
	nr := &netlink.Route{
		LinkIndex: idx,
		Dst:       &net.IPNet{IP: r.Dst.Addr().AsSlice(), Mask: net.CIDRMask(r.Dst.Bits(), 32)},
		Table:     unix.RT_TABLE_MAIN,
		Scope:     netlink.SCOPE_LINK,
	}
	if r.Src.IsValid() {
		nr.Src = r.Src.AsSlice()
	}
	if r.Via.IsValid() {
		nr.Gw = r.Via.AsSlice()
		nr.Flags = int(netlink.FLAG_ONLINK)
		nr.Scope = netlink.SCOPE_UNIVERSE
	}
	return nr, nil
}

// Apply implements RouteApplier: it removes the tunnel devices' routes
// that are not wanted and adds or replaces the wanted ones that are
// missing. It goes on past a failed route and returns every error.
func (a *NetlinkRoutes) Apply(want []Route) (added, removed []Route, err error) {
	if err := checkWant(want); err != nil {
		return nil, nil, err
	}
	have, err := a.Routes()
	if err != nil {
		return nil, nil, err
	}
	add, del := DiffRoutes(want, have)
	return a.ApplyDiff(add, del)
}

// ApplyDiff adds (or replaces) the routes add and removes the routes del,
// without reading the kernel's routes first: DiffRoutes against what the
// last apply left. It goes on past a failed route and returns every
// error; a route to remove that is already gone is not one.
func (a *NetlinkRoutes) ApplyDiff(add, del []Route) (added, removed []Route, err error) {
	index := map[string]int{}
	var errs []error
	for _, r := range add {
		nr, err := a.toNetlink(r, index)
		if err == nil {
			nr.Protocol = unix.RTPROT_STATIC
			err = a.h.RouteReplace(nr)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("adding route %s: %w", r, err))
			continue
		}
		added = append(added, r)
	}
	for _, r := range del {
		nr, err := a.toNetlink(r, index)
		if err == nil {
			err = a.h.RouteDel(nr)
		}
		if err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("removing route %s: %w", r, err))
			continue
		}
		removed = append(removed, r)
	}
	return added, removed, errors.Join(errs...)
}
