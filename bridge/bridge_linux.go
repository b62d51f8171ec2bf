package bridge

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/utils/sysctl"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Names of the chains in weft's table.
const (
	natChain     = "postrouting"
	forwardChain = "forward"
)

// dumpAttempts bounds the retries of a netlink dump that the kernel
// interrupted because the list changed while it was read.
const dumpAttempts = 5

// Ensure converges the network namespace at nsPath ("" = the caller's own) on
// cfg: the bridge exists, is up, has cfg.MTU, a stable MAC and the gateway
// address and no other address inside the pod range; IPv4 forwarding is on;
// weft's nftables table masquerades traffic from the pod range to elsewhere.
// A compatible bridge is adopted, never deleted, so attached veths stay.
// Ensure is idempotent: a second call changes nothing and reports no changes.
func Ensure(nsPath string, cfg Config, log *slog.Logger) (*Info, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("bridge config: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("bridge", cfg.Name)
	n, err := openNS(nsPath)
	if err != nil {
		return nil, err
	}
	defer n.close()

	info := &Info{}
	br, err := n.ensureLink(cfg, log, info)
	if err != nil {
		return nil, err
	}
	if err := n.ensureSysctls(cfg.Name, log, info); err != nil {
		return nil, err
	}
	if err := n.ensureNFT(cfg, log, info); err != nil {
		return nil, err
	}
	info.Index = br.Attrs().Index
	info.MAC = br.Attrs().HardwareAddr
	info.MTU = br.Attrs().MTU
	return info, nil
}

// Teardown removes weft's nftables tables (ip weft, bridge weft and the
// NetworkPolicy table ip weft-policy) and the bridge named name from the
// namespace at nsPath ("" = the caller's own). Missing pieces are not an error.
// A link of that name that is not a bridge is left alone. Sysctls stay as they
// are: other software may rely on forwarding.
func Teardown(nsPath string, name string, log *slog.Logger) error {
	if err := validateName(name); err != nil {
		return err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	n, err := openNS(nsPath)
	if err != nil {
		return err
	}
	defer n.close()

	c, err := n.nft()
	if err != nil {
		return err
	}
	t := weftTable()
	c.AddTable(t) // so that the delete succeeds when there is no table
	c.DelTable(t)
	if _, err := c.ListTableOfFamily(TableName, nftables.TableFamilyBridge); err == nil {
		c.DelTable(bridgeTable()) // the guard's
	}
	pt := policyNFTable()
	c.AddTable(pt)
	c.DelTable(pt)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("delete nftables tables ip %s and ip %s: %w", TableName, PolicyTableName, err)
	}
	log.Info("deleted nftables tables", "tables", "ip "+TableName+", bridge "+TableName+", ip "+PolicyTableName)

	l, err := n.h.LinkByName(name)
	switch {
	case isNotFound(err):
		return nil
	case err != nil:
		return fmt.Errorf("look up link %q: %w", name, err)
	case l.Type() != "bridge":
		log.Warn("not deleting link: it is not a bridge", "link", name, "kind", l.Type())
		return nil
	}
	if err := n.h.LinkDel(l); err != nil && !isNotFound(err) {
		return fmt.Errorf("delete bridge %q: %w", name, err)
	}
	log.Info("deleted bridge", "bridge", name)
	return nil
}

// DefaultRouteMTU finds the interface of the IPv4 default route in the
// namespace at nsPath ("" = the caller's own), its MTU and its first IPv4
// address. Among several default routes the one with the lowest metric wins.
func DefaultRouteMTU(nsPath string) (ifName string, mtu int, addr netip.Addr, err error) {
	n, err := openNS(nsPath)
	if err != nil {
		return "", 0, netip.Addr{}, err
	}
	defer n.close()

	var routes []netlink.Route
	err = retryDump(func() (err error) {
		routes, err = n.h.RouteList(nil, netlink.FAMILY_V4)
		return err
	})
	if err != nil {
		return "", 0, netip.Addr{}, fmt.Errorf("list routes: %w", err)
	}
	index, metric := 0, 0
	for _, r := range routes {
		if !isDefault(r) || r.Type != unix.RTN_UNICAST {
			continue
		}
		li := r.LinkIndex
		if li == 0 && len(r.MultiPath) > 0 {
			li = r.MultiPath[0].LinkIndex
		}
		if li != 0 && (index == 0 || r.Priority < metric) {
			index, metric = li, r.Priority
		}
	}
	if index == 0 {
		return "", 0, netip.Addr{}, errors.New("no default route in this namespace: set --host")
	}
	l, err := n.h.LinkByIndex(index)
	if err != nil {
		return "", 0, netip.Addr{}, fmt.Errorf("look up the link of the default route (index %d): %w", index, err)
	}
	ifName, mtu = l.Attrs().Name, l.Attrs().MTU
	prefixes, err := n.addrs(l)
	if err != nil {
		return "", 0, netip.Addr{}, err
	}
	if len(prefixes) == 0 {
		return "", 0, netip.Addr{}, fmt.Errorf("interface %s of the default route has no IPv4 address: set --host", ifName)
	}
	return ifName, mtu, prefixes[0].Addr(), nil
}

func isDefault(r netlink.Route) bool {
	if r.Dst == nil {
		return true
	}
	ones, _ := r.Dst.Mask.Size()
	return ones == 0 && r.Dst.IP.IsUnspecified()
}

// netNS holds the handles for one network namespace.
type netNS struct {
	path string         // "" = the caller's own namespace
	fd   netns.NsHandle // open only when path != ""
	h    *netlink.Handle
}

// openNS opens handles on the namespace at path without switching the
// calling thread into it.
func openNS(path string) (*netNS, error) {
	n := &netNS{path: path, fd: netns.None()}
	if path != "" {
		fd, err := netns.GetFromPath(path)
		if err != nil {
			return nil, fmt.Errorf("open network namespace %q: %w", path, err)
		}
		n.fd = fd
	}
	h, err := netlink.NewHandleAt(n.fd)
	if err != nil {
		n.close()
		return nil, fmt.Errorf("open netlink in network namespace %q: %w", path, err)
	}
	n.h = h
	return n, nil
}

func (n *netNS) close() {
	if n.h != nil {
		n.h.Close()
	}
	if n.fd.IsOpen() {
		n.fd.Close()
	}
}

// nft returns an nftables connection to the namespace.
func (n *netNS) nft() (*nftables.Conn, error) {
	var opts []nftables.ConnOption
	if n.path != "" {
		opts = append(opts, nftables.WithNetNSFd(int(n.fd)))
	}
	c, err := nftables.New(opts...)
	if err != nil {
		return nil, fmt.Errorf("open nftables in network namespace %q: %w", n.path, err)
	}
	return c, nil
}

// do runs f with the calling thread inside the namespace (for sysctls, which
// /proc/sys/net resolves by the opening thread's namespace).
func (n *netNS) do(f func() error) error {
	if n.path == "" {
		return f()
	}
	return ns.WithNetNSPath(n.path, func(ns.NetNS) error { return f() })
}

// addrs lists the IPv4 addresses of l.
func (n *netNS) addrs(l netlink.Link) ([]netip.Prefix, error) {
	var list []netlink.Addr
	err := retryDump(func() (err error) {
		list, err = n.h.AddrList(l, netlink.FAMILY_V4)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list addresses of %s: %w", l.Attrs().Name, err)
	}
	var out []netip.Prefix
	for _, a := range list {
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok {
			continue
		}
		ones, _ := a.Mask.Size()
		out = append(out, netip.PrefixFrom(ip.Unmap(), ones))
	}
	return out, nil
}

// observe reads the link named name; nil, nil when there is none.
func (n *netNS) observe(name string) (netlink.Link, *Link, error) {
	l, err := n.h.LinkByName(name)
	if isNotFound(err) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("look up link %q: %w", name, err)
	}
	a := l.Attrs()
	have := &Link{Kind: l.Type(), MTU: a.MTU, Up: a.Flags&net.FlagUp != 0, MAC: a.HardwareAddr}
	if have.Kind != "bridge" {
		return l, have, nil
	}
	var links []netlink.Link
	err = retryDump(func() (err error) {
		links, err = n.h.LinkList()
		return err
	})
	if err != nil {
		return nil, nil, fmt.Errorf("list links: %w", err)
	}
	for _, p := range links {
		if p.Attrs().MasterIndex == a.Index {
			have.Ports++
		}
	}
	if have.Addrs, err = n.addrs(l); err != nil {
		return nil, nil, err
	}
	return l, have, nil
}

// ensureLink converges the bridge link and returns it as it is afterwards.
func (n *netNS) ensureLink(cfg Config, log *slog.Logger, info *Info) (netlink.Link, error) {
	l, have, err := n.observe(cfg.Name)
	if err != nil {
		return nil, err
	}
	plan := Compare(cfg, have)
	if plan.Create {
		if plan.Delete {
			log.Warn("replacing link", "reason", plan.Reason)
			if err := n.h.LinkDel(l); err != nil && !isNotFound(err) {
				return nil, fmt.Errorf("delete link %q (%s): %w", cfg.Name, plan.Reason, err)
			}
		}
		if err := n.create(cfg); err != nil {
			return nil, err
		}
		log.Info("created bridge", "mtu", cfg.MTU, "mac", StableMAC(cfg.Name).String())
		info.Changes = append(info.Changes, plan.Changes(cfg, have)...)

		// Re-read: the link may have appeared between our look-up and the
		// add (EEXIST), and it must really be a bridge now.
		if l, have, err = n.observe(cfg.Name); err != nil {
			return nil, err
		}
		if plan = Compare(cfg, have); plan.Create {
			return nil, fmt.Errorf("bridge %q: created it, but %s", cfg.Name, plan.Reason)
		}
	}
	if plan.IsZero() {
		return l, nil
	}
	changes := plan.Changes(cfg, have)
	for _, c := range changes {
		log.Info("changing bridge", "change", c)
	}
	info.Changes = append(info.Changes, changes...)

	if plan.MTU != 0 {
		if err := n.h.LinkSetMTU(l, plan.MTU); err != nil {
			return nil, fmt.Errorf("set MTU %d on bridge %q: %w", plan.MTU, cfg.Name, err)
		}
	}
	if plan.MAC != nil {
		if err := n.h.LinkSetHardwareAddr(l, plan.MAC); err != nil {
			return nil, fmt.Errorf("set MAC %s on bridge %q: %w", plan.MAC, cfg.Name, err)
		}
	}
	for _, a := range plan.RemoveAddrs {
		if err := n.h.AddrDel(l, toAddr(a)); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
			return nil, fmt.Errorf("remove stale address %s from bridge %q: %w", a, cfg.Name, err)
		}
	}
	if plan.AddGateway || len(plan.RemoveAddrs) > 0 {
		// Removing a primary address also removes its secondaries (unless
		// promote_secondaries is on), which may include the gateway: look
		// again instead of trusting the plan.
		added, err := n.ensureGateway(l, cfg)
		if err != nil {
			return nil, err
		}
		if added && !plan.AddGateway {
			c := fmt.Sprintf("re-add gateway address %s (removed along with a stale primary address)", cfg.Gateway)
			log.Info("changing bridge", "change", c)
			info.Changes = append(info.Changes, c)
		}
	}
	if plan.Up {
		if err := n.h.LinkSetUp(l); err != nil {
			return nil, fmt.Errorf("set bridge %q up: %w", cfg.Name, err)
		}
	}

	if l, err = n.h.LinkByName(cfg.Name); err != nil {
		return nil, fmt.Errorf("look up bridge %q: %w", cfg.Name, err)
	}
	return l, nil
}

// create adds the bridge with the configured MTU and the stable MAC. EEXIST is
// fine: the caller re-reads the link and checks it.
//
// The MTU is changed after the add, not given with it: only an MTU set on an
// existing bridge counts as chosen by the user, and a bridge without one
// follows the smallest MTU of its ports as they come and go.
func (n *netNS) create(cfg Config) error {
	attrs := netlink.NewLinkAttrs()
	attrs.Name = cfg.Name
	attrs.MTU = MinMTU
	if cfg.MTU == MinMTU {
		attrs.MTU = MinMTU + 1
	}
	attrs.HardwareAddr = StableMAC(cfg.Name)
	br := &netlink.Bridge{LinkAttrs: attrs}
	err := n.h.LinkAdd(br)
	if errors.Is(err, unix.EEXIST) {
		return nil // someone else's: Compare decides what to do with it
	}
	if err != nil {
		return fmt.Errorf("create bridge %q: %w", cfg.Name, err)
	}
	if err := n.h.LinkSetMTU(br, cfg.MTU); err != nil {
		return fmt.Errorf("set MTU %d on new bridge %q: %w", cfg.MTU, cfg.Name, err)
	}
	return nil
}

// ensureGateway adds the gateway address to l unless it is there, and says
// whether it added it.
func (n *netNS) ensureGateway(l netlink.Link, cfg Config) (bool, error) {
	addrs, err := n.addrs(l)
	if err != nil {
		return false, err
	}
	if slices.Contains(addrs, cfg.Gateway) {
		return false, nil
	}
	if err := n.h.AddrAdd(l, toAddr(cfg.Gateway)); err != nil && !errors.Is(err, unix.EEXIST) {
		return false, fmt.Errorf("add gateway address %s to bridge %q: %w", cfg.Gateway, cfg.Name, err)
	}
	return true, nil
}

// ensureSysctls writes the sysctls the bridge needs, each only when it differs.
func (n *netNS) ensureSysctls(bridge string, log *slog.Logger, info *Info) error {
	var changes []string
	err := n.do(func() error {
		for _, s := range sysctls(bridge) {
			got, err := sysctl.Sysctl(s.Key)
			if err != nil {
				return fmt.Errorf("read sysctl %s: %w", s.Key, err)
			}
			if strings.TrimSpace(got) == s.Want {
				continue
			}
			if _, err := sysctl.Sysctl(s.Key, s.Want); err != nil {
				return fmt.Errorf("set sysctl %s=%s: %w", s.Key, s.Want, err)
			}
			changes = append(changes, fmt.Sprintf("sysctl %s=%s (was %s)", s.Key, s.Want, strings.TrimSpace(got)))
		}
		return nil
	})
	for _, c := range changes {
		log.Info("changed sysctl", "change", c)
	}
	info.Changes = append(info.Changes, changes...)
	return err
}

// ensureNFT converges weft's tables: table ip weft (masquerade, forward,
// and with a Guard its guard chains and the peers set) and, with a Guard,
// table bridge weft (the pods' anti-spoofing). Tables whose chains and
// rules are already the wanted ones are left alone, so that their
// counters and set elements stay; otherwise both are rebuilt in one
// atomic batch (added, deleted with everything in them, built afresh,
// with the set elements they had), so that packets never see a
// half-written table.
func (n *netNS) ensureNFT(cfg Config, log *slog.Logger, info *Info) error {
	c, err := n.nft()
	if err != nil {
		return err
	}
	_, err = c.ListTableOfFamily(TableName, nftables.TableFamilyIPv4)
	existed := err == nil
	_, err = c.ListTableOfFamily(TableName, nftables.TableFamilyBridge)
	bridgeExisted := err == nil
	if existed && (bridgeExisted == cfg.Guard.On()) && nftUpToDate(c, cfg) {
		return nil
	}
	var peerEls, ownEls, podEls []nftables.SetElement
	if _, els, err := setElements(c, weftTable(), peersSet); err == nil {
		peerEls = els
	}
	if s, els, err := setElements(c, weftTable(), ownSet); err == nil && s.Interval {
		if bs, err := intervalBounds(rangesOfBounds(boundsOfElements(els))); err == nil {
			ownEls = boundElements(bs)
		}
	}
	if _, els, err := setElements(c, bridgeTable(), podsSet); err == nil {
		podEls = els
	}
	t := weftTable()
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
	nat, fwd := baseChains(t)
	c.AddChain(nat)
	c.AddChain(fwd)
	for _, r := range rules(t, nat, fwd, cfg.PodRange) {
		c.AddRule(r)
	}
	bt := bridgeTable()
	switch {
	case cfg.Guard.On():
		peers := newPeersSet(t)
		if err := c.AddSet(peers, peerEls); err != nil {
			return fmt.Errorf("nftables set ip %s %s: %w", TableName, peersSet, err)
		}
		own := newOwnSet(t)
		if err := c.AddSet(own, ownEls); err != nil {
			return fmt.Errorf("nftables set ip %s %s: %w", TableName, ownSet, err)
		}
		in, gfwd := guardChainsOf(t)
		c.AddChain(in)
		c.AddChain(gfwd)
		for _, r := range guardRules(t, in, gfwd, peers, own, cfg) {
			c.AddRule(r)
		}
		if port := cfg.Guard.VXLANPort; port != 0 {
			pre, out := notrackChainsOf(t)
			c.AddChain(pre)
			c.AddChain(out)
			for _, r := range notrackRules(t, pre, out, peers, port) {
				c.AddRule(r)
			}
		}
		c.AddTable(bt)
		c.DelTable(bt)
		c.AddTable(bt)
		pods := newPodsSet(bt)
		if err := c.AddSet(pods, podEls); err != nil {
			return fmt.Errorf("nftables set bridge %s %s: %w", TableName, podsSet, err)
		}
		ch := podChainOf(bt)
		c.AddChain(ch)
		for _, r := range podRules(bt, ch, pods) {
			c.AddRule(r)
		}
	case bridgeExisted:
		c.DelTable(bt) // left by a run with a guard
	}
	if err := c.Flush(); err != nil {
		if cfg.Guard.On() && errors.Is(err, unix.EOPNOTSUPP) {
			return fmt.Errorf("write nftables tables ip %s and bridge %s: %w (does the kernel have nftables for bridges, nf_tables_bridge?)", TableName, TableName, err)
		}
		return fmt.Errorf("write nftables table ip %s: %w", TableName, err)
	}
	var change string
	switch {
	case !existed:
		change = fmt.Sprintf("create nftables table ip %s (masquerade %s to elsewhere)", TableName, cfg.PodRange)
		log.Info("created nftables table", "table", "ip "+TableName, "masquerade", cfg.PodRange)
	default:
		change = fmt.Sprintf("rewrite nftables table ip %s: its rules were not the wanted ones", TableName)
		log.Info("rewrote nftables table: its rules were not the wanted ones", "table", "ip "+TableName)
	}
	if cfg.Guard.On() && !bridgeExisted {
		log.Info("guarding the routers from pods", "table", "bridge "+TableName, "gossip-port", cfg.Guard.GossipPort,
			"data-port", cfg.Guard.DataPort, "ipip-from-peers-only", cfg.Guard.IPIPPeersOnly, "vxlan-device", cfg.Guard.VXLANDevice)
	}
	info.Changes = append(info.Changes, change)
	return nil
}

// chainSpec is a chain and the comments of its rules, in order: what
// nftUpToDate compares with the kernel's.
type chainSpec struct {
	chain    *nftables.Chain
	comments []string
}

// wantedChains lists every chain of weft's tables that cfg calls for,
// with the comments of its rules.
func wantedChains(cfg Config) []chainSpec {
	t := weftTable()
	nat, fwd := baseChains(t)
	rs := rules(t, nat, fwd, cfg.PodRange)
	chains := []*nftables.Chain{nat, fwd}
	if cfg.Guard.On() {
		in, gfwd := guardChainsOf(t)
		bt := bridgeTable()
		pch := podChainOf(bt)
		chains = append(chains, in, gfwd, pch)
		rs = append(rs, guardRules(t, in, gfwd, newPeersSet(t), newOwnSet(t), cfg)...)
		rs = append(rs, podRules(bt, pch, newPodsSet(bt))...)
		if port := cfg.Guard.VXLANPort; port != 0 {
			pre, out := notrackChainsOf(t)
			chains = append(chains, pre, out)
			rs = append(rs, notrackRules(t, pre, out, newPeersSet(t), port)...)
		}
	}
	specs := make([]chainSpec, len(chains))
	for i, ch := range chains {
		specs[i].chain = ch
		for _, r := range rs {
			if r.Chain == ch {
				specs[i].comments = append(specs[i].comments, commentOf(r))
			}
		}
	}
	return specs
}

func familyName(f nftables.TableFamily) string {
	if f == nftables.TableFamilyBridge {
		return "bridge"
	}
	return "ip"
}

// nftUpToDate reports whether weft's tables hold exactly the chains cfg
// calls for, with the wanted hooks and the wanted rules (by comment, which
// names each rule's parameters), and the guard's sets.
func nftUpToDate(c *nftables.Conn, cfg Config) bool {
	want := wantedChains(cfg)
	for _, fam := range []nftables.TableFamily{nftables.TableFamilyIPv4, nftables.TableFamilyBridge} {
		have, err := c.ListChainsOfTableFamily(fam)
		if err != nil {
			return false
		}
		n := 0
		for _, ch := range have {
			if ch.Table.Name == TableName {
				n++
			}
		}
		wantN := 0
		for _, sp := range want {
			if sp.chain.Table.Family == fam {
				wantN++
			}
		}
		if n != wantN {
			return false
		}
	}
	for _, sp := range want {
		ch, err := c.ListChain(sp.chain.Table, sp.chain.Name)
		if err != nil || !sameHook(ch, sp.chain) {
			return false
		}
		rs, err := c.GetRules(sp.chain.Table, ch)
		if err != nil || len(rs) != len(sp.comments) {
			return false
		}
		for i, r := range rs {
			if commentOf(r) != sp.comments[i] {
				return false
			}
		}
	}
	if cfg.Guard.On() {
		if _, err := c.GetSetByName(weftTable(), peersSet); err != nil {
			return false
		}
		if s, err := c.GetSetByName(weftTable(), ownSet); err != nil || !s.Interval {
			return false
		}
		if _, err := c.GetSetByName(bridgeTable(), podsSet); err != nil {
			return false
		}
	}
	return true
}

func sameHook(a, b *nftables.Chain) bool {
	eq := func(x, y any) bool { return fmt.Sprint(x) == fmt.Sprint(y) }
	deref := func(p *nftables.ChainHook) any {
		if p == nil {
			return nil
		}
		return *p
	}
	prio := func(p *nftables.ChainPriority) any {
		if p == nil {
			return nil
		}
		return *p
	}
	pol := func(p *nftables.ChainPolicy) any {
		if p == nil {
			return nftables.ChainPolicyAccept
		}
		return *p
	}
	return a.Type == b.Type && eq(deref(a.Hooknum), deref(b.Hooknum)) && eq(prio(a.Priority), prio(b.Priority)) && eq(pol(a.Policy), pol(b.Policy))
}

func weftTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyIPv4, Name: TableName}
}

// baseChains are the chains of table ip weft without a guard.
func baseChains(t *nftables.Table) (nat, fwd *nftables.Chain) {
	accept := nftables.ChainPolicyAccept
	nat = &nftables.Chain{
		Name: natChain, Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource,
	}
	fwd = &nftables.Chain{
		Name: forwardChain, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept,
	}
	return nat, fwd
}

// rules are the rules of weft's table:
//
//	postrouting: ip saddr <pods> ip daddr != <pods> masquerade
//	forward:     ip saddr <pods> accept; ip daddr <pods> accept
func rules(t *nftables.Table, nat, fwd *nftables.Chain, pods netip.Prefix) []*nftables.Rule {
	masq := slices.Concat(
		matchPrefix(ipv4SrcOffset, pods, expr.CmpOpEq),
		matchPrefix(ipv4DstOffset, pods, expr.CmpOpNeq),
		[]expr.Any{&expr.Masq{}},
	)
	accept := &expr.Verdict{Kind: expr.VerdictAccept}
	return []*nftables.Rule{
		{Table: t, Chain: nat, Exprs: masq, UserData: comment("weft: masquerade pods leaving the pod range " + pods.String())},
		{Table: t, Chain: fwd, Exprs: append(matchPrefix(ipv4SrcOffset, pods, expr.CmpOpEq), accept),
			UserData: comment("weft: forward from pods " + pods.String())},
		{Table: t, Chain: fwd, Exprs: append(matchPrefix(ipv4DstOffset, pods, expr.CmpOpEq), accept),
			UserData: comment("weft: forward to pods " + pods.String())},
	}
}

// Offsets of the addresses in the IPv4 header.
const (
	ipv4SrcOffset = 12
	ipv4DstOffset = 16
)

// matchPrefix compares the IPv4 address at offset in the network header with
// prefix p: "ip saddr p" or "ip daddr != p".
func matchPrefix(offset uint32, p netip.Prefix, op expr.CmpOp) []expr.Any {
	mask := net.CIDRMask(p.Bits(), 32)
	network := p.Masked().Addr().As4()
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: make([]byte, 4)},
		&expr.Cmp{Op: op, Register: 1, Data: network[:]},
	}
}

func toAddr(p netip.Prefix) *netlink.Addr {
	return &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}}
}

func isNotFound(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf) || errors.Is(err, unix.ENODEV)
}

// retryDump runs a netlink dump again when the kernel interrupted it because
// the list changed meanwhile; after dumpAttempts it returns the error.
func retryDump(f func() error) error {
	var err error
	for range dumpAttempts {
		if err = f(); !errors.Is(err, netlink.ErrDumpInterrupted) {
			return err
		}
	}
	return err
}
