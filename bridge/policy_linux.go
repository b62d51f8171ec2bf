package bridge

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/containernetworking/plugins/pkg/utils/sysctl"
	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/weft-net/weft/policy"
)

// brNetfilterSysctl passes bridged IPv4 to the ip family's hooks, where the
// policy table is (the bridge family has no connection tracking on the
// kernels weft runs on). It is per network namespace.
const brNetfilterSysctl = "net/bridge/bridge-nf-call-iptables"

// reg32Port is the second 4-byte register (NFT_REG32_01): the destination
// port, after the protocol in NFT_REG32_00, for the ports sets' key.
const reg32Port = 9

// nftObjectCounter is NFT_OBJECT_COUNTER, for an objref expression.
const nftObjectCounter = 1

// PolicyConfig configures a PolicyTable.
type PolicyConfig struct {
	// NSPath is the network namespace ("" = the caller's own).
	NSPath string
	// Log gets a line for every Sync that writes (nil: none).
	Log *slog.Logger
}

// PolicyTable enforces the NetworkPolicies of the pods of one node in
// weft's table ip weft-policy (see policy.go for its layout). Sync makes
// the kernel enforce exactly a policy.NodeRules, writing only what differs
// from what the kernel holds; the first Sync reads the table the kernel
// has (a router restarted adopts what its predecessor wrote). Its methods
// take turns: it is safe for concurrent use.
type PolicyTable struct {
	log *slog.Logger
	// g is the lasting nftables connection; its mutex, held while its do
	// runs an operation, also guards have.
	g *GuardConn
	// have is what the kernel holds below the table's fixed part, as
	// last read or written; nil: unknown (read it before the next write).
	have *polState
	// writes counts the batches written (for the tests: an adopting
	// Sync writes none).
	writes int
	// hash makes the names of the shared sets and chains (hashName; the
	// tests make it collide).
	hash func(string) string
}

// NewPolicyTable returns a PolicyTable for the namespace of cfg, after
// turning on net.bridge.bridge-nf-call-iptables there, so that traffic
// between the pods of the bridge reaches the table. It writes no nftables
// table yet: the first Sync does.
func NewPolicyTable(cfg PolicyConfig) (*PolicyTable, error) {
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := ensureBrNetfilter(cfg.NSPath, log); err != nil {
		return nil, err
	}
	g := NewGuardConn(cfg.NSPath)
	g.bigBatches = true
	return &PolicyTable{log: log, g: g, hash: hashName}, nil
}

// ensureBrNetfilter sets brNetfilterSysctl to 1 in the namespace at nsPath
// when it is not.
func ensureBrNetfilter(nsPath string, log *slog.Logger) error {
	n, err := openNS(nsPath)
	if err != nil {
		return err
	}
	defer n.close()
	return n.do(func() error {
		got, err := sysctl.Sysctl(brNetfilterSysctl)
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("sysctl %s is missing: NetworkPolicy needs the kernel's br_netfilter (modprobe br_netfilter)", brNetfilterSysctl)
		}
		if err != nil {
			return fmt.Errorf("read sysctl %s: %w", brNetfilterSysctl, err)
		}
		if strings.TrimSpace(got) == "1" {
			return nil
		}
		if _, err := sysctl.Sysctl(brNetfilterSysctl, "1"); err != nil {
			return fmt.Errorf("set sysctl %s=1: %w", brNetfilterSysctl, err)
		}
		log.Info("changed sysctl", "change", fmt.Sprintf("sysctl %s=1 (was %s)", brNetfilterSysctl, strings.TrimSpace(got)))
		return nil
	})
}

// Close closes the connection. The table stays in the kernel, enforcing.
func (t *PolicyTable) Close() error { return t.g.Close() }

func policyNFTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyIPv4, Name: PolicyTableName}
}

func policyForward(tab *nftables.Table) *nftables.Chain {
	accept := nftables.ChainPolicyAccept
	return &nftables.Chain{Name: policyForwardChain, Table: tab, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityRef(policyPriority), Policy: &accept}
}

// policyInput judges what pods send to this node's own addresses (the
// bridge's gateway, the underlay, a hostNetwork pod's port, a Service whose
// endpoint is one): that arrives on the input hook, not forward, and is the
// pods' egress as much as what they send elsewhere.
func policyInput(tab *nftables.Table) *nftables.Chain {
	accept := nftables.ChainPolicyAccept
	return &nftables.Chain{Name: policyInputChain, Table: tab, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityRef(policyPriority), Policy: &accept}
}

func verdictMap(tab *nftables.Table, name string) *nftables.Set {
	return &nftables.Set{Table: tab, Name: name, IsMap: true, KeyType: nftables.TypeIPAddr, DataType: nftables.TypeVerdict}
}

func peersNFTSet(tab *nftables.Table, name string) *nftables.Set {
	return &nftables.Set{Table: tab, Name: name, Interval: true, KeyType: nftables.TypeIPAddr}
}

var portsKeyType = nftables.MustConcatSetType(nftables.TypeInetProto, nftables.TypeInetService)

func portsNFTSet(tab *nftables.Table, name string) *nftables.Set {
	return &nftables.Set{Table: tab, Name: name, Interval: true, Concatenation: true, KeyType: portsKeyType}
}

// Comments of the forward chain's rules.
const (
	commentEstablished = "weft-policy: replies and related of allowed connections"
	commentEgress      = "weft-policy: the egress of isolated pods"
	commentIngress     = "weft-policy: the ingress of isolated pods"
)

// commentEgressToNode is the input chain's rule after commentEstablished.
const commentEgressToNode = "weft-policy: the egress of isolated pods to this node"

var (
	forwardComments = []string{commentEstablished, commentEgress, commentIngress}
	inputComments   = []string{commentEstablished, commentEgressToNode}
)

// vmapRule looks the address at offset up in the verdict map s.
func vmapRule(offset uint32, s *nftables.Set) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Lookup{SourceRegister: reg1, SetName: s.Name, SetID: s.ID, IsDestRegSet: true, DestRegister: 0},
	}
}

// establishedRule accepts replies and related packets of connections
// that were allowed.
func establishedRule(tab *nftables.Table, ch *nftables.Chain) *nftables.Rule {
	return &nftables.Rule{Table: tab, Chain: ch, UserData: comment(commentEstablished), Exprs: []expr.Any{
		&expr.Ct{Register: reg1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: reg1, DestRegister: reg1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED),
			Xor:  binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: reg1, Data: []byte{0, 0, 0, 0}},
		&expr.Verdict{Kind: expr.VerdictAccept},
	}}
}

// forwardRules are the rules of the forward chain; in and eg are the maps.
func forwardRules(tab *nftables.Table, ch *nftables.Chain, in, eg *nftables.Set) []*nftables.Rule {
	return []*nftables.Rule{
		establishedRule(tab, ch),
		{Table: tab, Chain: ch, UserData: comment(commentEgress), Exprs: vmapRule(ipv4SrcOffset, eg)},
		{Table: tab, Chain: ch, UserData: comment(commentIngress), Exprs: vmapRule(ipv4DstOffset, in)},
	}
}

// inputRules are the rules of the input chain: the egress of this node's
// isolated pods (their chains, as for forward); ingress does not apply,
// the node sends from its own addresses.
func inputRules(tab *nftables.Table, ch *nftables.Chain, eg *nftables.Set) []*nftables.Rule {
	return []*nftables.Rule{
		establishedRule(tab, ch),
		{Table: tab, Chain: ch, UserData: comment(commentEgressToNode), Exprs: vmapRule(ipv4SrcOffset, eg)},
	}
}

// podChainRules are the rules of a chain that pods jump to; sets holds
// the sets created in the same batch (their IDs), others are referred to
// by name.
func podChainRules(tab *nftables.Table, ch *nftables.Chain, pc polChain, sets map[string]*nftables.Set) []*nftables.Rule {
	lookup := func(reg uint32, name string) *expr.Lookup {
		l := &expr.Lookup{SourceRegister: reg, SetName: name}
		if s, ok := sets[name]; ok {
			l.SetID = s.ID
		}
		return l
	}
	peerOffset := uint32(ipv4SrcOffset)
	if pc.egress {
		peerOffset = ipv4DstOffset
	}
	var out []*nftables.Rule
	for _, r := range pc.rules {
		var ex []expr.Any
		if r.peers != "" {
			ex = append(ex,
				&expr.Payload{DestRegister: reg1, Base: expr.PayloadBaseNetworkHeader, Offset: peerOffset, Len: 4},
				lookup(reg1, r.peers))
		}
		if r.ports != "" {
			ex = append(ex,
				&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: reg32Name},
				&expr.Payload{DestRegister: reg32Port, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
				lookup(reg32Name, r.ports))
		}
		ex = append(ex, &expr.Verdict{Kind: expr.VerdictReturn})
		out = append(out, &nftables.Rule{Table: tab, Chain: ch, Exprs: ex, UserData: comment(ruleComment(pc.egress, r))})
	}
	out = append(out, &nftables.Rule{Table: tab, Chain: ch, UserData: comment(policyLogComment()), Exprs: []expr.Any{
		&expr.Limit{Type: expr.LimitTypePkts, Rate: PolicyLogRate, Unit: expr.LimitTimeSecond, Burst: PolicyLogBurst},
		&expr.Log{Key: 1<<unix.NFTA_LOG_GROUP | 1<<unix.NFTA_LOG_PREFIX | 1<<unix.NFTA_LOG_SNAPLEN,
			Group: PolicyLogGroup, Snaplen: PolicyLogSnaplen, Data: []byte(policyLogPrefix(pc.egress))},
	}})
	return append(out, &nftables.Rule{Table: tab, Chain: ch, UserData: comment(policyDropComment(pc.egress)), Exprs: []expr.Any{
		&expr.Objref{Type: nftObjectCounter, Name: blockedOf(pc.egress)},
		&expr.Verdict{Kind: expr.VerdictDrop},
	}})
}

// portKey is the key of a ports set element: the protocol and the port,
// each in a 4-byte register.
func portKey(proto byte, port uint16) []byte {
	k := make([]byte, 8)
	k[0] = proto
	binary.BigEndian.PutUint16(k[4:6], port)
	return k
}

func portElements(ps []portRange) []nftables.SetElement {
	out := make([]nftables.SetElement, len(ps))
	for i, p := range ps {
		out[i] = nftables.SetElement{Key: portKey(p.proto, p.lo), KeyEnd: portKey(p.proto, p.hi)}
	}
	return out
}

// portOfElement reads a ports set element back.
func portOfElement(e nftables.SetElement) (portRange, bool) {
	if len(e.Key) != 8 {
		return portRange{}, false
	}
	end := e.KeyEnd
	if len(end) == 0 {
		end = e.Key
	}
	if len(end) != 8 || end[0] != e.Key[0] {
		return portRange{}, false
	}
	return portRange{proto: e.Key[0], lo: binary.BigEndian.Uint16(e.Key[4:6]), hi: binary.BigEndian.Uint16(end[4:6])}, true
}

// peerElements are the elements of a peers set holding rs (merged).
func peerElements(rs []AddrRange) []nftables.SetElement {
	bs, _ := intervalBounds(rs) // IPv4 and ordered: from peersOf or the kernel
	return boundElements(bs)
}

// policyRead is the table as the kernel has it.
type policyRead struct {
	exists bool
	// intact: the fixed part (forward and input chains and their rules,
	// the maps, the counters) is as written, and every set is of the type
	// its name says.
	intact bool
	// noInput: the table is intact but for the input chain, which a
	// router before it did not write.
	noInput bool
	state   *polState
	use     uint32
}

// tableUse is the kernel's use count of a table (its chains, sets and
// objects). google/nftables v0.3.0 decodes the attribute, which the kernel
// sends in network byte order, in the host's: this undoes that.
func tableUse(t *nftables.Table) uint32 {
	return binary.BigEndian.Uint32(binary.NativeEndian.AppendUint32(nil, t.Use))
}

// isSetOf reports whether a set's name is that of a peers or a ports set
// (prefix peersPrefix or portsPrefix): a shared one, or one of the sets
// of a single pod's rule that weft wrote before sets were shared
// ("ingress-10.32.0.3-0-peers"), so that such a table is adopted, and
// its sets replaced, without a rebuild.
func isSetOf(name, prefix string) bool {
	return strings.HasPrefix(name, prefix) || strings.HasSuffix(name, "-"+strings.TrimSuffix(prefix, "-"))
}

// readPolicy reads table ip weft-policy.
func readPolicy(c *nftables.Conn) (*policyRead, error) {
	out := &policyRead{state: newPolState()}
	tab, err := c.ListTableOfFamily(PolicyTableName, nftables.TableFamilyIPv4)
	if errors.Is(err, unix.ENOENT) {
		return out, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading nftables table ip %s: %w", PolicyTableName, err)
	}
	out.exists, out.intact, out.use = true, true, tableUse(tab)
	tab = policyNFTable()
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyIPv4)
	if err != nil {
		return nil, fmt.Errorf("reading the chains of table ip %s: %w", PolicyTableName, err)
	}
	sawForward, sawInput := false, false
	for _, ch := range chains {
		if ch.Table.Name != PolicyTableName {
			continue
		}
		rules, err := c.GetRules(tab, ch)
		if err != nil {
			return nil, fmt.Errorf("reading the rules of chain %s of table ip %s: %w", ch.Name, PolicyTableName, err)
		}
		comments := make([]string, len(rules))
		for i, r := range rules {
			comments[i] = commentOf(r)
		}
		if ch.Name == policyForwardChain {
			sawForward = true
			if !sameHook(ch, policyForward(tab)) || !slices.Equal(comments, forwardComments) {
				out.intact = false
			}
			continue
		}
		if ch.Name == policyInputChain {
			sawInput = true
			if !sameHook(ch, policyInput(tab)) || !slices.Equal(comments, inputComments) {
				out.intact = false
			}
			continue
		}
		out.state.chains[ch.Name] = comments
	}
	if !sawForward {
		out.intact = false
	}
	sets, err := c.GetSets(tab)
	if err != nil {
		return nil, fmt.Errorf("reading the sets of table ip %s: %w", PolicyTableName, err)
	}
	maps := 0
	for _, s := range sets {
		switch {
		case s.Name == ingressMap || s.Name == egressMap:
			// (google/nftables v0.3.0 reads a verdict map's data type
			// into its KeyType: only IsMap is telling.)
			if !s.IsMap {
				out.intact = false
				continue
			}
			maps++
			els, err := c.GetSetElements(s)
			if err != nil {
				return nil, fmt.Errorf("reading map %s of table ip %s: %w", s.Name, PolicyTableName, err)
			}
			m := out.state.mapOf(s.Name == egressMap)
			for _, e := range els {
				a, ok := netip.AddrFromSlice(e.Key)
				if !ok {
					continue
				}
				chain, _ := jumpOfVerdict(e.Val)
				m[a] = chain // "" (another verdict): no state names it, it is replaced
			}
		case isSetOf(s.Name, peersPrefix) && s.Interval && !s.IsMap && s.KeyType.Name == nftables.TypeIPAddr.Name:
			els, err := c.GetSetElements(s)
			if err != nil {
				return nil, fmt.Errorf("reading set %s of table ip %s: %w", s.Name, PolicyTableName, err)
			}
			out.state.peerSets[s.Name] = rangesOfBounds(boundsOfElements(els))
		case isSetOf(s.Name, portsPrefix) && s.Interval && !s.IsMap && s.KeyType.Name == portsKeyType.Name:
			els, err := c.GetSetElements(s)
			if err != nil {
				return nil, fmt.Errorf("reading set %s of table ip %s: %w", s.Name, PolicyTableName, err)
			}
			var ps []portRange
			for _, e := range els {
				if p, ok := portOfElement(e); ok {
					ps = append(ps, p)
				} else {
					out.intact = false
				}
			}
			out.state.portSets[s.Name] = mergePorts(ps)
		default:
			out.intact = false // a set weft does not write
		}
	}
	if maps != 2 {
		out.intact = false
	}
	objs, err := c.GetNamedObjects(tab)
	if err != nil {
		return nil, fmt.Errorf("reading the counters of table ip %s: %w", PolicyTableName, err)
	}
	counters := 0
	for _, o := range objs {
		if no, ok := o.(*nftables.NamedObj); ok && no.Type == nftables.ObjTypeCounter && (no.Name == blockedIngress || no.Name == blockedEgress) {
			counters++
		}
	}
	if counters != 2 || len(objs) != 2 {
		out.intact = false
	}
	if out.intact && !sawInput {
		out.noInput = true
	}
	return out, nil
}

// Sync makes the kernel enforce exactly nr for the pods of this node: an
// isolated direction of a pod gets an element in that direction's map
// that jumps to the chain of its rules, which the pods with the same
// rules share, as they share the sets of the peers and ports of those
// rules; pods and directions that no policy isolates pass untouched.
// Only what differs from the kernel's table is written, in one batch, so
// packets never see a half-written state; when nothing differs, nothing
// is written. The first Sync (and the first after an error, or after the
// table changed under it) reads the table from the kernel; a table whose
// fixed part is not weft's is rebuilt, also in one batch.
func (t *PolicyTable) Sync(nr *policy.NodeRules) error {
	w, err := wantPolicyNamed(nr, t.hash)
	if err != nil {
		return err
	}
	return t.g.do(func(c *nftables.Conn) error {
		err := t.syncLocked(c, w)
		if err != nil {
			// Read the table again before the next write (GuardConn.do
			// tries once more, over a new socket).
			t.have = nil
			t.log.Warn("syncing NetworkPolicy rules failed", "table", "ip "+PolicyTableName, "err", err)
		}
		return err
	})
}

func (t *PolicyTable) syncLocked(c *nftables.Conn, w *polWant) error {
	rebuild, addInput := false, false
	if t.have != nil {
		// A cheap check that the table is still the one written last:
		// it exists and holds as many objects.
		tab, err := c.ListTableOfFamily(PolicyTableName, nftables.TableFamilyIPv4)
		if err != nil || tableUse(tab) != t.have.objects() {
			t.have = nil
		}
	}
	if t.have == nil {
		r, err := readPolicy(c)
		if err != nil {
			return err
		}
		switch {
		case !r.exists:
			rebuild = true
			t.log.Info("creating nftables table for NetworkPolicy", "table", "ip "+PolicyTableName)
		case r.noInput:
			t.have = r.state
			addInput = true
			t.log.Info("adding the input chain to nftables table for NetworkPolicy: pods' egress to this node's own addresses is judged too", "table", "ip "+PolicyTableName)
		case !r.intact:
			rebuild = true
			t.log.Warn("rebuilding nftables table: it is not as weft writes it (its counters start again from 0)", "table", "ip "+PolicyTableName)
		default:
			t.have = r.state
		}
		if rebuild {
			t.have = newPolState()
		}
	}
	ops := diffPolicy(w.state, t.have)
	ops.addInput = addInput
	if ops.empty() && !rebuild {
		return nil
	}
	if err := writePolicy(c, w, ops, rebuild); err != nil {
		return fmt.Errorf("writing nftables table ip %s (%s): %w", PolicyTableName, ops, err)
	}
	t.have = w.state.clone()
	t.writes++
	t.log.Debug("synced NetworkPolicy rules", "table", "ip "+PolicyTableName, "changes", ops.String(),
		"pods", len(w.state.ingress)+len(w.state.egress))
	return nil
}

// writePolicy writes ops (from have to w) in one batch; with rebuild, it
// first replaces the table by an empty one with its fixed part.
func writePolicy(c *nftables.Conn, w *polWant, o *polOps, rebuild bool) error {
	tab := policyNFTable()
	in, eg := verdictMap(tab, ingressMap), verdictMap(tab, egressMap)
	if rebuild {
		c.AddTable(tab)
		c.DelTable(tab)
		c.AddTable(tab)
		for _, name := range []string{blockedIngress, blockedEgress} {
			c.AddObj(&nftables.NamedObj{Table: tab, Name: name, Type: nftables.ObjTypeCounter, Obj: &expr.Counter{}})
		}
		for _, m := range []*nftables.Set{in, eg} {
			if err := c.AddSet(m, nil); err != nil {
				return err
			}
		}
		fwd := policyForward(tab)
		c.AddChain(fwd)
		for _, r := range forwardRules(tab, fwd, in, eg) {
			c.AddRule(r)
		}
	}
	if rebuild || o.addInput {
		inp := policyInput(tab)
		c.AddChain(inp)
		for _, r := range inputRules(tab, inp, eg) {
			c.AddRule(r)
		}
	}
	created := map[string]*nftables.Set{}
	for _, name := range o.newPeerSets {
		s := peersNFTSet(tab, name)
		if err := c.AddSet(s, peerElements(w.state.peerSets[name])); err != nil {
			return err
		}
		created[name] = s
	}
	for _, name := range o.newPortSets {
		s := portsNFTSet(tab, name)
		if err := c.AddSet(s, portElements(w.state.portSets[name])); err != nil {
			return err
		}
		created[name] = s
	}
	for _, d := range o.peerDiffs {
		s := peersNFTSet(tab, d.name)
		if len(d.del) > 0 {
			if err := c.SetDeleteElements(s, peerElements(d.del)); err != nil {
				return err
			}
		}
		if len(d.add) > 0 {
			if err := c.SetAddElements(s, peerElements(d.add)); err != nil {
				return err
			}
		}
	}
	for _, d := range o.portDiffs {
		s := portsNFTSet(tab, d.name)
		if len(d.del) > 0 {
			if err := c.SetDeleteElements(s, portElements(d.del)); err != nil {
				return err
			}
		}
		if len(d.add) > 0 {
			if err := c.SetAddElements(s, portElements(d.add)); err != nil {
				return err
			}
		}
	}
	for _, name := range o.newChains {
		c.AddChain(&nftables.Chain{Name: name, Table: tab})
	}
	for _, name := range o.writeChains {
		ch := &nftables.Chain{Name: name, Table: tab}
		if !slices.Contains(o.newChains, name) {
			c.FlushChain(ch)
		}
		for _, r := range podChainRules(tab, ch, w.chains[name], created) {
			c.AddRule(r)
		}
	}
	for _, m := range o.mapDel {
		if err := c.SetDeleteElements(mapSet(m.egress, in, eg), []nftables.SetElement{{Key: m.addr.AsSlice()}}); err != nil {
			return err
		}
	}
	for _, m := range o.mapAdd {
		el := nftables.SetElement{Key: m.addr.AsSlice(), VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: m.chain}}
		if err := c.SetAddElements(mapSet(m.egress, in, eg), []nftables.SetElement{el}); err != nil {
			return err
		}
	}
	for _, name := range o.delChains {
		ch := &nftables.Chain{Name: name, Table: tab}
		c.FlushChain(ch)
		c.DelChain(ch)
	}
	for _, name := range o.delPeerSets {
		c.DelSet(peersNFTSet(tab, name))
	}
	for _, name := range o.delPortSets {
		c.DelSet(portsNFTSet(tab, name))
	}
	return c.Flush()
}

func mapSet(egress bool, in, eg *nftables.Set) *nftables.Set {
	if egress {
		return eg
	}
	return in
}

// Blocked reads the packets dropped by policy, by direction (for
// weft_policy_blocked_total): every packet of a connection that a pod's
// ingress or egress does not allow, retransmissions included. Both are 0
// when there is no table. A table rebuilt (see Sync) or torn down starts
// again from 0.
func (t *PolicyTable) Blocked() (ingress, egress uint64, err error) {
	err = t.g.do(func(c *nftables.Conn) error {
		ingress, egress = 0, 0
		objs, err := c.GetNamedObjects(policyNFTable())
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading the counters of table ip %s: %w", PolicyTableName, err)
		}
		for _, o := range objs {
			no, ok := o.(*nftables.NamedObj)
			if !ok || no.Type != nftables.ObjTypeCounter {
				continue
			}
			ctr, ok := no.Obj.(*expr.Counter)
			if !ok {
				continue
			}
			switch no.Name {
			case blockedIngress:
				ingress = ctr.Packets
			case blockedEgress:
				egress = ctr.Packets
			}
		}
		return nil
	})
	return ingress, egress, err
}

// Teardown deletes table ip weft-policy: nothing is enforced any more
// (policy switched off, weft reset). No table is not an error. A later
// Sync writes the table again.
func (t *PolicyTable) Teardown() error {
	return t.g.do(func(c *nftables.Conn) error {
		t.have = nil
		return deletePolicyTable(c)
	})
}

// RemovePolicyTable deletes table ip weft-policy in the namespace at nsPath
// ("" the current one), if it is there, without a PolicyTable (which
// turns on br_netfilter): what a router with --network-policy=false does
// with the rules a previous run left.
func RemovePolicyTable(nsPath string) error {
	g := NewGuardConn(nsPath)
	defer g.Close()
	return g.do(deletePolicyTable)
}

func deletePolicyTable(c *nftables.Conn) error {
	tab := policyNFTable()
	c.AddTable(tab) // so that the delete succeeds when there is no table
	c.DelTable(tab)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("delete nftables table ip %s: %w", PolicyTableName, err)
	}
	return nil
}
