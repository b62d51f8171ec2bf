package ipalloc

import (
	"errors"
	"fmt"
	"maps"
	"slices"
)

// Removal as durable state (see peer_reclaim.go for the reclaim itself).
//
// The barrier. A reclaim of X waits for every member of this ring except
// X: the peers this peer has ever seen in the mesh or heard from, every
// owner of every ring it merged (and of the first claim), and whatever the
// shell adds (AddMember: in --kube mode, the peers registered in the
// ConfigMap). Members are saved on disk and never forgotten, so the set a
// reclaim waits for at any time holds every peer it would have waited for
// when it started: a reclaimer that restarts, or that is asked before the
// mesh has connected to anyone, still waits for a peer that is down or cut
// off. A member leaves the barrier only by being removed too, or (until
// the next restart) by showing a ring seeded apart from this one. An
// acknowledgement counts only if it came since this peer started, with the
// acknowledger's ring, merged here: so no barrier with a member in it
// completes before this peer has merged a ring from a live peer since it
// started. A barrier with no member at all (every other peer that ever
// shared the ring is removed) completes at once: nobody else can know
// anything of X's.
//
// Removed. A peer told that it is removed (Remove naming itself) records
// that on disk and from then on allocates nothing (Allocate answers a
// *RemovedError), gives no donation and re-claims nothing: its ranges are
// being taken over. It stays so across restarts until the reclaimer
// withdraws the removal; the way back is weft reset (a new name).
//
// Withdrawn. While the barrier of a reclaim is open, nothing of X's has
// been taken over, so the reclaimer may call it off (Withdraw): it
// forgets the removal and tells every member, and X, with Withdraw, until
// each has answered (kept on disk until then); each forgets the removal if
// it was by that reclaimer, and answers. Once the
// barrier has completed (recorded on disk), a removal can no longer be
// withdrawn: X's ranges belong to the reclaimer.

// ErrRemoved is matched (errors.Is) by a *RemovedError.
var ErrRemoved = errors.New("this peer was removed from the cluster")

// RemovedError answers allocations on a peer that was removed (weft
// rmpeer on another peer, or its Node was deleted in --kube mode).
type RemovedError struct {
	Self PeerName // this peer
	By   PeerName // the peer that takes its ranges over
}

func (e *RemovedError) Error() string {
	return fmt.Sprintf("this node's peer %s was removed from the cluster by %s (weft rmpeer, or its Node was deleted), "+
		"which takes over its ranges, so it hands out no addresses any more; to bring the node back, run "+
		"'weft reset --force' on it (its pods lose their addresses) and start the router again: it joins under a new name", e.Self, e.By)
}

// Is makes errors.Is(err, ErrRemoved) true.
func (e *RemovedError) Is(target error) bool { return target == ErrRemoved }

// ReclaimingError is returned by PeerGone when another live peer is taking
// over Peer's ranges already, and by Withdraw when the removal is not this
// peer's to call off.
type ReclaimingError struct {
	Peer PeerName
	By   PeerName
}

func (e *ReclaimingError) Error() string {
	return fmt.Sprintf("rmpeer %s: %s is taking over its ranges already (if %s is gone too, rmpeer it first; then rmpeer %s again to take the job over; "+
		"if %s lost its state, run rmpeer %s on %s)",
		e.Peer, e.By, e.By, e.Peer, e.By, e.Peer, e.By)
}

// ErrReclaimDone is returned by Withdraw once the reclaim has taken over.
var ErrReclaimDone = errors.New("the reclaim has taken over the ranges already")

// removedErr is the answer to an allocation while this peer is removed.
func (p *Peer) removedErr() error {
	if by, ok := p.removed[p.cfg.Self]; ok {
		return &RemovedError{Self: p.cfg.Self, By: by}
	}
	return nil
}

// restoreMembers loads the saved members, plus the owners of the saved
// ring and the removed peers (state saved before members were kept).
func (p *Peer) restoreMembers(hs HardState) {
	for _, q := range hs.Members {
		if ValidatePeerName(q) == nil && q != p.cfg.Self {
			p.members[q] = true
		}
	}
	for _, q := range hs.Reclaimed {
		if _, ok := hs.Removed[q]; ok {
			p.reclaimed[q] = true
		}
	}
	for _, q := range hs.Withdrawn {
		if _, ok := hs.Removed[q]; !ok && ValidatePeerName(q) == nil {
			p.withdrawing[q] = map[PeerName]bool{} // resent at the first tick that resends
		}
	}
	n := len(p.members)
	p.addOwners()
	for x := range hs.Removed {
		p.addMember(x)
	}
	p.membersDirty = p.membersDirty || len(p.members) != n || hs.Members == nil && len(p.members) > 0
}

// addMember records q as a member of this ring (on disk at the next Ready).
func (p *Peer) addMember(q PeerName) {
	if q == p.cfg.Self || q == "" || p.members[q] {
		return
	}
	p.members[q] = true
	p.membersDirty = true
}

// addOwners records the owners of the live ring as members.
func (p *Peer) addOwners() {
	for _, q := range p.a.ring.Peers() {
		p.addMember(q)
	}
}

// AddMember tells the core that q shares this ring, whether or not the
// mesh sees it (in --kube mode: a peer registered in the ConfigMap). It is
// saved, and every later reclaim waits for q until q is removed too.
func (p *Peer) AddMember(q PeerName) error {
	if err := ValidatePeerName(q); err != nil {
		return fmt.Errorf("ipalloc: member %w", err)
	}
	p.addMember(q)
	for x := range p.acks {
		if q != x && p.inBarrier(q) && !p.acks[x][q] {
			p.send(q, &Remove{Peer: x})
		}
	}
	return nil
}

// Reclaiming reports whether this peer reclaims x (x's removal is this
// peer's), and whether that reclaim has taken over (then it can no longer
// be withdrawn).
func (p *Peer) Reclaiming(x PeerName) (reclaiming, done bool) {
	if p.removed[x] != p.cfg.Self {
		return false, false
	}
	return true, p.reclaimed[x]
}

// Members returns the peers that share this ring, sorted.
func (p *Peer) Members() []PeerName { return slices.Sorted(maps.Keys(p.members)) }

// inBarrier reports whether member q is one a reclaim waits for.
func (p *Peer) inBarrier(q PeerName) bool {
	_, gone := p.removed[q]
	return p.members[q] && q != p.cfg.Self && !gone && !p.foreign[q]
}

// barrier lists the members the reclaim of x waits for, sorted.
func (p *Peer) barrier(x PeerName) []PeerName {
	var out []PeerName
	for q := range p.members {
		if q != x && p.inBarrier(q) {
			out = append(out, q)
		}
	}
	slices.Sort(out)
	return out
}

// waitingFor lists the members of x's barrier that have not acknowledged.
func (p *Peer) waitingFor(x PeerName) []PeerName {
	out := []PeerName{}
	for _, q := range p.barrier(x) {
		if !p.acks[x][q] {
			out = append(out, q)
		}
	}
	return out
}

// removeSelf records that by removes this peer.
func (p *Peer) removeSelf(by PeerName) {
	if cur, ok := p.removed[p.cfg.Self]; ok && (cur == by || (cur < by && !p.isRemoved(cur))) {
		return
	}
	p.removed[p.cfg.Self] = by
	p.removedDirty = true
	p.event(true, "ipalloc: %s is removing this peer (weft rmpeer, or its Node was deleted) and will take over its ranges: "+
		"this peer allocates no more addresses. If this peer is alive, that was a mistake: the removal can be withdrawn on %s "+
		"while it waits for the other peers; otherwise run weft reset --force here and restart the router (a new name)", by, by)
	p.ask = nil
	p.found = nil
	p.serve() // answers what waits with the error
}

// stepRemovedSelf handles a message on a peer that knows it is removed.
// It merges no ring: its entries are its reclaimer's now, and its view of
// them no longer counts (it may hold changes nobody saw, made while it was
// cut off, which the reclaimer's takeover contradicts). It answers what
// others wait for, names its reclaimer to a peer that would hand it its
// ranges, and listens for a withdrawal.
func (p *Peer) stepRemovedSelf(from PeerName, m Msg) error {
	switch m := m.(type) {
	case *Withdraw:
		p.stepWithdraw(from, m)
	case *WithdrawAck:
		p.stepWithdrawAck(from, m)
	case *Remove:
		p.stepRemove(from, m)
	case *DonateRequest:
		p.send(from, &Denial{ID: m.ID})
	case *Denial:
		p.stepDenial(from, m)
	case *Handover:
		p.send(from, &HandoverAck{ID: m.ID, Heir: p.removed[p.cfg.Self]})
	case *HandoverAck:
		p.stepHandoverAck(from, m)
	case *PaxosMsg:
		return p.stepPaxos(from, m)
	case *AskRemoved:
		p.stepAskRemoved(from, m)
	case *Members:
		p.stepMembers(from, m)
	}
	return nil
}

// takenOver handles a ring from a live peer that gives ranges this peer
// owns to another: only a reclaim changes an entry that its owner did not,
// so this peer was removed (weft rmpeer, or its Node deleted, while it
// was cut off from its reclaimer), or its disk is older than what it told
// the others (a restored backup). Either way its ranges are no longer its
// own: it stops allocating as a removed peer does, and says so.
func (p *Peer) takenOver(from PeerName, r *Ring) {
	var by PeerName
	for _, rg := range p.a.Owned() {
		if q, ok := r.Owner(rg.Start); ok && q != p.cfg.Self {
			by = q
			break
		}
	}
	if by == "" || ValidatePeerName(by) != nil {
		return
	}
	p.event(true, "ipalloc: the ring from %s takes ranges this peer owns (it gives them to %s): this peer was removed while it was cut off "+
		"(or its state is older than what it told the others)", from, by)
	p.removeSelf(by)
}

// tellRemoved tells x, a peer this one removes that still talks (it was
// down or cut off while it was removed, and is back), that it is removed,
// at most once every Timing.RemoveRetry ticks.
func (p *Peer) tellRemoved(x PeerName) {
	if p.removed[x] != p.cfg.Self {
		return
	}
	if at, ok := p.told[x]; ok && p.now-at < int64(p.cfg.Timing.RemoveRetry) {
		return
	}
	if p.told == nil || len(p.told) > 1000 {
		p.told = map[PeerName]int64{}
	}
	p.told[x] = p.now
	p.send(x, &Remove{Peer: x})
}

// Withdraw calls off this peer's reclaim of x while its barrier is still
// open: x is no longer removed here, and every member (and x itself) is
// told to forget the removal. Withdrawing a peer that is not removed does
// nothing. It fails with ErrReclaimDone once the reclaim has taken over,
// and with a *ReclaimingError when another peer reclaims x.
func (p *Peer) Withdraw(x PeerName) error {
	if err := ValidatePeerName(x); err != nil {
		return fmt.Errorf("withdraw: %w", err)
	}
	by, ok := p.removed[x]
	switch {
	case x == p.cfg.Self:
		return fmt.Errorf("withdraw %s: this is the peer's own name; only its reclaimer (%s) can withdraw its removal", x, by)
	case !ok:
		return nil
	case by != p.cfg.Self:
		return &ReclaimingError{Peer: x, By: by}
	case p.reclaimed[x]:
		return fmt.Errorf("withdraw %s: %w; run weft reset --force on %s and restart it (it joins under a new name)", x, ErrReclaimDone, x)
	}
	delete(p.removed, x)
	delete(p.acks, x)
	delete(p.ackInUse, x)
	p.removedDirty = true
	p.withdrawing[x] = map[PeerName]bool{}
	p.event(false, "ipalloc: rmpeer of %s withdrawn before anything was taken over: telling the other peers to listen to it again", x)
	p.sendWithdraws(x)
	return nil
}

// sendWithdraws sends Withdraw{x} to x and every member that has not
// acknowledged it.
func (p *Peer) sendWithdraws(x PeerName) {
	acked := p.withdrawing[x]
	for _, q := range append(p.barrier(x), x) {
		if !acked[q] {
			p.send(q, &Withdraw{Peer: x})
		}
	}
}

// tickWithdraws resends unacknowledged withdrawals.
func (p *Peer) tickWithdraws() {
	for x := range p.withdrawing {
		p.sendWithdraws(x)
	}
}

func (p *Peer) stepWithdraw(from PeerName, m *Withdraw) {
	x := m.Peer
	if p.removed[x] == from {
		delete(p.removed, x)
		p.removedDirty = true
		if x == p.cfg.Self {
			p.event(false, "ipalloc: %s withdrew the removal of this peer: it allocates again", from)
			p.serve()
		} else {
			p.event(false, "ipalloc: %s withdrew the removal of %s: listening to it again", from, x)
		}
	}
	p.send(from, &WithdrawAck{Peer: x})
}

func (p *Peer) stepWithdrawAck(from PeerName, m *WithdrawAck) {
	acked, ok := p.withdrawing[m.Peer]
	if !ok {
		return
	}
	acked[from] = true
	for _, q := range append(p.barrier(m.Peer), m.Peer) {
		if !acked[q] {
			return
		}
	}
	delete(p.withdrawing, m.Peer)
	p.removedDirty = true
}

// Asking who is removed. Only a reclaimer tells the members of its barrier
// that it removes X, and only while that barrier is open. A peer that
// learned of X afterwards, without the removal (it started without state
// under its old name, so its barrier holds an old acknowledgement of the
// peer that is now forgetful; or X still owned ranges in a ring it merged
// before the takeover), would wait for X forever: in every reclaim's
// barrier, and in the hold of a start without state. So every
// Timing.RemoveRetry ticks while it waits for anyone, a peer asks the live
// members it does not wait for which of those are removed (AskRemoved);
// each answers with the removals it records (Remove with By). A peer that
// learns a removal this way records it as if the reclaimer had told it,
// and acknowledges it to the reclaimer: a reclaimer that has withdrawn the
// removal since answers that acknowledgement with a Withdraw (stepRemoveAck),
// so what it learned is called off as it would be for any member.

// waited lists the peers this peer waits for: the members of its barriers
// that have not acknowledged (also after the takeover: a member whose
// removal this peer had learned, and which a late Withdraw of its
// reclaimer made a member again, holds the reclaim open until it asks:
// make test-long's seed 6049), and those its rejoin or its start hold
// waits for.
func (p *Peer) waited() []PeerName {
	w := map[PeerName]bool{}
	for _, q := range p.rejoinWaits() {
		w[q] = true
	}
	if p.startHold {
		for _, q := range p.startWaits() {
			w[q] = true
		}
	}
	for x := range p.acks {
		if p.removed[x] == p.cfg.Self {
			for _, q := range p.waitingFor(x) {
				w[q] = true
			}
		}
	}
	return slices.Sorted(maps.Keys(w))
}

// askRemovedFanout bounds the peers asked at each retry. Asking every live
// member each time cost N messages per waiting peer per retry: a fresh
// consensus=200 cluster, where every peer waits for the others' rings for
// a while, sent 459,458 AskRemoved in two minutes and never settled. The
// peers asked rotate, so that each is asked within N/askRemovedFanout
// retries; a cluster of up to askRemovedFanout+1 peers asks them all at
// once, as before.
const askRemovedFanout = 8

// askRemoved sends AskRemoved for the peers this one waits for to the next
// askRemovedFanout of the live members and known peers it does not wait
// for (all of them, in turn).
func (p *Peer) askRemoved() {
	if p.leave != nil || p.removedErr() != nil {
		return
	}
	waits := p.waited()
	if len(waits) == 0 {
		return
	}
	ask := map[PeerName]bool{}
	for q := range p.members {
		ask[q] = true
	}
	for q := range p.known {
		ask[q] = true
	}
	var to []PeerName
	for _, q := range slices.Sorted(maps.Keys(ask)) {
		if p.live(q) && !slices.Contains(waits, q) {
			to = append(to, q)
		}
	}
	if len(to) > askRemovedFanout {
		start := p.askRemovedNext % len(to)
		to = slices.Concat(to[start:], to[:start])[:askRemovedFanout]
		p.askRemovedNext = start + askRemovedFanout
	}
	for _, q := range to {
		p.send(q, &AskRemoved{Peers: waits})
	}
}

// stepAskRemoved answers with the removals this peer records among m.Peers.
func (p *Peer) stepAskRemoved(from PeerName, m *AskRemoved) {
	for _, q := range m.Peers {
		if by, ok := p.removed[q]; ok && q != from {
			p.send(from, &Remove{Peer: q, By: by})
		}
	}
}

// learnRemoval handles the answer to an AskRemoved: from records that by
// removes x. A peer with no record of it records it, stops waiting for x,
// and acknowledges it to by.
func (p *Peer) learnRemoval(from PeerName, x, by PeerName) {
	if x == p.cfg.Self || by == x || p.leave != nil || p.removedErr() != nil {
		return // a peer learns its own removal from its reclaimer only
	}
	if _, ok := p.removed[x]; ok {
		return
	}
	if _, ok := p.withdrawing[x]; ok {
		return
	}
	p.removed[x] = by
	p.removedDirty = true
	p.addMember(x)
	p.addMember(by)
	p.forget(x)
	p.event(false, "ipalloc: %s records that %s removes %s (weft rmpeer, or its Node was deleted), which this peer had not been told: "+
		"it no longer waits for %s", from, by, x, x)
	if by != p.cfg.Self && p.live(by) {
		p.send(by, &RemoveAck{Peer: x, Ring: p.a.Ring(), Members: p.barrier(x)})
	}
	p.completeReclaims()
}
