package ipalloc

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
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
)

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

// ServiceConfig configures a Service.
type ServiceConfig struct {
	Self     PeerName
	Universe netip.Prefix // from ParseUniverse
	DB       *state.DB
	Log      *slog.Logger
	Now      func() time.Time
}

// Service is the IO shell around the Allocator: it serialises calls, loads
// and saves state, and commits every change to disk before it returns.
type Service struct {
	db       *state.DB
	log      *slog.Logger
	now      func() time.Time
	universe netip.Prefix

	mu   sync.Mutex
	a    *Allocator
	meta map[Key]Meta
}

// NewService loads the allocator's state from cfg.DB. A peer with no ring
// yet claims the whole range: the single-peer case; the consensus issue
// replaces this with an agreed claim.
func NewService(cfg ServiceConfig) (*Service, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	s := &Service{db: cfg.DB, log: cfg.Log, now: cfg.Now, universe: cfg.Universe, meta: map[Key]Meta{}}
	s.a = NewAllocator(cfg.Self, RangeOf(cfg.Universe))

	saved, err := cfg.DB.Get(bucketIPAM, keyUniverse)
	if err != nil {
		return nil, err
	}
	if len(saved) > 0 && string(saved) != cfg.Universe.String() {
		return nil, fmt.Errorf("%w: the state in %s was made for range %s, but --ipalloc-range is %s; "+
			"start with --ipalloc-range=%s, or (only on a node without pods) remove the state file to start afresh",
			ErrBadRange, cfg.DB.Path(), saved, cfg.Universe, saved)
	}
	if err := s.loadRing(); err != nil {
		return nil, err
	}
	// Claim before restoring allocations, so that saved allocations of a state
	// whose ring record went missing are restored into the claim rather than
	// set aside while the same addresses become free.
	if s.a.ring.Empty() {
		if err := s.a.ClaimAlone(); err != nil {
			return nil, err
		}
		if err := s.saveRing(); err != nil {
			return nil, err
		}
	}
	if err := s.loadAllocations(); err != nil {
		return nil, err
	}
	s.logOwnership()
	return s, nil
}

func (s *Service) loadRing() error {
	data, err := s.db.Get(bucketIPAM, keyRing)
	if err != nil || len(data) == 0 {
		return err
	}
	var r Ring
	if err := json.Unmarshal(data, &r); err != nil {
		return fmt.Errorf("the ring saved in %s is unreadable: %w (move the file away to start afresh; allocations on this node would be lost)", s.db.Path(), err)
	}
	if err := s.a.SetRing(&r); err != nil {
		return fmt.Errorf("the ring saved in %s is invalid: %w", s.db.Path(), err)
	}
	return nil
}

func (s *Service) saveRing() error {
	data, err := json.Marshal(s.a.ring)
	if err != nil {
		return err
	}
	return s.db.Update(bucketIPAM, func(b *bolt.Bucket) error {
		if err := b.Put([]byte(keyUniverse), []byte(s.universe.String())); err != nil {
			return err
		}
		return b.Put([]byte(keyRing), data)
	})
}

func dbKey(k Key) []byte { return []byte(k.ContainerID + "\x00" + k.IfName) }

func parseDBKey(b []byte) (Key, bool) {
	id, ifname, ok := strings.Cut(string(b), "\x00")
	return Key{ContainerID: id, IfName: ifname}, ok
}

// loadAllocations restores every saved allocation. A record that cannot be
// restored is reported and kept on disk, never silently dropped.
func (s *Service) loadAllocations() error {
	var bad []string
	err := s.db.View(bucketAllocations, func(b *bolt.Bucket) error {
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
			if err == nil {
				err = s.a.Restore(k, addr)
			}
			if err != nil {
				bad = append(bad, fmt.Sprintf("%s: %v", k, err))
				return nil
			}
			s.meta[k] = rec.Meta
			return nil
		})
	})
	if err != nil {
		return err
	}
	for _, b := range bad {
		s.log.Error("ipalloc: a saved allocation could not be restored; it stays on disk", "allocation", b)
	}
	if n := len(s.meta); n > 0 {
		s.log.Info("ipalloc: restored allocations from state", "count", n, "state", s.db.Path())
	}
	return nil
}

func (s *Service) logOwnership() {
	total := uint64(s.a.Universe().Size())
	for _, r := range s.a.Owned() {
		for _, c := range r.CIDRs() {
			n := uint64(1) << (32 - c.Bits())
			s.log.Info(fmt.Sprintf("ipalloc: owning %s (%d addresses, %.4g%% of range)", c, n, Percent(n, total)))
		}
	}
}

// Prefix returns addr with the length of the pod network.
func (s *Service) Prefix(addr Address) netip.Prefix {
	return netip.PrefixFrom(addr.Addr(), s.universe.Bits())
}

// Universe is the pod range.
func (s *Service) Universe() netip.Prefix { return s.universe }

// Allocate returns k's address, allocating and saving a new one if needed.
func (s *Service) Allocate(k Key, m Meta) (netip.Addr, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	addr, isNew, err := s.a.Allocate(k)
	if err != nil {
		return netip.Addr{}, false, err // not 0.0.0.0, which looks like an address
	}
	if !isNew {
		return addr.Addr(), false, nil
	}
	m.Created = s.now().UTC()
	data, err := json.Marshal(record{Address: addr.String(), Meta: m})
	if err == nil {
		err = s.db.Update(bucketAllocations, func(b *bolt.Bucket) error { return b.Put(dbKey(k), data) })
	}
	if err != nil {
		s.a.Release(k) // not on disk, so not handed out
		return netip.Addr{}, false, fmt.Errorf("saving allocation of %s: %w", k, err)
	}
	s.meta[k] = m
	s.log.Debug("ipalloc: allocated", "key", k, "address", addr, "pod", m.PodNamespace+"/"+m.PodName)
	return addr.Addr(), true, nil
}

// Lookup returns k's address.
func (s *Service) Lookup(k Key) (netip.Addr, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	addr, ok := s.a.Lookup(k)
	return addr.Addr(), ok
}

// Release frees k's address; it reports whether k held one.
func (s *Service) Release(k Key) (netip.Addr, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	addr, ok := s.a.Lookup(k)
	if !ok {
		return netip.Addr{}, false, nil
	}
	// Delete on disk first: if that fails the address stays held everywhere.
	if err := s.db.Update(bucketAllocations, func(b *bolt.Bucket) error { return b.Delete(dbKey(k)) }); err != nil {
		return netip.Addr{}, false, fmt.Errorf("saving release of %s: %w", k, err)
	}
	s.a.Release(k)
	delete(s.meta, k)
	s.log.Debug("ipalloc: released", "key", k, "address", addr)
	return addr.Addr(), true, nil
}

// GC releases every pod allocation whose key keep rejects, in one
// transaction, and returns what it released.
func (s *Service) GC(keep func(Key) bool) ([]Allocation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var drop []Allocation
	for _, al := range s.a.Allocations() {
		if !al.Key.Internal() && !keep(al.Key) {
			drop = append(drop, al)
		}
	}
	if len(drop) == 0 {
		return nil, nil
	}
	err := s.db.Update(bucketAllocations, func(b *bolt.Bucket) error {
		for _, al := range drop {
			if err := b.Delete(dbKey(al.Key)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("saving GC: %w", err)
	}
	for _, al := range drop {
		s.a.Release(al.Key)
		delete(s.meta, al.Key)
	}
	return drop, nil
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
	Allocations []Held
}

// Snapshot returns the current state.
func (s *Service) Snapshot() Snapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	snap := Snapshot{Self: s.a.Self(), Universe: s.universe, Ring: s.a.Ring(), Owned: s.a.Owned(), Stats: s.a.Stats()}
	for _, al := range s.a.Allocations() {
		snap.Allocations = append(snap.Allocations, Held{Allocation: al, Meta: s.meta[al.Key]})
	}
	return snap
}

// Stats returns the allocator's counts.
func (s *Service) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.a.Stats()
}

// ErrIsExhausted reports whether err means no address can be had now.
func ErrIsExhausted(err error) bool { return errors.Is(err, ErrNoSpace) || errors.Is(err, ErrNoRange) }
