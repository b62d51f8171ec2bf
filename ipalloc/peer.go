package ipalloc

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
)

// Peer is the whole IPAM state of one peer as a pure state machine, in the
// shape of etcd's raft.Node: the shell feeds it messages (Step), time (Tick)
// and requests (Allocate, Release, PeerGone), and takes what it produced
// with Ready. There are no goroutines, clocks, logging, disk or network
// inside, and every input is deterministic (randomness comes from
// PeerConfig.Rand), so a simulation can replay any schedule.
//
// The contract with the shell, for every Ready, in order:
//
//  1. Persist: Ready.Ring, Ready.Paxos, Ready.Removed (with
//     Ready.Reclaimed), Ready.Members, Ready.Rejoin and Ready.Allocs, in one transaction (HardState.Apply shows what that means). If that
//     fails, drop this Peer and build a new one from what is on disk: never
//     send or answer what was not saved.
//  2. Send: Ready.Broadcast to every peer (gossip), Ready.Messages to their
//     peers. Losing, delaying, duplicating or reordering them is fine.
//  3. Answer: Ready.Answers to the callers of Allocate; log Ready.Events.
//
// Gossip() is the ring to offer in a full-state exchange (memberlist's
// push-pull): the ring of the last Ready, which step 1 made durable, never
// the live one, which may hold changes not yet on disk.
//
// A Peer is not safe for concurrent use: the shell serialises calls.
type Peer struct {
	cfg PeerConfig
	rng *rand.Rand
	a   *Allocator
	px  *Paxos // consensus peers, until the ring is claimed

	now     int64
	known   map[PeerName]bool     // peers this one knows of (not self)
	removed map[PeerName]PeerName // removed peer -> the peer that reclaims it (self too: see peer_removal.go)

	// The durable barrier (peer_removal.go): every peer that shares this
	// ring as far as this one ever learned, kept on disk.
	members      map[PeerName]bool
	membersDirty bool
	reclaimed    map[PeerName]bool              // reclaims of this peer's that took over (on disk): no withdrawal any more
	withdrawing  map[PeerName]map[PeerName]bool // removals withdrawn -> the peers that acknowledged
	told         map[PeerName]int64             // removed peers heard from -> when they were told (ticks)
	toldBy       map[PeerName]int64             // removed peers whose reclaimer was reminded -> when (ticks)

	// Reclaims this peer runs: acks from live peers per removed peer.
	acks        map[PeerName]map[PeerName]bool
	removeTimer int
	reported    map[PeerName]bool // reclaims logged since start

	pending []pendingAlloc

	// Donations asked for.
	ask      *donationAsk
	tried    map[PeerName]bool // donors that denied or timed out this round
	askAfter int64             // no new request before this tick
	trail    donationTrail     // what the requests met since allocations began to wait
	// holdAskAt: while holding back (rejoin), no request before this tick.
	holdAskAt  int64
	holdAskSet bool
	// pullAt: while holding back, the next pull of the rings it waits
	// for; pullNext: where that pull starts among them (peer_rejoin.go).
	pullAt   int64
	pullSet  bool
	pullNext int
	// Donations given: the last request id served per requester.
	served map[PeerName]uint64

	// Output not yet handed out by Ready.
	rd           Ready
	ringDirty    bool // persist the ring
	paxosPending bool
	removedDirty bool
	broadcast    bool // gossip the ring now
	freeGossip   bool // gossip the ring at the next tick (free counts changed)
	lastOwned    []Range
	gossip       *Ring // the ring of the last Ready

	leave     *leaving          // weft reset: set once this peer left
	leftDirty bool              // persist leave.heir
	ringPeers map[PeerName]bool // peers whose (claimed) ring this one merged: they share its seed
	// foreign are peers whose ring was refused as seeded apart (a split
	// cluster): they are not live peers of this ring. Soft state: a split
	// ring is refused again on every gossip.
	foreign   map[PeerName]bool
	departed  map[PeerName]bool // peers that left and handed their ranges here (since start)
	found     map[Key]Address   // addresses in use on the node, to hold once owned (HoldFound)
	foundWarn map[Key]bool      // found addresses reported as another peer's
	refused   map[string]int64  // refusal reported -> when (ticks)
	// rejoin: started without a ring, and has not yet heard from every
	// owner of its ring (peer_rejoin.go): it holds back.
	rejoin      bool
	rejoinSaved bool // the disk says it holds back
	// external: the members kept outside given by SetExternalMembers
	// (registered peers); nil until the first call since start.
	external map[PeerName]bool
	// startHold: started with a ring on disk, and has not yet merged a
	// claimed ring from a live peer since (peer_stale.go): its disk may
	// be older than what the peers know of it, so it holds back.
	startHold  bool
	stale      string            // why its saved state was found older than what a peer knows (peer_stale.go); empty: it was not
	unseenSaid bool              // ringUnseen has said why no reclaim completes
	staleSaid  map[PeerName]bool // staleFor has said why the takeover of this peer waits
	nodeFound  map[Key]Address   // what HoldFound showed in use on the node, less what was released since
	since      map[Key]bool      // keys allocated (or held as found) since this peer started
	// foundSaved: found entries that are allocations of a saved state
	// found stale, not pods the node showed.
	foundSaved map[Key]bool
	fromState  bool // started with a ring on disk
	// want: found addresses asked for from their owners (peer_found.go).
	wantAt    map[PeerName]int64
	heldWants map[PeerName][]Address // the last Want of each peer while this one held back (peer_found.go)
	// ackInUse: for each peer this one removes, the addresses that each
	// acknowledger reported in use on its node (RemoveAck.InUse), handed
	// to it when the reclaim completes (peer_found.go).
	ackInUse map[PeerName]map[PeerName][]Address
	// membersFrom: peers whose members this peer merged since it started;
	// membersAskAt: when it last asked each (peer_rejoin.go).
	membersFrom  map[PeerName]bool
	membersAskAt map[PeerName]int64
	// askRemovedNext: where the next AskRemoved round starts among the
	// peers it asks (peer_removal.go).
	askRemovedNext int
}

// reportAgainAfter is how long (in ticks: 10 minutes with DefaultTiming's
// tick) the same refusal of the same peer's ring is not logged again: a
// split ring is refused on every gossip.
const reportAgainAfter = 6000

// RefusedRing wraps the error for a ring this peer refused to merge. The
// refusal is in the Ready's Events already (the same one at most once
// every reportAgainAfter ticks), so the shell need not log it again.
type RefusedRing struct{ Err error }

func (e *RefusedRing) Error() string { return e.Err.Error() }
func (e *RefusedRing) Unwrap() error { return e.Err }

// reportRefusal logs that the ring from from was refused, unless the same
// refusal was logged lately.
func (p *Peer) reportRefusal(from string, err error) {
	p.reportOnce(fmt.Sprintf("ipalloc: refused the ring from %s: %v", from, err))
}

// reportOnce logs text as a warning, unless it was logged lately.
func (p *Peer) reportOnce(text string) {
	if at, ok := p.refused[text]; ok && p.now-at < reportAgainAfter {
		return
	}
	if p.refused == nil || len(p.refused) > 1000 {
		p.refused = map[string]int64{}
	}
	p.refused[text] = p.now
	p.event(true, "%s", text)
}

// retryDue reports whether this peer may send to q again under the record
// *at (peer -> tick of the last send), at most once every
// Timing.RemoveRetry ticks, and records the send if so. The record only
// spaces sends: past maxWireValue peers it starts afresh.
func (p *Peer) retryDue(at *map[PeerName]int64, q PeerName) bool {
	if t, ok := (*at)[q]; ok && p.now-t < int64(p.cfg.Timing.RemoveRetry) {
		return false
	}
	if *at == nil || len(*at) > maxWireValue {
		*at = map[PeerName]int64{}
	}
	(*at)[q] = p.now
	return true
}

type pendingAlloc struct {
	key      Key
	deadline int64
}

// donationTrail is what this peer's requests for space met since an
// allocation last began to wait with none before it: an allocation that
// waits too long says it in its error, for the operator (and a failing
// test) to see why no space came.
type donationTrail struct {
	asked, denied, unanswered, donated, noDonor int
	last                                        string
}

type donationAsk struct {
	id     uint64
	donor  PeerName
	sentAt int64
}

// Init is how the first claim of the ring is made (--ipalloc-init). Set
// exactly one of its fields.
type Init struct {
	// Consensus is N of consensus=N: Paxos among the N peers that start the
	// cluster, with a quorum of N/2+1.
	Consensus int
	// Seeds (seed=a,b,c) builds the ring shared by these peers at once, with
	// no vote; every peer given the same list builds the same ring.
	Seeds []PeerName
	// Observer never claims and never votes: it gets space by donation only.
	Observer bool
}

func (in Init) validate() error {
	n := 0
	if in.Consensus > 0 {
		n++
	}
	if len(in.Seeds) > 0 {
		n++
	}
	if in.Observer {
		n++
	}
	if n != 1 || in.Consensus < 0 {
		return errors.New("--ipalloc-init: give exactly one of consensus=N, seed=a,b,c or observer")
	}
	for _, s := range in.Seeds {
		if err := ValidatePeerName(s); err != nil {
			return fmt.Errorf("--ipalloc-init seed: %w", err)
		}
	}
	if in.Consensus > maxWireValue {
		return fmt.Errorf("--ipalloc-init consensus=%d: at most %d", in.Consensus, maxWireValue)
	}
	return nil
}

// Timing is the core's sense of time, in ticks (the shell decides how long
// a tick is; DefaultTiming assumes 100 ms).
type Timing struct {
	PaxosRetry    int // a Paxos proposer tries again after this (plus up to as much jitter)
	PaxosPatience int // a proposer waits this long to hear from all N before proposing with a quorum
	DonationRetry int // a donation request unanswered this long goes to the next donor
	AllocDeadline int // an allocation waits this long for space, then fails
	RemoveRetry   int // a Remove unacknowledged this long is sent again
	GossipEvery   int // free counts changed are gossiped at most this often
}

// DefaultTiming is for a tick of 100 ms.
var DefaultTiming = Timing{
	PaxosRetry:    20,
	PaxosPatience: 50,
	DonationRetry: 20,
	AllocDeadline: 300,
	RemoveRetry:   30,
	GossipEvery:   10,
}

// PeerConfig configures a Peer.
type PeerConfig struct {
	Self     PeerName
	Universe Range
	Init     Init
	Peers    []PeerName // peers known at start (the mesh's members); more with AddPeer
	Timing   Timing     // zero fields take DefaultTiming's
	Rand     *rand.Rand // jitter and request ids; nil: seeded from Self
	// StateName names where the state is kept, for the log (the state
	// file); empty: "the saved state".
	StateName string
	// ExternalMembers says that the peers which share the ring are also
	// recorded outside this peer (the Kubernetes ConfigMap's registered
	// peers in --kube mode): a hold of a peer that started without state
	// and owns ranges does not end before they have been given once since
	// it started (SetExternalMembers). See peer_rejoin.go. Nor does
	// this peer ask for space (a donation, or a Want of the addresses
	// its pods use) before the members given name it: see
	// unregistered (peer_rejoin.go).
	ExternalMembers bool
}

// HardState is everything a Peer keeps on disk. Apply keeps one up to date
// from Ready; NewPeer resumes from one.
type HardState struct {
	Ring        *Ring
	Paxos       PaxosState
	Removed     map[PeerName]PeerName // removed peer -> its reclaimer
	Reclaimed   []PeerName            // removed peers whose ranges this peer took over
	Withdrawn   []PeerName            // removals this peer withdrew that not every member has confirmed
	Members     []PeerName            // the peers that share this ring, sorted (the barrier of a reclaim)
	Allocations map[Key]Address
	Left        PeerName // the heir, once this peer has left the cluster (weft reset)
	Rejoin      bool     // it started without a ring and holds back still (peer_rejoin.go)
}

// Apply records what rd says to persist.
func (h *HardState) Apply(rd Ready) {
	if rd.Ring != nil {
		h.Ring = rd.Ring.Clone()
	}
	if rd.Paxos != nil {
		h.Paxos = *rd.Paxos
		h.Paxos.Value = slices.Clone(rd.Paxos.Value)
	}
	if rd.Removed != nil {
		h.Removed = maps.Clone(rd.Removed)
		h.Reclaimed = slices.Clone(rd.Reclaimed)
		h.Withdrawn = slices.Clone(rd.Withdrawn)
	}
	if rd.Members != nil {
		h.Members = slices.Clone(rd.Members)
	}
	if rd.Left != "" {
		h.Left = rd.Left
	}
	if rd.Rejoin != nil {
		h.Rejoin = *rd.Rejoin
	}
	if len(rd.Allocs) > 0 && h.Allocations == nil {
		h.Allocations = map[Key]Address{}
	}
	for _, c := range rd.Allocs {
		if c.Held {
			h.Allocations[c.Key] = c.Address
		} else {
			delete(h.Allocations, c.Key)
		}
	}
}

// Clone returns a deep copy.
func (h HardState) Clone() HardState {
	c := HardState{Paxos: h.Paxos, Removed: maps.Clone(h.Removed), Allocations: maps.Clone(h.Allocations), Left: h.Left,
		Reclaimed: slices.Clone(h.Reclaimed), Withdrawn: slices.Clone(h.Withdrawn), Members: slices.Clone(h.Members), Rejoin: h.Rejoin}
	c.Paxos.Value = slices.Clone(h.Paxos.Value)
	if h.Ring != nil {
		c.Ring = h.Ring.Clone()
	}
	return c
}

// Ready is the output of a Peer: persist, then send, then answer.
type Ready struct {
	// Persist.
	Ring    *Ring                 // the whole ring, when it changed
	Paxos   *PaxosState           // when it changed
	Removed map[PeerName]PeerName // the whole set, when it changed
	// Reclaimed and Withdrawn go with Removed (the whole sets, whenever
	// Removed is set).
	Reclaimed []PeerName
	Withdrawn []PeerName
	Members   []PeerName    // the whole set, when it changed
	Allocs    []AllocChange // in order
	Left      PeerName      // the heir, when this peer has just left (weft reset)
	Rejoin    *bool         // whether it holds back (peer_rejoin.go), when that changed

	// Then send.
	Broadcast *Ring      // gossip to every peer
	Messages  []Envelope // to one peer each

	// Then answer and log.
	Answers []Answer
	Events  []Event
}

// Empty reports whether rd holds nothing.
func (rd *Ready) Empty() bool {
	return rd.Ring == nil && rd.Paxos == nil && rd.Removed == nil && rd.Members == nil && len(rd.Allocs) == 0 && rd.Left == "" && rd.Rejoin == nil &&
		rd.Broadcast == nil && len(rd.Messages) == 0 && len(rd.Answers) == 0 && len(rd.Events) == 0
}

// AllocChange is one allocation made (Held) or released.
type AllocChange struct {
	Key     Key
	Address Address
	Held    bool
}

// Envelope is a message for one peer.
type Envelope struct {
	To  PeerName
	Msg Msg
}

// Answer answers an Allocate: the address, or an error (ErrIsExhausted
// reports whether it means "no space now").
type Answer struct {
	Key     Key
	Address Address
	Err     error
}

// Event is something an operator should see in the log. Warn marks the ones
// that need attention.
type Event struct {
	Warn bool
	Text string
}

// ErrRemovedPeer is returned by Step for a message from a peer that was
// removed (weft rmpeer): nothing it says is believed any more.
var ErrRemovedPeer = errors.New("message from a removed peer")

// ErrCanceled answers an allocation that was released while it waited.
var ErrCanceled = errors.New("allocation canceled: the container was released while it waited for an address")

// NewPeer builds a Peer from its configuration and what it saved (the zero
// HardState for a first start).
func NewPeer(cfg PeerConfig, hs HardState) (*Peer, error) {
	if err := ValidatePeerName(cfg.Self); err != nil {
		return nil, fmt.Errorf("ipalloc: %w", err)
	}
	if err := cfg.Init.validate(); err != nil {
		return nil, err
	}
	t, d := &cfg.Timing, DefaultTiming
	for _, f := range []struct{ v, d *int }{
		{&t.PaxosRetry, &d.PaxosRetry}, {&t.PaxosPatience, &d.PaxosPatience}, {&t.DonationRetry, &d.DonationRetry},
		{&t.AllocDeadline, &d.AllocDeadline}, {&t.RemoveRetry, &d.RemoveRetry}, {&t.GossipEvery, &d.GossipEvery},
	} {
		if *f.v <= 0 {
			*f.v = *f.d
		}
	}
	if cfg.Rand == nil {
		s := uint64(SeedOf(cfg.Universe, []PeerName{cfg.Self}))
		cfg.Rand = rand.New(rand.NewPCG(s, s>>1))
	}
	p := &Peer{
		cfg: cfg, rng: cfg.Rand,
		a:           NewAllocator(cfg.Self, cfg.Universe),
		known:       map[PeerName]bool{},
		removed:     map[PeerName]PeerName{},
		members:     map[PeerName]bool{},
		reclaimed:   map[PeerName]bool{},
		withdrawing: map[PeerName]map[PeerName]bool{},
		acks:        map[PeerName]map[PeerName]bool{},
		reported:    map[PeerName]bool{},
		tried:       map[PeerName]bool{},
		served:      map[PeerName]uint64{},
		gossip:      NewRing(cfg.Universe),

		ringPeers: map[PeerName]bool{},
		foreign:   map[PeerName]bool{},
		departed:  map[PeerName]bool{},
	}
	for _, n := range cfg.Peers {
		p.AddPeer(n)
	}
	p.fromState = hs.Ring != nil && !hs.Ring.Empty()
	if !p.fromState || hs.Rejoin {
		p.rejoin, p.a.frozen, p.rejoinSaved = true, true, hs.Rejoin
	}
	if p.fromState && !hs.Rejoin && hs.Left == "" {
		// Its disk may be a restored backup: it holds back until the live
		// peers have shown it the ring (peer_stale.go).
		p.startHold, p.a.noFree = true, true
	}
	if hs.Ring != nil && !hs.Ring.Empty() {
		r := hs.Ring.Clone()
		if r.Seed == 0 { // saved before rings had seeds: a claim by its owners
			r.Seed = SeedOf(r.Universe, r.Peers())
		}
		if err := p.a.SetRing(r); err != nil {
			return nil, fmt.Errorf("the saved ring is invalid: %w", err)
		}
		p.ringDirty = !p.a.ring.Equal(hs.Ring) // free counts recounted
		p.gossip = hs.Ring.Clone()
		p.gossip.Seed = r.Seed
	}
	for _, k := range slices.SortedFunc(maps.Keys(hs.Allocations), Key.Compare) {
		if err := p.a.Restore(k, hs.Allocations[k]); err != nil {
			p.event(true, "ipalloc: saved allocation %s of %s cannot be restored (%v); it is left on disk", k, hs.Allocations[k], err)
			continue
		}
		p.ringDirty = true
	}
	for x, by := range hs.Removed {
		p.removed[x] = by
		if by == cfg.Self {
			p.acks[x] = map[PeerName]bool{}
		}
	}
	p.restoreMembers(hs)
	if p.startHold && p.lone() {
		p.startHold, p.a.noFree = false, false
		if p.a.refreshFree() {
			p.ringDirty = true
		}
	}
	if cfg.Init.Consensus > 0 {
		if n := hs.Paxos.Size; n != 0 && n != cfg.Init.Consensus && p.a.ring.Empty() {
			return nil, &ConsensusSizeError{Local: cfg.Init.Consensus, Remote: n}
		}
		p.px = NewPaxos(cfg.Self, cfg.Init.Consensus, hs.Paxos, cfg.Timing, p.rng)
	}
	p.lastOwned = nil               // the first Ready logs what this peer owns
	p.broadcast = !p.a.ring.Empty() // tell the others where this peer stands
	if p.a.ring.Empty() && len(cfg.Init.Seeds) > 0 {
		p.claim(cfg.Init.Seeds, "seed")
	}
	for x := range p.acks {
		p.sendRemoves(x)
	}
	if hs.Left != "" {
		// It left before it stopped: it stays left, and makes sure its
		// heir has everything.
		p.leave = &leaving{heir: hs.Left}
		p.handOn()
	}
	return p, nil
}

// Self is this peer's name.
func (p *Peer) Self() PeerName { return p.cfg.Self }

// Ring returns a copy of the live ring.
func (p *Peer) Ring() *Ring { return p.a.Ring() }

// Gossip returns a copy of the ring of the last Ready: the ring to offer in
// a full-state exchange. A peer that knows it is removed offers an empty
// ring (offersRing).
func (p *Peer) Gossip() *Ring {
	if !p.offersRing() {
		return NewRing(p.cfg.Universe)
	}
	return p.gossip.Clone()
}

// offersRing reports whether this peer shows its ring to others. A peer
// that knows it is removed does not: its entries are its reclaimer's now,
// and what it changed in them after its removal began (a donation that
// nobody else saw, made while it was cut off) contradicts the takeover. A
// peer that has not heard of the removal (one that joined after the
// reclaim) would take those changes and then carry a ring that the others
// refuse (make test-long seed 397).
func (p *Peer) offersRing() bool { return p.removedErr() == nil }

// shownRing is the live ring as this peer shows it in an answer: empty
// once it knows it is removed (offersRing).
func (p *Peer) shownRing() *Ring {
	if !p.offersRing() {
		return NewRing(p.cfg.Universe)
	}
	return p.a.Ring()
}

// Lookup returns k's address.
func (p *Peer) Lookup(k Key) (Address, bool) { return p.a.Lookup(k) }

// Allocations lists this peer's allocations by address.
func (p *Peer) Allocations() []Allocation { return p.a.Allocations() }

// Stats returns the allocator's counts.
func (p *Peer) Stats() Stats { return p.a.Stats() }

// Owned returns the ranges this peer owns.
func (p *Peer) Owned() []Range { return p.a.Owned() }

// Removed returns the removed peers and who reclaims each.
func (p *Peer) Removed() map[PeerName]PeerName { return maps.Clone(p.removed) }

// AddPeer tells the core about a peer of the mesh (a member joined).
// Peers are also learned from the messages they send.
func (p *Peer) AddPeer(name PeerName) {
	if name == p.cfg.Self || name == "" || p.known[name] {
		return
	}
	p.known[name] = true
	if !p.a.ring.Empty() && p.leave == nil && p.live(name) && p.offersRing() {
		// What memberlist's join does with the full state: a peer that
		// started without state learns at once what it owns (and answers
		// with its own ring, as this one is new to it).
		p.send(name, &RingMsg{Ring: p.gossip.Clone()})
	}
	p.addMember(name)
	for x := range p.acks {
		if !p.acks[x][name] && p.live(name) {
			p.send(name, &Remove{Peer: x})
		}
	}
}

// live reports whether q counts as a live peer: known, not removed.
func (p *Peer) live(q PeerName) bool {
	_, gone := p.removed[q]
	return q != p.cfg.Self && !gone && !p.foreign[q]
}

// livePeers lists the live peers this one knows, sorted.
func (p *Peer) livePeers() []PeerName {
	var out []PeerName
	for q := range p.known {
		if p.live(q) {
			out = append(out, q)
		}
	}
	slices.Sort(out)
	return out
}

func (p *Peer) event(warn bool, format string, args ...any) {
	p.rd.Events = append(p.rd.Events, Event{Warn: warn, Text: fmt.Sprintf(format, args...)})
}

func (p *Peer) send(to PeerName, m Msg) {
	p.rd.Messages = append(p.rd.Messages, Envelope{To: to, Msg: m})
}

// HasReady reports whether Ready would return anything.
func (p *Peer) HasReady() bool {
	return p.ringDirty || p.broadcast || p.removedDirty || p.membersDirty || p.leftDirty || (p.px != nil && p.px.Dirty()) || !p.rd.Empty()
}

// Ready returns what to persist, send and answer, in that order (see Peer),
// and forgets it: the shell must act on every Ready it takes.
func (p *Peer) Ready() Ready {
	p.noteOwnership()
	rd := p.rd
	p.rd = Ready{}
	if p.ringDirty || p.broadcast {
		rd.Ring = p.a.Ring()
		p.gossip = rd.Ring.Clone()
	}
	if p.broadcast && !p.gossip.Empty() && p.offersRing() {
		rd.Broadcast = p.gossip.Clone()
		p.freeGossip = false
	}
	p.ringDirty, p.broadcast = false, false
	if p.px != nil && p.px.Dirty() {
		hs := p.px.HardState()
		rd.Paxos = &hs
		p.px.ClearDirty()
	}
	if p.removedDirty {
		rd.Removed = maps.Clone(p.removed)
		rd.Reclaimed = slices.Sorted(maps.Keys(p.reclaimed))
		rd.Withdrawn = slices.Sorted(maps.Keys(p.withdrawing))
		p.removedDirty = false
	}
	if p.membersDirty {
		rd.Members = slices.Sorted(maps.Keys(p.members))
		if rd.Members == nil {
			rd.Members = []PeerName{}
		}
		p.membersDirty = false
	}
	if p.leftDirty {
		rd.Left = p.leave.heir
		p.leftDirty = false
	}
	if rd.Ring != nil && p.rejoin && !rd.Ring.Empty() && !p.rejoinSaved {
		// With the first ring it saves: a restart holds back too.
		rd.Rejoin, p.rejoinSaved = new(true), true
	}
	if !p.rejoin && p.rejoinSaved {
		rd.Rejoin, p.rejoinSaved = new(false), false
	}
	return rd
}

// noteOwnership logs every change of the ranges this peer owns.
func (p *Peer) noteOwnership() {
	owned := p.a.Owned()
	if slices.Equal(owned, p.lastOwned) {
		return
	}
	total := uint64(p.a.Universe().Size())
	for _, rg := range rangesMinus(owned, p.lastOwned) {
		for _, c := range rg.CIDRs() {
			n := uint64(1) << (32 - c.Bits())
			p.event(false, "ipalloc: owning %s (%d addresses, %.4g%% of range)", c, n, Percent(n, total))
		}
	}
	for _, rg := range rangesMinus(p.lastOwned, owned) {
		p.event(false, "ipalloc: no longer owning %s (%d addresses)", rg, rg.Size())
	}
	p.lastOwned = owned
}

// ringChanged records a change of the ring: owned ranges are gossiped at
// once, free counts at the next gossip tick.
func (p *Peer) ringChanged(ownership bool) {
	p.ringDirty = true
	if ownership {
		p.broadcast = true
	} else {
		p.freeGossip = true
	}
}

// claim builds the ring shared by peers (the chosen Paxos value, or the
// seed list).
func (p *Peer) claim(peers []PeerName, how string) {
	r := NewRing(p.cfg.Universe)
	if err := r.ClaimEvenly(peers); err != nil {
		p.event(true, "ipalloc: cannot claim the ring for %v (%s): %v", peers, how, err)
		return
	}
	if err := p.mergeRing(r, "the "+how+" claim"); err != nil {
		return
	}
	p.event(false, "ipalloc: the ring is claimed by %s (%s, seed %s)", strings.Join(names(peers), ", "), how, r.Seed)
}

func names(ps []PeerName) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = string(p)
	}
	return out
}

// mergeRing merges a ring from outside (a peer, or a claim) and serves what
// waits for space.
func (p *Peer) mergeRing(r *Ring, from string) error {
	p.checkStale(r, from)
	before := len(p.a.ring.Entries)
	changed, err := p.a.Merge(r)
	if err != nil {
		p.reportRefusal(from, err)
		return &RefusedRing{err}
	}
	if !changed {
		return nil
	}
	p.addOwners()
	p.ringChanged(before == 0 || !slices.Equal(p.a.Owned(), p.lastOwned))
	p.completeReclaims()
	p.holdFound()
	p.serve()
	return nil
}

// Step handles a decoded message from peer from. An error means the message
// was refused (the shell may count or log it); the Peer stays usable.
func (p *Peer) Step(from PeerName, m Msg) error {
	if err := ValidatePeerName(from); err != nil {
		return fmt.Errorf("ipalloc: message from %w", err)
	}
	if from == p.cfg.Self {
		return fmt.Errorf("ipalloc: message from this peer's own name %s", from)
	}
	if by, ok := p.removed[from]; ok {
		if h, isHandover := m.(*Handover); isHandover && by == p.cfg.Self {
			// A retry from a peer that left, which this peer removes
			// already: the reclaim covers whatever it still owns.
			p.send(from, &HandoverAck{ID: h.ID})
			return nil
		}
		p.tellRemoved(from)
		return fmt.Errorf("%w %s (removed by %s)", ErrRemovedPeer, from, by)
	}
	p.AddPeer(from)
	if p.leave != nil {
		return p.stepLeft(from, m)
	}
	if p.removedErr() != nil {
		return p.stepRemovedSelf(from, m)
	}
	var err error
	var ring *Ring // the sender's ring, if the message carries one
	switch m := m.(type) {
	case *RingMsg:
		ring, err = m.Ring, p.mergeRing(m.Ring, string(from))
	case *PaxosMsg:
		err = p.stepPaxos(from, m)
	case *DonateRequest:
		p.stepDonateRequest(from, m)
	case *Donation:
		ring, err = m.Ring, p.stepDonation(from, m)
	case *Denial:
		p.stepDenial(from, m)
	case *Remove:
		p.stepRemove(from, m)
	case *RemoveAck:
		ring, err = m.Ring, p.stepRemoveAck(from, m)
	case *Handover:
		ring, err = m.Ring, p.stepHandover(from, m)
	case *HandoverAck:
		p.stepHandoverAck(from, m)
	case *Withdraw:
		p.stepWithdraw(from, m)
	case *WithdrawAck:
		p.stepWithdrawAck(from, m)
	case *AskRemoved:
		p.stepAskRemoved(from, m)
	case *Want:
		p.stepWant(from, m)
	case *Members:
		p.stepMembers(from, m)
	default:
		return fmt.Errorf("%w: unexpected %T", ErrBadMessage, m)
	}
	p.remindReclaimer(from, m)
	switch {
	case err == nil && ring != nil && !ring.Empty() && !p.a.ring.Empty():
		p.ringPeers[from] = true
		delete(p.foreign, from)
		p.askMembers(from)
		p.checkRejoin()
		p.checkStartHold()
	case errors.Is(err, ErrRangeTaken) && ring != nil:
		p.takenOver(from, ring)
	case errors.Is(err, ErrSplitRing) && !p.foreign[from]:
		// A peer of another ring never acknowledges this ring's removals,
		// takes no donation from it and cannot be its heir: waiting for it
		// would hold every reclaim forever. It shares no entry with this
		// ring (rings seeded apart are never merged), so nothing it says
		// can bring a removed peer's ranges back.
		p.foreign[from] = true
		p.event(false, "ipalloc: %s's ring was seeded apart from this one: it no longer counts as a live peer of this ring", from)
		p.completeReclaims()
	}
	return err
}

func (p *Peer) stepPaxos(from PeerName, m *PaxosMsg) error {
	if err := m.validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrBadMessage, err)
	}
	if !p.a.ring.Empty() {
		// Claimed already: show the asker the ring instead of voting.
		if (m.Type == Prepare || m.Type == Accept) && p.offersRing() {
			p.send(from, &RingMsg{Ring: p.a.Ring()})
		}
		return nil
	}
	if p.px == nil {
		return nil // observers and seed peers do not vote
	}
	if err := p.px.CheckSize(from, m); err != nil {
		p.reportOnce(fmt.Sprintf("refused a %s: %v", m.Type, err))
		return err
	}
	p.paxosOut(p.px.Step(from, m))
	return nil
}

// paxosOut sends Paxos's messages and acts on a chosen value.
func (p *Peer) paxosOut(out []PaxosOut) {
	for _, o := range out {
		if o.To != "" {
			p.send(o.To, o.Msg)
			continue
		}
		for _, q := range p.livePeers() {
			p.send(q, o.Msg)
		}
	}
	if p.px == nil {
		return
	}
	if v, ok := p.px.Chosen(); ok && p.a.ring.Empty() {
		p.claim(v, fmt.Sprintf("consensus of %d", len(v)))
		p.showClaim()
	}
}

// showClaim sends the ring this peer just claimed from the chosen value to
// every live peer. Each of them starts without a ring and holds back until
// it has merged a claimed ring from every other owner (peer_rejoin.go); the
// claim's ring is the same everywhere, so no broadcast carries it (a peer's
// ranges did not change), and without these sends a peer of a fresh
// consensus=100 cluster waited for the periodic push-pull with each of the
// 99 others: no first address within minutes. A seed claim needs no such
// send: the seed ring is there from the start, and AddPeer shows it to
// each peer as it is learnt. One ring to each live peer: N(N-1) messages of
// N entries over a cluster's first claim, once.
//
// The hold of a peer that owns ranges also waits for every owner's members
// (the answer to a Members ask, peer_rejoin.go), and each peer of a fresh
// consensus cluster owns ranges: so the answer goes along unasked, before
// the ring (the receiver asks an owner whose ring it merged unless it has
// its members already). That saves the N(N-1) asks, and their repeats
// every RemoveRetry on a mesh too busy to answer in time (a fresh
// consensus=200 cluster on 2 cores: 251,294 Members delivered in two
// minutes, and no hold ended).
func (p *Peer) showClaim() {
	if p.a.ring.Empty() || !p.offersRing() {
		return
	}
	r := p.a.Ring()
	members := &Members{Peers: p.memberList(), InUse: p.unownedFound()}
	for _, q := range p.livePeers() {
		p.send(q, members)
		p.send(q, &RingMsg{Ring: r})
	}
}

// Tick advances time by one tick.
func (p *Peer) Tick() {
	p.now++
	p.tickLeave()
	if p.px != nil && p.a.ring.Empty() && p.leave == nil {
		for q := range p.removed {
			p.px.Forget(q) // a removed peer's other N no longer halts the claim
		}
		// A consensus peer works on the first claim from its first tick,
		// whether or not anything waits for an address yet.
		p.paxosOut(p.px.Propose())
		p.paxosOut(p.px.Tick())
	}
	p.tickDonation()
	p.pullHoldRings()
	// Allocations that waited too long fail.
	keep := p.pending[:0]
	for _, w := range p.pending {
		if p.now < w.deadline {
			keep = append(keep, w)
			continue
		}
		err := fmt.Errorf("%w: waited %d ticks for space (%s; %s)", ErrNoSpace, p.cfg.Timing.AllocDeadline, p.Status(), p.trailString())
		if p.a.ring.Empty() {
			err = fmt.Errorf("%w: waited %d ticks (%s)", ErrNoRange, p.cfg.Timing.AllocDeadline, p.Status())
		}
		p.rd.Answers = append(p.rd.Answers, Answer{Key: w.key, Err: err})
	}
	p.pending = keep
	p.removeTimer++
	if p.removeTimer >= p.cfg.Timing.RemoveRetry {
		p.removeTimer = 0
		for x := range p.acks {
			p.sendRemoves(x)
		}
		p.tickWithdraws()
		p.askRemoved()
		p.askFound()
		p.askAllMembers()
	}
	if p.freeGossip && p.now%int64(p.cfg.Timing.GossipEvery) == 0 {
		p.broadcast = true
	}
}

// Allocate asks for k's address. The answer comes in a Ready's Answers,
// after the allocation is in the same Ready's Allocs: at once when this
// peer has space, later when it must wait for the first claim or a
// donation, or an error after Timing.AllocDeadline ticks.
func (p *Peer) Allocate(k Key) {
	if err := p.removedErr(); err != nil { // also for a key it holds: its address may be another's now
		p.rd.Answers = append(p.rd.Answers, Answer{Key: k, Err: err})
		return
	}
	if addr, ok := p.a.Lookup(k); ok {
		p.rd.Answers = append(p.rd.Answers, Answer{Key: k, Address: addr})
		return
	}
	if p.leave != nil {
		p.rd.Answers = append(p.rd.Answers, Answer{Key: k, Err: ErrLeft})
		return
	}
	for _, w := range p.pending {
		if w.key == k {
			return
		}
	}
	if len(p.pending) == 0 {
		p.trail = donationTrail{}
	}
	p.pending = append(p.pending, pendingAlloc{key: k, deadline: p.now + int64(p.cfg.Timing.AllocDeadline)})
	p.serve()
}

// serve hands out addresses to waiting allocations, in order, and asks for
// space for the rest.
func (p *Peer) serve() {
	if err := p.removedErr(); err != nil {
		for _, w := range p.pending {
			p.rd.Answers = append(p.rd.Answers, Answer{Key: w.key, Err: err})
		}
		p.pending = nil
		return
	}
	if p.rejoin && !p.a.ring.Empty() || p.startHold {
		return // it does not know yet what it owns (peer_rejoin.go, peer_stale.go)
	}
	for len(p.pending) > 0 {
		k := p.pending[0].key
		addr, _, err := p.a.Allocate(k)
		if err != nil {
			break
		}
		p.pending = p.pending[1:]
		p.noteSince(k)
		p.rd.Allocs = append(p.rd.Allocs, AllocChange{Key: k, Address: addr, Held: true})
		p.rd.Answers = append(p.rd.Answers, Answer{Key: k, Address: addr})
		p.ringChanged(false)
	}
	if len(p.pending) == 0 {
		return
	}
	if p.a.ring.Empty() {
		if p.px != nil {
			p.paxosOut(p.px.Propose())
		}
		return
	}
	p.askDonation()
}

// Release frees k's address (or cancels its wait for one). The release is
// in the next Ready's Allocs.
func (p *Peer) Release(k Key) {
	for i, w := range p.pending {
		if w.key == k {
			p.pending = slices.Delete(p.pending, i, i+1)
			p.rd.Answers = append(p.rd.Answers, Answer{Key: k, Err: ErrCanceled})
			return
		}
	}
	delete(p.found, k) // a pod found on the node, gone before it was held again
	delete(p.nodeFound, k)
	delete(p.since, k)
	delete(p.foundSaved, k)
	if addr, ok := p.a.Release(k); ok {
		p.rd.Allocs = append(p.rd.Allocs, AllocChange{Key: k, Address: addr})
		p.ringChanged(false)
	}
}

// PeerStatus is the operator's view of this peer's IPAM.
type PeerStatus struct {
	Claimed   bool // the ring has owners
	Observer  bool
	Quorum    int // consensus: the quorum, and the peers heard from
	Known     int
	Owned     uint64 // addresses owned here
	Free      uint64
	Waiting   int                     // allocations waiting for space
	Reclaims  map[PeerName][]PeerName // peer being removed -> live peers that have not acknowledged yet
	RemovedBy PeerName                // this peer was removed (rmpeer, or its Node deleted) by that peer
	Left      bool                    // this peer has left the cluster (weft reset)
	Heir      PeerName                // to which peer it handed its ranges
	HandedOn  bool                    // the heir has saved them
	Rejoin    string                  // why a peer that started without state holds back; empty: it does not
	Conflict  string                  // why the first claim is halted (another peer's consensus size); empty: it is not
	// Unregistered: the members kept outside do not name this peer yet
	// (PeerConfig.ExternalMembers), so it asks for no space.
	Unregistered bool
}

// Status returns the current status.
func (p *Peer) Status() PeerStatus {
	st := p.a.Stats()
	s := PeerStatus{Claimed: !p.a.ring.Empty(), Observer: p.cfg.Init.Observer, Owned: st.Owned, Free: st.Free, Waiting: len(p.pending)}
	if p.px != nil {
		s.Quorum, s.Known = p.px.Quorum(), p.px.Known()
		s.Conflict = p.px.Conflict()
	}
	s.Left, s.Heir, s.HandedOn = p.Leaving()
	s.Rejoin = p.rejoinStatus()
	if p.startHold {
		s.Rejoin = p.startHoldStatus()
	}
	s.RemovedBy = p.removed[p.cfg.Self]
	s.Unregistered = p.unregistered()
	for x := range p.acks {
		if s.Reclaims == nil {
			s.Reclaims = map[PeerName][]PeerName{}
		}
		s.Reclaims[x] = p.waitingFor(x)
	}
	return s
}

// String is the Status: line of /status (the shell adds the case where
// every owner is unreachable, which needs the mesh).
func (s PeerStatus) String() string {
	switch {
	case s.Left && s.Heir == "":
		return "left the cluster (weft reset)"
	case s.Left && s.HandedOn:
		return fmt.Sprintf("left the cluster (weft reset): ranges handed to %s", s.Heir)
	case s.Left:
		return fmt.Sprintf("left the cluster (weft reset): waiting for %s to confirm the handover of its ranges", s.Heir)
	case s.RemovedBy != "":
		return fmt.Sprintf("removed from the cluster by %s: allocates nothing; run weft reset --force on this node and restart it to join again", s.RemovedBy)
	case !s.Claimed && s.Conflict != "":
		return s.Conflict
	case !s.Claimed && s.Quorum > 0:
		return fmt.Sprintf("awaiting consensus (quorum: %d, known: %d)", s.Quorum, s.Known)
	case !s.Claimed:
		return "waiting for the ring from a peer"
	case s.Rejoin != "":
		return s.Rejoin
	case s.Unregistered && (s.Owned == 0 || s.Waiting > 0):
		return "waiting for space: this peer asks for none before it is registered in the cluster's records " +
			"(in --kube mode the ConfigMap; check that the router can write it: its log says why not)"
	case s.Owned == 0 || s.Waiting > 0:
		return "waiting for space"
	}
	return "ready"
}
