package ipalloc

import (
	"fmt"
	"slices"
)

// Reclaim (weft rmpeer X) makes this peer take over X's ranges. X is gone
// for good, but what it did before it died may not have reached this peer
// yet: a range it gave to R, or a split, known only to R. Taking X's
// entries over on what this peer alone knows could hand R's range to this
// peer too. So the takeover waits behind a barrier:
//
//  1. This peer records X as removed (on disk, before anything is sent)
//     and sends Remove{X} to every member of the ring (peer_removal.go:
//     every peer that shares it as far as this one ever learned, on disk)
//     that is not removed itself.
//  2. A peer that gets Remove{X} records it (on disk), from then on refuses
//     every message from X, and answers RemoveAck with its ring and the
//     members it knows. A member this peer did not know joins the barrier
//     (it may hold a change of X's that neither has seen: a peer that came
//     back under a new name knows only the peers it reached).
//  3. Once every such member has answered, this peer has merged every change
//     of X's that any live peer holds, and no live peer will take another
//     one. Only then does it take over X's entries that are left, each at
//     its version plus one (Ring.Reclaim), which wins everywhere.
//
// A peer that is crashed or cut off holds the barrier closed until it is
// back (or is removed too): a peer that is merely unreachable keeps its
// ranges, and nothing it may know is overruled. If two peers remove X at
// once, the one with the lower name does it; the other leaves it. If the
// reclaimer dies before it is done, rmpeer it, and then X again on another
// peer, which takes the job over.
// While the barrier is open, the reclaim can be withdrawn (Withdraw, in
// peer_removal.go).
//
// The one thing the barrier cannot see is a message from another dead
// peer, still in flight, that carries news of X's: remove peers only once
// they have been gone long enough for nothing they sent to be in flight.

// PeerGone starts the reclaim of peer x (weft rmpeer). Progress shows in
// Status().Reclaims; the takeover is logged in Ready.Events as "rmpeer of
// X: N IPs taken over".
func (p *Peer) PeerGone(x PeerName) error {
	if err := ValidatePeerName(x); err != nil {
		return fmt.Errorf("rmpeer: %w", err)
	}
	if x == p.cfg.Self {
		return fmt.Errorf("rmpeer %s: this is the peer's own name; to take this peer out, use 'weft reset' on it", x)
	}
	if p.leave != nil {
		return fmt.Errorf("rmpeer %s: %w; run rmpeer on a peer that is still in it", x, ErrLeft)
	}
	if err := p.removedErr(); err != nil {
		return fmt.Errorf("rmpeer %s: %w", x, err)
	}
	if by, ok := p.removed[x]; ok {
		if by == p.cfg.Self {
			return nil
		}
		if _, byGone := p.removed[by]; !byGone {
			return &ReclaimingError{Peer: x, By: by}
		}
		// Its reclaimer was removed too: this peer takes the job over.
	}
	p.event(false, "ipalloc: rmpeer of %s: waiting for %d peers that share this ring to stop listening to it before taking over its ranges", x, len(p.barrier(x)))
	p.startRemoval(x)
	return nil
}

// startRemoval records x as removed by this peer and starts the barrier.
func (p *Peer) startRemoval(x PeerName) {
	p.removed[x] = p.cfg.Self
	p.removedDirty = true
	p.addMember(x)
	delete(p.withdrawing, x)
	p.acks[x] = map[PeerName]bool{}
	p.forget(x)
	p.sendRemoves(x)
	p.completeReclaims()
}

func (p *Peer) isRemoved(q PeerName) bool {
	_, ok := p.removed[q]
	return ok
}

// forget drops what this peer expects from x: a donation it asked for.
func (p *Peer) forget(x PeerName) {
	if p.ask != nil && p.ask.donor == x {
		p.ask = nil
		p.askDonation()
	}
}

// sendRemoves sends Remove{x} to every member of x's barrier that has not
// acknowledged, and, while any has not, to x itself: if it is alive after
// all, it stops allocating at once (peer_removal.go).
func (p *Peer) sendRemoves(x PeerName) {
	waiting := p.waitingFor(x)
	for _, q := range waiting {
		p.send(q, &Remove{Peer: x})
	}
	if len(waiting) > 0 {
		p.send(x, &Remove{Peer: x})
	}
}

func (p *Peer) stepRemove(from PeerName, m *Remove) {
	x := m.Peer
	if m.By != "" {
		p.stepRemoveNews(from, m)
		return
	}
	if x == p.cfg.Self && p.leave != nil {
		p.event(false, "ipalloc: %s is removing this peer, which has left the cluster", from)
		return
	}
	if x == p.cfg.Self {
		p.removeSelf(from)
		return
	}
	cur, ok := p.removed[x]
	switch {
	case !ok:
		p.removed[x] = from
		p.removedDirty = true
		p.forget(x)
	case from == cur:
	case from < cur || p.isRemoved(cur):
		if cur == p.cfg.Self {
			delete(p.acks, x)
			p.event(false, "ipalloc: rmpeer of %s: %s is removing it too and goes first", x, from)
		}
		p.removed[x] = from
		p.removedDirty = true
	}
	if p.removed[x] == p.cfg.Self {
		// This peer reclaims x too, and goes first (the lower name): from
		// must not take x's ranges over as well, since two takeovers of
		// one peer clash (a reclaimer that lost its state and was asked
		// to rmpeer again, make test-long seed 629). It gets this peer's
		// Remove instead of an acknowledgement, and gives way.
		p.send(from, &Remove{Peer: x})
	} else {
		// With the addresses in use on this node that it does not own:
		// some may be x's, which the reclaimer hands here (peer_found.go).
		p.send(from, &RemoveAck{Peer: x, Ring: p.shownRing(), Members: p.barrier(x), InUse: p.unownedFound()})
	}
	// x no longer counts as live: a reclaim that waited for it may go on.
	p.completeReclaims()
}

func (p *Peer) stepRemoveAck(from PeerName, m *RemoveAck) error {
	acked, ok := p.acks[m.Peer]
	if !ok {
		if _, removes := p.removed[m.Peer]; !removes {
			// A Remove that overtook this peer's Withdraw, or came after
			// it: from recorded a removal that was called off.
			p.send(from, &Withdraw{Peer: m.Peer})
		}
		return nil
	}
	for _, q := range m.Members {
		if err := ValidatePeerName(q); err != nil {
			return fmt.Errorf("ipalloc: remove ack from %s: member %w", from, err)
		}
	}
	if err := p.mergeRing(m.Ring, string(from)); err != nil {
		return err // not counted: this peer does not have what from knows
	}
	acked[from] = true
	if len(m.InUse) > 0 {
		if p.ackInUse == nil {
			p.ackInUse = map[PeerName]map[PeerName][]Address{}
		}
		if p.ackInUse[m.Peer] == nil {
			p.ackInUse[m.Peer] = map[PeerName][]Address{}
		}
		p.ackInUse[m.Peer][from] = m.InUse
	}
	// The barrier grows by the members from knows and this peer did not:
	// one of them may hold a change of m.Peer's that neither has seen (a
	// peer that joined under a new name knows only the peers it reached).
	for _, q := range m.Members {
		if q != m.Peer {
			_ = p.AddMember(q) // validated above
		}
	}
	p.completeReclaims()
	return nil
}

// completeReclaims takes over the ranges of every peer this peer removes
// once the barrier is complete. It stays complete: ranges that such a peer
// gets later (the first claim, if it names it) are taken at once.
func (p *Peer) completeReclaims() {
	if p.rejoin {
		// Its view of the ring may be stale (peer_rejoin.go); a removal
		// may also end the wait.
		p.checkRejoin()
		return
	}
	if p.startHold {
		// Its disk may be stale (peer_stale.go): the end of the hold
		// completes them. A removal may end it (a lone peer).
		p.checkStartHold()
		return
	}
	if p.ringUnseen() {
		return
	}
	xs := make([]PeerName, 0, len(p.acks))
	for x := range p.acks {
		xs = append(xs, x)
	}
	slices.Sort(xs)
	tookAny := false
	for _, x := range xs {
		if p.removed[x] != p.cfg.Self {
			delete(p.acks, x)
			continue
		}
		if len(p.waitingFor(x)) > 0 || p.staleFor(x) {
			continue
		}
		n, err := p.a.Reclaim(x)
		if err != nil {
			p.event(true, "ipalloc: rmpeer of %s: %v", x, err)
			continue
		}
		if p.handFound(x) {
			tookAny = true
			p.ringChanged(true)
		}
		if !p.reported[x] {
			p.send(x, &Remove{Peer: x}) // once more, in case it is alive
		}
		if !p.reclaimed[x] {
			p.reclaimed[x] = true // no withdrawal from now on
			p.removedDirty = true
		}
		switch {
		case p.departed[x] && n > 0:
			p.event(false, "ipalloc: %s, which left the cluster, still owned %d IPs (a late donation): taken over", x, n)
		case p.departed[x] && !p.reported[x]:
			p.event(false, "ipalloc: every live peer has stopped listening to %s, which left the cluster", x)
		case n > 0 || !p.reported[x]:
			p.event(false, "rmpeer of %s: %d IPs taken over", x, n)
		}
		p.reported[x] = true
		if n > 0 {
			tookAny = true
			p.ringChanged(true)
		}
	}
	if tookAny {
		p.holdFound()
		p.serve()
	}
}

// remindReclaimer tells from, a peer that this one records as removing x
// while x still owns ranges here (its reclaim is open, as far as this peer
// knows), that it does, at most once every Timing.RemoveRetry ticks for
// each x: if from lost its state meanwhile, it forgot the reclaim, and
// without the reminder it would wait for x forever (a peer that starts
// without state waits to hear from every owner of its ring) while every
// other peer refuses x's messages (reliability.md, finding 2).
func (p *Peer) remindReclaimer(from PeerName, m Msg) {
	for x, by := range p.removed {
		if by != from || x == p.cfg.Self || !slices.Contains(p.a.ring.Peers(), x) {
			continue
		}
		if rm, ok := m.(*Remove); ok && rm.Peer == x {
			continue // from asks for it: it has the record
		}
		if !p.retryDue(&p.toldBy, x) {
			continue
		}
		p.send(from, &Remove{Peer: x, By: from})
	}
}

// stepRemoveNews handles news (Remove with By): from records that m.By
// removes m.Peer. Sent to another peer than m.By, it answers an AskRemoved
// (learnRemoval, in peer_removal.go). If m.By is this peer and it has no
// record of it, or only one of a reclaimer that goes after it (a higher
// name), it lost its state while it reclaimed m.Peer (a wiped disk, restarted
// under the same name): it takes the reclaim up again, as if the operator
// ran rmpeer once more, with a new barrier (nothing is taken over before
// every member it knows now has stopped listening to m.Peer). That also
// ends the wait of its rejoin for m.Peer, which is gone.
func (p *Peer) stepRemoveNews(from PeerName, m *Remove) {
	x := m.Peer
	if m.By != p.cfg.Self {
		p.learnRemoval(from, x, m.By)
		return
	}
	if x == p.cfg.Self || p.leave != nil || p.removedErr() != nil {
		return
	}
	cur, ok := p.removed[x]
	if ok && (cur == p.cfg.Self || (cur < p.cfg.Self && !p.isRemoved(cur))) {
		return // this peer's record stands (its own, or another's that goes first)
	}
	if _, ok := p.withdrawing[x]; ok {
		return // withdrawn here: the Withdraw is on its way to from
	}
	// A record of another reclaimer that does not go first (a higher
	// name, learned after this peer lost its state) does not stand: that
	// reclaimer gives way to from's record of this peer, from keeps
	// waiting for this one, and nobody would take x over (make test-long
	// seed 6037: three records in a ring, each naming the next).
	had := "had no record of"
	if ok {
		had = "recorded as " + string(cur) + "'s, which goes after this peer's"
	}
	p.event(false, "ipalloc: %s records that this peer removes %s (weft rmpeer), which this peer %s: its state was lost "+
		"while it reclaimed %s. Taking the reclaim up again (it waits for every peer that shares the ring, as a new rmpeer does)", from, x, had, x)
	p.startRemoval(x)
}

// ringUnseen reports whether this peer has not yet seen the cluster's ring
// although it knows that the cluster has one, and if so says once why no
// reclaim completes. Its ring is still the first claim as made (nobody has
// handed out an address from it: Ring.FirstClaimOnly), while its node
// shows pods whose addresses were handed out (HoldFound): from a ring that
// has moved on since, which this peer has lost (a wiped disk, under a name
// that ring may not even hold) and which only peers that are down now
// know. The peers it hears know no more than it does (a joiner that has
// only the first claim): their acknowledgements prove nothing about what
// the peers that know did. A takeover on this ring would take ranges those
// peers own and allocate from (make test-long seed 8935). Every reclaim
// waits until a ring that has moved on is merged: its owners then join
// the barrier, and a ring that names this peer makes it rejoin.
func (p *Peer) ringUnseen() bool {
	if len(p.nodeFound) == 0 || !p.a.ring.FirstClaimOnly() {
		p.unseenSaid = false
		return false
	}
	if !p.unseenSaid && len(p.acks) > 0 {
		p.unseenSaid = true
		p.event(true, "ipalloc: rmpeer waits: this node's pods use %d addresses, but the ring this peer has is still the first claim, "+
			"so the cluster's ring has moved on and no peer heard since knows it (this peer's state was lost?); "+
			"the takeover waits until a peer that has the cluster's ring is reachable (start the routers that are down)", len(p.nodeFound))
	}
	return true
}

// staleFor reports whether this peer's ring cannot hold the cluster's
// word on x's ranges, and if so says once why their takeover waits: an
// address that this node uses (HoldFound) lies in an entry of x still at
// version 1, as the first claim made it. Whoever handed that address out
// changed the entry (its free count, a donation), so a ring that saw it
// exists that no peer heard since has given this peer: this peer lost its
// state, and so did the peers it hears, or they would know. That is
// ringUnseen's case, also after a peer it hears, which lost its state
// too, has moved its own entries on since (it allocated), so that the
// ring as a whole is no longer the first claim: its ring proves nothing
// about x's entries. A takeover on this ring would take an address that x
// gave a peer that is down and that nobody heard since knows (make
// test-long seed 18083). Only a ring that has x's entries moved on ends
// the wait, or the node's pods going (the operator drains the node).
//
// What acknowledgers report in use in such an entry is no evidence here:
// it is handed to them at the takeover (handFound), and they are up. A
// peer that is down and holds an address of x's is then covered only if
// this node's pods show the loss (make test-long seed 10788 and six
// others of 10001-20000 never settled with that evidence counted: every
// disk that knew x's donations was lost, the acknowledgers' pods were all
// that was left, and the takeover that hands them on is what settles it).
func (p *Peer) staleFor(x PeerName) bool {
	at, stale := p.staleAt(x)
	if !stale {
		delete(p.staleSaid, x)
		return false
	}
	if !p.staleSaid[x] {
		if p.staleSaid == nil {
			p.staleSaid = map[PeerName]bool{}
		}
		p.staleSaid[x] = true
		p.event(true, "ipalloc: rmpeer of %s waits: %s is in use on this node, inside a range of %s that this peer's ring still has as the first claim made it, "+
			"so whoever handed it out changed that range in a ring that no peer heard since knows (their state was lost?); "+
			"the takeover waits until a peer that has the cluster's ring is reachable (start the routers that are down)", x, at, x)
	}
	return true
}

// staleAt returns the lowest address that this node uses inside an entry
// of x still at version 1 (staleFor).
func (p *Peer) staleAt(x PeerName) (at Address, stale bool) {
	for _, a := range p.nodeFound {
		if e, ok := p.a.ring.EntryOf(a); ok && e.Peer == x && e.Version == 1 && (!stale || a < at) {
			at, stale = a, true
		}
	}
	return at, stale
}
