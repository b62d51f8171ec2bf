package ipalloc

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
)

// Single-decree Paxos for the first claim (--ipalloc-init consensus=N): the
// peers that start a cluster agree on one value, the set of peers that share
// the empty ring, and each then builds the same ring from it with
// ClaimEvenly. Every consensus peer is proposer, acceptor and learner.
//
//   - A proposer picks a ballot (round, its name) above any it has seen and
//     sends Prepare to every peer. An acceptor promises to ignore lower
//     ballots and answers with the highest ballot it accepted, and its value.
//   - With promises from a quorum (N/2+1), the proposer sends Accept with the
//     value of the highest accepted ballot among the promises, or, if none,
//     its own value: itself and every peer it has heard from. It waits for
//     promises from all N peers for a while (Patience) so that the value
//     usually names them all.
//   - An acceptor accepts a ballot it has not promised to ignore and tells
//     every peer (Accepted). A learner that has Accepted for one ballot from
//     a quorum knows the value is chosen.
//   - A proposer that has not seen the value chosen after a timeout (with
//     random jitter, so duelling proposers settle) tries again with a
//     higher round. Each attempt doubles the timeout (up to 16 times the
//     first), so that a round outlasts a mesh slower than the first
//     timeout, and a proposer that has heard a lower-named proposer at
//     work (its Prepare or Accept) within its own timeout's bound stands
//     back rather than pre-empt it: with N proposers that start together
//     and a slow mesh, each new ballot otherwise cancels the one before
//     (100 peers made no choice in 2 minutes, 383,068 Prepares). Who
//     proposes when is liveness only: safety never rests on it.
//
// Safety needs the acceptor's promise and acceptance, and the proposer's
// last round, to be on disk before any message that depends on them leaves:
// the caller persists HardState when Dirty says so, before it sends.
//
// Quorums overlap only if every participant counts the same N. Every
// message carries the sender's N (Size), and a participant that hears of
// another N stops taking part (Halt): peers with different N refuse each
// other instead of each choosing with a quorum of its own and seeding two
// rings (Weave's #3908). The N a peer voted with is saved with its promise,
// so a restart with another N is refused too. What no message can reveal:
// two groups with different N that never hear from each other before each
// has chosen (a partition from the very start); see docs/ipam.md.

// Ballot orders proposals: by round, then by proposer name. The zero
// Ballot is below every real one.
type Ballot struct {
	Round uint32   `json:"round"`
	Peer  PeerName `json:"peer,omitempty"`
}

// Compare orders ballots.
func (b Ballot) Compare(o Ballot) int {
	if c := cmp.Compare(b.Round, o.Round); c != 0 {
		return c
	}
	return cmp.Compare(b.Peer, o.Peer)
}

func (b Ballot) String() string { return fmt.Sprintf("%d.%s", b.Round, b.Peer) }

// PaxosType is the type of a Paxos message.
type PaxosType byte

// The Paxos messages.
const (
	Prepare  PaxosType = iota + 1 // proposer -> all: Ballot
	Promise                       // acceptor -> proposer: Ballot, and Accepted with Value if any
	Accept                        // proposer -> all: Ballot, Value
	Accepted                      // acceptor -> all: Ballot, Value
	Nack                          // acceptor -> proposer: Ballot refused; Accepted is the ballot promised
)

func (t PaxosType) String() string {
	switch t {
	case Prepare:
		return "prepare"
	case Promise:
		return "promise"
	case Accept:
		return "accept"
	case Accepted:
		return "accepted"
	case Nack:
		return "nack"
	}
	return fmt.Sprintf("paxos type %d", t)
}

// PaxosMsg is one Paxos message.
type PaxosMsg struct {
	Type     PaxosType
	Ballot   Ballot
	Accepted Ballot     // Promise: the highest ballot accepted; Nack: the ballot promised
	Value    []PeerName // Promise (of Accepted), Accept, Accepted: sorted, unique
	// Size is the sender's consensus size N (1..maxWireValue); 0 only in
	// a message from a peer that predates it, which is not checked.
	Size uint32
}

func (m *PaxosMsg) kind() msgKind { return kindPrepare + msgKind(m.Type) - 1 }

// validate checks a decoded message.
func (m *PaxosMsg) validate() error {
	if m.Type < Prepare || m.Type > Nack {
		return fmt.Errorf("paxos: unknown type %d", m.Type)
	}
	if m.Ballot.Round == 0 {
		return fmt.Errorf("paxos %s: no ballot", m.Type)
	}
	for _, b := range []Ballot{m.Ballot, m.Accepted} {
		if b.Round != 0 {
			if err := ValidatePeerName(b.Peer); err != nil {
				return fmt.Errorf("paxos %s: ballot %s: %w", m.Type, b, err)
			}
		}
	}
	if m.Size > maxWireValue {
		return fmt.Errorf("paxos %s: consensus size %d, at most %d", m.Type, m.Size, maxWireValue)
	}
	needValue := m.Type == Accept || m.Type == Accepted || (m.Type == Promise && m.Accepted.Round != 0)
	switch {
	case needValue && len(m.Value) == 0:
		return fmt.Errorf("paxos %s: no value", m.Type)
	case !needValue && len(m.Value) != 0:
		return fmt.Errorf("paxos %s: unexpected value", m.Type)
	}
	return validValue(m.Value)
}

// validValue checks a set of peers: sorted, unique, valid names.
func validValue(v []PeerName) error {
	for i, p := range v {
		if err := ValidatePeerName(p); err != nil {
			return fmt.Errorf("paxos value: %w", err)
		}
		if i > 0 && p <= v[i-1] {
			return errors.New("paxos value: peers not sorted and unique")
		}
	}
	return nil
}

// PaxosState is what a Paxos participant keeps on disk.
type PaxosState struct {
	Promised  Ballot     `json:"promised"`        // no lower ballot is accepted
	Accepted  Ballot     `json:"accepted"`        // the highest ballot accepted
	Value     []PeerName `json:"value,omitempty"` // its value
	LastRound uint32     `json:"lastRound"`       // the highest round this peer proposed in
	Size      int        `json:"size,omitempty"`  // the consensus size N it took part with (0: saved before it was recorded)
}

// PaxosOut is a message to send: To empty means every other peer.
type PaxosOut struct {
	To  PeerName
	Msg *PaxosMsg
}

// Paxos is one peer's Paxos participant: a pure state machine.
type Paxos struct {
	self     PeerName
	quorum   int // N/2+1
	expected int // N
	retry    int // ticks before a proposer tries again (plus jitter)
	patience int // ticks a proposer waits to hear from all N before proposing
	rng      *rand.Rand

	hs    PaxosState
	dirty bool

	known    map[PeerName]bool // peers heard from, and self
	maxRound uint32            // the highest round seen anywhere

	// proposer
	proposing bool
	ballot    Ballot
	promises  map[PeerName]*PaxosMsg
	sentValue bool
	elapsed   int // ticks since this attempt started
	timeout   int // ticks this attempt lasts
	waited    int // ticks since the first attempt started
	attempts  int // attempts since proposing started (the backoff)

	ticks   int  // ticks since this participant started
	lowerAt int  // the tick a lower-named proposer was last heard at work
	lower   bool // one was heard
	backs   int  // timeouts in a row this proposer stood back

	// learner
	votes  map[Ballot]map[PeerName]bool
	chosen []PeerName

	// conflicts are the peers last heard with another consensus size:
	// while there is one, this participant takes no part.
	conflicts map[PeerName]int
}

// NewPaxos returns a participant for self in a cluster of expected peers,
// resuming from hs.
func NewPaxos(self PeerName, expected int, hs PaxosState, t Timing, rng *rand.Rand) *Paxos {
	px := &Paxos{
		self: self, quorum: expected/2 + 1, expected: expected,
		retry: max(t.PaxosRetry, 1), patience: t.PaxosPatience, rng: rng,
		hs:    hs,
		known: map[PeerName]bool{self: true},
		votes: map[Ballot]map[PeerName]bool{},
	}
	px.maxRound = max(hs.Promised.Round, hs.Accepted.Round, hs.LastRound)
	if px.hs.Size == 0 {
		px.hs.Size = expected // saved with the first promise or round
	}
	return px
}

// ConsensusSizeError is the refusal of a peer that counts another
// consensus size: quorums of different sizes need not overlap.
type ConsensusSizeError struct {
	Peer          PeerName // the other peer; empty: this peer's own saved state
	Local, Remote int
}

func (e *ConsensusSizeError) Error() string {
	if e.Peer == "" {
		return fmt.Sprintf("ipalloc: this peer took part in the first claim with consensus=%d (saved in its state), "+
			"but it is started with consensus=%d; start it with --ipalloc-init consensus=%d (or the --peers list it had), "+
			"the same N as every other peer (if no peer has claimed the ring yet and no pod runs, you may instead remove the state of every peer and start them all with one N)",
			e.Remote, e.Local, e.Remote)
	}
	return fmt.Sprintf("ipalloc: %s runs the first claim with consensus=%d, but this peer with consensus=%d: "+
		"quorums of different sizes need not overlap, and two rings could be claimed, so neither takes part until every peer "+
		"counts the same N; give every peer the same --ipalloc-init consensus=N (or --peers lists of the same length) "+
		"and restart the ones that differ", e.Peer, e.Remote, e.Local)
}

// CheckSize refuses a message from a peer that counts another N, and
// halts this participant: from then on it neither proposes nor votes.
// A later message from the same peer with this peer's N (it was restarted
// with the right one) lifts the halt, once no other peer differs.
func (px *Paxos) CheckSize(from PeerName, m *PaxosMsg) error {
	if m.Size == 0 || int(m.Size) == px.expected {
		delete(px.conflicts, from)
		return nil
	}
	if px.conflicts == nil {
		px.conflicts = map[PeerName]int{}
	}
	px.conflicts[from] = int(m.Size)
	px.proposing = false
	return &ConsensusSizeError{Peer: from, Local: px.expected, Remote: int(m.Size)}
}

// Forget drops a conflict with peer q (it was removed: it is gone for
// good and takes no part).
func (px *Paxos) Forget(q PeerName) { delete(px.conflicts, q) }

// Halted reports whether this participant stopped on another peer's N.
func (px *Paxos) Halted() bool { return len(px.conflicts) > 0 }

// Conflict describes the first peer (by name) that counts another N, if any.
func (px *Paxos) Conflict() string {
	if len(px.conflicts) == 0 {
		return ""
	}
	q := slices.Sorted(maps.Keys(px.conflicts))[0]
	return fmt.Sprintf("first claim halted: %s counts consensus=%d, this peer %d (see the log)", q, px.conflicts[q], px.expected)
}

// Size is the consensus size N this participant counts.
func (px *Paxos) Size() int { return px.expected }

// Quorum is the number of acceptors that decide.
func (px *Paxos) Quorum() int { return px.quorum }

// Known is the number of peers heard from, self included.
func (px *Paxos) Known() int { return len(px.known) }

// Chosen returns the chosen value once this peer has learned it.
func (px *Paxos) Chosen() ([]PeerName, bool) { return px.chosen, px.chosen != nil }

// HardState is what to persist; Dirty reports whether it changed since
// ClearDirty.
func (px *Paxos) HardState() PaxosState {
	hs := px.hs
	hs.Value = slices.Clone(hs.Value)
	return hs
}

// Dirty reports whether HardState changed since the last ClearDirty.
func (px *Paxos) Dirty() bool { return px.dirty }

// ClearDirty is called once HardState has been handed out for persisting.
func (px *Paxos) ClearDirty() { px.dirty = false }

// Propose starts proposing, if this peer is not already.
func (px *Paxos) Propose() []PaxosOut {
	if px.proposing || px.chosen != nil || px.Halted() {
		return nil
	}
	px.proposing = true
	px.waited = 0
	if px.standingBack() {
		px.rearm() // a lower-named proposer is at work: its round first
		return nil
	}
	return px.attempt()
}

// attempt starts a new ballot.
func (px *Paxos) attempt() []PaxosOut {
	round := max(px.maxRound, px.hs.LastRound) + 1
	px.maxRound = round
	px.hs.LastRound = round
	px.dirty = true
	px.ballot = Ballot{Round: round, Peer: px.self}
	px.promises = map[PeerName]*PaxosMsg{}
	px.sentValue = false
	px.rearm()
	px.attempts++
	return px.send("", &PaxosMsg{Type: Prepare, Ballot: px.ballot})
}

// maxBackoff bounds the doubling of a proposer's timeout: at most
// 1<<maxBackoff times the first (with the default timing, 32 to 64 s).
const maxBackoff = 4

// base is the current attempt's timeout before its jitter.
func (px *Paxos) base() int { return px.retry << min(px.attempts, maxBackoff) }

// rearm starts a new timeout: the base and up to as much jitter.
func (px *Paxos) rearm() {
	px.elapsed = 0
	b := px.base()
	px.timeout = b + px.rng.IntN(b+1)
}

// maxStandBacks bounds the timeouts in a row a proposer stands back: a
// lower-named proposer that is heard but cannot finish (it hears no
// quorum: a partition one way only) must not stop the others for ever.
const maxStandBacks = 3

// standingBack reports whether this proposer stands back at a timeout: a
// lower-named proposer was heard at work within the bound of this
// proposer's own timeout (it may still finish, and a new ballot from here
// would cancel its round), and this proposer has not stood back
// maxStandBacks times in a row already.
func (px *Paxos) standingBack() bool {
	if px.lower && px.ticks-px.lowerAt < 2*px.base() && px.backs < maxStandBacks {
		px.backs++
		return true
	}
	px.backs = 0
	return false
}

// Tick advances time: a proposer that has not seen its value chosen in time
// tries again with a higher round.
func (px *Paxos) Tick() []PaxosOut {
	px.ticks++
	if !px.proposing || px.chosen != nil || px.Halted() {
		return nil
	}
	px.elapsed++
	px.waited++
	if px.elapsed >= px.timeout {
		if px.standingBack() {
			px.rearm() // look again after another timeout
			return nil
		}
		return px.attempt()
	}
	return px.maybeAccept()
}

// send delivers m to this peer's own acceptor and learner at once, and
// returns it (with what the local delivery produced) for the others.
func (px *Paxos) send(to PeerName, m *PaxosMsg) []PaxosOut {
	m.Size = uint32(px.expected)
	var out []PaxosOut
	if to == "" || to == px.self {
		out = append(out, px.Step(px.self, m)...)
	}
	if to != px.self {
		out = append(out, PaxosOut{To: to, Msg: m})
	}
	return out
}

// Step handles a message (already validated) from peer from.
func (px *Paxos) Step(from PeerName, m *PaxosMsg) []PaxosOut {
	if px.CheckSize(from, m) != nil || px.Halted() {
		return nil
	}
	px.known[from] = true
	px.maxRound = max(px.maxRound, m.Ballot.Round, m.Accepted.Round)
	if (m.Type == Prepare || m.Type == Accept) && m.Ballot.Peer == from && from < px.self {
		px.lower, px.lowerAt = true, px.ticks
	}
	switch m.Type {
	case Prepare:
		if m.Ballot.Compare(px.hs.Promised) < 0 {
			return px.send(from, &PaxosMsg{Type: Nack, Ballot: m.Ballot, Accepted: px.hs.Promised})
		}
		if m.Ballot != px.hs.Promised {
			px.hs.Promised = m.Ballot
			px.dirty = true
		}
		reply := &PaxosMsg{Type: Promise, Ballot: m.Ballot, Accepted: px.hs.Accepted}
		if px.hs.Accepted.Round != 0 {
			reply.Value = slices.Clone(px.hs.Value)
		}
		return px.send(from, reply)
	case Accept:
		if m.Ballot.Compare(px.hs.Promised) < 0 {
			return px.send(from, &PaxosMsg{Type: Nack, Ballot: m.Ballot, Accepted: px.hs.Promised})
		}
		if m.Ballot != px.hs.Promised || m.Ballot != px.hs.Accepted {
			px.hs.Promised, px.hs.Accepted = m.Ballot, m.Ballot
			px.hs.Value = slices.Clone(m.Value)
			px.dirty = true
		}
		return px.send("", &PaxosMsg{Type: Accepted, Ballot: m.Ballot, Value: slices.Clone(m.Value)})
	case Accepted:
		v := px.votes[m.Ballot]
		if v == nil {
			v = map[PeerName]bool{}
			px.votes[m.Ballot] = v
		}
		v[from] = true
		if len(v) >= px.quorum && px.chosen == nil {
			px.chosen = slices.Clone(m.Value)
			px.proposing = false
		}
	case Promise:
		if px.proposing && m.Ballot == px.ballot && !px.sentValue {
			px.promises[from] = m
			return px.maybeAccept()
		}
	case Nack:
		// The round is already noted in maxRound; the next attempt (on
		// timeout) goes above it.
	}
	return nil
}

// maybeAccept sends Accept once a quorum has promised and either every
// expected peer is known or patience has run out.
func (px *Paxos) maybeAccept() []PaxosOut {
	if !px.proposing || px.sentValue || len(px.promises) < px.quorum {
		return nil
	}
	var best *PaxosMsg
	for _, p := range px.promises {
		if p.Accepted.Round != 0 && (best == nil || p.Accepted.Compare(best.Accepted) > 0) {
			best = p
		}
	}
	var value []PeerName
	if best != nil {
		value = slices.Clone(best.Value)
	} else {
		if len(px.known) < px.expected && px.waited < px.patience {
			return nil
		}
		for p := range px.known {
			value = append(value, p)
		}
		slices.Sort(value)
	}
	px.sentValue = true
	return px.send("", &PaxosMsg{Type: Accept, Ballot: px.ballot, Value: value})
}
