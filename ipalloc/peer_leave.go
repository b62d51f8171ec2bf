package ipalloc

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Leaving (weft reset) takes a healthy peer out of the cluster for good.
// The peer drops every allocation, gives every range it owns to one live
// peer, its heir (GiveAway, as for a donation), saves that, and sends the
// heir a Handover with its ring. The heir merges it, saves it, and answers
// with a HandoverAck: from then on the ranges are safe on a live peer's
// disk, and the leaving peer may go (its state can be deleted).
//
// The heir then removes the leaving peer as weft rmpeer would (see
// PeerGone): it tells every live peer to stop listening to it, so that no
// later reclaim waits for a peer that is gone, and once they all have, it
// takes over whatever the leaving peer still owns in their rings (a
// donation given to it just before it left, which nobody has handed on).
// A retried Handover from a peer the heir already removes is acknowledged
// without a merge: the reclaim covers it.
//
// A peer that has left stays left across restarts: it allocates nothing
// more, and resends the Handover until the heir answers. It merges no
// ring any more: its view stays the one it handed its heir, so it never
// relays news that its heir lacks (its heir stops listening to it, and a
// reclaim that does not wait for it must not miss what it knows). A
// donation that reaches it late stays its own in the donor's ring; the
// heir's reclaim takes it over.
//
// A peer that has left is no heir: asked (two peers leave at once, and
// one picked the other), it names its own heir instead, which will take
// over its ranges, and so those it was given too.

// ErrLeft answers allocations on a peer that has left the cluster.
var ErrLeft = errors.New("this peer has left the cluster (weft reset)")

// ErrPodsHeld is returned by Leave without force while pods hold addresses.
var ErrPodsHeld = errors.New("pods on this node still hold addresses")

// ErrHolding is returned by Leave while this peer holds back (its start
// hold, or a rejoin): it does not yet know which of its ranges it still
// owns, and a handover of one its lost self gave away would clash with that
// donation in every other peer's ring.
var ErrHolding = errors.New("this peer holds back and does not yet know which ranges are its own")

// ErrNoHeir is returned by Leave when no live peer can take the ranges.
var ErrNoHeir = errors.New("no live peer to hand this peer's ranges to")

type leaving struct {
	heir   PeerName // "" for a peer that was alone: nothing to hand over
	id     uint64   // of the last Handover sent
	sentAt int64
	acked  bool // the heir saved the last Handover
}

// LeaveResult says what Leave did.
type LeaveResult struct {
	Heir    PeerName     // the peer that takes the ranges; "" when there was nobody to give them to
	Ranges  []Range      // given to Heir by this call
	Size    uint64       // addresses in Ranges
	Dropped []Allocation // allocations dropped by this call
}

// Leave takes this peer out of the cluster (weft reset): it drops every
// allocation and gives every range it owns to its heir, the live peer
// (alive reports what the shell sees) that shares this ring and owns the
// least, ties by name. Without force it refuses while pods hold addresses
// (keys that are not Internal, and re-claimed ones). It refuses while a
// reclaim of this peer's (rmpeer) waits for live peers, and when no live
// peer can take the ranges, unless this peer is alone (no other peer known
// or in the ring). Leave on a peer that left already resends the Handover
// and returns the heir. Progress shows in Leaving.
func (p *Peer) Leave(alive func(PeerName) bool, force bool) (LeaveResult, error) {
	if p.leave != nil {
		if p.leave.heir != "" && !p.leave.acked {
			p.sendHandover()
		}
		return LeaveResult{Heir: p.leave.heir}, nil
	}
	for _, x := range slices.Sorted(maps.Keys(p.acks)) {
		if p.removed[x] != p.cfg.Self {
			continue
		}
		waiting := names(p.waitingFor(x))
		if len(waiting) > 0 {
			return LeaveResult{}, fmt.Errorf("this peer is taking over the ranges of %s (rmpeer) and waits for %s: "+
				"wait until that is done (weft status ipam), or rmpeer those peers too if they are gone", x, strings.Join(waiting, ", "))
		}
	}
	if _, removed := p.removed[p.cfg.Self]; !removed && (p.startHold || p.rejoin) && !p.a.ring.Empty() {
		why := p.startHoldStatus()
		if why == "" {
			why = p.rejoinStatus()
		}
		return LeaveResult{}, fmt.Errorf("%w (%s): it cannot hand its ranges to another peer yet, forced or not; "+
			"wait until it allocates (weft status ipam), then run weft reset again", ErrHolding, why)
	}
	if !force {
		var pods []string
		for _, al := range p.a.Allocations() {
			if !al.Key.Internal() || al.Key.Reclaimed() {
				pods = append(pods, fmt.Sprintf("%s (%s)", al.Address, al.Key))
			}
		}
		if n := len(pods); n > 0 {
			more := ""
			if n > 5 {
				more = fmt.Sprintf(" and %d more", n-5)
				pods = pods[:5]
			}
			return LeaveResult{}, fmt.Errorf("%w: %d of them: %s%s; drain the node first, or use --force (their addresses may then be handed out again elsewhere)",
				ErrPodsHeld, n, strings.Join(pods, ", "), more)
		}
	}
	heir, ok := p.pickHeir(alive)
	removedBy, removed := p.removed[p.cfg.Self]
	if removed {
		// Its reclaimer takes over whatever it owns: nothing to hand
		// over, and nobody would listen to a Handover anyway.
		heir, ok = "", true
	}
	if !ok && !p.a.ring.Empty() {
		others := slices.DeleteFunc(p.a.ring.Peers(), func(q PeerName) bool { return q == p.cfg.Self })
		if len(others) > 0 || len(p.livePeers()) > 0 {
			return LeaveResult{}, fmt.Errorf("%w: none of the live peers that share this ring is reachable (known: %s); "+
				"start or reconnect one, then try again", ErrNoHeir, strings.Join(names(p.livePeers()), ", "))
		}
	}
	res := LeaveResult{Heir: heir, Dropped: p.a.Allocations()}
	for _, al := range res.Dropped {
		p.a.Release(al.Key)
		p.rd.Allocs = append(p.rd.Allocs, AllocChange{Key: al.Key, Address: al.Address})
	}
	for _, w := range p.pending {
		p.rd.Answers = append(p.rd.Answers, Answer{Key: w.key, Err: ErrLeft})
	}
	p.pending, p.ask, p.found = nil, nil, nil
	clear(p.tried)
	p.leave = &leaving{heir: heir}
	p.leftDirty = true
	p.ringChanged(!p.a.ring.Empty())
	switch {
	case removed:
		p.event(false, "ipalloc: leaving the cluster (weft reset) after %s removed this peer: %s takes over its ranges; %d allocations dropped",
			removedBy, removedBy, len(res.Dropped))
		return res, nil
	case heir == "" && p.a.ring.Empty():
		p.event(false, "ipalloc: leaving the cluster (weft reset) before the ring was claimed: nothing to hand over; "+
			"if the first claim names this peer, run weft rmpeer %s on another peer", p.cfg.Self)
		return res, nil
	case heir == "":
		p.event(false, "ipalloc: leaving the cluster (weft reset): no other peer shares this ring, nothing to hand over; %d allocations dropped", len(res.Dropped))
		return res, nil
	}
	res.Ranges = p.a.Owned()
	for _, rg := range res.Ranges {
		res.Size += uint64(rg.Size())
	}
	p.event(false, "ipalloc: leaving the cluster (weft reset): handing %d addresses (%s) to %s; %d allocations dropped",
		res.Size, rangesText(res.Ranges), heir, len(res.Dropped))
	p.handOn()
	return res, nil
}

// Leaving reports whether this peer has left the cluster, to which heir,
// and whether the heir has saved what it was given (then this peer may go).
func (p *Peer) Leaving() (left bool, heir PeerName, confirmed bool) {
	if p.leave == nil {
		return false, "", false
	}
	return true, p.leave.heir, p.leave.heir == "" || p.leave.acked
}

// pickHeir returns the live peer, as alive sees it, that shares this ring
// (an owner in it, or a peer whose ring this one merged) and owns the
// least of it, ties by name.
func (p *Peer) pickHeir(alive func(PeerName) bool) (PeerName, bool) {
	owned := map[PeerName]uint64{}
	for _, s := range p.a.ring.Shares() {
		owned[s.Peer] = s.Size
	}
	var heir PeerName
	found := false
	for _, q := range p.livePeers() { // sorted: the first of equals wins
		if _, owner := owned[q]; (!owner && !p.ringPeers[q]) || (alive != nil && !alive(q)) {
			continue
		}
		if !found || owned[q] < owned[heir] {
			heir, found = q, true
		}
	}
	return heir, found
}

// handOn gives the heir every range this peer (which has left) owns, and
// sends it a Handover with the ring that says so.
func (p *Peer) handOn() {
	if p.leave == nil || p.leave.heir == "" {
		return
	}
	owned := p.a.Owned()
	for _, rg := range owned {
		if err := p.a.GiveAway(p.leave.heir, rg); err != nil {
			p.event(true, "ipalloc: leaving: cannot give %s to %s: %v", rg, p.leave.heir, err)
			return
		}
	}
	if len(owned) > 0 || p.leave.id == 0 {
		if len(owned) > 0 {
			p.ringChanged(true)
		}
		p.leave.acked = false
		p.leave.id = p.rng.Uint64() | 1
		p.sendHandover()
	}
}

func (p *Peer) sendHandover() {
	p.leave.sentAt = p.now
	p.send(p.leave.heir, &Handover{ID: p.leave.id, Ring: p.a.Ring()})
}

// tickLeave resends an unanswered Handover.
func (p *Peer) tickLeave() {
	if l := p.leave; l != nil && l.heir != "" && !l.acked && p.now-l.sentAt >= int64(p.cfg.Timing.RemoveRetry) {
		p.sendHandover()
	}
}

// stepHandover takes the ranges of a peer that leaves, and removes it.
func (p *Peer) stepHandover(from PeerName, m *Handover) error {
	if err := p.mergeRing(m.Ring, string(from)); err != nil {
		return err
	}
	p.event(false, "ipalloc: %s left the cluster (weft reset) and handed its ranges to this peer, which now owns %d addresses; "+
		"telling every live peer to stop listening to it", from, p.a.Stats().Owned)
	p.departed[from] = true
	p.startRemoval(from)
	p.send(from, &HandoverAck{ID: m.ID})
	return nil
}

// stepLeft handles a message on a peer that has left: it answers what
// others wait for (Remove, a donation request, Paxos), with its frozen
// ring, and merges nothing.
func (p *Peer) stepLeft(from PeerName, m Msg) error {
	switch m := m.(type) {
	case *PaxosMsg:
		return p.stepPaxos(from, m)
	case *DonateRequest:
		p.send(from, &Denial{ID: m.ID})
	case *Remove:
		p.stepRemove(from, m)
	case *HandoverAck:
		p.stepHandoverAck(from, m)
	case *AskRemoved:
		p.stepAskRemoved(from, m)
	case *Members:
		p.stepMembers(from, m)
	case *Handover:
		if p.leave.heir == "" || p.leave.heir == from {
			return fmt.Errorf("refused the ranges of %s: %w too, with nobody to hand them to", from, ErrLeft)
		}
		p.send(from, &HandoverAck{ID: m.ID, Heir: p.leave.heir})
	}
	return nil
}

func (p *Peer) stepHandoverAck(from PeerName, m *HandoverAck) {
	l := p.leave
	if l == nil || l.acked || from != l.heir || m.ID != l.id {
		return
	}
	if m.Heir != "" {
		if m.Heir == p.cfg.Self {
			p.event(true, "ipalloc: %s has left the cluster too, and names %q as its heir: cannot hand over; "+
				"stop this router and run weft rmpeer %s on a peer still in the cluster", from, m.Heir, p.cfg.Self)
			return
		}
		// from has left too, and its heir takes over what from has, so
		// also what this peer gave it.
		p.event(false, "ipalloc: %s has left the cluster too: handing over to its heir %s", from, m.Heir)
		l.heir, l.id = m.Heir, p.rng.Uint64()|1
		p.leftDirty = true
		p.sendHandover()
		return
	}
	l.acked = true
	p.event(false, "ipalloc: %s has saved the ranges this peer handed over: it may go now", from)
}

// rangesText lists ranges as CIDRs, at most 8.
func rangesText(rs []Range) string {
	var cs []string
	for _, r := range rs {
		for _, c := range r.CIDRs() {
			cs = append(cs, c.String())
		}
	}
	if len(cs) > 8 {
		return strings.Join(cs[:8], ", ") + fmt.Sprintf(" and %d more", len(cs)-8)
	}
	return strings.Join(cs, ", ")
}

// HoldFound hands the core addresses that are in use on this node but
// unknown to its state (found on the bridge after the state was lost),
// each under the key to hold it by. Each is held as soon as it lies in a
// range this peer owns and nobody holds it; one that lies in another
// peer's range is never taken (it waits, in case the range comes here,
// and is reported once). The holds are in Ready.Allocs and logged.
func (p *Peer) HoldFound(found map[Key]Address) {
	if p.leave != nil {
		return
	}
	if p.found == nil {
		p.found = map[Key]Address{}
	}
	if p.nodeFound == nil {
		p.nodeFound = map[Key]Address{}
	}
	for k, a := range found {
		p.nodeFound[k] = a // kept in case its saved state is found stale later (peer_stale.go)
		if _, ok := p.a.Lookup(k); !ok {
			p.found[k] = a
		}
	}
	p.holdFound()
}

// holdFound holds the found addresses that are this peer's now.
func (p *Peer) holdFound() {
	if len(p.found) == 0 || p.a.ring.Empty() || p.leave != nil || p.rejoin || p.startHold || p.removedErr() != nil {
		return
	}
	for _, k := range slices.SortedFunc(maps.Keys(p.found), Key.Compare) {
		addr := p.found[k]
		if _, ok := p.a.Lookup(k); ok {
			delete(p.found, k)
			continue
		}
		if holder, ok := p.a.Holder(addr); ok && !k.Internal() && !p.foundSaved[k] && !holder.Internal() && !p.since[holder] {
			// The node shows a pod of its own using addr, and the state
			// holds it for another pod: a record of a pod gone since
			// (a restored backup, peer_stale.go). The pod on the node wins.
			if _, nodeToo := p.nodeFound[holder]; !nodeToo {
				p.a.Release(holder)
				p.rd.Allocs = append(p.rd.Allocs, AllocChange{Key: holder, Address: addr})
				p.event(false, "ipalloc: %s is in use on this node by %s, and the state held it for %s, which the node does not show: held for %s", addr, k, holder, k)
			}
		}
		if holder, ok := p.a.Holder(addr); ok {
			delete(p.found, k)
			if !p.fromState {
				// (With a saved state, the router shows its pods at every
				// start: most are held already.)
				p.event(false, "ipalloc: %s is in use on this node, and held already by %s", addr, holder)
			}
			continue
		}
		if !p.a.space.Owns(addr) {
			if !p.foundWarn[k] {
				if p.foundWarn == nil {
					p.foundWarn = map[Key]bool{}
				}
				p.foundWarn[k] = true
				owner, _ := p.a.ring.Owner(addr)
				if p.foundSaved[k] {
					p.event(true, "ipalloc: %s is held in the saved state (older than what the peers know) for %s, but the ring gives it to %q: not taken; "+
						"if that pod still runs, a pod there may get the same address", addr, k, owner)
					continue
				}
				if by, removed := p.removed[owner]; removed {
					if by == p.cfg.Self {
						p.event(false, "ipalloc: %s is in use on this node (found on the bridge), and the ring gives it to %s, which this peer removes: "+
							"held once it takes %s's ranges over", addr, owner, owner)
						continue
					}
					p.event(false, "ipalloc: %s is in use on this node (found on the bridge), and the ring gives it to %s, which %s removes: "+
						"this peer's acknowledgement of the removal says so, and the takeover hands it here", addr, owner, by)
					continue
				}
				p.event(false, "ipalloc: %s is in use on this node (found on the bridge), and the ring gives it to %s: asking %s for it "+
					"(what gave it here was lost with this peer's state)", addr, owner, owner)
			}
			continue
		}
		delete(p.found, k)
		saved := p.foundSaved[k]
		delete(p.foundSaved, k)
		if err := p.a.Restore(k, addr); err != nil {
			p.event(true, "ipalloc: %s is in use on this node but cannot be held: %v", addr, err)
			continue
		}
		p.rd.Allocs = append(p.rd.Allocs, AllocChange{Key: k, Address: addr, Held: true})
		p.ringChanged(false)
		if saved {
			p.event(false, "ipalloc: re-claimed %s, held for %s in the saved state", addr, k)
			continue
		}
		p.noteSince(k)
		p.event(false, "ipalloc: re-claimed %s, in use on this node but unknown to its state: held as %s until released", addr, k)
	}
	p.askFound()
}
