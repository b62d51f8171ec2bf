// Package ipammesh is the glue between the allocator (ipalloc) and the mesh:
// the gossiper on the mesh's "ipam" channel, the transport the allocator's
// owner loop sends through, and the routine that tells the allocator about
// every peer the mesh sees join. The router wires it (router/ipam.go,
// router/mesh.go, router/build.go), and so does the scale harness
// (internal/scale), so that what the harness measures is the router's glue.
// It lives apart from ipalloc so that the allocator talks to the mesh
// through its Transport interface only.
package ipammesh

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/mesh"
)

// Channel is the mesh channel the allocators talk on.
const Channel = "ipam"

// Gossiper plugs the allocator's gossip adapter (ipalloc.Gossip: the
// versioned push-pull frame, a queue for the owner loop) into the mesh
// (a mesh.Gossiper).
type Gossiper struct{ G *ipalloc.Gossip }

func (g Gossiper) OnBroadcast(from mesh.PeerName, data []byte) ([]byte, error) {
	return nil, g.G.OnBroadcast(ipalloc.PeerName(from), data)
}

func (g Gossiper) OnUnicast(from mesh.PeerName, data []byte) error {
	return g.G.OnUnicast(ipalloc.PeerName(from), data)
}

func (g Gossiper) LocalState() []byte { return g.G.LocalState() }

func (g Gossiper) MergeRemoteState(data []byte) error { return g.G.MergeRemoteState(data) }

// Transport sends the allocator's messages on its channel (an
// ipalloc.Transport).
//
// A message to a peer the mesh does not know yet is parked, not lost: the
// core may learn of a peer from its first ipam message (a broadcast or a
// unicast can arrive before memberlist's news that the peer is alive),
// and it sends some messages only once, when it first learns of a peer:
// the ring it unicasts to a newcomer (Peer.AddPeer), which the newcomer's
// rejoin hold waits for. RunMembers sends what is parked for a peer as
// soon as the mesh sees it join. Parked messages are bounded (maxParked
// per peer, the oldest dropped; maxParkedPeers peers) and expire after
// parkFor: a peer the mesh never sees (a name nobody runs) costs little.
type Transport struct {
	m  *mesh.Mesh
	ch *mesh.Channel

	mu     sync.Mutex
	parked map[mesh.PeerName]*parking
	resend map[mesh.PeerName][]byte // the newest ring whose send failed, by peer; a retry routine runs for each
	done   chan struct{}            // closed when RunMembers ends: the retries stop
	closed bool
	wg     sync.WaitGroup
	// The ring over the broadcast limit being spread (Broadcast), its
	// generation, whether routineSpread runs, and this peer's ranges in
	// the last ring broadcast (nil before the first).
	spreadData []byte
	spreadGen  uint64
	spreading  bool
	lastOwned  []ipalloc.Range
	// Counters for tests and the scale harness.
	parkedN, unparkedN, expiredN, resentN, resendFailedN uint64
	spreadN, spreadSentN, spreadFailedN, deferredN       uint64
	overLimitN                                           uint64
}

type parking struct {
	since time.Time
	msgs  [][]byte
}

const (
	maxParked      = 16
	maxParkedPeers = 256
	parkFor        = time.Minute
)

// NewTransport returns the transport of the allocator on ch, a channel
// of m.
func NewTransport(m *mesh.Mesh, ch *mesh.Channel) *Transport {
	return &Transport{m: m, ch: ch, parked: map[mesh.PeerName]*parking{}, resend: map[mesh.PeerName][]byte{}, done: make(chan struct{})}
}

// Resends of a ring whose unicast failed (a stream refused by a busy
// peer, a timeout): resendTries, the first after resendAfter, doubling.
// A ring is state, not an event: sending it again is always safe, and a
// newer ring for the same peer replaces the one waiting.
const (
	resendTries = 4
	resendAfter = time.Second
)

// Broadcast gossips data on the channel, and spreads a ring in which this
// peer's own ranges changed to every peer by unicast, as below.
func (t *Transport) Broadcast(data []byte) error {
	owned, ring := t.ownedIn(data)
	t.mu.Lock()
	changed := ring && len(t.lastOwned) > 0 && !slices.Equal(owned, t.lastOwned)
	if ring {
		t.lastOwned = owned
	}
	t.mu.Unlock()
	err := t.ch.Broadcast(data)
	tooLarge := errors.Is(err, mesh.ErrTooLarge)
	if !ring || err != nil && !tooLarge {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if tooLarge {
		t.overLimitN++
	}
	if !changed {
		if tooLarge {
			t.deferredN++
		}
		return nil
	}
	t.spreadN++
	t.spreadData, t.spreadGen = data, t.spreadGen+1
	if t.spreading || t.closed {
		return nil
	}
	t.spreading = true
	t.wg.Add(1)
	go t.routineSpread()
	return nil
}

// Spreading a ring. The core broadcasts its whole ring when this peer's
// own ranges change (a donation given or taken, a reclaim, a leave) and,
// every gossip interval, when anything else in it changed: its free
// counts, or news merged from a peer's ring (that is how rings relay).
// That relay
// carries news to everyone only while every ring fits a broadcast: one
// broadcast reaches about RetransmitMult*log10(N) peers, and a ring over
// the limit (mesh.MaxBroadcastSize: the whole ring passes it at about 60
// owners of an evenly claimed ring, and from about 20 once donations have
// split the ranges) is refused, the relays' too. Near the limit, where
// some nodes' rings fit and others' do not, a change died out half way
// (a donation to a 65th node reached 13 of 65 nodes in 3 minutes with
// push-pull off); past it, a change reached the other peers only by
// push-pull (a random peer every 30 s to 3 min), so a range donated to a
// new node stayed unknown to most of the cluster for minutes: their
// routes to its pods went to the donor.
//
// Now a ring in which this peer's own ranges differ from the ring it
// broadcast before is also unicast to every peer the mesh sees alive,
// whatever its size, spreadConcurrency streams at a time, off the core's
// send routine; a failed stream is sent again as any ring is (failed). A newer ring
// replaces the one being spread: the peers not reached yet get the newer
// one, and a pass that saw a newer ring starts over for the peers it
// already sent the older one, at most one pass per spreadEvery. Left to
// the broadcast and to push-pull: a ring in which this peer's ranges did
// not change (free counts only guide the choice of a donor, and another
// peer's change is that peer's to spread); the first ring this transport
// broadcasts (a claim that every peer made alike, or a restart's ring,
// which the others know: else a consensus claim of N peers would cost
// N(N-1) streams); and the first ranges of a peer that owned none (a
// newcomer's donation: its donor, whose ranges shrank, spreads the same
// change). One change costs N-1 streams of the whole ring (about 16 KB
// at 1,000 owners); docs/benchmarks.md, Scale, has the figures; ring
// deltas would cut the size.
const (
	spreadConcurrency = 8
	spreadEvery       = time.Second
)

// ownedIn decodes data and, if it is a ring, lists this peer's ranges in
// it (never nil).
func (t *Transport) ownedIn(data []byte) ([]ipalloc.Range, bool) {
	m, err := ipalloc.DecodeMsg(data)
	if err != nil {
		return nil, false
	}
	rm, ok := m.(*ipalloc.RingMsg)
	if !ok || rm.Ring == nil {
		return nil, false
	}
	owned := rm.Ring.Owned(ipalloc.PeerName(t.m.Name()))
	if owned == nil {
		owned = []ipalloc.Range{}
	}
	return owned, true
}

// routineSpread unicasts the newest ring to spread to every live peer,
// pass after pass while a newer one came during the pass.
func (t *Transport) routineSpread() {
	defer t.wg.Done()
	for {
		t.mu.Lock()
		gen := t.spreadGen
		t.mu.Unlock()
		began := time.Now()
		var peers []mesh.PeerName
		for _, p := range t.m.Peers() {
			if !p.Self && (p.State == mesh.StateAlive || p.State == mesh.StateSuspect) {
				peers = append(peers, p.Name)
			}
		}
		sem := make(chan struct{}, spreadConcurrency)
		var pass sync.WaitGroup
	peersLoop:
		for _, p := range peers {
			select {
			case <-t.done:
				break peersLoop
			default:
			}
			select {
			case <-t.done:
				break peersLoop
			case sem <- struct{}{}:
			}
			t.mu.Lock()
			data := t.spreadData // the newest: a ring is state
			t.mu.Unlock()
			pass.Add(1)
			go func() {
				defer pass.Done()
				defer func() { <-sem }()
				err := t.ch.SendTo(p, data)
				t.mu.Lock()
				if err == nil {
					t.spreadSentN++
				} else {
					t.spreadFailedN++
				}
				t.mu.Unlock()
				if err != nil {
					t.failed(p, data, err)
				}
			}()
		}
		pass.Wait()
		t.mu.Lock()
		if t.spreadGen == gen || t.closed {
			t.spreading = false
			t.mu.Unlock()
			return
		}
		t.mu.Unlock()
		// A newer ring came during the pass: the next pass starts
		// spreadEvery after this one began, so that a burst of changes
		// (a seed donating to many new nodes) costs a pass a second,
		// with the newest ring, not a pass each.
		timer := time.NewTimer(spreadEvery - time.Since(began))
		select {
		case <-t.done:
			timer.Stop()
			t.mu.Lock()
			t.spreading = false
			t.mu.Unlock()
			return
		case <-timer.C:
		}
	}
}

// Spread counts what Broadcast did with rings: those spread by unicast
// (Rings, of any size), the unicasts that carried them (Sent, Failed:
// failed ones are sent again as any failed ring), the rings over the
// broadcast limit (OverLimit, spread or not), and those of them left to
// push-pull alone (Deferred: free counts only, the first, a newcomer's).
type Spread struct{ Rings, Sent, Failed, OverLimit, Deferred uint64 }

// Spread returns the counts of spread rings.
func (t *Transport) Spread() Spread {
	t.mu.Lock()
	defer t.mu.Unlock()
	return Spread{t.spreadN, t.spreadSentN, t.spreadFailedN, t.overLimitN, t.deferredN}
}

func (t *Transport) SendTo(p ipalloc.PeerName, data []byte) error {
	err := t.ch.SendTo(mesh.PeerName(p), data)
	if err != nil && !errors.Is(err, mesh.ErrUnknownPeer) {
		t.failed(mesh.PeerName(p), data, err)
	}
	if !errors.Is(err, mesh.ErrUnknownPeer) {
		return err
	}
	if !t.park(mesh.PeerName(p), data) {
		return err
	}
	// The mesh may have learnt of p since: then RunMembers's flush may
	// have run before the message was parked.
	if _, ok := t.m.Peer(mesh.PeerName(p)); ok {
		t.Flush(mesh.PeerName(p))
	}
	return nil
}

// park keeps data for p; false if there is no room.
func (t *Transport) park(p mesh.PeerName, data []byte) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	for q, pk := range t.parked {
		if now.Sub(pk.since) > parkFor {
			t.expiredN += uint64(len(pk.msgs))
			delete(t.parked, q)
		}
	}
	pk := t.parked[p]
	if pk == nil {
		if len(t.parked) >= maxParkedPeers {
			return false
		}
		pk = &parking{since: now}
		t.parked[p] = pk
	}
	if len(pk.msgs) == maxParked {
		pk.msgs = pk.msgs[1:]
		t.expiredN++
	}
	pk.msgs = append(pk.msgs, data)
	t.parkedN++
	return true
}

// Flush sends what is parked for p, in order. A send that fails is not
// parked again (a ring is sent again, see failed; the core retries what
// else it must, and gossip heals the rest).
func (t *Transport) Flush(p mesh.PeerName) {
	t.mu.Lock()
	pk := t.parked[p]
	delete(t.parked, p)
	t.mu.Unlock()
	if pk == nil {
		return
	}
	for _, data := range pk.msgs {
		err := t.ch.SendTo(p, data)
		if err == nil {
			t.mu.Lock()
			t.unparkedN++
			t.mu.Unlock()
			continue
		}
		t.failed(p, data, err)
	}
}

// failed resends data later if it is a ring and the send failed on the
// way (not: too large, peer unreachable or left, mesh closed).
func (t *Transport) failed(p mesh.PeerName, data []byte, err error) {
	if errors.Is(err, mesh.ErrTooLarge) || errors.Is(err, mesh.ErrPeerUnreachable) || errors.Is(err, mesh.ErrClosed) || errors.Is(err, mesh.ErrNotStarted) {
		return
	}
	if m, derr := ipalloc.DecodeMsg(data); derr != nil {
		return
	} else if _, ring := m.(*ipalloc.RingMsg); !ring {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	_, running := t.resend[p]
	if !running && len(t.resend) >= maxParkedPeers {
		return
	}
	if t.closed {
		return
	}
	t.resend[p] = data
	if running {
		return
	}
	t.wg.Add(1)
	go t.routineResend(p)
}

// routineResend sends the newest failed ring for p again, with backoff.
func (t *Transport) routineResend(p mesh.PeerName) {
	defer t.wg.Done()
	wait := resendAfter
	for try := 0; try < resendTries; try++ {
		timer := time.NewTimer(wait/2 + rand.N(wait/2+1)) // a backoff between tries, jittered
		select {
		case <-t.done:
			timer.Stop()
			return
		case <-timer.C:
		}
		wait *= 2
		t.mu.Lock()
		data := t.resend[p]
		t.mu.Unlock()
		err := t.ch.SendTo(p, data)
		t.mu.Lock()
		if err == nil {
			t.resentN++
			if bytes.Equal(t.resend[p], data) {
				delete(t.resend, p)
				t.mu.Unlock()
				return
			}
			t.mu.Unlock() // a newer ring failed meanwhile
			continue
		}
		t.mu.Unlock()
		if errors.Is(err, mesh.ErrClosed) || errors.Is(err, mesh.ErrPeerUnreachable) {
			break
		}
	}
	t.mu.Lock()
	t.resendFailedN++
	delete(t.resend, p)
	t.mu.Unlock()
}

// stop ends the retries and waits for them.
func (t *Transport) stop() {
	t.mu.Lock()
	if !t.closed {
		t.closed = true
		close(t.done)
	}
	t.mu.Unlock()
	t.wg.Wait()
}

// Resent counts the rings sent again after a failed unicast, and those
// given up after resendTries.
func (t *Transport) Resent() (sent, failed uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.resentN, t.resendFailedN
}

// Parked counts the messages parked for a peer the mesh did not know yet,
// those sent once it did, and those dropped (expired, or over the bound).
func (t *Transport) Parked() (parked, sent, dropped uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.parkedN, t.unparkedN, t.expiredN
}

// RunMembers tells svc about every peer m sees, then about each peer that
// joins or rejoins (all of them again when events were dropped), and sends
// what tr parked for it (tr may be nil), until ctx ends or m closes.
//
// One event adds one peer: a newcomer that learns N peers from its first
// push-pull gets N events, and adding all N peers on each would queue N²
// entries in its allocator's inbox (1,024), which then drops the rings
// the others send it.
func RunMembers(ctx context.Context, m *mesh.Mesh, svc *ipalloc.Service, tr *Transport) {
	events, cancel := m.Subscribe(256)
	defer cancel()
	var flushing sync.WaitGroup
	defer func() {
		flushing.Wait()
		if tr != nil {
			tr.stop()
		}
	}()
	flush := func(p mesh.PeerName) {
		if tr == nil {
			return
		}
		tr.mu.Lock()
		_, ok := tr.parked[p]
		tr.mu.Unlock()
		if ok {
			// Off this loop: a send blocks up to the mesh's TCP timeout.
			flushing.Add(1)
			go func() { defer flushing.Done(); tr.Flush(p) }()
		}
	}
	add := func(p mesh.Peer) {
		if !p.Self {
			svc.AddPeer(ipalloc.PeerName(p.Name))
			flush(p.Name)
		}
	}
	addAll := func() {
		for _, p := range m.Peers() {
			add(p)
		}
	}
	addAll()
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				return
			}
			switch {
			case ev.Dropped > 0:
				addAll()
			case ev.Kind == mesh.EventJoined || ev.Kind == mesh.EventRejoined:
				add(ev.Peer)
			}
		}
	}
}

var (
	_ mesh.Gossiper     = Gossiper{}
	_ ipalloc.Transport = (*Transport)(nil)
)

// The demand-driven pull (RunPull): a peer that started without state
// allocates only once it has merged a claimed ring from every other owner
// and live peer (ipalloc's rejoin hold). They unicast it their rings when
// they learn of it (Peer.AddPeer), and a failed send is retried above;
// what still misses after PullGrace is pulled, one peer per PullEvery:
// a push-pull with that peer (Mesh.PushPull), which carries its ring,
// instead of waiting for the periodic push-pull with a random peer (30 s
// to 3 min) to happen upon it. Only the tail is pulled: while the hold
// waits for more than PullTail peers, their unicasts are still on the way
// (a newcomer) or everyone is in the same position (a fresh cluster,
// where pulling every missing ring would cost N² push-pulls); see
// docs/benchmarks.md, Scale.
const (
	PullEvery = 2 * time.Second
	PullGrace = 5 * time.Second
	PullTail  = 8
	pullAgain = 30 * time.Second // a pulled peer is not pulled again before this
)

// Pulls counts the push-pulls RunPull made, and those that failed.
type Pulls struct{ Made, Failed atomic.Uint64 }

// RunPull pulls the rings svc's rejoin hold still waits for (see above)
// until ctx ends; counts may be nil.
func RunPull(ctx context.Context, m *mesh.Mesh, svc *ipalloc.Service, counts *Pulls) {
	if counts == nil {
		counts = &Pulls{}
	}
	waitedSince := map[ipalloc.PeerName]time.Time{}
	pulled := map[ipalloc.PeerName]time.Time{}
	t := time.NewTicker(PullEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		waits := svc.RejoinWaits()
		still := map[ipalloc.PeerName]bool{}
		for _, q := range waits {
			still[q] = true
			if _, ok := waitedSince[q]; !ok {
				waitedSince[q] = now
			}
		}
		for q := range waitedSince {
			if !still[q] {
				delete(waitedSince, q)
				delete(pulled, q)
			}
		}
		if len(waits) == 0 || len(waits) > PullTail {
			continue
		}
		var pick ipalloc.PeerName
		for _, q := range waits { // sorted: the first due
			if now.Sub(waitedSince[q]) < PullGrace || now.Sub(pulled[q]) < pullAgain {
				continue
			}
			if p, ok := m.Peer(mesh.PeerName(q)); !ok || p.State == mesh.StateUnreachable || p.State == mesh.StateLeft {
				continue
			}
			pick = q
			break
		}
		if pick == "" {
			continue
		}
		pulled[pick] = now
		counts.Made.Add(1)
		if err := m.PushPull(mesh.PeerName(pick)); err != nil {
			counts.Failed.Add(1)
		}
	}
}
