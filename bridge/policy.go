package bridge

// NetworkPolicy enforcement (issue 15): the rules of package policy for
// the pods of this node, in weft's own nftables table ip weft-policy.
//
//	table ip weft-policy
//	  counter blocked-ingress, counter blocked-egress
//	  map ingress { ipv4_addr : verdict }   pod -> jump ingress-<pod>
//	  map egress  { ipv4_addr : verdict }   pod -> jump egress-<pod>
//	  chain forward (filter, hook forward, priority filter - 5, policy accept)
//	    ct state established,related accept
//	    ip saddr vmap @egress
//	    ip daddr vmap @ingress
//	  chain egress-<pod> (one per pod whose egress is isolated)
//	    ip daddr @egress-<pod>-<i>-peers meta l4proto . th dport @egress-<pod>-<i>-ports return
//	    ...
//	    counter name blocked-egress drop
//	  chain ingress-<pod>: the same with ip saddr
//
// A pod that no policy isolates in a direction has no element in that
// map: its packets pass this table untouched. A rule that allows every
// peer or every port leaves out that lookup (and its set).
//
// This file holds the pure part: the kernel's state as values (polState),
// the encoding of policy.NodeRules into it (wantPolicy), and the diff of two
// states (diffPolicy), so that a Sync writes only what changed.

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/weft-net/weft/policy"
)

// Names in table ip weft-policy.
const (
	// PolicyTableName is the name of weft's nftables table (family ip)
	// that enforces NetworkPolicies.
	PolicyTableName = "weft-policy"

	policyForwardChain = "forward"
	ingressMap         = "ingress"
	egressMap          = "egress"
	blockedIngress     = "blocked-ingress"
	blockedEgress      = "blocked-egress"

	// policyPriority is the forward chain's priority: after the guard
	// (filter - 10), so that what the guard drops is not counted as
	// blocked by policy; before table ip weft's forward chain (filter).
	// kube-proxy's filter chains (dstnat - 10) and its DNAT run before,
	// so a connection to a Service is judged by the endpoint it goes to.
	policyPriority = -5
)

// Protocol numbers of the ports a policy can name.
var protoNumbers = map[corev1.Protocol]byte{
	corev1.ProtocolTCP:  6,
	corev1.ProtocolUDP:  17,
	corev1.ProtocolSCTP: 132,
}

// portRange is one element of a ports set: an IP protocol number and an
// inclusive range of destination ports.
type portRange struct {
	proto  byte
	lo, hi uint16
}

func (p portRange) String() string { return fmt.Sprintf("%d:%d-%d", p.proto, p.lo, p.hi) }

func comparePortRanges(a, b portRange) int {
	return cmp.Or(cmp.Compare(a.proto, b.proto), cmp.Compare(a.lo, b.lo), cmp.Compare(a.hi, b.hi))
}

// mergePorts sorts ps and merges overlapping and adjacent ranges of the
// same protocol (the kernel refuses overlapping elements); a range with lo
// after hi is dropped.
func mergePorts(ps []portRange) []portRange {
	s := slices.DeleteFunc(slices.Clone(ps), func(p portRange) bool { return p.lo > p.hi })
	slices.SortFunc(s, comparePortRanges)
	var out []portRange
	for _, p := range s {
		if n := len(out); n > 0 && out[n-1].proto == p.proto && (out[n-1].hi == 65535 || p.lo <= out[n-1].hi+1) {
			out[n-1].hi = max(out[n-1].hi, p.hi)
			continue
		}
		out = append(out, p)
	}
	return out
}

// portsOf translates a rule's ports; those of a protocol without a number
// here (none the API admits) match nothing.
func portsOf(prs []policy.PortRange) []portRange {
	var out []portRange
	for _, p := range prs {
		if n, ok := protoNumbers[p.Protocol]; ok {
			out = append(out, portRange{n, p.Lo, p.Hi})
		}
	}
	return mergePorts(out)
}

// peersOf translates a rule's peers into merged address ranges.
func peersOf(ivs []policy.Interval) []AddrRange {
	rs := make([]AddrRange, 0, len(ivs))
	for _, iv := range ivs {
		if iv.Lo.Is4() && iv.Hi.Is4() && !iv.Hi.Less(iv.Lo) {
			rs = append(rs, AddrRange{First: iv.Lo, Last: iv.Hi})
		}
	}
	m, _ := mergeRanges(rs) // checked above
	return m
}

// polRule is one allow rule of a pod's chain: the names of its peers and
// ports sets, "" for any peer or any port.
type polRule struct {
	peers, ports string
}

// polChain is the chain of one pod in one direction: its allow rules,
// then the counted drop.
type polChain struct {
	pod    netip.Addr
	egress bool
	rules  []polRule
}

func dirName(egress bool) string {
	if egress {
		return "egress"
	}
	return "ingress"
}

func podChainName(pod netip.Addr, egress bool) string { return dirName(egress) + "-" + pod.String() }

func podSetName(chain string, i int, kind string) string {
	return fmt.Sprintf("%s-%d-%s", chain, i, kind)
}

// ruleComment is the comment of an allow rule; it names the sets, so
// equal comments mean equal rules.
func ruleComment(egress bool, r polRule) string {
	peer, port := "any peer", "any port"
	if r.peers != "" {
		peer = "@" + r.peers
	}
	if r.ports != "" {
		port = "@" + r.ports
	}
	if egress {
		return "weft-policy: allow to " + peer + ", " + port
	}
	return "weft-policy: allow from " + peer + ", " + port
}

func policyDropComment(egress bool) string {
	return "weft-policy: drop the rest, counted in " + blockedOf(egress)
}

func blockedOf(egress bool) string {
	if egress {
		return blockedEgress
	}
	return blockedIngress
}

// comments are the comments of the chain's rules, in order.
func (c polChain) comments() []string {
	out := make([]string, 0, len(c.rules)+1)
	for _, r := range c.rules {
		out = append(out, ruleComment(c.egress, r))
	}
	return append(out, policyDropComment(c.egress))
}

// polState is what table ip weft-policy holds below its fixed part (the
// forward chain, the maps and the counters): the pods' chains (by name:
// the comments of their rules), the sets (by name), and the maps'
// elements (pod address to chain name).
type polState struct {
	chains          map[string][]string
	peerSets        map[string][]AddrRange // merged
	portSets        map[string][]portRange // merged
	ingress, egress map[netip.Addr]string
}

func newPolState() *polState {
	return &polState{chains: map[string][]string{}, peerSets: map[string][]AddrRange{}, portSets: map[string][]portRange{},
		ingress: map[netip.Addr]string{}, egress: map[netip.Addr]string{}}
}

func (s *polState) clone() *polState {
	c := newPolState()
	for k, v := range s.chains {
		c.chains[k] = slices.Clone(v)
	}
	for k, v := range s.peerSets {
		c.peerSets[k] = slices.Clone(v)
	}
	for k, v := range s.portSets {
		c.portSets[k] = slices.Clone(v)
	}
	maps.Copy(c.ingress, s.ingress)
	maps.Copy(c.egress, s.egress)
	return c
}

func (s *polState) equal(o *polState) bool {
	return maps.EqualFunc(s.chains, o.chains, slices.Equal) &&
		maps.EqualFunc(s.peerSets, o.peerSets, slices.Equal) &&
		maps.EqualFunc(s.portSets, o.portSets, slices.Equal) &&
		maps.Equal(s.ingress, o.ingress) && maps.Equal(s.egress, o.egress)
}

// objects is the number of chains, sets and counters of the table in
// state s: the kernel's use count of the table.
func (s *polState) objects() uint32 {
	const fixed = 1 + 2 + 2 // forward, the two maps, the two counters
	return uint32(fixed + len(s.chains) + len(s.peerSets) + len(s.portSets))
}

// polWant is the state that enforces nr, with each chain's rules.
type polWant struct {
	state  *polState
	chains map[string]polChain
}

// wantPolicy encodes nr into the table's state. Rules that can match
// nothing (no peer or no port) are kept, with their empty set, so that a
// pod or port that comes later changes a set rather than the chain.
func wantPolicy(nr *policy.NodeRules) (*polWant, error) {
	w := &polWant{state: newPolState(), chains: map[string]polChain{}}
	if nr == nil {
		return w, nil
	}
	for addr, pr := range nr.Pods {
		if !addr.Is4() {
			return nil, fmt.Errorf("policy rules of pod %s/%s: address %s is not IPv4", pr.Namespace, pr.Name, addr)
		}
		for _, egress := range []bool{false, true} {
			d := pr.Ingress
			if egress {
				d = pr.Egress
			}
			if !d.Isolated {
				continue
			}
			name := podChainName(addr, egress)
			ch := polChain{pod: addr, egress: egress}
			for i, r := range d.Rules {
				var pr polRule
				if !r.AnyPeer {
					pr.peers = podSetName(name, i, "peers")
					w.state.peerSets[pr.peers] = peersOf(r.Peers)
				}
				if !r.AnyPort {
					pr.ports = podSetName(name, i, "ports")
					w.state.portSets[pr.ports] = portsOf(r.Ports)
				}
				ch.rules = append(ch.rules, pr)
			}
			w.chains[name] = ch
			w.state.chains[name] = ch.comments()
			if egress {
				w.state.egress[addr] = name
			} else {
				w.state.ingress[addr] = name
			}
		}
	}
	return w, nil
}

// setDiff is what to add to and delete from one set that both states have.
type setDiff[T any] struct {
	name     string
	add, del []T
}

// mapOp is one element of a verdict map.
type mapOp struct {
	egress bool
	addr   netip.Addr
	chain  string
}

// polOps are the writes that turn one state into another, in the order
// they are applied in one kernel batch: new sets, element changes, new
// chains, rewritten chains (flushed and filled), map elements deleted and
// added, then what is gone (chains with their rules, then sets).
type polOps struct {
	newPeerSets []string
	newPortSets []string
	peerDiffs   []setDiff[AddrRange]
	portDiffs   []setDiff[portRange]
	newChains   []string
	writeChains []string // new ones too: their rules
	mapDel      []mapOp
	mapAdd      []mapOp
	delChains   []string
	delPeerSets []string
	delPortSets []string
}

func (o *polOps) empty() bool {
	return len(o.newPeerSets)+len(o.newPortSets)+len(o.peerDiffs)+len(o.portDiffs)+len(o.newChains)+
		len(o.writeChains)+len(o.mapDel)+len(o.mapAdd)+len(o.delChains)+len(o.delPeerSets)+len(o.delPortSets) == 0
}

func compareAddrRanges(a, b AddrRange) int {
	return cmp.Or(a.First.Compare(b.First), a.Last.Compare(b.Last))
}

// diffPolicy lists the writes that turn have into want. Nothing that is
// the same in both is written.
func diffPolicy(want, have *polState) *polOps {
	// Sets are diffed range by range: the ranges of have that want lacks
	// go as a whole, those of want that have lacks come as a whole. Both
	// are merged (disjoint, not adjacent), so the kernel's interval set,
	// which holds the bounds of have, then holds exactly those of want.
	o := &polOps{}
	for _, name := range sortedKeys(want.peerSets) {
		h, ok := have.peerSets[name]
		if !ok {
			o.newPeerSets = append(o.newPeerSets, name)
			continue
		}
		if add, del := diffSet(want.peerSets[name], h, compareAddrRanges); len(add)+len(del) > 0 {
			o.peerDiffs = append(o.peerDiffs, setDiff[AddrRange]{name, add, del})
		}
	}
	for _, name := range sortedKeys(want.portSets) {
		h, ok := have.portSets[name]
		if !ok {
			o.newPortSets = append(o.newPortSets, name)
			continue
		}
		if add, del := diffSet(want.portSets[name], h, comparePortRanges); len(add)+len(del) > 0 {
			o.portDiffs = append(o.portDiffs, setDiff[portRange]{name, add, del})
		}
	}
	for _, name := range sortedKeys(want.chains) {
		h, ok := have.chains[name]
		if !ok {
			o.newChains = append(o.newChains, name)
		}
		if !ok || !slices.Equal(h, want.chains[name]) {
			o.writeChains = append(o.writeChains, name)
		}
	}
	for _, egress := range []bool{false, true} {
		w, h := want.ingress, have.ingress
		if egress {
			w, h = want.egress, have.egress
		}
		for _, a := range sortedAddrs(h) {
			if c, ok := w[a]; !ok || c != h[a] {
				o.mapDel = append(o.mapDel, mapOp{egress, a, h[a]})
			}
		}
		for _, a := range sortedAddrs(w) {
			if c, ok := h[a]; !ok || c != w[a] {
				o.mapAdd = append(o.mapAdd, mapOp{egress, a, w[a]})
			}
		}
	}
	for _, name := range sortedKeys(have.chains) {
		if _, ok := want.chains[name]; !ok {
			o.delChains = append(o.delChains, name)
		}
	}
	for _, name := range sortedKeys(have.peerSets) {
		if _, ok := want.peerSets[name]; !ok {
			o.delPeerSets = append(o.delPeerSets, name)
		}
	}
	for _, name := range sortedKeys(have.portSets) {
		if _, ok := want.portSets[name]; !ok {
			o.delPortSets = append(o.delPortSets, name)
		}
	}
	return o
}

// applyOps is what the kernel does with o, on a state: the model the
// tests check diffPolicy against.
func applyOps(s *polState, want *polState, o *polOps) *polState {
	out := s.clone()
	for _, n := range o.newPeerSets {
		out.peerSets[n] = slices.Clone(want.peerSets[n])
	}
	for _, n := range o.newPortSets {
		out.portSets[n] = slices.Clone(want.portSets[n])
	}
	for _, d := range o.peerDiffs {
		out.peerSets[d.name] = applySetDiff(out.peerSets[d.name], d.add, d.del, compareAddrRanges)
	}
	for _, d := range o.portDiffs {
		out.portSets[d.name] = applySetDiff(out.portSets[d.name], d.add, d.del, comparePortRanges)
	}
	for _, n := range o.writeChains {
		out.chains[n] = slices.Clone(want.chains[n])
	}
	for _, m := range o.mapDel {
		delete(out.mapOf(m.egress), m.addr)
	}
	for _, m := range o.mapAdd {
		out.mapOf(m.egress)[m.addr] = m.chain
	}
	for _, n := range o.delChains {
		delete(out.chains, n)
	}
	for _, n := range o.delPeerSets {
		delete(out.peerSets, n)
	}
	for _, n := range o.delPortSets {
		delete(out.portSets, n)
	}
	return out
}

func applySetDiff[T comparable](have, add, del []T, compare func(a, b T) int) []T {
	out := slices.DeleteFunc(slices.Clone(have), func(x T) bool { return slices.Contains(del, x) })
	out = append(out, add...)
	slices.SortFunc(out, compare)
	return out
}

func (s *polState) mapOf(egress bool) map[netip.Addr]string {
	if egress {
		return s.egress
	}
	return s.ingress
}

func sortedKeys[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }

func sortedAddrs(m map[netip.Addr]string) []netip.Addr {
	return slices.SortedFunc(maps.Keys(m), netip.Addr.Compare)
}

// String summarises o for a log line.
func (o *polOps) String() string {
	var parts []string
	add := func(what string, n int) {
		if n > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", what, n))
		}
	}
	add("new sets", len(o.newPeerSets)+len(o.newPortSets))
	add("changed sets", len(o.peerDiffs)+len(o.portDiffs))
	add("new chains", len(o.newChains))
	add("written chains", len(o.writeChains))
	add("map elements deleted", len(o.mapDel))
	add("map elements added", len(o.mapAdd))
	add("deleted chains", len(o.delChains))
	add("deleted sets", len(o.delPeerSets)+len(o.delPortSets))
	if len(parts) == 0 {
		return "nothing"
	}
	return strings.Join(parts, ", ")
}

// Netlink attributes of a verdict (linux/netfilter/nf_tables.h).
const (
	nftaVerdictCode  = 1
	nftaVerdictChain = 2
	nftJump          = 0xfffffffd // NFT_JUMP, -3
)

// jumpOfVerdict reads the chain a verdict map element jumps to from its
// data as the kernel sends it (google/nftables v0.3.0 passes the nested
// attributes of NFTA_DATA_VERDICT through undecoded): a verdict code and
// a chain name. ok is false for another verdict or a malformed one.
func jumpOfVerdict(b []byte) (chain string, ok bool) {
	code, haveCode := uint32(0), false
	for len(b) >= 4 {
		n := int(binary.NativeEndian.Uint16(b[0:2]))
		typ := binary.NativeEndian.Uint16(b[2:4]) &^ 0xc000 // NLA_F_NESTED, NLA_F_NET_BYTEORDER
		if n < 4 || n > len(b) {
			return "", false
		}
		data := b[4:n]
		switch typ {
		case nftaVerdictCode:
			if len(data) != 4 {
				return "", false
			}
			code, haveCode = binary.BigEndian.Uint32(data), true
		case nftaVerdictChain:
			chain = strings.TrimRight(string(data), "\x00")
		}
		next := (n + 3) &^ 3
		if next >= len(b) {
			break
		}
		b = b[next:]
	}
	if !haveCode || code != nftJump || chain == "" {
		return "", false
	}
	return chain, true
}
