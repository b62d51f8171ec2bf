package ipalloc

import (
	"fmt"
	"slices"
	"strings"
)

// A stale disk: the state a peer loads may be older than what it told the
// others before it stopped (a backup restored over a newer state, a VM
// snapshot rolled back). Its ring then says it owns ranges it gave away
// since, its allocations miss addresses it handed out since, and its
// entries' versions are lower than what its lost self sent.
//
//   - The start hold: a peer that starts with a ring on disk allocates
//     nothing, gives no donation, re-claims nothing found on the node,
//     completes no reclaim and writes no free count (a version of its own
//     that may clash with one its lost self sent), until it has merged a
//     claimed ring from a live peer since it started (heardLive), unless
//     it is a lone peer (lone). An allocation waits meanwhile, with its
//     deadline.
//   - Detection (staleReason): a ring in which this peer's own entries
//     show a change it never made (a newer version of an entry it owns,
//     the same version with other content, a range it owns given to
//     another peer at a version a donation makes, a range of its own with
//     addresses in use that it does not hold) can only come from its lost
//     self: only the owner changes its entries, and it saves every change
//     before it sends it. Such a peer knows its disk is stale, logs it,
//     drops its saved allocations and becomes a peer whose disk was lost
//     (peer_rejoin.go): frozen entries, no allocation, until it has heard
//     from every other owner and every live peer; then it re-claims only
//     the addresses its pods still use (HoldFound) and jumps its versions.
//
// What no peer saw cannot be detected: then nothing was handed out from it
// that any other peer knows, and the addresses its pods got after the
// backup are protected only by HoldFound (the shell hands the core what it
// finds on the node at every start; the found addresses that the saved
// state does not hold are held once the start hold ends).

// lone reports whether this peer has nobody to hear from: consensus=1,
// seed= itself alone, or every other peer it knows of is removed.
func (p *Peer) lone() bool {
	if p.cfg.Init.Consensus == 1 || slices.Equal(p.cfg.Init.Seeds, []PeerName{p.cfg.Self}) {
		return true
	}
	for q := range p.members {
		if p.live(q) {
			return false
		}
	}
	for q := range p.known {
		if p.live(q) {
			return false
		}
	}
	for _, q := range p.a.ring.Peers() {
		if p.live(q) {
			return false
		}
	}
	return true
}

// checkStartHold ends the start hold once a live peer has shown this peer
// the ring.
func (p *Peer) checkStartHold() {
	if !p.startHold || p.rejoin {
		return
	}
	if !p.lone() && (!p.heardLive() || len(p.startWaits()) > 0) {
		return
	}
	p.endStartHold()
}

// startWaits lists the live peers this peer knows whose ring it has not
// merged since it started, sorted.
func (p *Peer) startWaits() []PeerName {
	var out []PeerName
	for _, q := range p.livePeers() {
		if !p.ringPeers[q] {
			out = append(out, q)
		}
	}
	return out
}

func (p *Peer) endStartHold() {
	p.startHold, p.a.noFree = false, false
	if p.a.refreshFree() {
		p.ringChanged(false)
	}
	p.holdFound()
	p.completeReclaims()
	p.serveHeldWants()
	p.serve()
}

// checkStale looks for signs in r (a ring from outside) that this peer's
// saved state is older than what its lost self told the others, and if so
// makes it a peer whose disk was lost.
func (p *Peer) checkStale(r *Ring, from string) {
	if p.rejoin || p.leave != nil || p.removedErr() != nil || p.a.ring.Empty() || r == nil || r.Seed != p.a.ring.Seed || r.Universe != p.a.ring.Universe {
		return
	}
	why := p.staleReason(r)
	if why == "" {
		return
	}
	// What this peer knows to be in use stays held: the addresses it
	// handed out since it started, and those the node shows in use by the
	// pod they are saved for. Only the records that nothing but the saved
	// state vouches for are dropped (a pod deleted after the backup; its
	// range may have been given away since). A ring that takes a range
	// holding a kept address is not taken for a sign of a stale state: it
	// is refused (Allocator.Merge), as from any peer that lies, so that
	// one forged ring makes no peer drop what its pods use, or hold back.
	kept := func(al Allocation) bool {
		if a, ok := p.nodeFound[al.Key]; ok && a == al.Address {
			return true
		}
		return p.since[al.Key]
	}
	if lost := p.a.lostBy(r); len(lost) > 0 {
		for _, al := range p.a.Allocations() {
			for _, rg := range lost {
				if rg.Contains(al.Address) && kept(al) {
					p.event(true, "ipalloc: the ring from %s shows %s, as from this peer's lost self (a restored backup?), "+
						"but it gives away %s, where %s holds %s, in use on this node: refused",
						from, why, rg, al.Key, al.Address)
					return
				}
			}
		}
	}
	where := p.cfg.StateName
	if where == "" {
		where = "the saved state"
	}
	p.stale = fmt.Sprintf("the ring from %s shows %s", from, why)
	dropped := 0
	for _, al := range p.a.Allocations() {
		if !kept(al) {
			dropped++
		}
	}
	p.event(true, "ipalloc: the state in %s is older than what peers know of this node (a restored backup, or a lost disk that this peer refilled with the first claim alone?): %s. "+
		"This peer now holds back as one whose state was lost: of its %d allocations it keeps the %d in use on the node or handed out since it started, "+
		"drops the %d others until it knows its ranges, and allocates once it has heard from every other owner of the ring and every live peer",
		where, p.stale, len(p.a.byKey), len(p.a.byKey)-dropped, dropped)
	p.a.frozen, p.a.noFree = true, false // no free count of its own from now on
	// A saved record is held again once its hold ends, in the ranges it
	// really owns, unless the node shows another pod using its address.
	if p.found == nil {
		p.found = map[Key]Address{}
	}
	for _, al := range p.a.Allocations() {
		if kept(al) {
			continue
		}
		if _, ok := p.a.Release(al.Key); ok {
			p.rd.Allocs = append(p.rd.Allocs, AllocChange{Key: al.Key, Address: al.Address})
		}
		if _, ok := p.nodeFound[al.Key]; !ok {
			// A pod of the saved state, which may still run (the node
			// shows only the pods that talked to their gateway).
			p.found[al.Key] = al.Address
			if p.foundSaved == nil {
				p.foundSaved = map[Key]bool{}
			}
			p.foundSaved[al.Key] = true
		}
	}
	for k, a := range p.nodeFound {
		if _, ok := p.a.Lookup(k); !ok {
			p.found[k] = a
		}
	}
	// Its own entries that clash with its lost self's (the same version,
	// other content) give way: the lost self's went out first.
	own := p.a.Ring()
	for i := range own.Entries {
		e := &own.Entries[i]
		if e.Peer != p.cfg.Self {
			continue
		}
		if t, ok := r.entryAt(e.Token); ok && t.Version == e.Version && t != *e {
			*e = t
		}
	}
	if err := p.a.SetRing(own); err != nil {
		p.event(true, "ipalloc: stale state: %v", err)
	}
	p.startHold, p.rejoin, p.rejoinSaved = false, true, false
	p.ringDirty, p.broadcast = true, true
	p.holdAskSet = false
}

// entryAt returns r's entry whose token is t.
func (r *Ring) entryAt(t Address) (Entry, bool) {
	i, ok := slices.BinarySearchFunc(r.Entries, t, func(e Entry, t Address) int {
		switch {
		case e.Token < t:
			return -1
		case e.Token > t:
			return 1
		}
		return 0
	})
	if !ok {
		return Entry{}, false
	}
	return r.Entries[i], true
}

// staleReason says what in r only this peer's lost self can have written
// (empty: nothing).
func (p *Peer) staleReason(r *Ring) string {
	var why []string
	mine := p.a.ring
	for _, e := range mine.Entries {
		if e.Peer != p.cfg.Self || len(why) >= 3 {
			continue
		}
		t, ok := r.entryAt(e.Token)
		switch {
		case !ok || t.Version < e.Version:
		case t.Version == e.Version && t != e:
			why = append(why, fmt.Sprintf("its entry %s at version %d with other content (%s, %d free; here %d free)", e.Token, e.Version, t.Peer, t.Free, e.Free))
		case t.Version > e.Version && t.Peer == p.cfg.Self:
			why = append(why, fmt.Sprintf("its entry %s at version %d (here %d)", e.Token, t.Version, e.Version))
		case t.Version > e.Version && t.Version-e.Version < reclaimVersionJump/2:
			// A reclaim jumps by reclaimVersionJump: that is a removal,
			// which Merge refuses as a takeaway (takenOver). A smaller
			// step is a donation this peer has no record of.
			why = append(why, fmt.Sprintf("%s given to %s at version %d (here its own at %d)", e.Token, t.Peer, t.Version, e.Version))
		}
	}
	// A range given to this peer in which addresses are in use that it
	// does not hold: its lost self allocated there (a donation gives a
	// range with every address free).
	for j, t := range r.Entries {
		if t.Peer != p.cfg.Self || len(why) >= 3 {
			continue
		}
		i := mine.index(t.Token)
		if e := mine.Entries[i]; e.Peer == p.cfg.Self || e.Token == t.Token && e.Version >= t.Version {
			continue
		}
		rg := r.rangeOf(j)
		free := uint64(rg.Size())
		for _, a := range []Address{r.Universe.Start, r.Universe.End - 1} {
			if rg.Contains(a) {
				free--
			}
		}
		if uint64(t.Free) < free {
			why = append(why, fmt.Sprintf("%s as its own with %d addresses in use that it has no record of", rg, free-uint64(t.Free)))
		}
	}
	return strings.Join(why, "; ")
}

// noteSince records that k was allocated since this peer started.
func (p *Peer) noteSince(k Key) {
	if p.since == nil {
		p.since = map[Key]bool{}
	}
	p.since[k] = true
}

// startHoldStatus is the status line part of a peer in its start hold.
func (p *Peer) startHoldStatus() string {
	if !p.startHold {
		return ""
	}
	if w := p.startWaits(); len(w) > 0 {
		return fmt.Sprintf("started with state: waiting for the ring from every live peer (%s) before allocating, in case its state is older than what they know",
			strings.Join(names(w), ", "))
	}
	return "started with state: waiting for the ring from a live peer before allocating, in case its state is older than what the peers know; " +
		"if every other peer is gone for good, run 'weft rmpeer NAME' for each on this node"
}
