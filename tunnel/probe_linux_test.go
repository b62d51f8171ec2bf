package tunnel

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

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
