package mesh

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"
)

// PeerState is a peer's state in this peer's view.
type PeerState int

// Peer states. Memberlist does not expose its own short-lived SWIM
// suspicion, so StateSuspect here means: memberlist still counts the peer
// alive, but at least one other live peer reports it unreachable.
const (
	StateAlive       PeerState = iota // reachable
	StateSuspect                      // alive here, unreachable from some other peer
	StateUnreachable                  // failed: memberlist declared it dead
	StateLeft                         // left gracefully (Close)
)

func (s PeerState) String() string {
	switch s {
	case StateAlive:
		return "alive"
	case StateSuspect:
		return "suspect"
	case StateUnreachable:
		return "unreachable"
	case StateLeft:
		return "left"
	}
	return fmt.Sprintf("state(%d)", int(s))
}

// MarshalText makes a state a string in JSON.
func (s PeerState) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Peer is one peer as this peer sees it.
type Peer struct {
	Name     PeerName       `json:"name"`
	Nickname string         `json:"nickname,omitempty"`
	Addr     netip.AddrPort `json:"address"` // gossip address
	State    PeerState      `json:"state"`
	Since    time.Time      `json:"since"` // last state change
	Self     bool           `json:"self,omitempty"`
	Meta     Meta           `json:"meta"`
	// MetaError is set when the peer's metadata did not decode; Meta is
	// then empty and the peer shows as "invalid metadata".
	MetaError string `json:"metaError,omitempty"`
	// ReachableFrom counts the live peers, this one included, that see
	// this peer alive. The names are left out because the list is
	// quadratic in the cluster size; see Mesh.ReachableFrom.
	ReachableFrom int `json:"reachableFrom"`
	// UnreachableFrom lists the live peers that report this one
	// unreachable (usually none).
	UnreachableFrom []PeerName `json:"unreachableFrom,omitempty"`
}

func (p Peer) label() string { return fmt.Sprintf("%s(%s)", p.Name, p.Addr.Addr()) }

// EventKind says what happened to a peer.
type EventKind int

// Event kinds.
const (
	EventJoined      EventKind = iota + 1 // first seen alive
	EventRejoined                         // alive again after unreachable or left
	EventUpdated                          // metadata or address changed, or reachable again after suspect
	EventSuspect                          // some live peer reports it unreachable
	EventUnreachable                      // declared dead
	EventLeft                             // left gracefully
)

func (k EventKind) String() string {
	switch k {
	case EventJoined:
		return "joined"
	case EventRejoined:
		return "rejoined"
	case EventUpdated:
		return "updated"
	case EventSuspect:
		return "suspect"
	case EventUnreachable:
		return "unreachable"
	case EventLeft:
		return "left"
	}
	return fmt.Sprintf("event(%d)", int(k))
}

// MarshalText makes a kind a string in JSON.
func (k EventKind) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// Event is a change of a peer, as delivered to subscribers.
type Event struct {
	Kind EventKind
	Peer Peer
	// Dropped counts the events this subscriber missed just before this
	// one because its channel was full; re-read Peers to resynchronise.
	Dropped int
}

// peerEntry is a peer in the view: the exported Peer, plus memberlist's
// verdict (base) from which State is derived, and whether a leaving
// report arrived since it last joined.
type peerEntry struct {
	Peer
	base    PeerState // alive, unreachable or left, from memberlist's events
	bye     bool
	counted bool // in Mesh.counts (under its State)
}

type subscriber struct {
	ch      chan Event
	dropped int
}

// Subscribe returns a channel of peer events with the given buffer and a
// function that ends the subscription. Events are never blocked on: a
// subscriber that falls behind loses events and learns how many from the
// next one's Dropped. The channel is closed by cancel or Close.
func (m *Mesh) Subscribe(buffer int) (<-chan Event, func()) {
	s := &subscriber{ch: make(chan Event, max(buffer, 1))}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.viewDone {
		close(s.ch)
		return s.ch, func() {}
	}
	m.subs[s] = struct{}{}
	return s.ch, func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		if _, ok := m.subs[s]; ok {
			delete(m.subs, s)
			close(s.ch)
		}
	}
}

// emitLocked logs an event at info and hands it to every subscriber.
func (m *Mesh) emitLocked(kind EventKind, p Peer, detail string) {
	msg := "peer " + p.label() + " " + kind.String()
	switch {
	case kind == EventUpdated && detail != "":
		msg = "peer " + p.label() + " " + detail
	case detail != "":
		msg += ": " + detail
	}
	m.log.Info(msg, "peer", p.Name, "nickname", p.Nickname, "address", p.Addr, "state", p.State)
	for s := range m.subs {
		ev := Event{Kind: kind, Peer: p, Dropped: s.dropped}
		select {
		case s.ch <- ev:
			s.dropped = 0
		default:
			s.dropped++
		}
	}
}

// onAlive records memberlist's join of a peer (NotifyJoin) or a change of
// its metadata or address (NotifyUpdate).
func (m *Mesh) onAlive(name PeerName, addr netip.AddrPort, rawMeta []byte) {
	md, metaErr := decodeMeta(rawMeta, m.cfg.Components)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.viewDone {
		return
	}
	now := m.now()
	p := m.peers[name]
	kind := EventUpdated
	switch {
	case p == nil:
		p = &peerEntry{Peer: Peer{Name: name, Since: now, Self: name == m.cfg.Name}}
		m.peers[name] = p
		kind = EventJoined
	case p.base != StateAlive:
		kind = EventRejoined
		p.Since = now
	}
	oldMetaErr, oldRefused := p.MetaError, p.Meta.Refused
	p.Addr, p.base, p.bye = addr, StateAlive, false
	p.Meta, p.MetaError = md, ""
	if metaErr != nil {
		p.Meta, p.MetaError = Meta{}, metaErr.Error()
	}
	p.Nickname = p.Meta.Nickname
	if metaErr != nil && (kind != EventUpdated || oldMetaErr != p.MetaError) {
		m.metrics.badMeta.Inc()
		m.log.Warn(fmt.Sprintf("peer %s has invalid metadata: %v", p.label(), metaErr), "peer", name)
	}
	for _, c := range slices.Sorted(maps.Keys(p.Meta.Refused)) {
		why := p.Meta.Refused[c]
		if kind == EventUpdated && oldRefused[c] == why {
			continue
		}
		m.metrics.badMeta.Inc()
		m.log.Warn(fmt.Sprintf("peer %s: its %q metadata is refused (%s); its other metadata is used, and this component treats the peer as not publishing any", p.label(), c, why),
			"peer", name, "component", c)
	}
	if kind == EventUpdated { // alive already: its metadata or address, which nothing else derives from
		m.refreshLocked(name, name)
	} else {
		m.alive++
		m.refreshLocked(name, m.concerning(name)...)
	}
	if p.Self {
		return
	}
	m.emitLocked(kind, m.peerLocked(p), "")
	m.kickTopology()
}

// concerning lists name and the peers its report names: whose derived
// states change when name's own state does.
func (m *Mesh) concerning(name PeerName) []PeerName {
	return append([]PeerName{name}, m.reports[name].Unreachable...)
}

// onDead records memberlist's verdict that a peer is gone (NotifyLeave):
// left when it said goodbye, unreachable otherwise.
func (m *Mesh) onDead(name PeerName) {
	m.mu.Lock()
	defer m.mu.Unlock()
	p := m.peers[name]
	if m.viewDone || p == nil || p.Self || p.base != StateAlive {
		return
	}
	kind := EventUnreachable
	p.base = StateUnreachable
	if p.bye {
		kind, p.base = EventLeft, StateLeft
	}
	p.Since = m.now()
	m.alive--
	m.refreshLocked(name, m.concerning(name)...)
	m.emitLocked(kind, m.peerLocked(p), "")
	m.kickTopology()
}

// refreshLocked derives the State of the named peers from memberlist's
// verdict and the reports of the other live peers, logs the changes
// (except quiet's: its caller logs it), and updates the gauges. Only the
// named peers are derived: the callers name every peer whose inputs
// changed (the peer itself, and the peers named by its report when its
// liveness or its report changed), so that an event costs what it
// concerns, not O(N): with one derivation of every peer per memberlist
// event, a node of a 1,000-node cluster forming did a million of them, and
// two thirds of the nodes of such a cluster in one process were found in
// it at once. refreshAllLocked derives every peer (reap, Forget).
func (m *Mesh) refreshLocked(quiet PeerName, names ...PeerName) {
	for _, name := range names {
		p := m.peers[name]
		if p == nil {
			continue
		}
		if p.counted {
			m.counts[p.State]--
		}
		m.deriveLocked(p, quiet)
		m.counts[p.State]++
		p.counted = true
	}
	m.numAlive.Store(int64(max(m.alive, 1)))
	for _, s := range []PeerState{StateAlive, StateSuspect, StateUnreachable, StateLeft} {
		m.metrics.peers.WithLabelValues(s.String()).Set(float64(m.counts[s]))
	}
}

// refreshAllLocked counts the live peers again and derives every peer's
// State (see refreshLocked): after peers were dropped from the view.
func (m *Mesh) refreshAllLocked() {
	m.alive, m.counts = 0, [StateLeft + 1]int{}
	for _, p := range m.peers {
		p.counted = false
		if p.base == StateAlive {
			m.alive++
		}
	}
	m.refreshLocked("", slices.Collect(maps.Keys(m.peers))...)
}

// deriveLocked derives p's State and UnreachableFrom: memberlist's
// verdict, made suspect when a live peer that is not leaving reports p
// unreachable.
func (m *Mesh) deriveLocked(p *peerEntry, quiet PeerName) {
	var unreachable []PeerName
	for origin := range m.unreachBy[p.Name] {
		o := m.peers[origin]
		if o == nil || o.base != StateAlive || m.reports[origin].Leaving {
			continue
		}
		unreachable = append(unreachable, origin)
	}
	slices.Sort(unreachable)
	p.UnreachableFrom = unreachable
	state := p.base
	if state == StateAlive && len(unreachable) > 0 && !p.Self {
		state = StateSuspect
	}
	if state == p.State {
		return
	}
	was := p.State
	p.State = state
	if p.base == StateAlive && p.Name != quiet {
		p.Since = m.now()
		switch {
		case state == StateSuspect:
			m.emitLocked(EventSuspect, m.peerLocked(p), "unreachable from "+joinNames(unreachable))
		case was == StateSuspect:
			m.emitLocked(EventUpdated, m.peerLocked(p), "reachable again")
		}
	}
}

// peerLocked is p as shown: with ReachableFrom, which depends on how many
// peers are alive, counted when it is read rather than stored in every
// peer at every change of that count.
func (m *Mesh) peerLocked(p *peerEntry) Peer {
	out := p.Peer
	// The live peers other than p: this one sees p alive iff
	// memberlist does; the others unless they report it.
	others := m.alive
	if p.base == StateAlive {
		others--
	}
	reach := others - len(p.UnreachableFrom)
	if !p.Self && p.base != StateAlive {
		reach--
	}
	out.ReachableFrom = max(reach, 0)
	return out
}

// indexReportLocked moves origin's entries in unreachBy from its old
// report's list to its new one's, and adds every peer either names to
// touched.
func (m *Mesh) indexReportLocked(origin PeerName, old, cur []PeerName, touched map[PeerName]bool) {
	for _, n := range old {
		if set := m.unreachBy[n]; set != nil {
			delete(set, origin)
			if len(set) == 0 {
				delete(m.unreachBy, n)
			}
		}
		touched[n] = true
	}
	for _, n := range cur {
		if n == origin {
			continue
		}
		set := m.unreachBy[n]
		if set == nil {
			set = map[PeerName]bool{}
			m.unreachBy[n] = set
		}
		set[origin] = true
		touched[n] = true
	}
}

// dropReportLocked forgets origin's report and its entries in unreachBy.
func (m *Mesh) dropReportLocked(origin PeerName) {
	m.indexReportLocked(origin, m.reports[origin].Unreachable, nil, map[PeerName]bool{})
	delete(m.reports, origin)
}

func joinNames(ns []PeerName) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = string(n)
	}
	return strings.Join(s, ", ")
}

// applyReport takes in a peer's report; it says whether it was news. A
// report whose origin is no peer of the view (memberlist never announced
// it) is neither kept nor re-gossiped: otherwise anyone could fill every
// peer's state with reports of made-up names, and it would travel in every
// push-pull. The origin's own report arrives again with its push-pulls
// once it has joined.
func (m *Mesh) applyReport(rep report) bool { return m.applyReports([]report{rep}) > 0 }

// applyReports takes in reports (a push-pull's, or one broadcast) and
// derives the peers' states once for all of them, not once per report: a
// push-pull carries every peer's report and the derivation is O(N), so
// one per report made a push-pull O(N²) (at 300 in-process nodes most of
// the CPU). It returns how many were news.
func (m *Mesh) applyReports(reps []report) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.viewDone {
		return 0
	}
	news := 0
	var left []*peerEntry
	touched := map[PeerName]bool{}
	for _, rep := range reps {
		if rep.Origin == m.cfg.Name {
			continue
		}
		p, known := m.peers[rep.Origin]
		if !known {
			continue
		}
		old, ok := m.reports[rep.Origin]
		if ok && old.Version >= rep.Version {
			continue
		}
		if !ok && len(m.reports) >= maxReports {
			continue
		}
		switch {
		case !slices.Equal(old.Unreachable, rep.Unreachable):
			m.indexReportLocked(rep.Origin, old.Unreachable, rep.Unreachable, touched)
		case old.Leaving != rep.Leaving: // the same peers, now counted or no longer
			for _, n := range rep.Unreachable {
				touched[n] = true
			}
		}
		m.reports[rep.Origin] = rep
		news++
		if p != nil && !p.Self {
			p.bye = rep.Leaving
			if rep.Leaving && p.base == StateUnreachable {
				// The goodbye came after memberlist's verdict.
				p.base = StateLeft
				p.Since = m.now()
				left = append(left, p)
				touched[p.Name] = true
			}
		}
	}
	if news == 0 {
		return 0
	}
	m.refreshLocked("", slices.Collect(maps.Keys(touched))...)
	for _, p := range left {
		m.emitLocked(EventLeft, m.peerLocked(p), "")
	}
	return news
}

// publishReport makes our report current (the peers we see unreachable,
// and whether we are leaving) and broadcasts it when it changed. Reports
// also travel in every push-pull, so one too large to broadcast still
// arrives. It returns a channel closed once the broadcast has been sent
// as often as it will be, or nil when nothing was queued.
func (m *Mesh) publishReport(leaving bool) <-chan struct{} {
	m.mu.Lock()
	var unreachable []PeerName
	for _, p := range m.peers {
		if p.base == StateUnreachable && !p.Self {
			unreachable = append(unreachable, p.Name)
		}
	}
	slices.Sort(unreachable)
	cur := m.ownReport
	if cur.Version != 0 && cur.Leaving == leaving && slices.Equal(cur.Unreachable, unreachable) {
		m.mu.Unlock()
		return nil
	}
	v := uint64(m.now().UnixNano())
	if v <= cur.Version {
		v = cur.Version + 1
	}
	m.ownReport = report{Origin: m.cfg.Name, Version: v, Leaving: leaving, Unreachable: unreachable}
	enc := encodeReport(m.ownReport)
	m.mu.Unlock()
	if len(enc) > MaxBroadcastSize {
		return nil
	}
	done := make(chan struct{})
	m.enqueue(&namedBroadcast{
		name: topologyChannel + "/" + string(m.cfg.Name),
		msg:  encodeMessage(kindBroadcast, topologyChannel, m.cfg.Name, enc),
		done: done,
	})
	return done
}

// reap drops peers unreachable or left for longer than PeerRetention.
func (m *Mesh) reap() {
	m.mu.Lock()
	defer m.mu.Unlock()
	cutoff := m.now().Add(-m.cfg.Timings.PeerRetention)
	changed := false
	for name, p := range m.peers {
		if p.base != StateAlive && !p.Self && p.Since.Before(cutoff) {
			m.log.Info(fmt.Sprintf("forgetting peer %s: %s since %s", p.label(), p.State, p.Since.Format(time.RFC3339)), "peer", name)
			delete(m.peers, name)
			m.dropReportLocked(name)
			changed = true
		}
	}
	if changed {
		m.refreshAllLocked()
	}
}

// Peers returns every known peer, this one included, sorted by name.
func (m *Mesh) Peers() []Peer {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Peer, 0, len(m.peers))
	for _, p := range m.peers {
		out = append(out, m.peerLocked(p))
	}
	slices.SortFunc(out, func(a, b Peer) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// Peer returns one peer of the view, e.g. to find an owner's underlay
// address and data port.
func (m *Mesh) Peer(name PeerName) (Peer, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if p, ok := m.peers[name]; ok {
		return m.peerLocked(p), true
	}
	return Peer{}, false
}

// ReachableFrom lists the live peers, this one included, that see the
// named peer alive.
func (m *Mesh) ReachableFrom(name PeerName) []PeerName {
	m.mu.Lock()
	defer m.mu.Unlock()
	target := m.peers[name]
	if target == nil {
		return nil
	}
	var out []PeerName
	for _, o := range m.peers {
		if o.base != StateAlive || o.Name == name {
			continue
		}
		if o.Self {
			if target.base == StateAlive {
				out = append(out, o.Name)
			}
			continue
		}
		if rep, ok := m.reports[o.Name]; ok && slices.Contains(rep.Unreachable, name) {
			continue
		}
		out = append(out, o.Name)
	}
	slices.Sort(out)
	return out
}

// ErrPeerAlive is Forget's refusal of a peer that is alive or suspected.
var ErrPeerAlive = errors.New("peer is alive")

// Forget drops a peer that is gone for good (unreachable or left, e.g. its
// Kubernetes Node was deleted and its ranges reclaimed) from the view: it
// is no longer shown, remembered (KnownPeers) nor dialled. Should it come
// back, memberlist's join brings it into the view again. Self, a peer that
// is alive or suspect (ErrPeerAlive) and an unknown peer (ErrUnknownPeer)
// are refused.
func (m *Mesh) Forget(name PeerName) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	p := m.peers[name]
	switch {
	case p == nil:
		return fmt.Errorf("%w: %s", ErrUnknownPeer, name)
	case p.Self:
		return fmt.Errorf("peer %s is this peer", name)
	case p.base == StateAlive || p.State == StateSuspect:
		return fmt.Errorf("%w: %s is %s", ErrPeerAlive, p.label(), p.State)
	}
	m.log.Info(fmt.Sprintf("forgetting peer %s: %s since %s, and gone for good", p.label(), p.State, p.Since.Format(time.RFC3339)), "peer", name)
	delete(m.peers, name)
	m.dropReportLocked(name)
	m.refreshAllLocked()
	return nil
}

// KnownPeers returns the gossip addresses of the other peers that have not
// left, for the caller to persist and give back as Config.Remembered.
func (m *Mesh) KnownPeers() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for _, p := range m.peers {
		if !p.Self && p.base != StateLeft && p.Addr.IsValid() {
			out = append(out, p.Addr.String())
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}
