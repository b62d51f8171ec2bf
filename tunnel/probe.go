package tunnel

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"time"
)

// Path health of vxlan. The kernel carries vxlan traffic without the
// router, so nothing in the router sees it fail: a firewall that drops the
// VXLAN port between two nodes, an underlay whose MTU is smaller than the
// nodes think (an MTU black hole), a NIC that mangles the encapsulated
// frames. Each router therefore probes, once a second, every peer it
// sends (or could send) vxlan to, through its own VXLAN device: an ARP
// probe (sender 0.0.0.0, RFC 5227) for the peer's VTEP address, sent to
// the peer's VTEP MAC. The kernel wraps it like any pod frame; the peer's
// kernel answers it (any local address is answered, with the default
// arp_ignore 0), and the answer comes back through the peer's VXLAN
// device. A probe thus crosses both kernels' VXLAN paths, the port and
// every firewall between them, both ways, and is answered while the
// peer's router is down, as its pods' traffic is carried. Every other
// probe is padded to the device's MTU, the largest frame a pod sends.
//
// A path whose last probeMisses probes all went unanswered, or whose last
// probeBigMisses full-size probes did while the small ones were answered,
// is down: with auto, the peer is sent udp instead (logged once, counted,
// in status), and the probes go on; it is taken back once probeRecover
// probes in a row, small and big, were answered and the hold has passed
// (probeHold, doubled for each fall within probeFlapWindow of the last
// recovery, at most probeHoldMax). With --encap vxlan, which has nothing
// to fall back to, a path that is down is only reported.

// PathProber sends the probes and reads their answers. The kernel's is an
// AF_PACKET socket on the VXLAN device (probe_linux.go).
type PathProber interface {
	// Probe sends one probe of size bytes (the Ethernet frame) to the
	// peer at e.
	Probe(e VTEPEntry, size int) error
	// ProbeChecksum sends one round's checksum probes (csumprobe.go)
	// with nonce to the peer at e.
	ProbeChecksum(e VTEPEntry, nonce uint64) error
	// Run reads answers until Close, calling answered with the VTEP MAC
	// and address of the peer that answered, and verdict with the VTEP
	// MAC of a peer that answered a checksum probe, its nonce and what
	// the peer found.
	Run(answered func(mac [6]byte, addr netip.Addr), verdict func(mac [6]byte, nonce uint64, good bool)) error
	Close() error
}

const (
	probeInterval   = time.Second
	probeMisses     = 4 // probes in a row without answer: down
	probeBigMisses  = 3 // full-size probes in a row without answer, small ones answered: down (MTU)
	probeRecover    = 4 // probes in a row answered (both sizes): up again, once the hold has passed
	probeHold       = 10 * time.Second
	probeHoldMax    = 5 * time.Minute
	probeFlapWindow = 10 * time.Minute
	probeSmall      = 64 // bytes: an ARP frame with the minimum Ethernet padding
	probeHistory    = 2 * max(probeMisses, probeBigMisses, probeRecover)
	probeCsumBad    = 3 // checksum rounds in a row bad (found wrong, or lost while the control passed): down
)

// pathHealth is what the probes of one peer's vxlan path showed.
type pathHealth struct {
	history []bool // outcome of the last rounds, oldest first; even rounds small, odd big
	round   int    // rounds evaluated
	sent    bool   // a probe is out in the current round
	got     bool   // an answer came in the current round
	seen    bool   // some probe was answered

	down  bool
	why   string
	since time.Time // of the last change (or of the first probe)
	hold  time.Duration
	upAt  time.Time // the last recovery, for the flap window
	size  int       // the full probe size, for the reason

	// The checksum probes (csumprobe.go): only answers count; a round
	// without one says nothing.
	csumNonce uint64 // of the checksum probe out in the current round (odd; its control's is one less); 0: none
	csumGot   int8   // its answer: 0 none yet, 1 good, -1 bad
	csumCtl   bool   // the control was answered
	csum      []bool // the answers, oldest first (good: true); emptied at a fall
	csumDown  bool   // the path is down because of them
}

// csumFailure is the reason of a fall for checksums.
var csumFailure = fmt.Sprintf("%d probes in a row whose UDP checksum the device completes were lost or found wrong, while the same without a checksum passed (a checksum-offload fault: ping passes, TCP and UDP between pods do not)", probeCsumBad)

// csumLast reports whether the last n checksum answers were all good
// (want true) or all bad (want false).
func (h *pathHealth) csumLast(n int, want bool) bool {
	if len(h.csum) < n {
		return false
	}
	for _, good := range h.csum[len(h.csum)-n:] {
		if good != want {
			return false
		}
	}
	return true
}

// big says whether the probe of round r is full-size.
func big(r int) bool { return r%2 == 1 }

// pathEvent is what a round's end changed.
type pathEvent int

const (
	pathSame      pathEvent = iota
	pathAnswering           // the first answer: the path is known to carry
	pathDown
	pathUp
)

// tick ends the current round at now (its outcome is whether an answer
// came) and says what changed.
func (h *pathHealth) tick(now time.Time) pathEvent {
	if !h.sent {
		return pathSame
	}
	h.history = append(h.history, h.got)
	if len(h.history) > probeHistory {
		h.history = h.history[len(h.history)-probeHistory:]
	}
	h.round++
	// The probe answered says how it was found; lost while its control
	// was answered, it was dropped for its checksum (csumprobe.go).
	if h.csumGot != 0 || h.csumCtl {
		h.csum = append(h.csum, h.csumGot > 0)
		if len(h.csum) > probeHistory {
			h.csum = h.csum[len(h.csum)-probeHistory:]
		}
	}
	h.csumNonce, h.csumGot, h.csumCtl = 0, 0, false
	first := h.got && !h.seen
	h.seen = h.seen || h.got
	h.sent, h.got = false, false
	if !h.down {
		why := h.failure()
		if why == "" {
			if first {
				return pathAnswering
			}
			return pathSame
		}
		h.down, h.why, h.since = true, why, now
		h.csumDown, h.csum = why == csumFailure, h.csum[:0]
		switch {
		case h.hold == 0 || !h.upAt.IsZero() && now.Sub(h.upAt) > probeFlapWindow:
			h.hold = probeHold
		default:
			h.hold = min(2*h.hold, probeHoldMax)
		}
		return pathDown
	}
	// Back only once the checksums are not failing, and after a fall
	// for them, once the peer found them right again.
	if now.Sub(h.since) < h.hold || !h.answered(probeRecover) || h.csumLast(probeCsumBad, false) ||
		h.csumDown && !h.csumLast(probeRecover, true) {
		return pathSame
	}
	h.down, h.why, h.since, h.upAt, h.csumDown = false, "", now, now, false
	return pathUp
}

// failure says why the rounds so far show the path down, or "".
func (h *pathHealth) failure() string {
	n := len(h.history)
	if n >= probeMisses {
		lost := true
		for _, ok := range h.history[n-probeMisses:] {
			lost = lost && !ok
		}
		if lost {
			return fmt.Sprintf("no answer to %d probes in a row", probeMisses)
		}
	}
	if h.csumLast(probeCsumBad, false) {
		return csumFailure
	}
	// The big rounds among the last ones, newest first.
	bigLost, smallOK := 0, false
	for i := n - 1; i >= 0 && bigLost < probeBigMisses; i-- {
		r := h.round - (n - i) // the round of history[i]
		switch {
		case big(r) && h.history[i]:
			return ""
		case big(r):
			bigLost++
		case h.history[i]:
			smallOK = true
		}
	}
	if bigLost == probeBigMisses && smallOK {
		return fmt.Sprintf("frames of %d bytes are lost while small ones pass (an MTU black hole on the underlay?)", h.size)
	}
	return ""
}

// answered reports whether the last n rounds were all answered.
func (h *pathHealth) answered(n int) bool {
	if len(h.history) < n {
		return false
	}
	for _, ok := range h.history[len(h.history)-n:] {
		if !ok {
			return false
		}
	}
	return true
}

// status is the health as status shows it.
func (h *pathHealth) status() string {
	switch {
	case !h.down && h.seen:
		return "ok"
	case !h.down:
		return "probing: no answer yet"
	}
	return fmt.Sprintf("down since %s: %s", h.since.UTC().Format(time.TimeOnly), h.why)
}

// pathDown says why the peer's vxlan path is down, or "".
func (d *Device) pathDownLocked(peer string) string {
	if h := d.health[peer]; h != nil && h.down {
		return h.status()
	}
	return ""
}

// routineProbe probes every peer's vxlan path once per probeInterval
// until ctx ends.
func (d *Device) routineProbe(ctx context.Context) {
	t := time.NewTicker(probeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-d.closed:
			return
		case <-t.C:
			d.probeRound(d.now())
		}
	}
}

// probeRound ends the current round of every probed peer (falling back
// or taking a path back where the outcome says so) and sends the next
// probes.
func (d *Device) probeRound(now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.snap.Load()
	want, _ := vtepEntries(s.peers)
	changed := false
	probed := map[string]bool{}
	clear(d.csumOut)
	for _, e := range want {
		name := s.byAddr[e.Dst]
		p := s.peers[name]
		if p == nil {
			continue
		}
		probed[name] = true
		h := d.health[name]
		if h == nil {
			h = &pathHealth{since: now}
			d.health[name] = h
		}
		h.size = d.cfg.MTU + EthernetHeaderLen
		if h.csumNonce != 0 && h.csumGot == 0 && h.csumCtl {
			d.metrics.csumProbes.WithLabelValues("lost").Inc()
		}
		switch h.tick(now) {
		case pathAnswering:
			changed = true // for status
		case pathDown, pathUp:
			changed = true
			d.metrics.pathChanges.WithLabelValues(map[bool]string{true: "down", false: "up"}[h.down]).Inc()
			d.logPathLocked(p, h)
		}
		size := probeSmall
		if big(h.round) {
			size = h.size
		}
		if err := d.prober.Probe(e, size); err != nil && (d.probeErrAt.IsZero() || now.Sub(d.probeErrAt) >= time.Minute) {
			d.probeErrAt = now
			d.log.Warn("cannot send a vxlan path probe (warned once a minute)", "peer", name, "err", err)
		}
		h.sent = true
		h.csumNonce = rand.Uint64() | 1
		d.csumOut[h.csumNonce] = name
		if err := d.prober.ProbeChecksum(e, h.csumNonce); err != nil && (d.probeErrAt.IsZero() || now.Sub(d.probeErrAt) >= time.Minute) {
			d.probeErrAt = now
			d.log.Warn("cannot send a vxlan checksum probe (warned once a minute)", "peer", name, "err", err)
		}
		d.metrics.pathUp.WithLabelValues(name).Set(map[bool]float64{true: 0, false: 1}[h.down])
	}
	for name := range d.health {
		if !probed[name] {
			delete(d.health, name)
			d.metrics.pathUp.DeleteLabelValues(name)
		}
	}
	if changed {
		if err := d.rebuildLocked(); err != nil {
			d.log.Warn("applying the data paths after a vxlan path changed", "err", err)
		}
	}
}

// logPathLocked says what a change of p's vxlan path means.
func (d *Device) logPathLocked(p *peerPath, h *pathHealth) {
	fallback := d.cfg.Mode == ModeAuto && d.canUDP(&p.Peer)
	switch {
	case h.down && fallback:
		d.log.Warn(fmt.Sprintf("peer %s: the vxlan path is down (%s): sending udp instead, vxlan retried in %s", p.Name, h.why, h.hold),
			"peer", p.Name, "address", netip.AddrPortFrom(p.Underlay, d.cfg.VXLANPort))
	case h.down:
		d.log.Warn(fmt.Sprintf("peer %s: the vxlan path is down (%s), and --encap vxlan has no other: check that UDP %d passes between the nodes and the underlay MTU", p.Name, h.why, d.cfg.VXLANPort),
			"peer", p.Name, "address", netip.AddrPortFrom(p.Underlay, d.cfg.VXLANPort))
	default:
		d.log.Info(fmt.Sprintf("peer %s: the vxlan path answers again", p.Name), "peer", p.Name)
	}
}

// pathAnswered notes an answer to a probe from the VTEP at mac, addr.
func (d *Device) pathAnswered(mac [6]byte, addr netip.Addr) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for name, p := range d.snap.Load().peers {
		if p.vxlan != nil && p.vxlan.MAC == mac && p.vxlan.Addr == addr {
			if h := d.health[name]; h != nil && h.sent {
				h.got = true
			}
			return
		}
	}
}

// pathChecksum notes a peer's answer (good or not) to the checksum probe
// with nonce (odd) or to its control (even), from the VTEP at mac.
func (d *Device) pathChecksum(mac [6]byte, nonce uint64, good bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	name, ok := d.csumOut[nonce|1]
	h, p := d.health[name], d.snap.Load().peers[name]
	switch {
	case !ok || h == nil || h.csumNonce != nonce|1 || p == nil || p.vxlan == nil || p.vxlan.MAC != mac:
	case nonce&1 == 0:
		h.csumCtl = true
	case h.csumGot == 0:
		h.csumGot = map[bool]int8{true: 1, false: -1}[good]
		d.metrics.csumProbes.WithLabelValues(map[bool]string{true: "good", false: "bad"}[good]).Inc()
	}
}
