package tunnel

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/bpf"

	"github.com/weft-net/weft/internal/ethtool"
	"github.com/weft-net/weft/internal/netstat"
	"github.com/weft-net/weft/tunnel/internal/netnstest"
)

// waitLong waits for cond, up to a minute: the probes run on their own
// clock (one a second), and a loaded machine may be slow.
func waitLong(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after a minute waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pathOf is what d's probes say of peer's vxlan path, and the rounds
// they ended.
func pathOf(d *Device, peer string) (string, int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	h := d.health[peer]
	if h == nil {
		return "", 0
	}
	return h.status(), h.round
}

// blockVXLAN makes node n drop the VXLAN port coming in (the firewall of
// a node), or lets it through again.
func blockVXLAN(t *testing.T, n *netnstest.Node, on bool) {
	t.Helper()
	ctx := context.Background()
	_, _ = n.NS.Exec(ctx, "nft", "delete", "table", "inet", "weftprobetest")
	if !on {
		return
	}
	for _, c := range [][]string{
		{"nft", "add", "table", "inet", "weftprobetest"},
		{"nft", "add", "chain", "inet", "weftprobetest", "in", "{ type filter hook input priority -300 ; policy accept ; }"},
		{"nft", "add", "rule", "inet", "weftprobetest", "in", "udp", "dport", "4789", "drop"},
	} {
		show(t, n.NS, c...)
	}
}

// TestKernelVXLANProbes: the probes cross the real kernels. Both nodes'
// probes are answered (by the peer's kernel); they go on being answered
// while the peer's router is down (its kernel still carries the pods'
// traffic, so the path is up); a firewall that drops the VXLAN port on
// one node takes the path down on both (each probe needs both ways), and
// it comes back once the port passes again. A node whose arp_ignore keeps
// its kernel from answering has its router answer instead.
func TestKernelVXLANProbes(t *testing.T) {
	mtu := netnstest.UnderlayMTU - Overhead(ModeVXLAN)
	p := newPair(t, mtu)
	a, b := p.Nodes[0], p.Nodes[1]
	da, db := startVXLAN(t, a, mtu), startVXLAN(t, b, mtu)
	if da.prober == nil || db.prober == nil {
		t.Fatal("no prober on the vxlan devices")
	}
	wireVXLAN(t, p, da, db)
	waitLong(t, "both paths answering", func() bool {
		pa, _ := pathOf(da.Device, "b")
		pb, _ := pathOf(db.Device, "a")
		return pa == "ok" && pb == "ok"
	})
	if c := connOf(da.Device, "b"); c.Path != "ok" {
		t.Errorf("a's status of b: path %q, want ok", c.Path)
	}

	// b's router stops; its kernel answers on.
	db.stop()
	_, r0 := pathOf(da.Device, "b")
	waitLong(t, "a's probes of b to go on", func() bool {
		_, r := pathOf(da.Device, "b")
		return r >= r0+probeMisses+2
	})
	if st, _ := pathOf(da.Device, "b"); st != "ok" {
		t.Fatalf("a's path to b with b's router down: %q, want ok (b's kernel answers)", st)
	}

	db = startVXLAN(t, b, mtu)
	wireVXLAN(t, p, da, db)
	blockVXLAN(t, b, true)
	waitLong(t, "the blocked path down on both nodes", func() bool {
		pa, _ := pathOf(da.Device, "b")
		pb, _ := pathOf(db.Device, "a")
		return strings.HasPrefix(pa, "down since") && strings.HasPrefix(pb, "down since")
	})
	if c := connOf(da.Device, "b"); !strings.Contains(c.Path, "no answer to") {
		t.Errorf("a's status of b: path %q, want the lost probes named", c.Path)
	}
	blockVXLAN(t, b, false)
	waitLong(t, "the path back up on both nodes", func() bool {
		pa, _ := pathOf(da.Device, "b")
		pb, _ := pathOf(db.Device, "a")
		return pa == "ok" && pb == "ok"
	})

	// arp_ignore 1 on b: its kernel answers only for addresses on the
	// device the request came by; b's router answers.
	db.stop()
	show(t, b.NS, "sysctl", "-q", "-w", "net.ipv4.conf.all.arp_ignore=1")
	db = startVXLAN(t, b, mtu)
	if !db.prober.(*ARPProber).AnswersItself() {
		t.Fatal("b's prober does not answer with arp_ignore 1")
	}
	wireVXLAN(t, p, da, db)
	waitLong(t, "a's path to b answering with arp_ignore 1 on b", func() bool {
		st, _ := pathOf(da.Device, "b")
		return st == "ok"
	})
	_, r0 = pathOf(da.Device, "b")
	waitLong(t, "a's probes of b with arp_ignore on b", func() bool {
		_, r := pathOf(da.Device, "b")
		return r >= r0+probeMisses+2
	})
	if st, _ := pathOf(da.Device, "b"); st != "ok" {
		t.Errorf("a's path to b with arp_ignore 1 on b: %q, want ok (b's router answers)", st)
	}

	// arp_ignore changed while b's router runs: its prober follows,
	// and a's path to b never goes down meanwhile.
	downs := value(da.metrics.pathChanges.WithLabelValues("down"))
	bp := db.prober.(*ARPProber)
	for _, v := range []int{0, 1} {
		show(t, b.NS, "sysctl", "-q", "-w", fmt.Sprintf("net.ipv4.conf.all.arp_ignore=%d", v))
		waitLong(t, fmt.Sprintf("b's prober to see arp_ignore %d", v), func() bool { return bp.AnswersItself() == (v > 0) })
		_, r0 = pathOf(da.Device, "b")
		waitLong(t, fmt.Sprintf("a's probes of b after arp_ignore %d on b", v), func() bool {
			_, r := pathOf(da.Device, "b")
			return r >= r0+probeMisses+2
		})
	}
	if st, _ := pathOf(da.Device, "b"); st != "ok" || value(da.metrics.pathChanges.WithLabelValues("down")) != downs {
		t.Errorf("a's path to b while arp_ignore changed on b: %q, %v falls; want ok and none", st, value(da.metrics.pathChanges.WithLabelValues("down"))-downs)
	}
}

// mangleInnerChecksums makes n's underlay ingress overwrite the inner
// UDP (a non-zero one: a datagram without a checksum passes) and TCP
// checksums of the VXLAN frames it receives, as a device that completes
// them wrongly would have sent them; without IP options inside, the
// inner IPv4 header starts 50 bytes into the outer one (IPv4, UDP,
// VXLAN, Ethernet), so its protocol is at byte 59, the UDP checksum at
// 76 and the TCP checksum at 86.
func mangleInnerChecksums(t *testing.T, n *netnstest.Node, dev string, on, zeroOuter bool) {
	t.Helper()
	ctx := context.Background()
	_, _ = n.NS.Exec(ctx, "nft", "delete", "table", "netdev", "weftcsumtest")
	if !on {
		return
	}
	for _, c := range [][]string{
		{"nft", "add", "table", "netdev", "weftcsumtest"},
		{"nft", "add", "chain", "netdev", "weftcsumtest", "in", fmt.Sprintf("{ type filter hook ingress device %q priority 0 ; policy accept ; }", dev)},
		{"nft", "add", "rule", "netdev", "weftcsumtest", "in", "udp", "dport", "4789", "@nh,472,8", "17", "@nh,608,16", "!=", "0", "@nh,608,16", "set", "0x0bad", "counter"},
		{"nft", "add", "rule", "netdev", "weftcsumtest", "in", "udp", "dport", "4789", "@nh,472,8", "6", "@nh,688,16", "set", "0x0bad", "counter"},
	} {
		if zeroOuter && len(c) > 9 {
			c = append(c[:len(c)-1], "udp", "checksum", "set", "0", "counter")
		}
		show(t, n.NS, c...)
	}
}

// udpCsumErrors is n's kernel's count of UDP datagrams dropped for a
// wrong checksum (Udp InCsumErrors in /proc/net/snmp).
func udpCsumErrors(t *testing.T, n *netnstest.Node) int64 {
	t.Helper()
	var v int64
	if err := n.NS.Do(func() (err error) { v, err = netstat.SNMP("Udp", "InCsumErrors"); return err }); err != nil {
		t.Fatalf("%s: %v", n.Name, err)
	}
	return v
}

// TestKernelVXLANChecksumProbes: each router checks the checksum probes
// of its peer (their UDP checksum left to the device) and answers. A
// device that completes inner checksums wrongly is modelled on a's side:
// a's underlay computes every checksum in software (tx offload off, so
// that b's kernel checks it; across a veth it would otherwise arrive
// unfinished and trusted) and b's underlay ingress overwrites the inner
// UDP and TCP checksums. b's kernel then drops a's datagrams for their
// checksum, the ARP probes still pass, and a's path to b goes down for
// checksums, while b's path to a stays up; once the checksums arrive
// right again the path comes back after the hold.
func TestKernelVXLANChecksumProbes(t *testing.T) {
	mtu := netnstest.UnderlayMTU - Overhead(ModeVXLAN)
	p := newPair(t, mtu)
	a, b := p.Nodes[0], p.Nodes[1]
	da, db := startVXLAN(t, a, mtu), startVXLAN(t, b, mtu)
	if ap := da.prober.(*ARPProber); ap.csum == nil {
		t.Fatalf("a has no checksum prober: %v", ap.CsumErr)
	}
	wireVXLAN(t, p, da, db)
	answers := func(d *vxlanDevice, outcome string) float64 {
		return value(d.metrics.csumProbes.WithLabelValues(outcome))
	}
	waitLong(t, "both nodes' checksum probes answered good", func() bool {
		return answers(da, "good") >= probeCsumBad && answers(db, "good") >= probeCsumBad
	})
	for _, d := range []*vxlanDevice{da, db} {
		if bad := answers(d, "bad") + answers(d, "lost"); bad != 0 {
			t.Errorf("%v checksum probes bad or lost on sound paths", bad)
		}
	}

	if err := a.NS.Do(func() error { return ethtool.SetTxChecksum("ul0", false) }); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, outcome string
		zeroOuter     bool
	}{
		// VXLAN's outer UDP checksum (on by default) covers the inner
		// one: b's kernel drops the datagram, and the control's answer
		// shows the probe lost for its checksum.
		{"lost", "lost", false},
		// Without an outer checksum the probe reaches b's router, which
		// finds it wrong.
		{"found wrong", "bad", true},
	} {
		errs, outcomes := udpCsumErrors(t, b), answers(da, c.outcome)
		mangleInnerChecksums(t, b, "ul0", true, c.zeroOuter)
		waitLong(t, c.name+": a's path to b down for checksums", func() bool {
			st, _ := pathOf(da.Device, "b")
			return strings.HasPrefix(st, "down since") && strings.Contains(st, "checksum")
		})
		st, _ := pathOf(da.Device, "b")
		t.Logf("%s: a's path to b: %s", c.name, st)
		if n := udpCsumErrors(t, b); !c.zeroOuter && n <= errs {
			t.Errorf("%s: b's kernel dropped no datagram for its checksum (%d, was %d): the modelled fault did not happen", c.name, n, errs)
		}
		if st, _ := pathOf(db.Device, "a"); st != "ok" {
			t.Errorf("%s: b's path to a: %q, want ok (only a's checksums are spoiled)", c.name, st)
		}
		if n := answers(da, c.outcome) - outcomes; n < probeCsumBad {
			t.Errorf("%s: a counted %v probes %s, want at least %d", c.name, n, c.outcome, probeCsumBad)
		}
		mangleInnerChecksums(t, b, "ul0", false, false)
		waitLong(t, c.name+": a's path to b back up", func() bool {
			st, _ := pathOf(da.Device, "b")
			return st == "ok"
		})
	}
}

// FuzzARPFrame: the prober reads whatever reaches the VXLAN device as
// ARP, from any peer or forger: it never panics, reports an answer only
// for a reply to this node's MAC, and answers (here: would answer) only
// probes for this node's address.
func FuzzARPFrame(f *testing.F) {
	self := netip.MustParseAddr("192.0.2.1")
	mine, peer := VTEPMAC("a"), VTEPMAC("b")
	f.Add(appendARP(nil, mine, peer, arpReply, peer, netip.MustParseAddr("192.0.2.2"), mine, netip.IPv4Unspecified()))
	f.Add(appendARP(nil, mine, peer, arpRequest, peer, netip.IPv4Unspecified(), [6]byte{}, self))
	f.Add([]byte{})
	f.Add(make([]byte, EthernetHeaderLen+arpLen-1))
	f.Fuzz(func(t *testing.T, b []byte) {
		p := &ARPProber{mac: mine, self: self, closed: true, now: time.Now, readArp: func() int { return 1 }}
		p.answer.Store(true)
		p.handle(b, func(mac [6]byte, addr netip.Addr) {
			if len(b) < EthernetHeaderLen+arpLen || [6]byte(b[0:6]) != mine || [6]byte(b[EthernetHeaderLen+18:EthernetHeaderLen+24]) != mine {
				t.Fatalf("answer from %x %s reported for a frame not sent to this node: % x", mac, addr, b)
			}
		})
	})
}

// FuzzCsumHandle: the checksum prober reads whatever IPv4 UDP to its port
// the VXLAN device brings, from any peer or pod of another node: it never
// panics and reports a verdict only for an answer sent to this node's MAC.
func FuzzCsumHandle(f *testing.F) {
	self := netip.MustParseAddr("192.0.2.1")
	mine, peer := VTEPMAC("a"), VTEPMAC("b")
	from := netip.MustParseAddr("192.0.2.2")
	for _, kind := range []byte{csumKindProbe, csumKindGood, csumKindBad, csumKindControl} {
		f.Add(byte(0), appendCsumFrame(nil, mine, peer, from, self, kind, 7, true))
	}
	f.Add(byte(vnetNeedsCsum), appendCsumFrame(nil, mine, peer, from, self, csumKindProbe, 7, false))
	f.Fuzz(func(t *testing.T, flags byte, b []byte) {
		p := &ARPProber{mac: mine, self: self, closed: true}
		p.handleCsum(flags, b, func(mac [6]byte, nonce uint64, good bool) {
			if f, ok := parseCsumFrame(b); !ok || f.dstMAC != mine || f.dst != self {
				t.Fatalf("verdict from %x reported for a frame not sent to this node: % x", mac, b)
			}
		})
	})
}

// TestARPProberRereadsArpIgnore: arp_ignore changed while the router runs
// is seen at the next peer probe once arpIgnoreEvery has passed (not at
// every probe), answers start or stop with it, and each change is
// reported once.
func TestARPProberRereadsArpIgnore(t *testing.T) {
	self := netip.MustParseAddr("192.0.2.1")
	mine, peer := VTEPMAC("a"), VTEPMAC("b")
	probe := appendARP(nil, mine, peer, arpRequest, peer, netip.IPv4Unspecified(), [6]byte{}, self)
	now := time.Unix(1000, 0)
	sysctl, reads := 0, 0
	var changes []bool
	p := &ARPProber{mac: mine, self: self, closed: true, checked: now,
		now:     func() time.Time { return now },
		readArp: func() int { reads++; return sysctl },
		OnAnswerChange: func(answers bool, v int) {
			if v != sysctl {
				t.Errorf("OnAnswerChange(%v, %d), want arp_ignore %d", answers, v, sysctl)
			}
			changes = append(changes, answers)
		}}
	step := func(d time.Duration) {
		now = now.Add(d)
		p.handle(probe, func([6]byte, netip.Addr) { t.Fatal("a probe reported as an answer") })
	}
	step(100 * time.Millisecond)
	if reads != 0 || p.AnswersItself() {
		t.Fatalf("after 100ms: %d reads, answers %v; want none, false", reads, p.AnswersItself())
	}
	sysctl = 2
	step(arpIgnoreEvery)
	if reads != 1 || !p.AnswersItself() || len(changes) != 1 || !changes[0] {
		t.Fatalf("arp_ignore 2 after %s: %d reads, answers %v, changes %v; want 1, true, [true]", arpIgnoreEvery, reads, p.AnswersItself(), changes)
	}
	for range 5 {
		step(arpIgnoreEvery / 10)
	}
	if reads != 1 {
		t.Errorf("%d reads within %s; want 1", reads, arpIgnoreEvery)
	}
	step(arpIgnoreEvery)
	if reads != 2 || len(changes) != 1 {
		t.Errorf("the same value read again: %d reads, changes %v; want 2, one change", reads, changes)
	}
	sysctl = 0
	step(arpIgnoreEvery)
	if p.AnswersItself() || len(changes) != 2 || changes[1] {
		t.Errorf("arp_ignore 0 again: answers %v, changes %v; want false, [true false]", p.AnswersItself(), changes)
	}
	// A clock that went back reads again rather than never.
	sysctl = 1
	step(-time.Hour)
	if !p.AnswersItself() {
		t.Errorf("after the clock went back an hour, arp_ignore 1 not read")
	}
}

// TestCsumFilter runs the checksum socket's BPF program (x/net/bpf's
// VM): only IPv4 UDP to this node's underlay address and the probes'
// port reaches the router. A pod's packets, which reach the VXLAN device
// addressed to a pod or the bridge (the ranges routed through it), never
// do, whatever their ports and payload; nor do fragments or TCP.
func TestCsumFilter(t *testing.T) {
	self, peer := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2")
	var raw []bpf.RawInstruction
	for _, in := range csumFilter(self) {
		raw = append(raw, bpf.RawInstruction{Op: in.Code, Jt: in.Jt, Jf: in.Jf, K: in.K})
	}
	insns, ok := bpf.Disassemble(raw)
	if !ok {
		t.Fatal("the filter does not disassemble")
	}
	vm, err := bpf.NewVM(insns)
	if err != nil {
		t.Fatal(err)
	}
	mine, other := VTEPMAC("a"), VTEPMAC("b")
	frame := func(src, dst netip.Addr, kind byte) []byte {
		return appendCsumFrame(nil, mine, other, src, dst, kind, 7, true)
	}
	for _, c := range []struct {
		name string
		b    []byte
		take bool
	}{
		{"a peer's probe", frame(peer, self, csumKindProbe), true},
		{"a peer's answer", frame(peer, self, csumKindBad), true},
		{"to a pod of this node", frame(netip.MustParseAddr("10.36.0.5"), netip.MustParseAddr("10.32.0.9"), csumKindBad), false},
		{"to the bridge address", frame(netip.MustParseAddr("10.36.0.5"), netip.MustParseAddr("10.32.0.1"), csumKindBad), false},
		{"another port", func() []byte { b := frame(peer, self, csumKindBad); b[csumStart+3]++; return b }(), false},
		{"a fragment", func() []byte { b := frame(peer, self, csumKindBad); b[EthernetHeaderLen+7] = 8; return b }(), false},
		{"tcp", func() []byte { b := frame(peer, self, csumKindBad); b[EthernetHeaderLen+9] = 6; return b }(), false},
	} {
		n, err := vm.Run(c.b)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if (n > 0) != c.take {
			t.Errorf("%s: the filter returned %d, want taken %v", c.name, n, c.take)
		}
	}
}
