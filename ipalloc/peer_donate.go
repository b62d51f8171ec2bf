package ipalloc

import (
	"cmp"
	"fmt"
	"slices"
)

// Donation: a peer with allocations waiting and no free address asks the
// peer with the most free space (by the free counts gossiped in the ring;
// ties by name) for some. The donor gives part of its largest free run
// (Allocator.DonationRange) by GiveAway and answers with its ring; a donor
// with nothing free answers with a Denial, and the asker tries the next
// donor. A request unanswered for Timing.DonationRetry ticks counts as a
// denial. Once every donor has been tried, the asker waits as long again
// and starts over, as free counts change.

// askDonation sends a donation request if space is needed and none is
// being asked for.
func (p *Peer) askDonation() {
	if p.ask != nil || len(p.pending) == 0 || p.a.ring.Empty() || p.now < p.askAfter {
		return
	}
	if p.removedErr() != nil {
		return // its ranges are its reclaimer's; it needs no space
	}
	if p.unregistered() {
		p.trail.last = "none asked yet: this peer is not registered in the cluster's records"
		return // see unregistered (peer_rejoin.go)
	}
	if p.rejoin || p.startHold {
		// Holding back, it does not know yet what it owns (peer_rejoin.go),
		// and the owners' rings usually reach it within moments (at a
		// fresh cluster's first claim, each owner shows its own), or it
		// pulls them (pullHoldRings). It allocates nothing before the hold
		// ends, from space given meanwhile or not. So a peer that its ring
		// gives ranges asks for none: it allocates from its own once the
		// hold ends, and asks then if they are full. A donation now would
		// only split the ring (a fresh consensus=100 cluster with a pod
		// on every node: 300 to 540 entries, and on a starved mesh of 200
		// the owners did not agree within minutes while the splits
		// spread). A peer that owns nothing asks once a donation retry
		// has passed: it needs space anyway, and the answer brings the
		// donor's ring.
		if p.holdOwns() {
			return
		}
		if !p.holdAskSet {
			p.holdAskAt, p.holdAskSet = p.now+int64(p.cfg.Timing.DonationRetry), true
		}
		if p.now < p.holdAskAt {
			return
		}
	}
	donor, ok := p.pickDonor()
	if !ok {
		p.trail.noDonor++
		clear(p.tried)
		p.askAfter = p.now + int64(p.cfg.Timing.DonationRetry)
		if len(p.livePeers()) == 0 {
			// Alone: no donor can appear, so answer now rather than at
			// the deadline. (With peers, free counts may be stale, so
			// the requests wait and ask again.)
			for _, w := range p.pending {
				p.rd.Answers = append(p.rd.Answers, Answer{Key: w.key, Err: fmt.Errorf("%w, and there is no other peer to ask", ErrNoSpace)})
			}
			p.pending = nil
		}
		return
	}
	p.ask = &donationAsk{id: p.rng.Uint64() | 1, donor: donor, sentAt: p.now}
	p.trail.asked++
	p.trail.last = fmt.Sprintf("asked %s", donor)
	p.send(donor, &DonateRequest{ID: p.ask.id})
}

// pickDonor returns the live peer with the most free space not yet tried.
func (p *Peer) pickDonor() (PeerName, bool) {
	shares := p.a.ring.Shares()
	slices.SortFunc(shares, func(a, b Share) int {
		if c := cmp.Compare(b.Free, a.Free); c != 0 {
			return c
		}
		return cmp.Compare(a.Peer, b.Peer)
	})
	for _, s := range shares {
		if s.Free > 0 && p.live(s.Peer) && !p.tried[s.Peer] {
			return s.Peer, true
		}
	}
	return "", false
}

// tickDonation gives up on an unanswered request and asks again.
func (p *Peer) tickDonation() {
	if p.ask != nil && p.now-p.ask.sentAt >= int64(p.cfg.Timing.DonationRetry) {
		p.trail.unanswered++
		p.trail.last = fmt.Sprintf("%s did not answer in %d ticks", p.ask.donor, p.cfg.Timing.DonationRetry)
		p.tried[p.ask.donor] = true
		p.ask = nil
	}
	p.askDonation()
}

func (p *Peer) stepDonateRequest(from PeerName, m *DonateRequest) {
	if p.a.ring.Empty() || p.rejoin || p.startHold || p.removedErr() != nil { // a removed peer's ranges are being taken over
		p.send(from, &Denial{ID: m.ID})
		return
	}
	if p.served[from] == m.ID {
		// A retry of a request already served: the ring shows the donation.
		p.send(from, &Donation{ID: m.ID, Ring: p.a.Ring()})
		return
	}
	rg, ok := p.a.DonationRange()
	if !ok || len(p.pending) > 0 {
		p.send(from, &Denial{ID: m.ID})
		return
	}
	if err := p.a.GiveAway(from, rg); err != nil {
		p.event(true, "ipalloc: cannot give %s to %s: %v", rg, from, err)
		p.send(from, &Denial{ID: m.ID})
		return
	}
	p.served[from] = m.ID
	p.ringChanged(true)
	p.event(false, "ipalloc: gave %s (%d addresses) to %s, which asked for space", rg, rg.Size(), from)
	p.send(from, &Donation{ID: m.ID, Ring: p.a.Ring()})
}

func (p *Peer) stepDonation(from PeerName, m *Donation) error {
	if p.ask != nil && p.ask.id == m.ID {
		p.ask = nil
		clear(p.tried)
		p.trail.donated++
		p.trail.last = fmt.Sprintf("%s gave space", from)
	}
	if err := p.mergeRing(m.Ring, string(from)); err != nil {
		return err
	}
	p.serve()
	return nil
}

func (p *Peer) stepDenial(from PeerName, m *Denial) {
	if p.ask == nil || p.ask.id != m.ID || p.ask.donor != from {
		return
	}
	p.tried[from] = true
	p.ask = nil
	p.trail.denied++
	p.trail.last = fmt.Sprintf("%s had none to give", from)
	p.askDonation()
}

// trailString says what this peer's requests for space met, and how much
// free space its ring shows at live peers.
func (p *Peer) trailString() string {
	var free uint64
	var at int
	for _, s := range p.a.ring.Shares() {
		if s.Free > 0 && p.live(s.Peer) {
			free += s.Free
			at++
		}
	}
	t := p.trail
	return fmt.Sprintf("asked for space %d times: %d denied, %d unanswered, %d donations (last: %s); %d times no live peer with free space was left to ask; its ring shows %d free addresses at %d live peers, of %d live peers it knows",
		t.asked, t.denied, t.unanswered, t.donated, cmp.Or(t.last, "none"), t.noDonor, free, at, len(p.livePeers()))
}
