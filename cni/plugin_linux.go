//go:build linux

package cni

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ip"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/weft-net/weft/api"
)

// Add answers ADD: it asks the router for the attachment's address, makes
// the veth pair (pod end CNI_IFNAME in CNI_NETNS with the address, MTU and a
// default route via the bridge; host end HostVethName on the bridge with
// hairpin on) and prints the result. A repeated ADD converges on the same
// state. If anything fails after the allocation, the address is released
// (only if this ADD allocated it) and a veth this ADD made is deleted.
//
// Add runs in the node's network namespace; it enters the pod's only through
// NetNS.Do, and talks to the router outside it.
func (p *Plugin) Add(args *skel.CmdArgs) (err error) {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	att, err := attachment(args.ContainerID, args.IfName)
	if err != nil {
		return err
	}
	if args.Netns == "" {
		return types.NewError(types.ErrInvalidEnvironmentVariables, "CNI_NETNS is empty: ADD needs the path of the pod's network namespace", "")
	}
	podNamespace, podName, err := parsePodArgs(args.Args)
	if err != nil {
		return err
	}
	log, done := p.log(conf, "ADD")
	defer done()
	log = log.With("attachment", att.String(), "netns", args.Netns)

	podNS, err := openPodNS(args.Netns)
	if err != nil {
		return err
	}
	defer podNS.Close()

	ctx, cancel := p.context()
	defer cancel()
	client := api.NewClient(conf.Socket)
	alloc, err := client.Allocate(ctx, api.AllocateRequest{
		Attachment: att, Netns: args.Netns, PodNamespace: podNamespace, PodName: podName,
	})
	if err != nil {
		log.Info("allocation failed", "err", err)
		return routerError("allocating an address for "+att.String(), err)
	}
	log.Debug("allocated", "address", alloc.Address, "gateway", alloc.Gateway, "bridge", alloc.Bridge, "mtu", alloc.MTU, "new", alloc.New)

	hostName := HostVethName(att.ContainerID, att.IfName)
	success, created := false, false
	defer func() {
		if success {
			return
		}
		log.Info("ADD failed, rolling back", "err", err, "deleteVeth", created, "release", alloc.New)
		if created {
			if derr := deleteVeth(podNS, att.IfName, hostName); derr != nil {
				log.Warn("rollback: could not delete the veth", "err", derr)
			}
		}
		if alloc.New {
			rctx, rcancel := p.context()
			defer rcancel()
			if _, rerr := client.Release(rctx, att); rerr != nil {
				log.Warn("rollback: could not release the address; DEL will", "address", alloc.Address, "err", rerr)
			}
		}
	}()

	pn, err := parseAllocation(alloc)
	if err != nil {
		return internalError("%w", err)
	}
	var pod linkInfo
	err = podNS.Do(func(hostNS ns.NetNS) error {
		var err error
		pod, err = ensurePodIface(hostNS, att.IfName, hostName, pn, &created, log)
		return err
	})
	if err != nil {
		return internalError("setting up %s in the pod network namespace %s: %w", att.IfName, args.Netns, err)
	}
	host, err := ensureHostVeth(hostName, pn)
	if err != nil {
		return err
	}
	result := buildResult(pn, args.Netns, host, pod)
	if err = printResult(p.stdout, result, conf.CNIVersion); err != nil {
		return internalError("printing the result: %w", err)
	}
	success = true
	log.Info("pod attached", "address", alloc.Address, "hostVeth", hostName, "bridge", pn.Bridge, "new", alloc.New)
	return nil
}

// Del answers DEL, and succeeds however often it is repeated: it deletes the
// pod interface if the pod netns is still there, the host end if it is still
// there, then releases the address. When the router cannot be reached the
// interfaces are still removed, and the error asks the runtime to retry so
// that the address is not leaked.
func (p *Plugin) Del(args *skel.CmdArgs) error {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	att, err := attachment(args.ContainerID, args.IfName)
	if err != nil {
		return err
	}
	log, done := p.log(conf, "DEL")
	defer done()
	log = log.With("attachment", att.String(), "netns", args.Netns)

	if args.Netns != "" {
		err := deletePodIface(args.Netns, att.IfName)
		switch {
		case nsGone(err):
			log.Debug("pod network namespace already gone", "err", err)
		case errors.Is(err, errOwnNS):
			// A runtime bug, or a path reused for the node's namespace:
			// never delete the node's own interface of that name. The
			// pod's end goes with the host veth below.
			log.Warn("CNI_NETNS is the plugin's own network namespace, not a pod's: not touching "+att.IfName+" there", "netns", args.Netns)
		case err != nil:
			return internalError("removing %s from the pod network namespace %s: %w", att.IfName, args.Netns, err)
		}
	}
	hostName := HostVethName(att.ContainerID, att.IfName)
	if err := deleteLink(hostName); err != nil {
		return internalError("removing the host veth %s of %s: %w", hostName, att, err)
	}

	ctx, cancel := p.context()
	defer cancel()
	// With the address of the prevResult, the router can also free an
	// address it only holds as re-claimed from its bridge (its state was
	// lost while this pod lived).
	rel, err := api.NewClient(conf.Socket).ReleaseWithPrev(ctx, att, prevAddress(conf))
	switch {
	case errors.Is(err, api.ErrUnreachable) || api.IsCode(err, api.CodeNotReady):
		log.Info("interfaces removed, address not released", "err", err)
		return types.NewError(types.ErrTryAgainLater, fmt.Sprintf(
			"releasing the address of %s: %v; its interfaces are removed but the address stays allocated: retry DEL when the weft router is up",
			att, err), "")
	case err != nil:
		return routerError("releasing the address of "+att.String(), err)
	}
	log.Info("pod detached", "released", rel.Released, "address", rel.Address)
	return nil
}

// prevAddress is the first IPv4 address of the prevResult, or the zero
// Addr when there is none or it cannot be read (DEL must not fail on it).
func prevAddress(conf *NetConf) netip.Addr {
	if conf.PrevResult == nil {
		return netip.Addr{}
	}
	prev, err := current.NewResultFromResult(conf.PrevResult)
	if err != nil {
		return netip.Addr{}
	}
	for _, c := range prev.IPs {
		if p, ok := prefixOf(c.Address); ok && p.Addr().Is4() {
			return p.Addr()
		}
	}
	return netip.Addr{}
}

// Check answers CHECK: the router still holds the attachment's address, the
// pod interface has the prevResult's address, routes and the router's MTU,
// and the host end is on the bridge with hairpin on.
func (p *Plugin) Check(args *skel.CmdArgs) error {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	if conf.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig, `CHECK needs "prevResult" (the result of ADD) in the network config; the runtime passed none`, "")
	}
	prev, err := current.NewResultFromResult(conf.PrevResult)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, fmt.Sprintf(`converting "prevResult" to CNI %s: %v`, current.ImplementedSpecVersion, err), "")
	}
	att, err := attachment(args.ContainerID, args.IfName)
	if err != nil {
		return err
	}
	if args.Netns == "" {
		return types.NewError(types.ErrInvalidEnvironmentVariables, "CNI_NETNS is empty: CHECK needs the path of the pod's network namespace", "")
	}
	log, done := p.log(conf, "CHECK")
	defer done()

	ctx, cancel := p.context()
	defer cancel()
	alloc, err := api.NewClient(conf.Socket).Lookup(ctx, att)
	switch {
	case api.IsCode(err, api.CodeNotFound):
		return internalError("weft router holds no address for %s: it was released; delete and recreate the pod", att)
	case err != nil:
		return routerError("looking up the address of "+att.String(), err)
	}
	pn, err := parseAllocation(alloc)
	if err != nil {
		return internalError("%w", err)
	}
	ips := podIPs(prev, att.IfName, args.Netns)
	if len(ips) == 0 {
		return internalError("prevResult lists no address for %s in %s", att.IfName, args.Netns)
	}
	if !slices.ContainsFunc(ips, func(c *current.IPConfig) bool { p, ok := prefixOf(c.Address); return ok && p == pn.Address }) {
		return internalError("prevResult gives %s addresses %v, but the weft router allocated %s", att.IfName, ips, pn.Address.String())
	}

	podNS, err := openPodNS(args.Netns)
	if err != nil {
		return err
	}
	defer podNS.Close()
	hostName := HostVethName(att.ContainerID, att.IfName)
	err = podNS.Do(func(hostNS ns.NetNS) error {
		return checkPodIface(hostNS, att.IfName, hostName, pn, ips, prev.Routes)
	})
	if err != nil {
		return internalError("pod interface %s in %s: %w", att.IfName, args.Netns, err)
	}
	if err := checkHostVeth(hostName, pn); err != nil {
		return internalError("host veth %s of %s: %w", hostName, att, err)
	}
	log.Debug("check passed", "attachment", att.String(), "address", alloc.Address)
	return nil
}

// openPodNS opens CNI_NETNS and refuses the plugin's own namespace: wiring
// the pod end there would rewire the node.
func openPodNS(path string) (ns.NetNS, error) {
	podNS, err := ns.GetNS(path)
	if err != nil {
		return nil, types.NewError(types.ErrInvalidNetNS, fmt.Sprintf("cannot open the pod network namespace %q (CNI_NETNS): %v", path, err), "")
	}
	if err := notOwnNS(podNS); err != nil {
		podNS.Close()
		if errors.Is(err, errOwnNS) {
			return nil, types.NewError(types.ErrInvalidNetNS, fmt.Sprintf("CNI_NETNS %q is the plugin's own network namespace, not a pod's", path), "")
		}
		return nil, internalError("%w", err)
	}
	return podNS, nil
}

// errOwnNS: CNI_NETNS names the plugin's own network namespace.
var errOwnNS = errors.New("the network namespace is the plugin's own, not a pod's")

// notOwnNS returns errOwnNS when n is the calling thread's namespace.
func notOwnNS(n ns.NetNS) error {
	self, err := ns.GetCurrentNS()
	if err != nil {
		return fmt.Errorf("opening the plugin's own network namespace: %w", err)
	}
	defer self.Close()
	if netns.NsHandle(n.Fd()).Equal(netns.NsHandle(self.Fd())) {
		return errOwnNS
	}
	return nil
}

// deletePodIface deletes ifName inside the namespace at path, which it
// opens once and enters by that handle, so that the namespace checked is
// the one entered; it refuses (errOwnNS) the plugin's own namespace.
func deletePodIface(path, ifName string) error {
	podNS, err := ns.GetNS(path)
	if err != nil {
		return err
	}
	defer podNS.Close()
	if err := notOwnNS(podNS); err != nil {
		return err
	}
	return podNS.Do(func(ns.NetNS) error { return deleteLink(ifName) })
}

// nsGone reports whether err says a network namespace path no longer exists
// (or is no longer a namespace): DEL treats that as already cleaned up.
func nsGone(err error) bool {
	var notExist ns.NSPathNotExistErr
	var notNS ns.NSPathNotNSErr
	return errors.As(err, &notExist) || errors.As(err, &notNS)
}

func isLinkNotFound(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf)
}

// deleteLink deletes the link name in the current namespace; a link that is
// not there is success.
func deleteLink(name string) error {
	link, err := netlinksafe.LinkByName(name)
	switch {
	case isLinkNotFound(err):
		return nil
	case err != nil:
		return fmt.Errorf("looking up %s: %w", name, err)
	}
	if err := netlink.LinkDel(link); err != nil {
		// The kernel may have removed it meanwhile (its peer's namespace went away).
		if _, lerr := netlinksafe.LinkByName(name); isLinkNotFound(lerr) {
			return nil
		}
		return fmt.Errorf("deleting %s: %w", name, err)
	}
	return nil
}

// deleteVeth removes both ends of a pod's veth (removing either end removes
// the pair; both are tried in case the pair is half made).
func deleteVeth(podNS ns.NetNS, ifName, hostName string) error {
	podErr := podNS.Do(func(ns.NetNS) error { return deleteLink(ifName) })
	return errors.Join(podErr, deleteLink(hostName))
}

// ensurePodIface runs inside the pod namespace. It makes the veth pair if the
// pod has no ifName yet (and sets *created), or accepts an existing ifName
// whose peer is weft's host end, then converges its MTU, address, state and
// default route.
func ensurePodIface(hostNS ns.NetNS, ifName, hostName string, pn podNet, created *bool, log *slog.Logger) (linkInfo, error) {
	host, err := netlinksafe.NewHandleAt(netns.NsHandle(hostNS.Fd()))
	if err != nil {
		return linkInfo{}, fmt.Errorf("opening netlink in the node's network namespace: %w", err)
	}
	defer host.Close()

	link, err := netlinksafe.LinkByName(ifName)
	switch {
	case err == nil:
		if err := checkPeer(link, host, hostName); err != nil {
			return linkInfo{}, err
		}
		log.Debug("veth already there, reconciling", "ifName", ifName, "hostVeth", hostName)
	case isLinkNotFound(err):
		// A host end with this name whose pod end is elsewhere is a leftover of
		// the same attachment (the name is a hash of it): it would block the pair.
		if stale, err := host.LinkByName(hostName); err == nil {
			log.Info("removing a stale host veth of this attachment", "hostVeth", hostName)
			if err := host.LinkDel(stale); err != nil {
				return linkInfo{}, fmt.Errorf("removing the stale host veth %s: %w", hostName, err)
			}
		}
		*created = true
		if _, _, err := ip.SetupVethWithName(ifName, hostName, pn.MTU, "", hostNS); err != nil {
			return linkInfo{}, fmt.Errorf("creating the veth pair %s (pod) / %s (node): %w", ifName, hostName, err)
		}
		if link, err = netlinksafe.LinkByName(ifName); err != nil {
			return linkInfo{}, fmt.Errorf("looking up the new %s: %w", ifName, err)
		}
	default:
		return linkInfo{}, fmt.Errorf("looking up %s: %w", ifName, err)
	}
	if err := configurePodIface(link, pn); err != nil {
		return linkInfo{}, err
	}
	if link, err = netlinksafe.LinkByName(ifName); err != nil {
		return linkInfo{}, fmt.Errorf("looking up %s: %w", ifName, err)
	}
	return linkInfo{Name: ifName, Mac: link.Attrs().HardwareAddr.String()}, nil
}

// checkPeer accepts an existing pod interface only if it is a veth whose
// peer is weft's host end of this attachment.
func checkPeer(link netlink.Link, host netlinksafe.Handle, hostName string) error {
	name := link.Attrs().Name
	if _, ok := link.(*netlink.Veth); !ok {
		return fmt.Errorf("%s already exists in the pod network namespace as a %s device, not weft's veth: remove it or use another CNI_IFNAME", name, link.Type())
	}
	peer, err := host.LinkByName(hostName)
	if err != nil || peer.Attrs().ParentIndex != link.Attrs().Index || link.Attrs().ParentIndex != peer.Attrs().Index {
		return fmt.Errorf("%s already exists in the pod network namespace, but its peer is not weft's host veth %s: remove it or use another CNI_IFNAME", name, hostName)
	}
	return nil
}

// configurePodIface converges the pod interface: MTU, the one address (other
// global addresses of its family are removed), up, and the default route via
// the gateway. Each step is idempotent, so a repeated ADD re-applies it.
func configurePodIface(link netlink.Link, pn podNet) error {
	name := link.Attrs().Name
	if link.Attrs().MTU != pn.MTU {
		if err := netlink.LinkSetMTU(link, pn.MTU); err != nil {
			return fmt.Errorf("setting the MTU of %s to %d: %w", name, pn.MTU, err)
		}
	}
	addr := ipNet(pn.Address)
	if err := netlink.AddrReplace(link, &netlink.Addr{IPNet: &addr}); err != nil {
		return fmt.Errorf("adding %s to %s: %w", pn.Address, name, err)
	}
	family := netlink.FAMILY_V4
	if !pn.Address.Addr().Is4() {
		family = netlink.FAMILY_V6
	}
	addrs, err := netlinksafe.AddrList(link, family)
	if err != nil {
		return fmt.Errorf("listing the addresses of %s: %w", name, err)
	}
	for _, a := range addrs {
		if p, ok := prefixOf(*a.IPNet); a.IP.IsGlobalUnicast() && (!ok || p != pn.Address) {
			if err := netlink.AddrDel(link, &a); err != nil {
				return fmt.Errorf("removing the stale address %s from %s: %w", a.IPNet, name, err)
			}
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("setting %s up: %w", name, err)
	}
	dst := defaultRoute(pn.Gateway)
	route := &netlink.Route{LinkIndex: link.Attrs().Index, Dst: &dst, Gw: netIP(pn.Gateway)}
	if err := netlink.RouteReplace(route); err != nil {
		return fmt.Errorf("adding the default route via %s dev %s: %w", pn.Gateway, name, err)
	}
	return nil
}

// ensureHostVeth converges the host end in the node's namespace: MTU, on the
// bridge, hairpin on (so a pod can reach itself through a service), up.
func ensureHostVeth(hostName string, pn podNet) (linkInfo, error) {
	link, err := netlinksafe.LinkByName(hostName)
	if err != nil {
		return linkInfo{}, internalError("looking up the host veth %s: %w", hostName, err)
	}
	br, err := bridgeLink(pn.Bridge)
	if err != nil {
		return linkInfo{}, err
	}
	if link.Attrs().MTU != pn.MTU {
		if err := netlink.LinkSetMTU(link, pn.MTU); err != nil {
			return linkInfo{}, internalError("setting the MTU of %s to %d: %w", hostName, pn.MTU, err)
		}
	}
	if link.Attrs().MasterIndex != br.Attrs().Index {
		if err := netlink.LinkSetMaster(link, br); err != nil {
			return linkInfo{}, internalError("attaching %s to the bridge %s: %w", hostName, pn.Bridge, err)
		}
	}
	if err := netlink.LinkSetHairpin(link, true); err != nil {
		return linkInfo{}, internalError("turning hairpin mode on for %s: %w", hostName, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return linkInfo{}, internalError("setting %s up: %w", hostName, err)
	}
	if link, err = netlinksafe.LinkByName(hostName); err != nil {
		return linkInfo{}, internalError("looking up the host veth %s: %w", hostName, err)
	}
	return linkInfo{Name: hostName, Mac: link.Attrs().HardwareAddr.String()}, nil
}

// bridgeLink finds the router's bridge in the node's namespace.
func bridgeLink(name string) (netlink.Link, error) {
	br, err := netlinksafe.LinkByName(name)
	switch {
	case isLinkNotFound(err):
		return nil, internalError("the bridge %s named by the weft router does not exist in this network namespace: the router makes it at start, so check that the router runs and is ready", name)
	case err != nil:
		return nil, internalError("looking up the bridge %s: %w", name, err)
	}
	if _, ok := br.(*netlink.Bridge); !ok {
		return nil, internalError("%s, named by the weft router as its bridge, is a %s device, not a bridge", name, br.Type())
	}
	return br, nil
}

// checkPodIface runs inside the pod namespace for CHECK.
func checkPodIface(hostNS ns.NetNS, ifName, hostName string, pn podNet, ips []*current.IPConfig, routes []*types.Route) error {
	link, err := netlinksafe.LinkByName(ifName)
	if err != nil {
		return fmt.Errorf("missing: %w", err)
	}
	host, err := netlinksafe.NewHandleAt(netns.NsHandle(hostNS.Fd()))
	if err != nil {
		return fmt.Errorf("opening netlink in the node's network namespace: %w", err)
	}
	defer host.Close()
	if err := checkPeer(link, host, hostName); err != nil {
		return err
	}
	if err := ip.ValidateExpectedInterfaceIPs(ifName, ips); err != nil {
		return err
	}
	if err := ip.ValidateExpectedRoute(routes); err != nil {
		return err
	}
	if mtu := link.Attrs().MTU; mtu != pn.MTU {
		return fmt.Errorf("MTU is %d, the weft router says %d", mtu, pn.MTU)
	}
	if link.Attrs().Flags&net.FlagUp == 0 {
		return errors.New("is down")
	}
	return nil
}

// checkHostVeth verifies the host end for CHECK.
func checkHostVeth(hostName string, pn podNet) error {
	link, err := netlinksafe.LinkByName(hostName)
	if err != nil {
		return fmt.Errorf("missing: %w", err)
	}
	br, err := bridgeLink(pn.Bridge)
	if err != nil {
		return err
	}
	if link.Attrs().MasterIndex != br.Attrs().Index {
		return fmt.Errorf("is not attached to the bridge %s", pn.Bridge)
	}
	if mtu := link.Attrs().MTU; mtu != pn.MTU {
		return fmt.Errorf("MTU is %d, the weft router says %d", mtu, pn.MTU)
	}
	pi, err := netlinksafe.LinkGetProtinfo(link)
	if err != nil {
		return fmt.Errorf("reading its bridge port settings: %w", err)
	}
	if !pi.Hairpin {
		return errors.New("has hairpin mode off")
	}
	if link.Attrs().Flags&net.FlagUp == 0 {
		return errors.New("is down")
	}
	return nil
}
