package tunnel

import (
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/tunnel/conn/bindtest"
	"github.com/weft-net/weft/tunnel/tun/tuntest"
)

// fakeProber records the probes; answer makes the test's peers answer
// them (as their kernels would), per peer and probe size.
type fakeProber struct {
	mu     sync.Mutex
	probes []fakeProbe
	answer func(e VTEPEntry, size int) bool
	csums  int    // checksum probes sent
	nonce  uint64 // the last one's
	d      *Device
	wg     sync.WaitGroup // answers on their way
}

type fakeProbe struct {
	to   VTEPEntry
	size int
}

func (f *fakeProber) Probe(e VTEPEntry, size int) error {
	f.mu.Lock()
	f.probes = append(f.probes, fakeProbe{e, size})
	answer := f.answer
	f.mu.Unlock()
	if answer != nil && answer(e, size) {
		// The answer comes while probeRound holds the lock: deliver it
		// as the reading goroutine would, after.
		f.wg.Go(func() { f.d.pathAnswered(e.MAC, e.Addr) })
	}
	return nil
}

func (f *fakeProber) ProbeChecksum(e VTEPEntry, nonce uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.csums++
	f.nonce = nonce
	return nil
}

func (f *fakeProber) Run(func([6]byte, netip.Addr), func([6]byte, uint64, bool)) error { return nil }
func (f *fakeProber) Close() error                                                     { return nil }

func (f *fakeProber) sent() []fakeProbe {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.probes)
}

// TestPathHealthMisses: four probes in a row without answer take a path
// down; it comes back only after the hold and four answered probes; a
// fall soon after a recovery doubles the hold, one long after resets it.
func TestPathHealthMisses(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	h := &pathHealth{size: 1454}
	round := func(answered bool) pathEvent {
		h.sent, h.got = true, answered
		now = now.Add(probeInterval)
		return h.tick(now)
	}
	if ev := round(true); ev != pathAnswering || h.status() != "ok" {
		t.Fatalf("first answer: %v, %q", ev, h.status())
	}
	for i := range probeMisses - 1 {
		if ev := round(false); ev != pathSame {
			t.Fatalf("miss %d: %v, want the path still up", i+1, ev)
		}
	}
	if ev := round(false); ev != pathDown || !strings.Contains(h.status(), "no answer to 4 probes") {
		t.Fatalf("miss %d: %v %q, want down", probeMisses, ev, h.status())
	}
	// Answered at once, but held for probeHold.
	downAt := now
	for now.Add(probeInterval).Sub(downAt) < probeHold {
		if ev := round(true); ev != pathSame {
			t.Fatalf("%s after the fall: %v, want held down", now.Sub(downAt), ev)
		}
	}
	if ev := round(true); ev != pathUp || h.status() != "ok" {
		t.Fatalf("after the hold: %v %q, want up", ev, h.status())
	}
	// Down again at once: the hold doubles.
	for range probeMisses {
		round(false)
	}
	if !h.down || h.hold != 2*probeHold {
		t.Fatalf("second fall: down %v, hold %s; want down, %s", h.down, h.hold, 2*probeHold)
	}
	// An answer in between the misses resets the count.
	for now.Sub(h.since) < h.hold {
		round(true)
	}
	if h.down {
		t.Fatal("not up after the doubled hold")
	}
	for range 20 {
		round(false)
		round(false)
		round(true)
	}
	if h.down {
		t.Fatalf("down with one probe in three answered: %q", h.status())
	}
	// Long after the recovery, a fall starts from probeHold again.
	now = now.Add(probeFlapWindow + time.Minute)
	for range probeMisses {
		round(false)
	}
	if !h.down || h.hold != probeHold {
		t.Fatalf("fall long after: down %v, hold %s; want %s", h.down, h.hold, probeHold)
	}
}

// TestPathHealthChecksum: checksum probes found wrong, or lost while
// their control passes, probeCsumBad rounds in a row take the path down
// while the ARP probes are answered; rounds without any checksum answer
// (a peer router that is down) change nothing; after such a fall the path
// comes back only once the hold has passed and the peer found
// probeRecover probes right in a row.
func TestPathHealthChecksum(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	h := &pathHealth{size: 1454}
	const (
		none = iota
		good
		bad
		lost // no answer, the control answered
	)
	round := func(csum int) pathEvent {
		h.sent, h.got = true, true
		h.csumNonce = 7
		h.csumGot, h.csumCtl = map[int]int8{good: 1, bad: -1}[csum], csum != none
		now = now.Add(probeInterval)
		return h.tick(now)
	}
	round(good)
	for range 30 {
		if ev := round(none); ev != pathSame {
			t.Fatalf("a round without checksum answers: %v %q, want no change", ev, h.status())
		}
	}
	// A round without answers neither ends nor breaks a streak.
	for i, c := range []int{bad, none, lost} {
		if ev := round(c); ev != pathSame {
			t.Fatalf("mixed round %d: %v %q, want no change", i, ev, h.status())
		}
	}
	if ev := round(good); ev != pathSame || h.down {
		t.Fatalf("a good answer among bad ones: %v %q", ev, h.status())
	}
	round(lost)
	round(bad)
	if ev := round(lost); ev != pathDown || !strings.Contains(h.status(), "checksum-offload fault") {
		t.Fatalf("%d bad rounds: %v %q, want down for checksums", probeCsumBad, ev, h.status())
	}
	downAt := now
	for now.Sub(downAt) < 3*probeHold {
		if ev := round(none); ev != pathSame {
			t.Fatalf("down for checksums, no checksum answers since: %v after %s, want held down", ev, now.Sub(downAt))
		}
	}
	for i := range probeRecover - 1 {
		if ev := round(good); ev != pathSame {
			t.Fatalf("good answer %d after the hold: %v, want still down until %d", i+1, ev, probeRecover)
		}
	}
	if ev := round(good); ev != pathUp {
		t.Fatalf("%d good answers after the hold: %v %q, want up", probeRecover, ev, h.status())
	}
	// A fall for lost ARP probes comes back without checksum answers
	// (an older peer never gives any).
	for range probeMisses {
		h.sent, h.got, h.csumNonce = true, false, 7
		now = now.Add(probeInterval)
		h.tick(now)
	}
	if !h.down {
		t.Fatal("not down after the lost ARP probes")
	}
	for h.down && now.Sub(h.since) < 2*h.hold+10*probeInterval {
		round(none)
	}
	if h.down {
		t.Fatalf("not back without checksum answers after a fall for ARP: %q", h.status())
	}
}

// TestChecksumAnswerMustMatch: an answer to a checksum probe counts only
// from the probed peer's MAC, with the nonce of the probe out this round,
// once; the control's answer (the nonce less one) marks the control; the
// answers of an earlier round count no more.
func TestChecksumAnswerMustMatch(t *testing.T) {
	d, p, _, _ := newProbedNode(t, ModeAuto)
	if err := d.SetPeers([]Peer{autoPeer(t, "b")}); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_000_000, 0)
	d.probeRound(now)
	p.mu.Lock()
	nonce, sent := p.nonce, p.csums
	p.mu.Unlock()
	if sent != 1 || nonce&1 != 1 {
		t.Fatalf("%d checksum probes, nonce %#x; want 1, odd", sent, nonce)
	}
	state := func() (int8, bool) {
		d.mu.Lock()
		defer d.mu.Unlock()
		return d.health["b"].csumGot, d.health["b"].csumCtl
	}
	d.pathChecksum(VTEPMAC("c"), nonce, false)
	d.pathChecksum(VTEPMAC("b"), nonce+2, false)
	if got, ctl := state(); got != 0 || ctl {
		t.Fatalf("answers from another MAC or with another nonce counted: %d %v", got, ctl)
	}
	d.pathChecksum(VTEPMAC("b"), nonce, false)
	d.pathChecksum(VTEPMAC("b"), nonce, true)
	if got, _ := state(); got != -1 {
		t.Fatalf("b's answers bad then good: %d, want the first (-1)", got)
	}
	d.pathChecksum(VTEPMAC("b"), nonce-1, true)
	if _, ctl := state(); !ctl {
		t.Fatal("the control's answer did not count")
	}
	d.probeRound(now.Add(probeInterval))
	d.pathChecksum(VTEPMAC("b"), nonce, true)
	d.pathChecksum(VTEPMAC("b"), nonce-1, true)
	if got, ctl := state(); got != 0 || ctl {
		t.Fatalf("an earlier round's answers counted: %d %v", got, ctl)
	}
}

// TestPathHealthBlackHole: full-size probes lost while the small ones
// are answered is an MTU black hole: down, and the reason says so.
func TestPathHealthBlackHole(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	h := &pathHealth{size: 1454}
	var ev pathEvent
	for i := 0; i < 2*probeBigMisses && ev != pathDown; i++ {
		h.sent, h.got = true, !big(h.round)
		now = now.Add(probeInterval)
		ev = h.tick(now)
	}
	if ev != pathDown || !strings.Contains(h.why, "frames of 1454 bytes are lost") {
		t.Fatalf("after %d rounds: %v %q, want down for an MTU black hole", h.round, ev, h.why)
	}
	if h.round != 2*probeBigMisses {
		t.Errorf("down after %d rounds, want %d", h.round, 2*probeBigMisses)
	}
	// One big probe answered: no black hole.
	h2 := &pathHealth{size: 1454}
	for r := range 40 {
		h2.sent, h2.got = true, !big(r) || r%6 == 5
		if h2.tick(now) == pathDown {
			t.Fatalf("round %d: down (%s) with one big probe in three answered", r, h2.why)
		}
	}
}

// newProbedNode is an auto node over the fakes whose vxlan paths are
// probed by a fakeProber, on a clock the test moves.
func newProbedNode(t *testing.T, mode Mode) (*Device, *fakeProber, *fakeVTEPs, *fakeRouting) {
	t.Helper()
	v, rt, p := &fakeVTEPs{}, &fakeRouting{}, &fakeProber{}
	d, err := New(Config{Self: "a", Mode: mode, MTU: 1440, Underlay: underlayOf("a"), TUN: tuntest.New("weft-tun", 1440),
		UDP: bindtest.NewNetwork().Bind(netip.AddrPortFrom(underlayOf("a"), DefaultDataPort)), Routing: rt,
		VTEPs: v, Prober: p, Logger: testLogger(t, "a")})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	p.d = d
	t.Cleanup(func() { d.Close() })
	return d, p, v, rt
}

func routeDevOf(rt *fakeRouting, peer string) string {
	for _, r := range rt.current() {
		for _, o := range ring {
			if o.Peer == peer && !r.Dst.Addr().Less(o.First) && !o.Last.Less(r.Dst.Addr()) {
				return r.Dev
			}
		}
	}
	return ""
}

func connOf(d *Device, peer string) Connection {
	for _, c := range d.Connections() {
		if c.Peer == peer {
			return c
		}
	}
	return Connection{}
}

// TestAutoFallsBackWhenThePathIsDown: an auto node probes its vxlan
// peers, small and full-size probes in turn; a peer whose probes go
// unanswered is sent udp (its routes move to weft-tun, the reason and the
// path say why) while its VXLAN entries stay for the probes, and it is
// taken back to vxlan once the probes are answered again and the hold has
// passed. The other peer stays on vxlan throughout.
func TestAutoFallsBackWhenThePathIsDown(t *testing.T) {
	d, p, v, rt := newProbedNode(t, ModeAuto)
	var mu sync.Mutex
	blocked := false
	p.answer = func(e VTEPEntry, size int) bool {
		mu.Lock()
		defer mu.Unlock()
		return !(blocked && e.Addr == underlayOf("b"))
	}
	pb, pc := autoPeer(t, "b"), autoPeer(t, "c")
	if err := d.SetPeers([]Peer{pb, pc}); err != nil {
		t.Fatal(err)
	}
	if err := d.SetRing(ring, gatewayOf("a")); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_000_000, 0)
	// round ends a probe round once the answers of the last are in.
	round := func() {
		t.Helper()
		p.wg.Wait()
		now = now.Add(probeInterval)
		d.probeRound(now)
	}
	round()
	round()
	if c := connOf(d, "b"); c.Mode != ModeVXLAN || c.Path != "ok" {
		t.Fatalf("b before the block: %+v, want vxlan, path ok", c)
	}
	sizes := map[int]bool{}
	for _, pr := range p.sent() {
		sizes[pr.size] = true
	}
	if !sizes[probeSmall] || !sizes[1440+EthernetHeaderLen] || len(sizes) != 2 {
		t.Errorf("probe sizes %v, want %d and %d", sizes, probeSmall, 1440+EthernetHeaderLen)
	}
	mu.Lock()
	blocked = true
	mu.Unlock()
	// The first round ends on the probe sent before the block.
	for range probeMisses + 1 {
		round()
	}
	c := connOf(d, "b")
	if c.Mode != ModeUDP || !strings.Contains(c.Reason, "vxlan path down") || !strings.Contains(c.Path, "no answer to 4 probes") {
		t.Fatalf("b after %d lost probes: %+v, want udp with the path down", probeMisses, c)
	}
	if dev := routeDevOf(rt, "b"); dev != "weft-tun" {
		t.Errorf("b's range routed through %q, want weft-tun", dev)
	}
	if dev := routeDevOf(rt, "c"); dev != DefaultVXLANName {
		t.Errorf("c's range routed through %q, want %s", dev, DefaultVXLANName)
	}
	if got := v.entries(); !slices.Contains(got, entryOf("b")) {
		t.Errorf("vxlan entries %v: b's is gone, the probes need it", got)
	}
	if got := value(d.metrics.pathUp.WithLabelValues("b")); got != 0 {
		t.Errorf("weft_tunnel_vxlan_path_up{peer=b} = %v, want 0", got)
	}
	if got := value(d.metrics.pathChanges.WithLabelValues("down")); got != 1 {
		t.Errorf("path changes to down = %v, want 1", got)
	}
	// A peer that claims the VTEP of one whose path is down clashes with
	// it all the same: neither gets entries.
	clash := pc
	cv := *pc.VTEP
	cv.Addr = pb.VTEP.Addr
	clash.VTEP = &cv
	if err := d.SetPeers([]Peer{pb, clash}); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"b", "c"} {
		if c := connOf(d, name); c.Mode != ModeUDP || !strings.Contains(c.Reason, "same VTEP address") {
			t.Errorf("%s with c claiming b's VTEP: %+v, want udp for the clash", name, c)
		}
	}
	if err := d.SetPeers([]Peer{pb, pc}); err != nil {
		t.Fatal(err)
	}
	// Probes go on while it is down; answered again, it comes back after
	// the hold.
	n := len(p.sent())
	mu.Lock()
	blocked = false
	mu.Unlock()
	start := now
	for connOf(d, "b").Mode != ModeVXLAN {
		if now.Sub(start) > probeHold+time.Duration(probeRecover+1)*probeInterval {
			t.Fatalf("b not back on vxlan %s after its probes were answered again: %+v", now.Sub(start), connOf(d, "b"))
		}
		round()
	}
	if now.Sub(start) < probeHold {
		t.Errorf("b back on vxlan after %s, before the hold of %s", now.Sub(start), probeHold)
	}
	if len(p.sent()) <= n {
		t.Error("no probes sent while the path was down")
	}
	if dev := routeDevOf(rt, "b"); dev != DefaultVXLANName {
		t.Errorf("b's range routed through %q after the recovery, want %s", dev, DefaultVXLANName)
	}
	// A peer that leaves is no longer probed.
	if err := d.SetPeers([]Peer{pc}); err != nil {
		t.Fatal(err)
	}
	round()
	d.mu.Lock()
	_, kept := d.health["b"]
	d.mu.Unlock()
	if kept {
		t.Error("the health of b is kept after it left")
	}
}

// TestVXLANModeReportsADownPath: --encap vxlan has nothing to fall back
// to: a path that stops answering is reported, and its traffic stays on
// vxlan.
func TestVXLANModeReportsADownPath(t *testing.T) {
	d, p, _, rt := newProbedNode(t, ModeVXLAN)
	if err := d.SetPeers([]Peer{vtepPeer("b")}); err != nil {
		t.Fatal(err)
	}
	if err := d.SetRing(ring, gatewayOf("a")); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_000_000, 0)
	for range probeMisses + 1 {
		now = now.Add(probeInterval)
		d.probeRound(now)
	}
	if len(p.sent()) == 0 {
		t.Fatal("no probes")
	}
	c := connOf(d, "b")
	if c.Mode != ModeVXLAN || !strings.HasPrefix(c.Path, "down since") {
		t.Errorf("b: %+v, want vxlan with the path down", c)
	}
	if dev := routeDevOf(rt, "b"); dev != DefaultVXLANName {
		t.Errorf("b's range routed through %q, want %s", dev, DefaultVXLANName)
	}
}

// TestPathAnswerMustMatch: an answer counts only from the MAC and address
// of the VTEP that was probed, and only while a probe is out.
func TestPathAnswerMustMatch(t *testing.T) {
	d, p, _, _ := newProbedNode(t, ModeAuto)
	if err := d.SetPeers([]Peer{autoPeer(t, "b")}); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_000_000, 0)
	d.probeRound(now)
	if len(p.sent()) != 1 {
		t.Fatalf("%d probes, want 1", len(p.sent()))
	}
	got := func() bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		return d.health["b"].got
	}
	d.pathAnswered(VTEPMAC("c"), underlayOf("b"))
	d.pathAnswered(VTEPMAC("b"), underlayOf("c"))
	if got() {
		t.Fatal("an answer from another MAC or address counted")
	}
	d.pathAnswered(VTEPMAC("b"), underlayOf("b"))
	if !got() {
		t.Fatal("the answer of b did not count")
	}
	d.mu.Lock()
	d.health["b"].sent, d.health["b"].got = false, false
	d.mu.Unlock()
	d.pathAnswered(VTEPMAC("b"), underlayOf("b"))
	if got() {
		t.Error("an answer with no probe out counted")
	}
}
