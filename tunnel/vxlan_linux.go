package tunnel

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// VXLANLink is the VXLAN device as weft wants it.
type VXLANLink struct {
	Name  string
	VNI   uint32
	Port  uint16
	Local netip.Addr // this node's underlay address: the outer source
	MTU   int
	MAC   [6]byte // VTEPMAC of this peer
}

// EnsureKernelVXLAN makes the VXLAN device as want says, up, with
// learning off and no multicast group, adopting a device of that name
// whose kind, VNI, port, local address and learning match (its MTU and MAC
// are repaired in place, so its routes, neighbours and FDB entries stay)
// and replacing any other. It returns the device's index.
func EnsureKernelVXLAN(h *netlink.Handle, want VXLANLink) (int, error) {
	if !want.Local.Is4() {
		return 0, errors.New("vxlan needs this node's underlay address (--host) as the local end of its device")
	}
	if want.VNI == 0 || want.VNI > MaxVNI {
		return 0, fmt.Errorf("--vxlan-vni %d out of range 1..%d", want.VNI, MaxVNI)
	}
	if want.Port == 0 {
		return 0, errors.New("--vxlan-port 0: give the UDP port of VXLAN, e.g. 4789")
	}
	mac := net.HardwareAddr(want.MAC[:])
	if l, err := h.LinkByName(want.Name); err == nil {
		if why := vxlanIncompatible(l, want); why != "" {
			if err := h.LinkDel(l); err != nil {
				return 0, fmt.Errorf("replacing %s (%s): %w", want.Name, why, err)
			}
		} else {
			if l.Attrs().MTU != want.MTU {
				if err := h.LinkSetMTU(l, want.MTU); err != nil {
					return 0, fmt.Errorf("setting the MTU of %s: %w", want.Name, err)
				}
			}
			if !slices.Equal(l.Attrs().HardwareAddr, mac) {
				if err := h.LinkSetHardwareAddr(l, mac); err != nil {
					return 0, fmt.Errorf("setting the MAC of %s: %w", want.Name, err)
				}
			}
			return l.Attrs().Index, setUp(h, l)
		}
	} else if !errors.As(err, new(netlink.LinkNotFoundError)) {
		return 0, fmt.Errorf("looking up %s: %w", want.Name, err)
	}
	v := &netlink.Vxlan{
		LinkAttrs: netlink.LinkAttrs{Name: want.Name, MTU: want.MTU, HardwareAddr: mac},
		VxlanId:   int(want.VNI),
		SrcAddr:   net.IP(want.Local.AsSlice()),
		Port:      int(want.Port),
		Learning:  false,
	}
	if err := h.LinkAdd(v); err != nil {
		return 0, fmt.Errorf("creating the VXLAN device %s (VNI %d, port %d): %w", want.Name, want.VNI, want.Port, err)
	}
	l, err := h.LinkByName(want.Name)
	if err != nil {
		return 0, fmt.Errorf("reading back %s: %w", want.Name, err)
	}
	if !slices.Equal(l.Attrs().HardwareAddr, mac) {
		if err := h.LinkSetHardwareAddr(l, mac); err != nil {
			return 0, fmt.Errorf("setting the MAC of %s: %w", want.Name, err)
		}
	}
	return l.Attrs().Index, setUp(h, l)
}

// vxlanIncompatible says why an existing link cannot serve as the VXLAN
// device, or "" if it can.
func vxlanIncompatible(l netlink.Link, want VXLANLink) string {
	v, ok := l.(*netlink.Vxlan)
	switch {
	case !ok:
		return fmt.Sprintf("it is a %s link", l.Type())
	case v.VxlanId != int(want.VNI):
		return fmt.Sprintf("its VNI is %d, want %d", v.VxlanId, want.VNI)
	case v.Port != int(want.Port):
		return fmt.Sprintf("its port is %d, want %d", v.Port, want.Port)
	case !v.SrcAddr.Equal(net.IP(want.Local.AsSlice())):
		return fmt.Sprintf("its local address is %v, want %v", v.SrcAddr, want.Local)
	case v.Learning:
		return "it learns addresses"
	case v.Group != nil && !v.Group.IsUnspecified():
		return fmt.Sprintf("it has the group %v", v.Group)
	case v.FlowBased:
		return "it is flow-based (external)"
	}
	return ""
}

// RemoveKernelVXLAN deletes the VXLAN device name from the calling
// thread's network namespace, if there is one and it is a VXLAN device
// (weft reset; and a start in another mode). Its routes, neighbours and
// FDB entries go with it.
func RemoveKernelVXLAN(name string) error { return removeLink[*netlink.Vxlan](name) }

// NetlinkVTEPs keeps the neighbours and FDB entries of the VXLAN device
// through a netlink handle. Only permanent entries are weft's: the
// kernel's own (the device's MAC in its FDB) are left alone.
type NetlinkVTEPs struct {
	h    *netlink.Handle
	name string
}

// NewVTEPApplier returns the applier for the device name, through h
// (which it closes on Close).
func NewVTEPApplier(h *netlink.Handle, name string) *NetlinkVTEPs {
	return &NetlinkVTEPs{h: h, name: name}
}

// Close closes the netlink handle.
func (a *NetlinkVTEPs) Close() error {
	a.h.Close()
	return nil
}

// Entries reads the device's entries: every permanent IPv4 neighbour
// whose MAC has a permanent FDB entry (with that entry's destination). A neighbour without an FDB entry, or an FDB entry without a
// neighbour, is returned as an entry with the missing half zero, so that
// Apply removes it.
func (a *NetlinkVTEPs) Entries() ([]VTEPEntry, int, error) {
	l, err := a.h.LinkByName(a.name)
	if err != nil {
		return nil, 0, fmt.Errorf("looking up %s: %w", a.name, err)
	}
	idx := l.Attrs().Index
	neighs, err := a.h.NeighList(idx, netlink.FAMILY_V4)
	if err != nil {
		return nil, 0, fmt.Errorf("listing the neighbours of %s: %w", a.name, err)
	}
	fdb, err := a.h.NeighList(idx, unix.AF_BRIDGE)
	if err != nil {
		return nil, 0, fmt.Errorf("listing the FDB of %s: %w", a.name, err)
	}
	fwd := map[[6]byte]netip.Addr{}
	for _, n := range fdb {
		if n.State&netlink.NUD_PERMANENT == 0 || len(n.HardwareAddr) != 6 || n.IP == nil {
			continue
		}
		ip, ok := netip.AddrFromSlice(n.IP)
		if !ok {
			continue
		}
		fwd[[6]byte(n.HardwareAddr)] = ip.Unmap()
	}
	var out []VTEPEntry
	used := map[[6]byte]bool{}
	for _, n := range neighs {
		if n.State&netlink.NUD_PERMANENT == 0 || len(n.HardwareAddr) != 6 {
			continue
		}
		ip, ok := netip.AddrFromSlice(n.IP)
		if !ok {
			continue
		}
		mac := [6]byte(n.HardwareAddr)
		e := VTEPEntry{Addr: ip.Unmap(), MAC: mac}
		if f, ok := fwd[mac]; ok {
			e.Dst = f
			used[mac] = true
		}
		out = append(out, e)
	}
	for mac, f := range fwd {
		if !used[mac] {
			out = append(out, VTEPEntry{MAC: mac, Dst: f})
		}
	}
	return out, idx, nil
}

// Apply implements VTEPApplier: FDB entries go in before the neighbours
// that lead to them, and neighbours out before their FDB entries.
func (a *NetlinkVTEPs) Apply(want []VTEPEntry, keep bool) (added, removed []VTEPEntry, err error) {
	if err := checkVTEPs(want); err != nil {
		return nil, nil, err
	}
	have, idx, err := a.Entries()
	if err != nil {
		return nil, nil, err
	}
	add, del := DiffVTEPs(want, have)
	if keep {
		del = nil
	}
	return a.applyDiff(idx, add, del)
}

// ApplyDiff adds (or replaces) the entries add and removes the entries
// del, without reading the device's entries first: DiffVTEPs against what
// the last apply left. An entry to remove that is already gone is not an
// error.
func (a *NetlinkVTEPs) ApplyDiff(add, del []VTEPEntry) (added, removed []VTEPEntry, err error) {
	l, err := a.h.LinkByName(a.name)
	if err != nil {
		return nil, nil, fmt.Errorf("looking up %s: %w", a.name, err)
	}
	return a.applyDiff(l.Attrs().Index, add, del)
}

func (a *NetlinkVTEPs) applyDiff(idx int, add, del []VTEPEntry) (added, removed []VTEPEntry, err error) {
	var errs []error
	for _, e := range add {
		fdb := a.fdb(idx, e)
		err := a.h.NeighSet(fdb)
		if err == nil {
			err = a.h.NeighSet(&netlink.Neigh{LinkIndex: idx, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
				Type: unix.RTN_UNICAST, IP: net.IP(e.Addr.AsSlice()), HardwareAddr: net.HardwareAddr(e.MAC[:])})
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("adding vxlan entry %s: %w", e, err))
			continue
		}
		added = append(added, e)
	}
	for _, e := range del {
		var err error
		if e.Addr.IsValid() {
			err = a.h.NeighDel(&netlink.Neigh{LinkIndex: idx, Family: netlink.FAMILY_V4, IP: net.IP(e.Addr.AsSlice()), HardwareAddr: net.HardwareAddr(e.MAC[:])})
			if errors.Is(err, unix.ENOENT) {
				err = nil
			}
		}
		if err == nil && e.Dst.IsValid() {
			err = a.h.NeighDel(a.fdb(idx, e))
			if errors.Is(err, unix.ENOENT) {
				err = nil
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("removing vxlan entry %s: %w", e, err))
			continue
		}
		removed = append(removed, e)
	}
	return added, removed, errors.Join(errs...)
}

func (a *NetlinkVTEPs) fdb(idx int, e VTEPEntry) *netlink.Neigh {
	n := &netlink.Neigh{LinkIndex: idx, Family: unix.AF_BRIDGE, State: netlink.NUD_PERMANENT, Flags: netlink.NTF_SELF,
		HardwareAddr: net.HardwareAddr(e.MAC[:])}
	if e.Dst.IsValid() {
		n.IP = net.IP(e.Dst.AsSlice())
	}
	return n
}
