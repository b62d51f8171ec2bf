package router

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// observeBridge reads the bridge named name in this process's network
// namespace: its ports, its IPv4 addresses, its IPv4 neighbours that are
// not failed or unresolved, and which of those have a MAC the bridge
// learnt on a port (bridge fdb). A missing bridge is no error (zero
// ports).
func observeBridge(name string) (bridgeSeen, error) {
	var seen bridgeSeen
	br, err := netlink.LinkByName(name)
	var notFound netlink.LinkNotFoundError
	switch {
	case errors.As(err, &notFound):
		return seen, nil
	case err != nil:
		return seen, fmt.Errorf("looking up bridge %s: %w", name, err)
	case br.Type() != "bridge":
		return seen, nil
	}
	idx := br.Attrs().Index
	links, err := netlink.LinkList()
	if err != nil {
		return seen, fmt.Errorf("listing links: %w", err)
	}
	learnt := map[string]bool{} // MACs the bridge learnt on its ports
	for _, l := range links {
		if l.Attrs().MasterIndex != idx {
			continue
		}
		seen.Ports++
		fdb, err := netlink.NeighList(l.Attrs().Index, unix.AF_BRIDGE)
		if err != nil {
			return seen, fmt.Errorf("listing the forwarding entries of %s on bridge %s: %w", l.Attrs().Name, name, err)
		}
		for _, f := range fdb {
			if f.State&unix.NUD_PERMANENT == 0 && f.LinkIndex == l.Attrs().Index {
				learnt[f.HardwareAddr.String()] = true
			}
		}
	}
	addrs, err := netlink.AddrList(br, netlink.FAMILY_V4)
	if err != nil {
		return seen, fmt.Errorf("listing the addresses of bridge %s: %w", name, err)
	}
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			ones, _ := a.Mask.Size()
			seen.Addrs = append(seen.Addrs, netip.PrefixFrom(ip.Unmap(), ones))
		}
	}
	neigh, err := netlink.NeighList(idx, netlink.FAMILY_V4)
	if err != nil {
		return seen, fmt.Errorf("listing the neighbours of bridge %s: %w", name, err)
	}
	for _, n := range neigh {
		if n.State == unix.NUD_NONE || n.State&(unix.NUD_FAILED|unix.NUD_INCOMPLETE) != 0 {
			continue
		}
		if ip, ok := netip.AddrFromSlice(n.IP); ok {
			seen.Neighbors = append(seen.Neighbors, ip.Unmap())
			if learnt[n.HardwareAddr.String()] {
				seen.Live = append(seen.Live, ip.Unmap())
			}
		}
	}
	return seen, nil
}
