package ipalloc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/weft-net/weft/state"
)

// Buckets and keys of the allocator's state.
const (
	bucketIPAM        = "ipalloc"
	bucketAllocations = "ipalloc-allocations"
	keyUniverse       = "universe"
	keyRing           = "ring"
	keyPaxos          = "paxos"
	keyRemoved        = "removed"
	keyReclaimed      = "reclaimed"
	keyWithdrawn      = "withdrawn"
	keyMembers        = "members"
	keyLeft           = "left"
	keyRejoin         = "rejoin"
)

// TickInterval is the length of one core tick (DefaultTiming assumes it).
const TickInterval = 100 * time.Millisecond

// internalPrefix starts the container id of keys the router holds for itself
// (the bridge's gateway address). The CNI spec forbids it as a first
// character of a container id, so no pod can collide, and GC skips them.
const internalPrefix = "_weft_"

// GatewayKey is the key under which the router holds its bridge's address.
func GatewayKey(bridge string) Key {
	return Key{ContainerID: internalPrefix + "gateway", IfName: bridge}
}

// Internal reports whether k is held by the router itself.
func (k Key) Internal() bool { return strings.HasPrefix(k.ContainerID, internalPrefix) }

// reclaimedPrefix starts the container id of ReclaimedKey.
const reclaimedPrefix = internalPrefix + "reclaimed_"

// ReclaimedKey is the placeholder under which the router holds addr, which
// it found in use on its bridge after its state was lost: a pod it cannot
// name holds it. CNI GC frees it once every attachment the runtime lists
// is known (so none can be the pod), and so does a release that names
// the address (api.Client.ReleaseAddress).
func ReclaimedKey(bridge string, addr Address) Key {
	return Key{ContainerID: reclaimedPrefix + addr.String(), IfName: bridge}
}

// Reclaimed reports whether k is a ReclaimedKey: internal, but most likely
// a pod.
func (k Key) Reclaimed() bool { return strings.HasPrefix(k.ContainerID, reclaimedPrefix) }

// Meta is what the service records beside an allocation, for operators.
type Meta struct {
	Netns        string    `json:"netns,omitempty"`
	PodNamespace string    `json:"podNamespace,omitempty"`
	PodName      string    `json:"podName,omitempty"`
	Created      time.Time `json:"created"`
}

type record struct {
	Address string `json:"address"`
	Meta
}

// Transport carries the core's messages to other peers (the mesh, through
// an adapter: ipalloc does not import it). Both may be slow; the service
// calls them from its own sender goroutine, never under its lock.
type Transport interface {
	Broadcast(data []byte) error
	SendTo(peer PeerName, data []byte) error
}

// ServiceConfig configures a Service.
type ServiceConfig struct {
	Self     PeerName
	Universe netip.Prefix // from ParseUniverse
	Init     Init         // zero: consensus among 1, a lone peer
	DB       *state.DB
	Log      *slog.Logger
	Now      func() time.Time
	// GCGrace protects an allocation against a GC that raced its ADD: one
	// made less than GCGrace before the GC (by Now) is never collected, as
	// the runtime's list of valid attachments may predate it. 0: none.
	GCGrace time.Duration
	// OnSave, if set, is told of every save the owner commits or fails
	// (one transaction, one fsync), with how long it took by Now: for
	// metrics. It runs on the owner and must be quick.
	OnSave func(took time.Duration, err error)
	// ExternalMembers: the peers that share the ring are also recorded
	// outside (the ConfigMap in --kube mode), and a peer that starts
	// without state does not allocate before they have been given once
	// (SetExternalMembers; PeerConfig.ExternalMembers).
	ExternalMembers bool
}

// DefaultGCGrace is a GCGrace for a router: longer than a runtime takes
// from listing its attachments to the end of the GC it sends them with.
const DefaultGCGrace = time.Minute

// Service is the IO shell around the pure Peer: its owner loop (Run,
// service_loop.go) serialises calls into steps, keeps the Ready contract
// (persist, then send, then answer) with one save per step, ticks the
// core, and makes allocation a blocking call for the local API.
type Service struct {
	cfg      ServiceConfig
	db       *state.DB
	log      *slog.Logger
	universe netip.Prefix

	reqs    chan *request        // to the loop: callers waiting for a step
	inbox   chan inbound         // to the loop: gossip, which does not wait
	dropped atomic.Uint64        // inbound dropped on a full inbox
	saves   atomic.Uint64        // transactions committed
	calling atomic.Int64         // callers waiting for the loop to take their request (TestServiceLoopOneSavePerStep waits on it)
	saved   atomic.Pointer[Ring] // the ring on disk: the only one offered in a full-state exchange

	running atomic.Bool   // Run's loop takes the steps (set under mu)
	stopped chan struct{} // closed when Run ended

	// mu is held by whoever runs a step: the loop, or a caller while no
	// loop runs. What follows is the owner's.
	mu      sync.Mutex
	p       *Peer
	meta    map[Key]Meta          // of held allocations, and of ones being made
	waiters map[Key][]chan Answer // callers of Allocate waiting for an answer
	out     chan outgoing         // to routineSend
	tr      Transport
	broken  error           // set when the state could not be saved nor reloaded
	leaving []chan struct{} // callers of Leave waiting for the heir

	ringChanged chan struct{} // signalled (coalesced) after a ring change is saved
}

// ErrBroken wraps every error of a service whose state could not be saved
// nor reloaded: the router must restart, rebuilding from what is on disk.
var ErrBroken = errors.New("ipalloc state unusable; restart the router")

// Err returns the error that made the service unusable, or nil.
func (s *Service) Err() error {
	var err error
	s.read(func() { err = s.broken })
	return err
}

type outgoing struct {
	broadcast []byte
	to        PeerName
	data      []byte
}

// NewService loads the state and builds the core. A lone peer (consensus
// among 1, the default) claims the whole range at once.
func NewService(cfg ServiceConfig) (*Service, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Init.Consensus == 0 && len(cfg.Init.Seeds) == 0 && !cfg.Init.Observer {
		cfg.Init.Consensus = 1
	}
	s := &Service{
		cfg: cfg, db: cfg.DB, log: cfg.Log, universe: cfg.Universe,
		meta: map[Key]Meta{}, waiters: map[Key][]chan Answer{},
		out:         make(chan outgoing, 4096),
		ringChanged: make(chan struct{}, 1),
		reqs:        make(chan *request),
		inbox:       make(chan inbound, inboxSize),
		stopped:     make(chan struct{}),
	}
	saved, err := cfg.DB.Get(bucketIPAM, keyUniverse)
	if err != nil {
		return nil, err
	}
	if len(saved) > 0 && string(saved) != cfg.Universe.String() {
		return nil, fmt.Errorf("%w: the state in %s was made for range %s, but --ipalloc-range is %s; "+
			"start with --ipalloc-range=%s, or (only on a node without pods) remove the state file to start afresh",
			ErrBadRange, cfg.DB.Path(), saved, cfg.Universe, saved)
	}
	if err := cfg.DB.Put(bucketIPAM, keyUniverse, []byte(cfg.Universe.String())); err != nil {
		return nil, err
	}
	if err := s.load(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if cfg.Init.Consensus == 1 {
		// A lone peer agrees with itself: run its core until it has claimed.
		for i := 0; i < 1000 && !s.p.Status().Claimed; i++ {
			s.p.Tick()
			if err := s.flushLocked(); err != nil {
				return nil, err
			}
		}
	}
	if err := s.flushLocked(); err != nil {
		return nil, err
	}
	return s, nil
}

// HasRing reports whether the state in db holds a claimed ring: a peer
// that has one resumes it, whatever its first-claim mode says.
func HasRing(db *state.DB) (bool, error) {
	data, err := db.Get(bucketIPAM, keyRing)
	if err != nil || len(data) == 0 {
		return false, err
	}
	r, err := decodeSavedRing(data)
	if err != nil {
		return false, nil // NewService reports it
	}
	return !r.Empty(), nil
}

// load reads the hard state and the allocations' metadata, and builds the core.
func (s *Service) load() error {
	var hs HardState
	var bad []string
	err := s.db.View(bucketIPAM, func(b *bolt.Bucket) error {
		if b == nil {
			return nil
		}
		if data := b.Get([]byte(keyRing)); len(data) > 0 {
			r, err := decodeSavedRing(data)
			if err != nil {
				return fmt.Errorf("the ring saved in %s is unreadable: %w (move the file away to start afresh; allocations on this node would be lost)", s.db.Path(), err)
			}
			if err := r.Validate(); err != nil {
				return fmt.Errorf("the ring saved in %s is invalid: %w", s.db.Path(), err)
			}
			hs.Ring = r
		}
		if data := b.Get([]byte(keyPaxos)); len(data) > 0 {
			if err := json.Unmarshal(data, &hs.Paxos); err != nil {
				return fmt.Errorf("the consensus state saved in %s is unreadable: %w", s.db.Path(), err)
			}
		}
		if data := b.Get([]byte(keyRemoved)); len(data) > 0 {
			if err := json.Unmarshal(data, &hs.Removed); err != nil {
				return fmt.Errorf("the removed peers saved in %s are unreadable: %w", s.db.Path(), err)
			}
		}
		hs.Rejoin = string(b.Get([]byte(keyRejoin))) == "1"
		if data := b.Get([]byte(keyReclaimed)); len(data) > 0 {
			if err := json.Unmarshal(data, &hs.Reclaimed); err != nil {
				return fmt.Errorf("the finished reclaims saved in %s are unreadable: %w", s.db.Path(), err)
			}
		}
		if data := b.Get([]byte(keyWithdrawn)); len(data) > 0 {
			if err := json.Unmarshal(data, &hs.Withdrawn); err != nil {
				return fmt.Errorf("the withdrawn removals saved in %s are unreadable: %w", s.db.Path(), err)
			}
		}
		if data := b.Get([]byte(keyMembers)); len(data) > 0 {
			if err := json.Unmarshal(data, &hs.Members); err != nil {
				return fmt.Errorf("the peers of the ring saved in %s are unreadable: %w", s.db.Path(), err)
			}
			for _, q := range hs.Members {
				if err := ValidatePeerName(q); err != nil {
					return fmt.Errorf("the peers of the ring saved in %s: %w", s.db.Path(), err)
				}
			}
		}
		if data := b.Get([]byte(keyLeft)); len(data) > 0 {
			hs.Left = PeerName(data)
			if err := ValidatePeerName(hs.Left); err != nil {
				return fmt.Errorf("the heir saved in %s (this peer has left the cluster) is invalid: %w", s.db.Path(), err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	if hs.Ring != nil && hs.Ring.Universe != RangeOf(s.universe) {
		return fmt.Errorf("the ring saved in %s is invalid: it is for range %s, but --ipalloc-range is %s", s.db.Path(), hs.Ring.Universe, s.universe)
	}
	meta := map[Key]Meta{}
	err = s.db.View(bucketAllocations, func(b *bolt.Bucket) error {
		if b == nil {
			return nil
		}
		return b.ForEach(func(kb, v []byte) error {
			k, ok := parseDBKey(kb)
			var rec record
			if !ok || json.Unmarshal(v, &rec) != nil {
				bad = append(bad, fmt.Sprintf("%q: unreadable record", kb))
				return nil
			}
			ip, err := netip.ParseAddr(rec.Address)
			if err != nil {
				bad = append(bad, fmt.Sprintf("%s: bad address %q", k, rec.Address))
				return nil
			}
			addr, err := AddressFrom(ip)
			if err != nil {
				bad = append(bad, fmt.Sprintf("%s: %v", k, err))
				return nil
			}
			if hs.Allocations == nil {
				hs.Allocations = map[Key]Address{}
			}
			hs.Allocations[k] = addr
			meta[k] = rec.Meta
			return nil
		})
	})
	if err != nil {
		return err
	}
	for _, b := range bad {
		s.log.Error("ipalloc: a saved allocation could not be restored; it stays on disk", "allocation", b)
	}
	if (hs.Ring == nil || hs.Ring.Empty()) && len(hs.Allocations) > 0 {
		return fmt.Errorf("the state in %s holds %d allocations but no ring, so it cannot tell which addresses are this peer's; "+
			"restore the file from a backup, or (only after removing this node's pods) remove it to start afresh", s.db.Path(), len(hs.Allocations))
	}
	p, err := NewPeer(PeerConfig{Self: s.cfg.Self, Universe: RangeOf(s.universe), Init: s.cfg.Init, StateName: s.db.Path(),
		ExternalMembers: s.cfg.ExternalMembers}, hs)
	if err != nil {
		return err
	}
	s.p, s.meta = p, meta
	saved := NewRing(RangeOf(s.universe))
	if hs.Ring != nil {
		saved = p.Gossip() // the saved ring (with the seed of a ring saved before seeds)
	}
	s.setSaved(saved)
	for k := range meta {
		if _, ok := p.Lookup(k); !ok {
			delete(s.meta, k) // not restored (reported by the core)
		}
	}
	if n := len(s.meta); n > 0 {
		s.log.Info("ipalloc: restored allocations from state", "count", n, "state", s.db.Path())
	}
	return nil
}

func dbKey(k Key) []byte { return []byte(k.ContainerID + "\x00" + k.IfName) }

func parseDBKey(b []byte) (Key, bool) {
	id, ifname, ok := strings.Cut(string(b), "\x00")
	return Key{ContainerID: id, IfName: ifname}, ok
}

// flushLocked acts on every Ready the core has: persist them all in one
// transaction, then queue the sends, then answer and log. If persisting
// fails, the core is rebuilt from disk and nothing of those Readies is
// sent or answered.
func (s *Service) flushLocked() error {
	if s.broken != nil {
		return s.broken
	}
	var rds []Ready
	for s.p.HasReady() {
		rds = append(rds, s.p.Ready())
	}
	if len(rds) > 0 {
		if err := s.persistLocked(rds); err != nil {
			s.log.Error("ipalloc: saving state failed; reloading it from disk", "err", err)
			if lerr := s.load(); lerr != nil {
				// Memory may now hold what the disk does not: answer
				// nothing from it any more.
				s.broken = fmt.Errorf("%w: %w", ErrBroken, errors.Join(err, lerr))
			}
			for k, ws := range s.waiters {
				for _, w := range ws {
					w <- Answer{Key: k, Err: fmt.Errorf("saving the allocation: %w", err)}
				}
				delete(s.waiters, k)
			}
			return err
		}
	}
	if slices.ContainsFunc(rds, func(rd Ready) bool { return rd.Ring != nil }) {
		s.setSaved(s.p.Gossip()) // the last Ready's ring, saved now; empty once this peer knows it is removed
		select {
		case s.ringChanged <- struct{}{}:
		default:
		}
	}
	for _, rd := range rds {
		if rd.Broadcast != nil {
			s.queue(outgoing{broadcast: EncodeMsg(&RingMsg{Ring: rd.Broadcast})})
		}
		for _, m := range rd.Messages {
			s.queue(outgoing{to: m.To, data: EncodeMsg(m.Msg)})
		}
		for _, a := range rd.Answers {
			if a.Err != nil {
				if _, held := s.p.Lookup(a.Key); !held {
					delete(s.meta, a.Key)
				}
			}
			for _, w := range s.waiters[a.Key] {
				w <- a
			}
			delete(s.waiters, a.Key)
		}
		for _, e := range rd.Events {
			if e.Warn {
				s.log.Warn(e.Text)
			} else {
				s.log.Info(e.Text)
			}
		}
	}
	if _, _, done := s.p.Leaving(); done {
		for _, ch := range s.leaving {
			close(ch)
		}
		s.leaving = nil
	}
	return nil
}

func (s *Service) queue(o outgoing) {
	if s.tr == nil {
		return // no mesh (tests, a lone peer before it starts): push-pull catches up
	}
	select {
	case s.out <- o:
	default:
		s.log.Warn("ipalloc: send queue full; dropping a message (gossip and retries recover it)")
	}
}

// setSaved records r (not changed afterwards) as the ring on disk, which
// LocalState offers.
func (s *Service) setSaved(r *Ring) { s.saved.Store(r) }

// persistLocked writes what rds say to persist, in order, in one
// transaction: each allocation under its own key, the ring once (the
// last one), and only when one of them changed it.
func (s *Service) persistLocked(rds []Ready) error {
	lastRing := -1
	some := false
	for i, rd := range rds {
		if rd.Ring != nil {
			lastRing = i
		}
		some = some || rd.Ring != nil || rd.Paxos != nil || rd.Removed != nil || rd.Members != nil || len(rd.Allocs) > 0 || rd.Left != "" || rd.Rejoin != nil
	}
	if !some {
		return nil
	}
	start := s.cfg.Now()
	now := start.UTC()
	err := s.db.UpdateTx(func(tx *bolt.Tx) error {
		for i, rd := range rds {
			if err := s.persistOne(tx, rd, i == lastRing, now); err != nil {
				return err
			}
		}
		return nil
	})
	if err == nil {
		s.saves.Add(1)
	}
	if s.cfg.OnSave != nil {
		s.cfg.OnSave(s.cfg.Now().Sub(start), err)
	}
	return err
}

// Saves counts the transactions the service committed (one per step that
// changed anything), for metrics.
func (s *Service) Saves() uint64 { return s.saves.Load() }

// persistOne writes one Ready in tx (its ring only if withRing).
func (s *Service) persistOne(tx *bolt.Tx, rd Ready, withRing bool, now time.Time) error {
	ipam, err := tx.CreateBucketIfNotExists([]byte(bucketIPAM))
	if err != nil {
		return err
	}
	put := func(key string, v any) error {
		data, err := json.Marshal(v)
		if err != nil {
			return err
		}
		return ipam.Put([]byte(key), data)
	}
	if rd.Ring != nil && withRing {
		if err := ipam.Put([]byte(keyRing), encodeSavedRing(rd.Ring)); err != nil {
			return err
		}
	}
	if rd.Paxos != nil {
		if err := put(keyPaxos, rd.Paxos); err != nil {
			return err
		}
	}
	if rd.Removed != nil {
		if err := put(keyRemoved, rd.Removed); err != nil {
			return err
		}
		if err := put(keyReclaimed, rd.Reclaimed); err != nil {
			return err
		}
		if err := put(keyWithdrawn, rd.Withdrawn); err != nil {
			return err
		}
	}
	if rd.Members != nil {
		if err := put(keyMembers, rd.Members); err != nil {
			return err
		}
	}
	if rd.Left != "" {
		if err := ipam.Put([]byte(keyLeft), []byte(rd.Left)); err != nil {
			return err
		}
	}
	if rd.Rejoin != nil {
		var err error
		if *rd.Rejoin {
			err = ipam.Put([]byte(keyRejoin), []byte("1"))
		} else {
			err = ipam.Delete([]byte(keyRejoin))
		}
		if err != nil {
			return err
		}
	}
	if len(rd.Allocs) == 0 {
		return nil
	}
	allocs, err := tx.CreateBucketIfNotExists([]byte(bucketAllocations))
	if err != nil {
		return err
	}
	for _, c := range rd.Allocs {
		if !c.Held {
			delete(s.meta, c.Key)
			if err := allocs.Delete(dbKey(c.Key)); err != nil {
				return err
			}
			continue
		}
		m := s.meta[c.Key]
		if m.Created.IsZero() {
			m.Created = now
		}
		s.meta[c.Key] = m
		data, err := json.Marshal(record{Address: c.Address.String(), Meta: m})
		if err != nil {
			return err
		}
		if err := allocs.Put(dbKey(c.Key), data); err != nil {
			return err
		}
	}
	return nil
}

// RingChanged is signalled after each saved change of the ring (several
// changes may come as one signal); read Snapshot for the ring itself. The
// data plane re-derives its routes from it.
func (s *Service) RingChanged() <-chan struct{} { return s.ringChanged }

// sendLanes is how many unicasts the service has in flight at once. A
// unicast is a stream (memberlist's SendReliable): to a peer that is slow
// or black-holed it takes up to the mesh's TCP timeout, and with one lane
// every other message (a donation request, the answer to one) waited
// behind it; the scale test saw single sends of 7 s and donation requests
// that waited out the allocation deadline (internal/scale). Each peer's
// messages keep one lane, so they stay in order.
const sendLanes = 16

// laneQueue is each lane's queue; a full lane drops (gossip and the core's
// retries recover), as the service's own queue does.
const laneQueue = 512

// routineSend delivers queued messages off the service's lock: broadcasts
// at once (the mesh only queues them), unicasts through sendLanes lanes
// chosen by the destination's name, each in order.
func (s *Service) routineSend(ctx context.Context, tr Transport) {
	var wg sync.WaitGroup
	var lanes [sendLanes]chan outgoing
	for i := range lanes {
		lanes[i] = make(chan outgoing, laneQueue)
		wg.Add(1)
		go func() { defer wg.Done(); s.routineLane(ctx, tr, lanes[i]) }()
	}
	defer wg.Wait()
	for {
		select {
		case <-ctx.Done():
			return
		case o := <-s.out:
			if o.broadcast != nil {
				s.deliver(tr, o)
				continue
			}
			select {
			case lanes[laneOf(o.to)] <- o:
			default:
				s.log.Warn("ipalloc: send queue to a peer full; dropping a message (gossip and retries recover it)", "to", o.to)
			}
		}
	}
}

// routineLane delivers one lane's messages in order until ctx ends.
func (s *Service) routineLane(ctx context.Context, tr Transport, lane <-chan outgoing) {
	for {
		select {
		case <-ctx.Done():
			return
		case o := <-lane:
			s.deliver(tr, o)
		}
	}
}

// laneOf is the lane of messages to p.
func laneOf(p PeerName) int {
	h := fnv.New32a()
	h.Write([]byte(p))
	return int(h.Sum32() % sendLanes)
}

func (s *Service) deliver(tr Transport, o outgoing) {
	var err error
	if o.broadcast != nil {
		err = tr.Broadcast(o.broadcast)
	} else {
		err = tr.SendTo(o.to, o.data)
	}
	if err != nil {
		s.log.Debug("ipalloc: sending failed (retried by the core or healed by gossip)", "to", o.to, "err", err)
	}
}

// Step takes a message from another peer and returns once its step is
// saved, with the core's error (tests, and callers that must know; gossip
// uses Deliver, which does not wait).
func (s *Service) Step(from PeerName, data []byte) error {
	m, err := DecodeMsg(data)
	if err != nil {
		return err
	}
	var serr error
	ferr := s.update(func() { serr = s.p.Step(from, m) })
	if ferr != nil {
		return ferr
	}
	var refused *RefusedRing
	if serr != nil && !errors.Is(serr, ErrRemovedPeer) && !errors.As(serr, &refused) { // the core logs refused rings
		s.log.Warn("ipalloc: refused a message", "from", from, "err", serr)
	}
	return serr
}

// LocalState is this peer's ring as saved, for a full-state exchange: the
// ring of the last Ready whose save succeeded (or the one loaded), never
// one whose save failed, also when the state could not be reloaded. It
// reads what the loop published and never waits for it.
func (s *Service) LocalState() []byte {
	return EncodeMsg(&RingMsg{Ring: s.saved.Load()})
}

// AddPeer tells the core about a member of the mesh; it does not wait.
func (s *Service) AddPeer(name PeerName) {
	if err := s.enqueue(inbound{from: name}); err != nil {
		s.log.Error("ipalloc: adding a peer", "peer", name, "err", err)
	}
}

// AddMembers tells the core about peers that share this ring whether or
// not the mesh sees them (Peer.AddMember; in --kube mode, the peers
// registered in the ConfigMap). It returns once they are on disk.
func (s *Service) AddMembers(names []PeerName) error {
	var errs []error
	ferr := s.update(func() {
		for _, q := range names {
			if q != s.cfg.Self {
				errs = append(errs, s.p.AddMember(q))
			}
		}
	})
	return errors.Join(append(errs, ferr)...)
}

// SetExternalMembers gives every member recorded outside this peer (the
// ConfigMap's registered peers): they join the members, and a hold that
// waited for them may end (Peer.SetExternalMembers). It returns once that
// is on disk.
func (s *Service) SetExternalMembers(names []PeerName) error {
	var err error
	ferr := s.update(func() { err = s.p.SetExternalMembers(names) })
	return errors.Join(err, ferr)
}

// Withdraw calls off this peer's reclaim of name while its barrier is open
// (Peer.Withdraw); it returns once that is on disk.
func (s *Service) Withdraw(name PeerName) error {
	var err error
	ferr := s.update(func() { err = s.p.Withdraw(name) })
	if err != nil {
		return err
	}
	return ferr
}

// Reclaiming reports whether this peer reclaims name (its removal is this
// peer's), and whether that reclaim has taken over already.
func (s *Service) Reclaiming(name PeerName) (reclaiming, done bool) {
	s.read(func() { reclaiming, done = s.p.Reclaiming(name) })
	return reclaiming, done
}

// PeerGone starts the reclaim of a peer that is gone for good (weft rmpeer);
// it returns once the decision is on disk.
func (s *Service) PeerGone(name PeerName) error {
	var err error
	ferr := s.update(func() { err = s.p.PeerGone(name) })
	if err != nil {
		return err
	}
	return ferr
}

// Prefix returns addr with the length of the pod network.
func (s *Service) Prefix(addr Address) netip.Prefix {
	return netip.PrefixFrom(addr.Addr(), s.universe.Bits())
}

// Universe is the pod range.
func (s *Service) Universe() netip.Prefix { return s.universe }

// Allocate returns k's address, allocating and saving a new one if needed.
// It waits (bounded by ctx and the core's deadline) while this peer waits
// for the first claim or for a donation.
func (s *Service) Allocate(ctx context.Context, k Key, m Meta) (netip.Addr, bool, error) {
	var (
		addr    netip.Addr
		settled bool // answered without waiting
		err     error
		ch      chan Answer
	)
	cerr := s.call(ctx, func() {
		if rerr := s.p.removedErr(); rerr != nil {
			settled, err = true, fmt.Errorf("allocating for %s: %w", k, rerr)
			return
		}
		if a, ok := s.p.Lookup(k); ok {
			settled, addr = true, a.Addr()
			return
		}
		ch = make(chan Answer, 1)
		s.waiters[k] = append(s.waiters[k], ch)
		if _, ok := s.meta[k]; !ok {
			s.meta[k] = m
		}
		s.p.Allocate(k)
	}, func(ferr error) {
		if !settled && ferr != nil {
			settled, err = true, fmt.Errorf("saving allocation of %s: %w", k, ferr)
		}
	})
	if cerr != nil {
		return netip.Addr{}, false, fmt.Errorf("allocating for %s: the allocator did not take the request in time: %w", k, cerr)
	}
	if settled {
		return addr, false, err
	}
	select {
	case a := <-ch:
		if a.Err != nil {
			return netip.Addr{}, false, fmt.Errorf("allocating for %s: %w", k, a.Err)
		}
		return a.Address.Addr(), true, nil
	case <-ctx.Done():
		var held bool
		var status PeerStatus
		s.read(func() {
			s.dropWaiterLocked(k, ch)
			var a Address
			if a, held = s.p.Lookup(k); held { // answered meanwhile
				addr = a.Addr()
			}
			status = s.p.Status()
		})
		if held {
			return addr, true, nil
		}
		return netip.Addr{}, false, fmt.Errorf("%w: still waiting for space (%s)", ErrNoSpace, status)
	}
}

func (s *Service) dropWaiterLocked(k Key, ch chan Answer) {
	ws := s.waiters[k]
	for i, w := range ws {
		if w == ch {
			s.waiters[k] = append(ws[:i:i], ws[i+1:]...)
			break
		}
	}
	if len(s.waiters[k]) == 0 {
		delete(s.waiters, k)
		if _, held := s.p.Lookup(k); !held {
			delete(s.meta, k)
		}
	}
}

// Lookup returns k's address.
func (s *Service) Lookup(k Key) (addr netip.Addr, ok bool) {
	s.read(func() {
		if s.broken != nil {
			return
		}
		var a Address
		a, ok = s.p.Lookup(k)
		addr = a.Addr()
	})
	return addr, ok
}

// Release frees k's address; it reports whether k held one.
func (s *Service) Release(k Key) (netip.Addr, bool, error) {
	var addr Address
	var ok bool
	if err := s.update(func() {
		addr, ok = s.p.Lookup(k)
		s.p.Release(k)
	}); err != nil {
		return netip.Addr{}, false, fmt.Errorf("saving release of %s: %w", k, err)
	}
	if !ok {
		return netip.Addr{}, false, nil
	}
	s.log.Debug("ipalloc: released", "key", k, "address", addr)
	return addr.Addr(), true, nil
}

// GC releases every pod allocation whose key is not in valid (the
// attachments the runtime still has), and returns what it released.
// Addresses re-claimed from the bridge (ReclaimedKey) are released too, but
// only when every valid attachment holds an address of its own here: a
// valid attachment this peer does not know may be the pod that uses one.
// An allocation younger than ServiceConfig.GCGrace is kept: its ADD may
// have raced the runtime's list.
func (s *Service) GC(valid []Key) ([]Allocation, error) {
	var drop []Allocation
	if err := s.update(func() { drop = s.gcLocked(valid) }); err != nil {
		return nil, fmt.Errorf("saving GC: %w", err)
	}
	return drop, nil
}

func (s *Service) gcLocked(valid []Key) []Allocation {
	young := s.cfg.Now().Add(-s.cfg.GCGrace)
	keep := make(map[Key]bool, len(valid))
	unknown := 0
	for _, k := range valid {
		keep[k] = true
		if _, ok := s.p.Lookup(k); !ok {
			unknown++
		}
	}
	var drop []Allocation
	for _, al := range s.p.Allocations() {
		pod := !al.Key.Internal() || (al.Key.Reclaimed() && unknown == 0)
		if m, ok := s.meta[al.Key]; ok && s.cfg.GCGrace > 0 && m.Created.After(young) {
			continue // made after the runtime may have listed its attachments
		}
		if pod && !keep[al.Key] {
			drop = append(drop, al)
			s.p.Release(al.Key)
		}
	}
	return drop
}

// ReleaseReclaimed frees addr if it is held as re-claimed from the bridge
// (ReclaimedKey): the pod that used it is gone. It reports whether it was.
func (s *Service) ReleaseReclaimed(addr netip.Addr) (bool, error) {
	a, err := AddressFrom(addr)
	if err != nil {
		return false, err
	}
	var k Key
	err = s.update(func() {
		for _, al := range s.p.Allocations() {
			if al.Address == a && al.Key.Reclaimed() {
				k = al.Key
			}
		}
		if k != (Key{}) {
			s.p.Release(k)
		}
	})
	if k == (Key{}) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("saving release of %s: %w", k, err)
	}
	return true, nil
}

// HoldFound holds addresses found in use on this node that its state does
// not know, each under its key, as soon as they are in a range this peer
// owns (Peer.HoldFound). The holds are saved and logged.
func (s *Service) HoldFound(found map[Key]netip.Addr) error {
	in := make(map[Key]Address, len(found))
	for k, ip := range found {
		a, err := AddressFrom(ip)
		if err != nil {
			return fmt.Errorf("found address of %s: %w", k, err)
		}
		in[k] = a
	}
	return s.update(func() { s.p.HoldFound(in) })
}

// Leave takes this peer out of the cluster (weft reset; see Peer.Leave):
// it gives every range to the live peer that owns the least, saves that,
// and waits until that peer has saved it too, or ctx ends. alive reports
// which peers the mesh sees up; it is called on the service's owner loop,
// so it must not call back into the service (or into anything that does).
// Calling it again after a timeout waits again.
func (s *Service) Leave(ctx context.Context, alive func(PeerName) bool, force bool) (LeaveResult, error) {
	var (
		res       LeaveResult
		err, ferr error
		done      bool
		ch        = make(chan struct{})
	)
	if cerr := s.call(ctx, func() { res, err = s.p.Leave(alive, force) }, func(e error) {
		ferr = e
		if err != nil || ferr != nil {
			return
		}
		if _, _, done = s.p.Leaving(); !done {
			s.leaving = append(s.leaving, ch)
		}
	}); cerr != nil {
		return res, cerr
	}
	if err != nil {
		return res, err
	}
	if ferr != nil {
		return res, fmt.Errorf("saving the handover: %w", ferr)
	}
	if done {
		return res, nil
	}
	select {
	case <-ch:
		return res, nil
	case <-ctx.Done():
		return res, fmt.Errorf("this peer has given its ranges to %s, but %s has not confirmed that it saved them (%w); "+
			"it is retried: run weft reset again to wait more. If %s is gone for good, weft rmpeer it on another peer",
			res.Heir, res.Heir, ctx.Err(), res.Heir)
	}
}

// Held is an allocation with its metadata, for status.
type Held struct {
	Allocation
	Meta
}

// Snapshot is a consistent view of the allocator for status and metrics.
type Snapshot struct {
	Self        PeerName
	Universe    netip.Prefix
	Ring        *Ring
	Owned       []Range
	Stats       Stats
	Status      PeerStatus
	Allocations []Held
}

// Snapshot returns the current state.
func (s *Service) Snapshot() (snap Snapshot) {
	s.read(func() {
		snap = Snapshot{Self: s.p.Self(), Universe: s.universe, Ring: s.p.Ring(), Owned: s.p.Owned(), Stats: s.p.Stats(), Status: s.p.Status()}
		for _, al := range s.p.Allocations() {
			snap.Allocations = append(snap.Allocations, Held{Allocation: al, Meta: s.meta[al.Key]})
		}
	})
	return snap
}

// Ring returns a copy of the current ring.
func (s *Service) Ring() (r *Ring) {
	s.read(func() { r = s.p.Ring() })
	return r
}

// Stats returns the allocator's counts.
func (s *Service) Stats() (st Stats) {
	s.read(func() { st = s.p.Stats() })
	return st
}

// Status is the core's status, for the Status: line.
func (s *Service) Status() (st PeerStatus) {
	s.read(func() { st = s.p.Status() })
	return st
}

// RejoinWaits lists the peers whose claimed ring this peer still waits for
// before it allocates: having started without state (the rejoin hold, see
// peer_rejoin.go) or with state (the start hold, see peer_stale.go); nil
// when it does not hold back. The glue to the mesh pulls their state
// (ipammesh.RunPull) instead of waiting for a random push-pull to bring it.
func (s *Service) RejoinWaits() (w []PeerName) {
	s.read(func() {
		if w = s.p.rejoinWaits(); len(w) == 0 && s.p.startHold {
			w = s.p.startWaits()
		}
	})
	return w
}

// ErrIsExhausted reports whether err means no address can be had now.
func ErrIsExhausted(err error) bool { return errors.Is(err, ErrNoSpace) || errors.Is(err, ErrNoRange) }
