package router

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// observeBridge reads the bridge named name in this process's network
// namespace: its ports, its IPv4 addresses and its IPv4 neighbours that
// are not failed or unresolved. A missing bridge is no error (zero ports).
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
	for _, l := range links {
		if l.Attrs().MasterIndex == idx {
			seen.Ports++
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
		}
	}
	return seen, nil
}
