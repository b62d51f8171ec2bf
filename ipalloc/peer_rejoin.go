package ipalloc

import (
	"fmt"
	"math"
	"slices"
	"strings"
)

// Rejoin: a peer that starts without a ring on disk cannot tell a first
// start from a restart after its disk was lost. If it kept its name, the
// cluster's ring may name it as the owner of ranges its lost self has
// changed since (allocated from, given away, split): its seed claim
// (seed=...) or the ring it is sent would let it hand out addresses that
// another peer holds, and a version of its own entries that clashes with
// one its lost self sent. So such a peer holds back:
//
//   - its entries are frozen (Allocator.frozen): it writes no free count,
//     and it takes a ring that moves its ranges to another peer, since its
//     lost self may have given them;
//   - it allocates nothing, gives no donation, re-claims nothing it found
//     on the node (HoldFound) and completes no reclaim, until it has merged
//     a claimed ring from every other owner in its ring that is not
//     removed, and from every live peer it knows (a donation of its lost
//     self may be known only to the peer it went to), since it started,
//     and from one live peer at least (the owners of its own
//     seed claim need not be the ring's owners any more; they may even
//     all be removed). Every change its lost self made to its ranges went to the
//     peer it concerned (a donation to its new owner) or was only a free
//     count; so it then knows every range it really owns.
//
// Then it writes its free counts with a jump of rejoinVersionJump over the
// highest version it has seen, so that a free count of its lost self that
// only a peer outside the ring's owners saw (an observer) loses. At a
// first start the same holds: the seed peers (or the consensus value's
// peers) allocate once they have heard from each other.
//
// An owner that is down holds the rejoin until it is back, or is removed
// (weft rmpeer): a removed peer is not waited for. A lone peer
// (consensus=1, or seed= itself alone) need hear from no peer before it
// allocates: it waits only for the peers it knows.

// rejoinVersionJump is how far a rejoined peer's entries jump.
const rejoinVersionJump = 1 << 10

// rejoining reports whether this peer holds back (see above).
func (p *Peer) rejoining() bool { return p.rejoin }

// rejoinWaits lists the owners this peer still waits for, sorted.
func (p *Peer) rejoinWaits() []PeerName {
	if !p.rejoin || p.a.ring.Empty() {
		return nil
	}
	// Every owner that is not removed (one whose ring is refused as
	// seeded apart too: this peer may have started in the wrong ring),
	// and every live peer it knows: a donation of its lost self may be
	// known only to the peer it went to.
	wait := map[PeerName]bool{}
	owners := map[PeerName]bool{}
	for _, q := range p.a.ring.Peers() {
		if _, gone := p.removed[q]; !gone && q != p.cfg.Self {
			wait[q] = true
			owners[q] = true
		}
	}
	for _, q := range p.livePeers() {
		wait[q] = true
	}
	owns := p.rejoinOwns()
	if owns {
		// And every member: a peer that got a donation from its lost
		// self and owns nothing else is in no ring that survived, and may
		// be down or cut off now (make test-long's wipe seeds 4238, 5481).
		for q := range p.members {
			if p.inBarrier(q) {
				wait[q] = true
			}
		}
	}
	var out []PeerName
	for q := range wait {
		if !p.ringPeers[q] || (owns && (owners[q] || p.external[q]) && !p.membersFrom[q]) {
			out = append(out, q)
		}
	}
	slices.Sort(out)
	return out
}

// Members while rejoining. A peer that starts without state and finds
// ranges of its own in the ring it learns must hear from every peer its
// lost self may have given some of them to. The ring's owners and the
// live peers its mesh shows it are not all of those: a peer that got a
// donation and owns nothing else is an owner only in rings that nobody
// alive may hold, and while it is down or cut off the mesh does not show
// it. Every peer that ever shared the ring knows it as a member, on disk
// (peer_removal.go). So the rejoining peer asks every peer it waits for
// for its members (Members with Ask, at once when it merges that peer's
// ring, and again every Timing.RemoveRetry ticks until answered), adds
// each to its own members, and waits for a ring from each of them too.
// It waits for the answer of every owner in its ring (each saw every
// peer that joined the mesh while it was up; a peer that is not an owner
// need not answer, so that one that only forges rings cannot hold it back
// for good). A member that is gone for good holds
// it until it is removed (weft rmpeer), as an owner does; a peer of a weft
// before this never answers, so during a rolling upgrade such a rejoin
// waits until the peers it asks are upgraded. A peer that owns nothing in
// its ring gets space only as a donation, which is safe: it asks nobody.

// Members kept outside. The members a rejoin waits for are those some
// peer it hears has on disk; a peer that got a donation from this peer's
// lost self is among them only if a peer that knew of it is up. When
// every peer that knew is down (the seed of make test-long's 11495 lost
// its disk while the two peers that knew the ring were down, and heard only
// a joiner as new as itself), nothing reachable names it, and the rejoin
// ends on the first claim: two owners of one range. In --kube mode the
// cluster keeps its members outside every peer (the ConfigMap's
// registered peers), so there a rejoin that owns ranges also waits until
// they have been read once since it started (SetExternalMembers): each
// is then a member the hold waits for, as any member is, until it is back
// or removed (the Node's deletion). The router reads them at start and
// then every 30 s; without this wait, a read that failed or came late
// (the API server unreachable while the node restarts) let the hold end
// on what the mesh showed alone.

// Registered first. A peer that gets space from another (a donation, or
// the addresses its pods use given on a Want) is from then on something
// the giver's state alone records: if the giver loses its disk while the
// peer is down, a rejoin finds it only through the members kept outside
// (above). So with ExternalMembers a peer asks for space only once the
// members given name it: its router registered it in the ConfigMap before
// it asks. The router registers as it starts, and the first space a
// joiner asks for is its bridge's gateway, at once, so without this its
// first donation usually came before the registration (a router that
// cannot write the ConfigMap then asks for none, and its status says
// why). Space that comes without asking (the first claim, an heir's
// handover, a takeover's hand-on of reported addresses) is not held back.

// unregistered reports whether this peer may not ask for space yet: the
// members kept outside, read since it started, do not name it.
func (p *Peer) unregistered() bool {
	return p.cfg.ExternalMembers && !p.external[p.cfg.Self]
}

// SetExternalMembers gives the members kept outside this peer (the
// ConfigMap's registered peers), all of them: each becomes a member (this
// peer itself is not, but once it is named it may ask for space), and a
// hold that waited for them may end.
func (p *Peer) SetExternalMembers(qs []PeerName) error {
	for _, q := range qs {
		if err := ValidatePeerName(q); err != nil {
			return fmt.Errorf("ipalloc: member %w", err)
		}
	}
	first := p.external == nil
	if first {
		p.external = map[PeerName]bool{}
	}
	wasUnregistered := p.unregistered()
	for _, q := range qs {
		if q == p.cfg.Self {
			p.external[q] = true
			continue
		}
		_ = p.AddMember(q) // validated above (every read: the barrier's reminders)
		if !p.external[q] {
			p.external[q] = true
			if p.ringPeers[q] {
				p.askMembers(q) // its ring came first: its answer now
			}
		}
	}
	if first {
		p.completeReclaims() // checkRejoin, while it holds
	}
	if wasUnregistered && !p.unregistered() {
		p.askDonation()
		p.askFound()
	}
	return nil
}

// externalWait reports whether a rejoin that owns ranges still waits for
// the members kept outside: none given since start.
func (p *Peer) externalWait() bool {
	return p.cfg.ExternalMembers && p.external == nil && p.rejoinOwns()
}

// rejoinOwns reports whether this peer holds back while its ring gives it
// ranges: then it waits for every member too.
func (p *Peer) rejoinOwns() bool {
	return p.rejoin && slices.Contains(p.a.ring.Peers(), p.cfg.Self)
}

// askMembers asks q for its members if q is an owner whose ring this
// peer just merged (Step), while its rejoin waits for them.
func (p *Peer) askMembers(q PeerName) {
	if p.rejoinOwns() && (slices.Contains(p.a.ring.Peers(), q) || p.external[q]) {
		p.askOwnerMembers(q)
	}
}

// askAllMembers asks again every owner whose ring this peer merged and
// whose members it has not had yet (every Timing.RemoveRetry ticks).
func (p *Peer) askAllMembers() {
	if !p.rejoinOwns() {
		return
	}
	for _, q := range p.a.ring.Peers() {
		if p.ringPeers[q] {
			p.askOwnerMembers(q)
		}
	}
	for q := range p.external {
		if p.ringPeers[q] {
			p.askOwnerMembers(q)
		}
	}
}

// askOwnerMembers sends owner q a Members ask, at most once every
// Timing.RemoveRetry ticks, until q has answered.
func (p *Peer) askOwnerMembers(q PeerName) {
	if q == p.cfg.Self || p.membersFrom[q] || !p.live(q) || !p.retryDue(&p.membersAskAt, q) {
		return
	}
	p.send(q, &Members{Ask: true, Peers: p.memberList()})
}

// memberList lists the members this peer knows that it does not record
// as removed, sorted.
func (p *Peer) memberList() []PeerName {
	var out []PeerName
	for q := range p.members {
		if _, gone := p.removed[q]; !gone && q != p.cfg.Self {
			out = append(out, q)
		}
	}
	slices.Sort(out)
	if len(out) > maxWireValue {
		out = out[:maxWireValue]
	}
	return out
}

// stepMembers records the members from knows, and answers an Ask with
// this peer's own.
func (p *Peer) stepMembers(from PeerName, m *Members) {
	for _, q := range m.Peers {
		if ValidatePeerName(q) == nil {
			p.addMember(q)
		}
	}
	if m.Ask {
		p.send(from, &Members{Peers: p.memberList(), InUse: p.unownedFound()})
		return
	}
	if len(m.InUse) > 0 {
		// The answer ends this peer's wait for from: what from's node
		// uses must be known before the hold ends, not after a Want of
		// its own that may come later or be lost (make test-long's seed
		// 5585: every disk lost, and the asker's first allocation after
		// the hold took an address a pod of from's node used).
		p.stepWant(from, &Want{Addrs: m.InUse})
	}
	if p.membersFrom == nil {
		p.membersFrom = map[PeerName]bool{}
	}
	p.membersFrom[from] = true
	p.checkRejoin()
}

// heardLive reports whether this peer merged a claimed ring from a live
// peer since it started (or needs none: a lone peer).
func (p *Peer) heardLive() bool {
	if p.cfg.Init.Consensus == 1 || slices.Equal(p.cfg.Init.Seeds, []PeerName{p.cfg.Self}) {
		return true
	}
	for q := range p.ringPeers {
		if p.live(q) {
			return true
		}
	}
	return false
}

// checkRejoin ends the hold once nothing is waited for.
func (p *Peer) checkRejoin() {
	if !p.rejoin || p.a.ring.Empty() || len(p.rejoinWaits()) > 0 || !p.heardLive() || p.removedErr() != nil || p.externalWait() {
		// A removed peer stays frozen: its entries are its reclaimer's.
		return
	}
	p.rejoin = false
	p.a.frozen = false
	p.ringDirty = true // with the Ready that says it no longer holds back
	owns := false
	for i := range p.a.ring.Entries {
		if e := &p.a.ring.Entries[i]; e.Peer == p.cfg.Self {
			owns = true
			if e.Version > math.MaxUint32-2*rejoinVersionJump {
				p.event(true, "ipalloc: ring entry %s: version %d cannot grow any more", e.Token, e.Version)
				continue
			}
			e.Version += rejoinVersionJump
		}
	}
	if err := p.a.SetRing(p.a.ring); err != nil {
		p.event(true, "ipalloc: after the rejoin: %v", err)
	}
	if owns {
		p.ringChanged(true)
		p.event(false, "ipalloc: heard from every owner of the ring since start; allocating from the ranges this peer owns")
	}
	p.holdFound()
	p.completeReclaims()
	p.serveHeldWants()
	p.serve()
}

// rejoinStatus is the status line part of a holding peer.
func (p *Peer) rejoinStatus() string {
	w := p.rejoinWaits()
	why := "started without state"
	if p.stale != "" {
		why = "its saved state is older than what the peers know (" + p.stale + ")"
	}
	if p.externalWait() {
		return why + ": waiting for the peers registered in the cluster's records (in --kube mode the ConfigMap) before allocating: " +
			"one of them may hold what this peer's lost state gave away; if this lasts, check that the router can read the ConfigMap (its log says why not)"
	}
	if len(w) == 0 && p.rejoin && !p.a.ring.Empty() {
		return why + ": waiting for the ring from a peer before allocating"
	}
	if len(w) == 0 {
		return ""
	}
	return fmt.Sprintf("%s: waiting to hear from every other owner of the ring (%s) before allocating; "+
		"if one of them is gone for good, run 'weft rmpeer NAME' for it on this node", why, strings.Join(names(w), ", "))
}

// Pulling the rings a hold waits for. A hold ends on a claimed ring from
// each peer it waits for, and those rings come unasked: the first claim
// shown (showClaim), the ring a peer sends to each peer it learns of
// (AddPeer), broadcasts of news, the mesh's push-pulls. Any of them may be
// lost, and the push-pull brings a given peer's ring only when that peer
// is the one picked (one in N every 30 s to 3 min). So once a hold has
// lasted a donation retry, the holding peer pulls: every Timing.
// DonationRetry ticks it sends an empty Want (a ring pull, peer_found.go)
// to at most holdPullFanout of the live peers whose ring it still waits
// for, in turn, and each answers with its ring, holding or not. That
// replaces the donation a holding peer used to ask for only to get a
// donor's ring (peer_donate.go).
const holdPullFanout = 8

// holdRingWaits lists the live peers whose claimed ring this holding peer
// has not merged since it started and waits for, sorted.
func (p *Peer) holdRingWaits() []PeerName {
	var w []PeerName
	switch {
	case p.rejoin:
		w = p.rejoinWaits()
	case p.startHold:
		w = p.startWaits()
	}
	var out []PeerName
	for _, q := range w {
		if q != p.cfg.Self && !p.ringPeers[q] && p.live(q) {
			out = append(out, q)
		}
	}
	return out
}

// holdOwns reports whether this peer's ring gives it ranges.
func (p *Peer) holdOwns() bool { return slices.Contains(p.a.ring.Peers(), p.cfg.Self) }

// pullHoldRings pulls the rings a lasting hold waits for (above).
func (p *Peer) pullHoldRings() {
	if !p.rejoin && !p.startHold || p.a.ring.Empty() || p.leave != nil || p.removedErr() != nil {
		return
	}
	retry := int64(p.cfg.Timing.DonationRetry)
	if !p.pullSet {
		p.pullAt, p.pullSet = p.now+retry, true
	}
	if p.now < p.pullAt {
		return
	}
	p.pullAt = p.now + retry
	to := p.holdRingWaits()
	if len(to) > holdPullFanout {
		start := p.pullNext % len(to)
		to = slices.Concat(to[start:], to[:start])[:holdPullFanout]
		p.pullNext = start + holdPullFanout
	}
	for _, q := range to {
		p.send(q, &Want{})
	}
}
