package bridge

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// ErrNoGuard says that weft's tables have no guard sets yet: Ensure has
// not run with a Guard (or weft reset removed them). Try again after it.
var ErrNoGuard = errors.New("weft's nftables guard is not set up yet (the bridge is not ensured)")

// ifNameLen is the size of an interface name in nftables (IFNAMSIZ).
const ifNameLen = 16

// Registers: the 16-byte register 1 for single matches; the 4-byte
// registers from NFT_REG32_00 for concatenations (an interface name takes
// four of them, the address the fifth).
const (
	reg1      = 1
	reg32Name = 8  // NFT_REG32_00
	reg32Addr = 12 // NFT_REG32_04
)

// Ether types.
const (
	etherIPv4 = 0x0800
	etherARP  = 0x0806
)

func bridgeTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyBridge, Name: TableName}
}

// dropComment is the comment of a drop rule: DropCounts reads its reason
// back from it, and Ensure compares comments to see whether the rules are
// the ones wanted, so each carries the parameters that shape its rule.
func dropComment(reason, text string) string { return "weft drop " + reason + ": " + text }

// reasonOf reads the reason back from a drop rule's comment.
func reasonOf(comment string) (string, bool) {
	rest, ok := strings.CutPrefix(comment, "weft drop ")
	if !ok {
		return "", false
	}
	reason, _, ok := strings.Cut(rest, ":")
	return reason, ok && slices.Contains(DropReasons, reason)
}

func counterDrop() []expr.Any {
	return []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}}
}

func l4proto(p byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: reg1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: []byte{p}},
	}
}

func sport(port uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: binary.BigEndian.AppendUint16(nil, port)},
	}
}

func dport(port uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: binary.BigEndian.AppendUint16(nil, port)},
	}
}

func ipProtoIPIP() []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: 9, Len: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: []byte{unix.IPPROTO_IPIP}},
	}
}

// guardChainsOf are the guard's chains of table ip weft: before any other
// filter at their hooks, so that their drops are final.
func guardChainsOf(t *nftables.Table) (in, fwd *nftables.Chain) {
	accept := nftables.ChainPolicyAccept
	prio := nftables.ChainPriorityRef(*nftables.ChainPriorityFilter - 10)
	in = &nftables.Chain{Name: guardInputChain, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: prio, Policy: &accept}
	fwd = &nftables.Chain{Name: guardForwardChain, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: prio, Policy: &accept}
	return in, fwd
}

// notrackChainsOf are the chains that exempt weft's VXLAN from
// conntrack (with a VXLAN port): at the raw priority, before conntrack
// looks a packet up.
func notrackChainsOf(t *nftables.Table) (pre, out *nftables.Chain) {
	accept := nftables.ChainPolicyAccept
	pre = &nftables.Chain{Name: notrackPreChain, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRaw, Policy: &accept}
	out = &nftables.Chain{Name: notrackOutChain, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityRaw, Policy: &accept}
	return pre, out
}

// notrackRules are the rules of the notrack chains:
//
//	prerouting: ip saddr @peers udp dport <port> fib daddr type local notrack
//	output:     ip daddr @peers udp dport <port> notrack
func notrackRules(t *nftables.Table, pre, out *nftables.Chain, peers *nftables.Set, port uint16) []*nftables.Rule {
	inPeers := func(offset uint32) []expr.Any {
		return []expr.Any{
			&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
			&expr.Lookup{SourceRegister: reg1, SetName: peers.Name, SetID: peers.ID},
		}
	}
	vxlan := slices.Concat(l4proto(unix.IPPROTO_UDP), dport(port))
	local := []expr.Any{
		&expr.Fib{Register: reg1, FlagDADDR: true, ResultADDRTYPE: true},
		&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: binary.NativeEndian.AppendUint32(nil, unix.RTN_LOCAL)},
	}
	return []*nftables.Rule{
		{Table: t, Chain: pre, Exprs: slices.Concat(inPeers(ipv4SrcOffset), vxlan, local, []expr.Any{&expr.Notrack{}}),
			UserData: comment(fmt.Sprintf("weft: vxlan (udp/%d) from @%s to this node, untracked: one-way flows", port, peersSet))},
		{Table: t, Chain: out, Exprs: slices.Concat(inPeers(ipv4DstOffset), vxlan, []expr.Any{&expr.Notrack{}}),
			UserData: comment(fmt.Sprintf("weft: vxlan (udp/%d) from this node to @%s, untracked: one-way flows", port, peersSet))},
	}
}

// iifname matches the input interface's name exactly (nft's
// iifname "name": the name padded with zeros to IFNAMSIZ).
func iifname(name string) []expr.Any {
	k := make([]byte, ifNameLen)
	copy(k, name)
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: reg1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: k},
	}
}

// guardRules are the rules of the guard's chains; peers is the peers set,
// own the own set.
func guardRules(t *nftables.Table, in, fwd *nftables.Chain, peers, own *nftables.Set, cfg Config) []*nftables.Rule {
	g := cfg.Guard
	pods := cfg.PodRange
	type match struct {
		what  string
		exprs []expr.Any
	}
	toRouter := []match{
		{fmt.Sprintf("tcp/%d (gossip)", g.GossipPort), slices.Concat(l4proto(unix.IPPROTO_TCP), dport(g.GossipPort))},
		{fmt.Sprintf("udp/%d (gossip)", g.GossipPort), slices.Concat(l4proto(unix.IPPROTO_UDP), dport(g.GossipPort))},
		{fmt.Sprintf("udp/%d (data)", g.DataPort), slices.Concat(l4proto(unix.IPPROTO_UDP), dport(g.DataPort))},
		{"ipip", ipProtoIPIP()},
	}
	if g.VXLANPort != 0 {
		toRouter = append(toRouter, match{fmt.Sprintf("udp/%d (vxlan)", g.VXLANPort), slices.Concat(l4proto(unix.IPPROTO_UDP), dport(g.VXLANPort))})
	}
	var out []*nftables.Rule
	for _, m := range toRouter {
		out = append(out, &nftables.Rule{Table: t, Chain: in,
			Exprs:    slices.Concat(matchPrefix(ipv4SrcOffset, pods, expr.CmpOpEq), m.exprs, counterDrop()),
			UserData: comment(dropComment(DropPodToRouter, fmt.Sprintf("pods %s to this node's %s", pods, m.what)))})
	}
	for _, m := range toRouter {
		out = append(out, &nftables.Rule{Table: t, Chain: fwd,
			Exprs: slices.Concat(matchPrefix(ipv4SrcOffset, pods, expr.CmpOpEq), matchPrefix(ipv4DstOffset, pods, expr.CmpOpNeq),
				m.exprs, counterDrop()),
			UserData: comment(dropComment(DropPodToRouter, fmt.Sprintf("pods %s to another host's %s", pods, m.what)))})
	}
	if g.IPIPPeersOnly {
		out = append(out, &nftables.Rule{Table: t, Chain: in,
			Exprs: slices.Concat(ipProtoIPIP(),
				[]expr.Any{
					&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: ipv4SrcOffset, Len: 4},
					&expr.Lookup{SourceRegister: reg1, SetName: peers.Name, SetID: peers.ID, Invert: true},
				}, counterDrop()),
			UserData: comment(dropComment(DropIPIPNonPeer, "ipip from an address not in @"+peersSet))})
	}
	if g.VXLANPort != 0 {
		out = append(out, &nftables.Rule{Table: t, Chain: in,
			Exprs: slices.Concat(l4proto(unix.IPPROTO_UDP), dport(g.VXLANPort),
				[]expr.Any{
					&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: ipv4SrcOffset, Len: 4},
					&expr.Lookup{SourceRegister: reg1, SetName: peers.Name, SetID: peers.ID, Invert: true},
				}, counterDrop()),
			UserData: comment(dropComment(DropVXLANNonPeer, fmt.Sprintf("vxlan (udp/%d) from an address not in @%s", g.VXLANPort, peersSet)))})
	}
	if dev := g.VXLANDevice; dev != "" {
		if g.VXLANProbePort != 0 {
			out = append(out, &nftables.Rule{Table: t, Chain: in,
				Exprs: slices.Concat(iifname(dev), l4proto(unix.IPPROTO_UDP), sport(g.VXLANProbePort), dport(g.VXLANProbePort),
					[]expr.Any{&expr.Verdict{Kind: expr.VerdictDrop}}),
				UserData: comment(fmt.Sprintf("weft: vxlan checksum probes (udp/%d), read by the router off %s", g.VXLANProbePort, dev))})
		}
		// What the VXLAN device decapsulated: to this node (input) or
		// to a pod (forward).
		for _, ch := range []*nftables.Chain{in, fwd} {
			out = append(out,
				&nftables.Rule{Table: t, Chain: ch,
					Exprs:    slices.Concat(iifname(dev), matchPrefix(ipv4SrcOffset, pods, expr.CmpOpNeq), counterDrop()),
					UserData: comment(dropComment(DropVXLANSpoofedSource, fmt.Sprintf("from %s with a source outside the pods %s", dev, pods)))},
				&nftables.Rule{Table: t, Chain: ch,
					Exprs: slices.Concat(iifname(dev), []expr.Any{
						&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: ipv4SrcOffset, Len: 4},
						&expr.Lookup{SourceRegister: reg1, SetName: own.Name, SetID: own.ID},
					}, counterDrop()),
					UserData: comment(dropComment(DropVXLANSpoofedSource, fmt.Sprintf("from %s with a source in @%s (this node's ranges)", dev, ownSet)))},
				&nftables.Rule{Table: t, Chain: ch,
					// The first packet's way (ct direction original):
					// a reply of a connection that this node NATs comes
					// here with its destination translated back already
					// (a NodePort's client, a masqueraded host address).
					Exprs: slices.Concat(iifname(dev), matchPrefix(ipv4DstOffset, pods, expr.CmpOpNeq), []expr.Any{
						&expr.Ct{Key: expr.CtKeyDIRECTION, Register: reg1},
						&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: []byte{0}}, // IP_CT_DIR_ORIGINAL
					}, counterDrop()),
					UserData: comment(dropComment(DropVXLANNotToPods, fmt.Sprintf("from %s to an address outside the pods %s, in a connection's original direction", dev, pods)))})
		}
	}
	return out
}

// podChainOf is table bridge weft's prerouting chain.
func podChainOf(t *nftables.Table) *nftables.Chain {
	accept := nftables.ChainPolicyAccept
	return &nftables.Chain{Name: podsChain, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityFilter, Policy: &accept}
}

// podRules are the anti-spoofing rules of chain ch; pods is the pods set.
func podRules(t *nftables.Table, ch *nftables.Chain, pods *nftables.Set) []*nftables.Rule {
	fromPod := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: reg1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: reg1, Data: []byte(PodVethPrefix)}, // a prefix: "weft*"
	}
	etherType := func(op expr.CmpOp, types ...uint16) []expr.Any {
		out := []expr.Any{&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseLLHeader, Offset: 12, Len: 2}}
		for _, et := range types {
			out = append(out, &expr.Cmp{Op: op, Register: reg1, Data: binary.BigEndian.AppendUint16(nil, et)})
		}
		return out
	}
	notPodSource := func(offset uint32) []expr.Any {
		return []expr.Any{
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: reg32Name},
			&expr.Payload{DestRegister: reg32Addr, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
			&expr.Lookup{SourceRegister: reg32Name, SetName: pods.Name, SetID: pods.ID, Invert: true},
		}
	}
	const arpSenderIP = 14 // after htype, ptype, hlen, plen, op and the sender's MAC
	specs := []struct {
		reason, text string
		exprs        []expr.Any
	}{
		{DropPodProtocol, "frames from pod veths " + PodVethPrefix + "* that are neither IPv4 nor ARP",
			etherType(expr.CmpOpNeq, etherIPv4, etherARP)},
		{DropSpoofedSource, "IPv4 from a pod veth whose source is not that pod's address in @" + podsSet,
			slices.Concat(etherType(expr.CmpOpEq, etherIPv4), notPodSource(ipv4SrcOffset))},
		{DropSpoofedARP, "ARP from a pod veth whose sender is not that pod's address in @" + podsSet + " (nor 0.0.0.0, a probe)",
			slices.Concat(etherType(expr.CmpOpEq, etherARP), []expr.Any{
				&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: arpSenderIP, Len: 4},
				&expr.Cmp{Op: expr.CmpOpNeq, Register: reg1, Data: []byte{0, 0, 0, 0}},
			}, notPodSource(arpSenderIP))},
	}
	var out []*nftables.Rule
	for _, r := range specs {
		out = append(out, &nftables.Rule{Table: t, Chain: ch, Exprs: slices.Concat(fromPod, r.exprs, counterDrop()),
			UserData: comment(dropComment(r.reason, r.text))})
	}
	return out
}

func newPeersSet(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, Name: peersSet, KeyType: nftables.TypeIPAddr}
}

// newOwnSet is this node's ranges of the ring, an interval set.
func newOwnSet(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, Name: ownSet, KeyType: nftables.TypeIPAddr, Interval: true}
}

func newPodsSet(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, Name: podsSet, KeyType: nftables.MustConcatSetType(nftables.TypeIFName, nftables.TypeIPAddr), Concatenation: true}
}

func comment(s string) []byte { return userdata.AppendString(nil, userdata.TypeComment, s) }

func commentOf(r *nftables.Rule) string {
	s, _ := userdata.GetString(r.UserData, userdata.TypeComment)
	return s
}

// podKey is the set key of a pod source: the interface name padded to
// IFNAMSIZ, then the address.
func podKey(p PodSource) []byte {
	k := make([]byte, ifNameLen+4)
	copy(k, p.Veth)
	a := p.Addr.As4()
	copy(k[ifNameLen:], a[:])
	return k
}

func podFromKey(k []byte) (PodSource, bool) {
	if len(k) != ifNameLen+4 {
		return PodSource{}, false
	}
	name, _, _ := strings.Cut(string(k[:ifNameLen]), "\x00")
	return PodSource{Veth: name, Addr: netip.AddrFrom4([4]byte(k[ifNameLen:]))}, true
}

// setElements reads a set's elements; ErrNoGuard when there is no such set.
func setElements(c *nftables.Conn, t *nftables.Table, name string) (*nftables.Set, []nftables.SetElement, error) {
	s, err := c.GetSetByName(t, name)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, nil, ErrNoGuard
		}
		return nil, nil, fmt.Errorf("reading nftables set %s of table %s: %w", name, t.Name, err)
	}
	els, err := c.GetSetElements(s)
	if err != nil {
		return nil, nil, fmt.Errorf("reading nftables set %s of table %s: %w", name, t.Name, err)
	}
	return s, els, nil
}

// GuardConn changes the guard's sets in one network namespace over one
// lasting nftables connection, for a caller that changes them often (the
// router, on every pod ADD), where a new netlink socket and a lookup of
// the set per change cost more than the change itself. It opens its
// socket on first use and keeps the sets' handles once looked up. After
// any error it closes the socket and forgets the handles, and tries once
// more from the start, so that a socket left in a bad state, or a handle
// of a table that Ensure rewrote or Teardown removed, costs one retry
// (then ErrNoGuard, when the set is gone). Its methods take turns: it is
// safe for concurrent use. Close it when done.
type GuardConn struct {
	nsPath string

	mu   sync.Mutex
	fd   netns.NsHandle // the namespace at nsPath, open only when nsPath != ""
	c    *nftables.Conn // nil: closed (opened again on use)
	sets map[string]*nftables.Set
	// bigBatches gives the socket buffers for batches of many
	// thousand messages (PolicyTable's), and for their acknowledgements.
	bigBatches bool
}

// batchBuffer is the size of the send and receive buffers of a socket
// with bigBatches: a batch is sent in one sendmsg, which fails
// (EMSGSIZE) when it is larger than the send buffer, and the kernel
// acknowledges every message, which overflows (ENOBUFS) a receive buffer
// too small for them. Memory is taken only as it is used.
const batchBuffer = 64 << 20

// bigBuffers sets the socket's buffers to batchBuffer, past the
// system's limits (SO_SNDBUFFORCE and SO_RCVBUFFORCE: weft runs with
// CAP_NET_ADMIN).
func bigBuffers(c *netlink.Conn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = errors.Join(
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, batchBuffer),
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, batchBuffer))
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("netlink socket buffers of %d bytes: %w", batchBuffer, serr)
	}
	return nil
}

// NewGuardConn returns a GuardConn for the network namespace at nsPath
// ("" = the caller's own). It opens nothing yet.
func NewGuardConn(nsPath string) *GuardConn {
	return &GuardConn{nsPath: nsPath, fd: netns.None()}
}

// Close closes the connection (a later call opens it again).
func (g *GuardConn) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	err := g.drop()
	if g.fd.IsOpen() {
		err = errors.Join(err, g.fd.Close())
		g.fd = netns.None()
	}
	return err
}

// drop closes the socket and forgets the sets' handles; g.mu is held.
func (g *GuardConn) drop() error {
	g.sets = nil
	if g.c == nil {
		return nil
	}
	c := g.c
	g.c = nil
	return c.CloseLasting()
}

// conn is the lasting connection, opened if need be; g.mu is held.
func (g *GuardConn) conn() (*nftables.Conn, error) {
	if g.c != nil {
		return g.c, nil
	}
	opts := []nftables.ConnOption{nftables.AsLasting()}
	if g.bigBatches {
		opts = append(opts, nftables.WithSockOptions(bigBuffers))
	}
	if g.nsPath != "" {
		if !g.fd.IsOpen() {
			fd, err := netns.GetFromPath(g.nsPath)
			if err != nil {
				return nil, fmt.Errorf("open network namespace %q: %w", g.nsPath, err)
			}
			g.fd = fd
		}
		opts = append(opts, nftables.WithNetNSFd(int(g.fd)))
	}
	c, err := nftables.New(opts...)
	if err != nil {
		return nil, fmt.Errorf("open nftables in network namespace %q: %w", g.nsPath, err)
	}
	g.c = c
	return c, nil
}

// set is the set name of table t, from the cache or looked up; ErrNoGuard
// when there is none. g.mu is held.
func (g *GuardConn) set(c *nftables.Conn, t *nftables.Table, name string) (*nftables.Set, error) {
	k := familyName(t.Family) + " " + name
	if s, ok := g.sets[k]; ok {
		return s, nil
	}
	s, err := c.GetSetByName(t, name)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, ErrNoGuard
		}
		return nil, fmt.Errorf("reading nftables set %s of table %s %s: %w", name, familyName(t.Family), t.Name, err)
	}
	if g.sets == nil {
		g.sets = map[string]*nftables.Set{}
	}
	g.sets[k] = s
	return s, nil
}

// do runs op on the connection, under g.mu. ErrNoGuard it returns as it
// is: it comes of a lookup answered in full (the socket is fine), and
// absence is never cached. After another error it drops the connection
// and the handles and runs op once more from the start. op must be safe
// to repeat.
func (g *GuardConn) do(op func(c *nftables.Conn) error) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	var err error
	for attempt := 0; attempt < 2; attempt++ {
		var c *nftables.Conn
		if c, err = g.conn(); err == nil {
			if err = op(c); err == nil || errors.Is(err, ErrNoGuard) {
				return err
			}
		}
		_ = g.drop()
	}
	return err
}

func addrElements(as []netip.Addr) []nftables.SetElement {
	out := make([]nftables.SetElement, len(as))
	for i, a := range as {
		out[i] = nftables.SetElement{Key: a.AsSlice()}
	}
	return out
}

func boundElements(bs []bound) []nftables.SetElement {
	out := make([]nftables.SetElement, len(bs))
	for i, b := range bs {
		out[i] = nftables.SetElement{Key: b.addr.AsSlice(), IntervalEnd: b.end}
	}
	return out
}

func boundsOfElements(els []nftables.SetElement) []bound {
	var out []bound
	for _, e := range els {
		if a, ok := netip.AddrFromSlice(e.Key); ok && a.Is4() {
			out = append(out, bound{addr: a, end: e.IntervalEnd})
		}
	}
	return out
}

func podElements(ps []PodSource) []nftables.SetElement {
	out := make([]nftables.SetElement, len(ps))
	for i, p := range ps {
		out[i] = nftables.SetElement{Key: podKey(p)}
	}
	return out
}

// readSet reads the elements of set name of table t (under g.do).
func readSet(g *GuardConn, c *nftables.Conn, t *nftables.Table, name string) (*nftables.Set, []nftables.SetElement, error) {
	s, err := g.set(c, t, name)
	if err != nil {
		return nil, nil, err
	}
	els, err := c.GetSetElements(s)
	if err != nil {
		return nil, nil, fmt.Errorf("reading nftables set %s %s %s: %w", familyName(t.Family), TableName, name, err)
	}
	return s, els, nil
}

// syncSet makes set name of table t (under g.do) hold want: it reads the
// set, decoding each element with decode, and adds what is missing and
// deletes what is not wanted (unless keep says to keep it), in one kernel
// batch. It returns what it added and deleted.
func syncSet[T comparable](g *GuardConn, c *nftables.Conn, t *nftables.Table, name string, want []T,
	decode func(nftables.SetElement) (T, bool), encode func([]T) []nftables.SetElement,
	cmp func(a, b T) int, keep func(T) bool) (add, del []T, err error) {
	s, els, err := readSet(g, c, t, name)
	if err != nil {
		return nil, nil, err
	}
	var have []T
	for _, e := range els {
		if v, ok := decode(e); ok {
			have = append(have, v)
		}
	}
	add, del = diffSet(want, have, cmp)
	if keep != nil {
		del = slices.DeleteFunc(del, keep)
	}
	if len(add)+len(del) == 0 {
		return nil, nil, nil
	}
	if len(add) > 0 {
		if err := c.SetAddElements(s, encode(add)); err != nil {
			return nil, nil, err
		}
	}
	if len(del) > 0 {
		if err := c.SetDeleteElements(s, encode(del)); err != nil {
			return nil, nil, err
		}
	}
	if err := c.Flush(); err != nil {
		return nil, nil, fmt.Errorf("updating nftables set %s %s %s: %w", familyName(t.Family), TableName, name, err)
	}
	return add, del, nil
}

func addrOfElement(e nftables.SetElement) (netip.Addr, bool) { return netip.AddrFromSlice(e.Key) }

func podOfElement(e nftables.SetElement) (PodSource, bool) { return podFromKey(e.Key) }

// SetPeerAddrs makes the peers set of table ip weft (IPIP is accepted only
// from these underlay addresses) exactly addrs, in one batch, and says how
// many it added and removed. It returns ErrNoGuard (wrapped) before Ensure
// has set the guard up.
func (g *GuardConn) SetPeerAddrs(addrs []netip.Addr) (added, removed int, err error) {
	for _, a := range addrs {
		if !a.Is4() {
			return 0, 0, fmt.Errorf("peer address %v: want IPv4", a)
		}
	}
	err = g.do(func(c *nftables.Conn) error {
		add, del, err := syncSet(g, c, weftTable(), peersSet, addrs, addrOfElement, addrElements, netip.Addr.Compare, nil)
		added, removed = len(add), len(del)
		return err
	})
	if err != nil {
		return 0, 0, err
	}
	return added, removed, nil
}

// OwnRanges reads the own set of table ip weft back, merged; ErrNoGuard
// (wrapped) before Ensure has set the guard up.
func (g *GuardConn) OwnRanges() ([]AddrRange, error) {
	var out []AddrRange
	err := g.do(func(c *nftables.Conn) error {
		_, els, err := readSet(g, c, weftTable(), ownSet)
		if err != nil {
			return err
		}
		out = rangesOfBounds(boundsOfElements(els))
		return nil
	})
	return out, err
}

// SetOwnRanges makes the own set of table ip weft (what the VXLAN device
// may not bring in as a source: this node's ranges of the ring) exactly
// ranges, merged: when it differs, it empties the set and fills it in one
// kernel batch, so that no packet ever sees it empty or half written. It
// says whether it changed the set, and returns ErrNoGuard (wrapped)
// before Ensure has set the guard up.
func (g *GuardConn) SetOwnRanges(ranges []AddrRange) (changed bool, err error) {
	bs, err := intervalBounds(ranges)
	if err != nil {
		return false, err
	}
	want := rangesOfBounds(bs)
	err = g.do(func(c *nftables.Conn) error {
		changed = false
		s, els, err := readSet(g, c, weftTable(), ownSet)
		if err != nil {
			return err
		}
		if slices.Equal(rangesOfBounds(boundsOfElements(els)), want) && len(els) == len(bs) {
			return nil
		}
		c.FlushSet(s)
		if len(bs) > 0 {
			if err := c.SetAddElements(s, boundElements(bs)); err != nil {
				return err
			}
		}
		if err := c.Flush(); err != nil {
			return fmt.Errorf("updating nftables set ip %s %s: %w", TableName, ownSet, err)
		}
		changed = true
		return nil
	})
	if err != nil {
		return false, err
	}
	return changed, nil
}

// SetPodSources makes the pods set of table bridge weft (what each pod
// veth may send as its source) want, in one batch: it adds what is
// missing and removes every other element, except those keep says to
// keep (a pod whose attachment the router no longer knows, but whose
// address it holds). It returns what it added and removed, or ErrNoGuard
// (wrapped) before Ensure has set the guard up. It reads the whole set:
// for one pod's entry, AddPodSources and RemovePodSource cost less.
func (g *GuardConn) SetPodSources(want []PodSource, keep func(PodSource) bool) (added, removed []PodSource, err error) {
	for _, p := range want {
		if err := validatePodSource(p); err != nil {
			return nil, nil, err
		}
	}
	err = g.do(func(c *nftables.Conn) error {
		var err error
		added, removed, err = syncSet(g, c, bridgeTable(), podsSet, want, podOfElement, podElements, comparePodSources, keep)
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	return added, removed, nil
}

// AddPodSources puts ps into the pods set of table bridge weft, in one
// batch, and removes nothing: an element already there stays as it is.
// It neither reads the set nor looks it up after the first time (see
// GuardConn); when it returns nil, every element of ps is in the set. It
// returns ErrNoGuard (wrapped) before Ensure has set the guard up.
func (g *GuardConn) AddPodSources(ps []PodSource) error {
	for _, p := range ps {
		if err := validatePodSource(p); err != nil {
			return err
		}
	}
	if len(ps) == 0 {
		return nil
	}
	els := podElements(ps)
	return g.do(func(c *nftables.Conn) error {
		s, err := g.set(c, bridgeTable(), podsSet)
		if err != nil {
			return err
		}
		if err := c.SetAddElements(s, els); err != nil {
			return err
		}
		if err := c.Flush(); err != nil {
			return fmt.Errorf("adding to nftables set bridge %s %s: %w", TableName, podsSet, err)
		}
		return nil
	})
}

// RemovePodSource takes p out of the pods set of table bridge weft and
// nothing else, without reading the set, and says whether p was in it.
// It returns ErrNoGuard (wrapped) before Ensure has set the guard up.
func (g *GuardConn) RemovePodSource(p PodSource) (removed bool, err error) {
	if err := validatePodSource(p); err != nil {
		return false, err
	}
	els := podElements([]PodSource{p})
	err = g.do(func(c *nftables.Conn) error {
		removed = false
		s, err := g.set(c, bridgeTable(), podsSet)
		if err != nil {
			return err
		}
		if err := c.SetDeleteElements(s, els); err != nil {
			return err
		}
		err = c.Flush()
		if errors.Is(err, unix.ENOENT) {
			// No such element, or no such set (a handle gone stale):
			// after a failed batch the socket is dropped; a fresh
			// lookup tells the two apart.
			_ = g.drop()
			if c, err = g.conn(); err != nil {
				return err
			}
			delete(g.sets, familyName(nftables.TableFamilyBridge)+" "+podsSet)
			_, err = g.set(c, bridgeTable(), podsSet)
			return err // nil: the set is there, p was not
		}
		if err != nil {
			return fmt.Errorf("deleting from nftables set bridge %s %s: %w", TableName, podsSet, err)
		}
		removed = true
		return nil
	})
	return removed, err
}

// DropCounts reads the packets the guard's rules dropped, by reason (every
// reason of DropReasons is present, 0 without a guard).
func (g *GuardConn) DropCounts() (map[string]uint64, error) {
	var out map[string]uint64
	err := g.do(func(c *nftables.Conn) error {
		out = map[string]uint64{}
		for _, r := range DropReasons {
			out[r] = 0
		}
		for _, tc := range []struct {
			t      *nftables.Table
			chains []string
		}{
			{weftTable(), []string{guardInputChain, guardForwardChain}},
			{bridgeTable(), []string{podsChain}},
		} {
			for _, name := range tc.chains {
				rules, err := c.GetRules(tc.t, &nftables.Chain{Name: name, Table: tc.t})
				if errors.Is(err, unix.ENOENT) {
					continue
				}
				if err != nil {
					return fmt.Errorf("reading the rules of %s %s: %w", tc.t.Name, name, err)
				}
				for _, r := range rules {
					reason, ok := reasonOf(commentOf(r))
					if !ok {
						continue
					}
					for _, x := range r.Exprs {
						if ctr, ok := x.(*expr.Counter); ok {
							out[reason] += ctr.Packets
						}
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// once runs f on a GuardConn for nsPath that lives for the call.
func once[T any](nsPath string, f func(*GuardConn) (T, error)) (T, error) {
	g := NewGuardConn(nsPath)
	defer g.Close()
	return f(g)
}

// SetPeerAddrs is GuardConn.SetPeerAddrs in the network namespace at
// nsPath, over a connection of its own.
func SetPeerAddrs(nsPath string, addrs []netip.Addr) (added, removed int, err error) {
	type counts struct{ added, removed int }
	c, err := once(nsPath, func(g *GuardConn) (counts, error) {
		a, r, err := g.SetPeerAddrs(addrs)
		return counts{a, r}, err
	})
	return c.added, c.removed, err
}

// SetOwnRanges is GuardConn.SetOwnRanges in the network namespace at
// nsPath, over a connection of its own.
func SetOwnRanges(nsPath string, ranges []AddrRange) (changed bool, err error) {
	return once(nsPath, func(g *GuardConn) (bool, error) { return g.SetOwnRanges(ranges) })
}

// SetPodSources is GuardConn.SetPodSources in the network namespace at
// nsPath, over a connection of its own.
func SetPodSources(nsPath string, want []PodSource, keep func(PodSource) bool) (added, removed []PodSource, err error) {
	type diff struct{ added, removed []PodSource }
	d, err := once(nsPath, func(g *GuardConn) (diff, error) {
		a, r, err := g.SetPodSources(want, keep)
		return diff{a, r}, err
	})
	return d.added, d.removed, err
}

// DropCounts is GuardConn.DropCounts in the network namespace at nsPath,
// over a connection of its own.
func DropCounts(nsPath string) (map[string]uint64, error) {
	return once(nsPath, (*GuardConn).DropCounts)
}
