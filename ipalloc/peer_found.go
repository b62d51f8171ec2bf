package ipalloc

import (
	"fmt"
	"maps"
	"slices"
)

// Pods found on the node at addresses that the ring gives to another peer.
//
// A peer that lost its state finds its node's pods on the bridge
// (HoldFound) and holds each address again once its ring gives it the
// range. The ring gives one to another peer when what gave it to this
// peer was lost with every disk that knew: a donation whose donor and
// recipient both lost their state (make test-long's wipe seeds 1151 and
// 1191), so that the ring the survivors rebuilt gives the range to its
// old owner, which would hand the address out again. Two ways bring such
// an address back:
//
//   - Want: this peer asks the owner for it (at once, and again every
//     Timing.RemoveRetry ticks while it waits). The owner gives each run
//     of the addresses it does not hold (GiveAway, as a donation) and
//     answers with its ring. One that the owner holds is a duplicate
//     already, made before anyone could know: the owner warns, naming both.
//   - An owner being removed (weft rmpeer, its Node deleted) answers
//     nothing: this peer lists the addresses in its RemoveAck (InUse), and
//     the reclaimer, when the reclaim completes, hands those it owns then
//     (the removed peer's, or its own) to this peer instead of keeping
//     them (handFound).
//
// What neither closes: an owner that handed the address out before this
// peer came back (nobody alive knew of it then). The owner's warning says
// so when this peer asks.
//
// A Want is a request for space, like a DonateRequest, but for exact
// addresses: a peer of the mesh could use it to take free addresses one by
// one and split the owner's ranges into many ring entries. With a password
// only peers that know it are in the mesh (docs/security.md); without one,
// anyone who reaches the gossip port can send forged rings already.

// unownedFound lists the found addresses that this peer does not own
// (sorted, unique, at most maxWireAddrs): what its RemoveAck reports. Only
// pods the node shows count: an allocation of a saved state found stale
// that the node does not show (foundSaved) is a record, most likely of a
// pod deleted since, not a claim on another peer's address.
func (p *Peer) unownedFound() []Address {
	var out []Address
	for k, a := range p.found {
		if !p.a.space.Owns(a) && !p.foundSaved[k] {
			out = append(out, a)
		}
	}
	slices.Sort(out)
	out = slices.Compact(out)
	if len(out) > maxWireAddrs {
		out = out[:maxWireAddrs]
	}
	return out
}

// askFound sends a Want to each live owner of found addresses this peer
// does not own, at most once every Timing.RemoveRetry ticks per owner. It
// asks while it holds back too (a rejoin, its start hold): its ring may
// name the wrong owner then, who answers with its ring, but the sooner the
// owner hears of the address, the sooner it stops handing it out.
func (p *Peer) askFound() {
	if len(p.found) == 0 || p.a.ring.Empty() || p.leave != nil || p.removedErr() != nil || p.unregistered() {
		return
	}
	byOwner := map[PeerName][]Address{}
	for _, a := range p.unownedFound() {
		if owner, ok := p.a.ring.Owner(a); ok && p.live(owner) {
			byOwner[owner] = append(byOwner[owner], a)
		}
	}
	for _, owner := range slices.Sorted(maps.Keys(byOwner)) {
		if !p.retryDue(&p.wantAt, owner) {
			continue
		}
		p.send(owner, &Want{Addrs: byOwner[owner]})
	}
}

// stepWant gives from the addresses it asks for that this peer owns and
// does not hold, and answers with this peer's ring.
func (p *Peer) stepWant(from PeerName, m *Want) {
	if len(m.Addrs) == 0 {
		// A pull of this peer's ring by a peer that holds back
		// (pullHoldRings): answered at once, also while this peer holds
		// (its ring is what it shows the others anyway: showClaim,
		// AddPeer), since at a fresh start every peer holds and each
		// waits for the others' rings.
		if !p.a.ring.Empty() {
			p.send(from, &RingMsg{Ring: p.a.Ring()})
		}
		return
	}
	if p.a.ring.Empty() || p.rejoin || p.startHold {
		// Its view of its ranges may be stale: the last Want of each
		// peer is kept, and answered when the hold ends, before anything
		// that waits for an address is served (make test-long seed 7268:
		// the rejoin ended between two of the asker's retries, and its
		// first allocation took the address the asker's pod uses).
		if p.heldWants == nil {
			p.heldWants = map[PeerName][]Address{}
		}
		// A Members answer lists every address from's node uses that its
		// state does not own, a Want only those its ring gives to this
		// peer: the union is kept.
		if _, ok := p.heldWants[from]; ok || len(p.heldWants) < maxWireValue {
			all := slices.Concat(p.heldWants[from], m.Addrs)
			slices.Sort(all)
			all = slices.Compact(all)
			if len(all) > maxWireAddrs {
				all = all[:maxWireAddrs]
			}
			p.heldWants[from] = all
		}
		return
	}
	var give []Address
	for _, a := range m.Addrs {
		if !p.a.space.Owns(a) {
			continue // not this peer's (any more): the ring it answers says whose
		}
		if k, ok := p.a.Holder(a); ok {
			p.reportOnce(fmt.Sprintf("ipalloc: %s asks for %s, which is in use on its node (found on its bridge after its state was lost), "+
				"but this peer holds it for %s: two pods have one address; delete one of them so that it gets an address of its own", from, a, k))
			continue
		}
		give = append(give, a)
	}
	if p.giveFound(from, give, "whose node uses them (found on its bridge after its state was lost)") {
		p.ringChanged(true)
	}
	p.send(from, &RingMsg{Ring: p.a.Ring()})
}

// serveHeldWants answers the Wants kept while this peer held back.
func (p *Peer) serveHeldWants() {
	wants := p.heldWants
	p.heldWants = nil
	for _, q := range slices.Sorted(maps.Keys(wants)) {
		if p.live(q) {
			p.stepWant(q, &Want{Addrs: wants[q]})
		}
	}
}

// giveFound gives each run of addrs (sorted, unique, owned by this peer
// and held by none) to q, and reports whether it gave any.
func (p *Peer) giveFound(q PeerName, addrs []Address, why string) bool {
	gave := false
	for _, rg := range addressRuns(addrs) {
		if err := p.a.GiveAway(q, rg); err != nil {
			p.event(true, "ipalloc: cannot give %s to %s: %v", rg, q, err)
			continue
		}
		gave = true
		p.event(false, "ipalloc: gave %s (%d addresses) to %s, %s", rangesText([]Range{rg}), rg.Size(), q, why)
	}
	return gave
}

// addressRuns turns sorted, unique addresses into the ranges they make.
func addressRuns(addrs []Address) []Range {
	var out []Range
	for _, a := range addrs {
		if n := len(out); n > 0 && out[n-1].End == a {
			out[n-1].End++
			continue
		}
		out = append(out, Range{a, a + 1})
	}
	return out
}

// handFound runs once the reclaim of x completes: the addresses that
// acknowledgers of the removal reported in use on their nodes go to them,
// if this peer owns them now (x's ranges it took over, or its own: a
// donation of its own that it lost with a stale disk) and does not hold
// them. An address that this peer holds, or that its own node uses too,
// or that two acknowledgers report, stays with the first.
//
// None of those is reported here: a report is as old as its
// acknowledgement, which can arrive long after it was sent (and after
// the reclaim completed: an acknowledgement late to a complete reclaim
// is handed on too). Meanwhile the acknowledger's pod may be gone and
// the address given here and handed out again (make test-long seed
// 17740: a stateless acker's report arrived after the acker
// had given the address to this peer, which gave it to a new pod). An
// acknowledger whose pod still uses the address asks its owner for it
// with a Want (askFound) as long as it does, and the owner warns then,
// from what that node uses now (stepWant).
func (p *Peer) handFound(x PeerName) bool {
	byAcker := p.ackInUse[x]
	delete(p.ackInUse, x)
	if len(byAcker) == 0 {
		return false
	}
	here := map[Address]Key{}
	for k, a := range p.found {
		here[a] = k
	}
	given := map[Address]PeerName{}
	gave := false
	for _, q := range slices.Sorted(maps.Keys(byAcker)) {
		if !p.live(q) {
			continue
		}
		var give []Address
		for _, a := range byAcker[q] {
			if !p.a.space.Owns(a) {
				continue
			}
			_, held := p.a.Holder(a)
			if !held {
				_, held = here[a]
			}
			switch _, dup := given[a]; {
			case held, dup:
				// Kept where it is; the acknowledger asks for it if
				// its pod still uses it (above).
			default:
				given[a] = q
				give = append(give, a)
			}
		}
		if p.giveFound(q, give, fmt.Sprintf("which reports them in use on its node (in its acknowledgement of the removal of %s)", x)) {
			gave = true
		}
	}
	return gave
}
