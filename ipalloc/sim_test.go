package ipalloc

import (
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The deterministic simulation of many peers (etcd raft's test network in
// spirit): every schedule is a seeded random sequence of steps over a
// simulated network that drops, delays, reorders and duplicates messages,
// partitions (both ways, and one way only) and heals, crashes peers and
// restarts them from what their Ready said to persist (and nothing else)
// knowing only the peers that are up and reachable, wipes a peer's disk
// (it comes back under its name, with its pods still running and found on
// its bridge, or under a new name), adds peers mid-run (some with another
// seed list, a joiner of another cluster), starts some schedules with one
// peer that counts another consensus size (fixed by the operator later),
// crashes some for good and removes them with rmpeer, and lets some leave
// (weft reset), while a workload allocates and releases; in half the
// schedules the peers run in --kube mode (the ConfigMap's registered peers
// given as members kept outside, SetExternalMembers). After every step it
// checks:
//
//   - no address is held twice: by two keys in the peers' memory and disks,
//     nor by two containers (the pods' own view, which outlives a wipe);
//   - every held address is inside a range its holder owns in its own ring;
//   - at most one live peer owns each address in its own ring (peers of
//     one seed; a peer that holds back after starting without state owns
//     nothing yet, see peer_rejoin.go);
//   - no two peers hold the same token and version with different content;
//   - no peer allocates once it knows it is removed;
//   - no message is refused, except those the fault explains (a removed
//     peer's, another consensus size's, a ring of another seed list's);
//
// and at the end, after healing, that the rings converge and that every
// peer gets an address when there is space.
//
// What the model does NOT model (see docs/ipam.md#simulation): the
// Service shell and its database (a failed save; tested in service tests),
// Kubernetes beyond the registered peers (the informers, the reclaim's
// marker, Node re-registration), CNI GC (a Service test), time
// beyond ticks (every peer ticks at one rate), a restored backup of a disk
// (a stale disk; see docs/ipam.md#lost-disk), bit flips on the wire or on
// disk (the fuzzers), more than one fault of configuration at a time, and
// two groups with different consensus sizes that each reach their own
// quorum before hearing from each other (not preventable by messages).

var (
	simSeed      = flag.Uint64("ipalloc.sim.seed", 0, "run only the simulation schedule with this seed, with a trace of its steps")
	simSchedules = flag.Int("ipalloc.sim.schedules", 0, "number of simulation schedules (default 300; 100 with -race, 40 with -short; make test runs 1500, make test-long 10000)")
	simSteps     = flag.Int("ipalloc.sim.steps", 0, "steps per simulation schedule (default 1500, 600 with -short)")
	simFirst     = flag.Uint64("ipalloc.sim.first", 1, "seed of the first simulation schedule")
	simFaults    = flag.String("ipalloc.sim.faults", "oneway,partialview,join,rename,mixedsize,wipe,kube", "faults of the hard simulation to inject (comma-separated; also: otherseeds, stale, all)")
	simRmLive    = flag.Bool("ipalloc.sim.rmlive", true, "also rmpeer live peers cut off from the rest (a Node deleted while its router is cut off): it must stop allocating once it knows (on by default since 2,300 schedules with it were clean; -ipalloc.sim.rmlive=false turns it off)")
)

// simCounts adds up what the schedules did.
type simCounts struct {
	Schedules, Steps, Delivered, Dropped, Duplicated, Refused   int64
	Allocations, Releases, Failed, Lost                         int64
	Crashes, CrashesMidReady, Restarts, Deaths, Partitions      int64
	Donations, Reclaims, ReclaimedIPs, Claims, Violations, Msgs int64
	Leaves, LeavesRefused, LeavesDone                           int64
	Wipes, Renamed, Joins, OneWay, Mixed, Expected              int64
	Backups, Stale                                              int64
}

func (c *simCounts) add(o *simCounts) {
	for _, f := range []struct{ a, b *int64 }{
		{&c.Schedules, &o.Schedules}, {&c.Steps, &o.Steps}, {&c.Delivered, &o.Delivered}, {&c.Dropped, &o.Dropped},
		{&c.Duplicated, &o.Duplicated}, {&c.Refused, &o.Refused}, {&c.Allocations, &o.Allocations}, {&c.Releases, &o.Releases},
		{&c.Failed, &o.Failed}, {&c.Lost, &o.Lost}, {&c.Crashes, &o.Crashes}, {&c.CrashesMidReady, &o.CrashesMidReady},
		{&c.Restarts, &o.Restarts}, {&c.Deaths, &o.Deaths}, {&c.Partitions, &o.Partitions}, {&c.Donations, &o.Donations},
		{&c.Reclaims, &o.Reclaims}, {&c.ReclaimedIPs, &o.ReclaimedIPs}, {&c.Claims, &o.Claims}, {&c.Violations, &o.Violations},
		{&c.Msgs, &o.Msgs}, {&c.Leaves, &o.Leaves}, {&c.LeavesRefused, &o.LeavesRefused}, {&c.LeavesDone, &o.LeavesDone},
		{&c.Wipes, &o.Wipes}, {&c.Renamed, &o.Renamed}, {&c.Joins, &o.Joins}, {&c.OneWay, &o.OneWay}, {&c.Mixed, &o.Mixed},
		{&c.Expected, &o.Expected}, {&c.Backups, &o.Backups}, {&c.Stale, &o.Stale},
	} {
		atomic.AddInt64(f.a, *f.b)
	}
}

func (c *simCounts) String() string {
	return fmt.Sprintf("schedules %d, steps %d, messages %d sent / %d delivered / %d dropped / %d duplicated / %d refused, "+
		"allocations %d (releases %d, failed for want of space or quorum %d, lost to a crash %d), "+
		"crashes %d (%d between persisting and sending), restarts %d, crashed for good %d, partitions %d, "+
		"donations %d, reclaims %d (%d IPs), first claims %d, leaves %d (refused %d, confirmed and gone %d), "+
		"disks wiped %d (back under a new name %d), joins mid-run %d, one-way cuts %d, mixed configurations %d (refusals they explain %d), "+
		"stale disks restored %d (of %d backups), violations %d",
		c.Schedules, c.Steps, c.Msgs, c.Delivered, c.Dropped, c.Duplicated, c.Refused,
		c.Allocations, c.Releases, c.Failed, c.Lost,
		c.Crashes, c.CrashesMidReady, c.Restarts, c.Deaths, c.Partitions,
		c.Donations, c.Reclaims, c.ReclaimedIPs, c.Claims, c.Leaves, c.LeavesRefused, c.LeavesDone,
		c.Wipes, c.Renamed, c.Joins, c.OneWay, c.Mixed, c.Expected, c.Stale, c.Backups, c.Violations)
}

var simTiming = Timing{PaxosRetry: 6, PaxosPatience: 15, DonationRetry: 6, AllocDeadline: 150, RemoveRetry: 8, GossipEvery: 3}

type simPeer struct {
	name    PeerName
	init    Init
	p       *Peer     // nil while crashed
	disk    HardState // what survives a crash: only what Ready said to persist
	dead    bool      // crashed for good, or gone after leaving
	removed bool      // removed with rmpeer by some live peer
	left    bool      // left with weft reset, confirmed, and gone
	rmpeers int       // times the operator ran rmpeer of it

	found        map[Key]Address // its pods' addresses after its disk was wiped, until it holds them again
	wiped        bool            // its disk was wiped under its own name, and it has not started since
	lostState    bool            // its disk was wiped (or restored from a backup) at least once
	knowsRemoved bool            // it has received a Remove of itself
	removedLive  bool            // removed with rmpeer while it was alive (rmlive)
	ownedAtRm    []Range         // what it owned in its own ring when it was removed while alive
	oddSize      int             // consensus: the size the operator wrongly gave it (0: none); fixed later
	otherSeeds   bool            // seed list of another cluster: its ring is refused, it never allocates

	extDue int // kube mode: the step its router reads the registered peers at (0: read since it started)
	regDue int // kube mode: the step its router registers it at (0: none pending)

	backup    *HardState   // a copy of its disk taken some steps before (the stale fault)
	restored  bool         // its disk was restored from a backup once
	staleKeys map[Key]bool // allocations of the restored disk whose pods were gone: records, not pods
}

// leaving reports whether sp is up but has left the cluster (weft reset)
// and waits for its heir before it goes.
func (sp *simPeer) leaving() bool {
	if sp.p == nil {
		return false
	}
	left, _, _ := sp.p.Leaving()
	return left
}

type simMsg struct {
	from, to PeerName
	data     []byte
}

// simFault reports whether a fault kind is on (-ipalloc.sim.faults).
func simFault(kind string) bool {
	for _, f := range strings.Split(*simFaults, ",") {
		if f == kind || f == "all" {
			return true
		}
	}
	return false
}

func simWeight(kind string) int {
	if simFault(kind) {
		return 1
	}
	return 0
}

type simVersion struct {
	seed    Seed
	token   Address
	version uint32
}

type simEntry struct {
	peer PeerName
	free uint32
	who  PeerName // the first peer seen holding it
}

type sim struct {
	seed   uint64
	rng    *rand.Rand
	u      Range
	peers  []*simPeer
	by     map[PeerName]*simPeer
	net    []simMsg
	group  map[PeerName]int        // partition: peers in different groups cannot talk
	oneway map[[2]PeerName]bool    // cut from -> to only
	quiet  bool                    // no faults (the final phase)
	seen   map[simVersion]simEntry // scratch for checkRings
	base   Init                    // the cluster's configuration

	// kube mode (half the schedules): the ConfigMap's registered peers
	// are members kept outside the peers (PeerConfig.ExternalMembers).
	// Every peer's router registers it 1-6 steps after it starts (as
	// kube.Kube writes the ConfigMap once the node list has synced; a
	// router that dies first has not), and reads the registered peers
	// again at once; a Node deleted (rmpeer) is no longer registered. A
	// router reads them 0-3 steps after it starts, every kubeReadEvery
	// steps, and before a reclaim. Its draws come
	// from krng, so that a schedule's other steps are those it has
	// without kube mode (until the peers act otherwise).
	kube     bool
	krng     *rand.Rand
	registry map[PeerName]bool

	held    map[Key]Address  // answered and not released: what the containers hold
	holder  map[Key]PeerName // the peer each held or waiting key was asked of
	waiting map[Key]bool
	nextKey int

	step    int
	maxDie  int
	c       simCounts
	trace   []string
	verbose bool
	err     error
}

func (s *sim) tracef(format string, args ...any) {
	line := fmt.Sprintf("%5d ", s.step) + fmt.Sprintf(format, args...)
	if s.verbose {
		fmt.Println(line)
	}
	s.trace = append(s.trace, line)
	if len(s.trace) > 400 {
		s.trace = s.trace[len(s.trace)-300:]
	}
}

func (s *sim) fail(format string, args ...any) {
	if s.err == nil {
		s.err = fmt.Errorf("step %d: %s", s.step, fmt.Sprintf(format, args...))
		s.c.Violations++
	}
}

func newSim(seed uint64, verbose bool) *sim {
	s := &sim{
		seed: seed, rng: rand.New(rand.NewPCG(seed, seed*0x9e3779b97f4a7c15+1)),
		by: map[PeerName]*simPeer{}, group: map[PeerName]int{}, oneway: map[[2]PeerName]bool{}, seen: map[simVersion]simEntry{},
		held: map[Key]Address{}, holder: map[Key]PeerName{}, waiting: map[Key]bool{},
		verbose: verbose,
	}
	s.krng = rand.New(rand.NewPCG(seed, 0x6b756265))
	s.kube, s.registry = simFault("kube") && s.krng.IntN(2) == 0, map[PeerName]bool{}
	n := 3 + s.rng.IntN(5)
	plen := []int{24, 25, 26}[s.rng.IntN(3)]
	s.u = Range{Start: 0x0a200000, End: 0x0a200000 + 1<<(32-plen)}
	var names []PeerName
	for i := range n {
		names = append(names, PeerName(fmt.Sprintf("p%d", i)))
	}
	mode := s.rng.IntN(10)
	var seeds []PeerName
	for _, nm := range names {
		if s.rng.IntN(2) == 0 {
			seeds = append(seeds, nm)
		}
	}
	if len(seeds) == 0 {
		seeds = names[:1]
	}
	quorumOf := n
	for i, nm := range names {
		sp := &simPeer{name: nm}
		switch {
		case mode < 2: // seed=...
			sp.init = Init{Seeds: seeds}
		case mode < 4 && i == n-1: // consensus among the others, and an observer
			sp.init = Init{Observer: true}
		case mode < 4:
			sp.init = Init{Consensus: n - 1}
			quorumOf = n - 1
		default:
			sp.init = Init{Consensus: n}
		}
		s.peers = append(s.peers, sp)
		s.by[nm] = sp
	}
	s.base = s.peers[0].init
	if odd := s.peers[n-1]; odd.init.Consensus > 0 && s.rng.IntN(8) == 0 && simFault("mixedsize") {
		// The operator gave one peer another N (a longer --peers list):
		// more than its share, so that it cannot choose alone.
		odd.oddSize = odd.init.Consensus + 1 + s.rng.IntN(3)
		odd.init.Consensus = odd.oddSize
		s.c.Mixed++
		s.tracef("%s counts consensus=%d, the others %d", odd.name, odd.oddSize, s.base.Consensus)
	}
	// Enough peers stay alive for a quorum and for two peers at least.
	s.maxDie = min(quorumOf-(quorumOf/2+1), n-2)
	s.tracef("seed %d: %d peers, universe %s, init %+v, at most %d die, kube mode %v", seed, n, s.u, s.peers[0].init, s.maxDie, s.kube)
	for _, sp := range s.peers {
		if s.rng.IntN(5) == 0 && sp != s.peers[0] {
			s.tracef("%s starts late", sp.name)
			continue
		}
		s.start(sp)
	}
	return s
}

func (s *sim) names() []PeerName {
	out := make([]PeerName, len(s.peers))
	for i, sp := range s.peers {
		out[i] = sp.name
	}
	return out
}

// start (re)starts a peer from its disk.
func (s *sim) start(sp *simPeer) {
	if sp.wiped {
		// The operator's restart after a wipe takes longer than any message
		// is in flight: what the lost process sent has arrived or is lost,
		// and what was sent to it is lost (restarts wait for the first
		// while they may, see restartable).
		sp.wiped = false
		s.net = slices.DeleteFunc(s.net, func(m simMsg) bool {
			lost := m.from == sp.name || m.to == sp.name
			if lost {
				s.c.Dropped++
			}
			return lost
		})
	}
	var known []PeerName
	for _, q := range s.peers {
		if q != sp && (!simFault("partialview") || q.p != nil && s.connected(sp.name, q.name) && s.connected(q.name, sp.name)) {
			known = append(known, q.name)
		}
	}
	p, err := NewPeer(PeerConfig{
		Self: sp.name, Universe: s.u, Init: sp.init, Peers: known, Timing: simTiming,
		Rand:            rand.New(rand.NewPCG(s.rng.Uint64(), s.rng.Uint64())),
		ExternalMembers: s.kube,
	}, sp.disk.Clone())
	if err != nil {
		s.fail("restart of %s: %v", sp.name, err)
		return
	}
	sp.p = p
	if s.kube {
		sp.regDue = 0
		if !s.registry[sp.name] {
			sp.regDue = s.step + 1 + s.krng.IntN(6)
		}
		sp.extDue = s.step + s.krng.IntN(4) // read at the end of this start, or up to 3 steps later
	}
	// The router finds its pods' addresses on its bridge, at every start
	// (docs/ipam.md, Persistence): those a lost or restored disk does not
	// hold (sp.found), and those it holds (which a state found stale later
	// must not drop: seed 155 of the stale runs, where a plain restart
	// showed nothing and the stale check then dropped a running pod's
	// address).
	onNode := maps.Clone(sp.found)
	for k, h := range s.holder {
		if _, ok := s.held[k]; ok && h == sp.name {
			if onNode == nil {
				onNode = map[Key]Address{}
			}
			onNode[k] = s.held[k]
		}
	}
	if len(onNode) > 0 {
		p.HoldFound(onNode)
	}
	s.ready(sp)
	// The mesh's join: the router tells its allocator of every member it
	// sees (routineMembers), and the members see the newcomer, so both
	// sides learn of each other if they can talk both ways.
	for _, q := range s.peers {
		if sp.p == nil {
			return // it went (a confirmed leave)
		}
		if q == sp || q.p == nil || !s.connected(sp.name, q.name) || !s.connected(q.name, sp.name) {
			continue
		}
		q.p.AddPeer(sp.name)
		s.ready(q)
		sp.p.AddPeer(q.name)
		s.ready(sp)
	}
	s.kubeStep()
}

// kubeReadEvery is how often (in steps) a router in kube mode reads the
// registered peers again (routineKube, every 30 s).
const kubeReadEvery = 40

// kubeStep has every router in kube mode whose read is due read the
// registered peers.
func (s *sim) kubeStep() {
	if !s.kube {
		return
	}
	for _, sp := range s.peers {
		if sp.p != nil && sp.regDue != 0 && s.step >= sp.regDue {
			sp.regDue = 0
			s.registry[sp.name] = true
			s.readRegistry(sp) // the router reads them again at once
		}
		if sp.p != nil && (sp.extDue != 0 && s.step >= sp.extDue || s.step%kubeReadEvery == 0) {
			s.readRegistry(sp)
		}
	}
}

// readRegistry gives sp the registered peers, as its router reads them
// from the ConfigMap.
func (s *sim) readRegistry(sp *simPeer) {
	if !s.kube || sp.p == nil {
		return
	}
	sp.extDue = 0
	names := slices.Sorted(maps.Keys(s.registry))
	if err := sp.p.SetExternalMembers(names); err != nil {
		s.fail("%s: the registered peers %v: %v", sp.name, names, err)
		return
	}
	s.ready(sp)
}

func (s *sim) up() []*simPeer {
	var out []*simPeer
	for _, sp := range s.peers {
		if sp.p != nil {
			out = append(out, sp)
		}
	}
	return out
}

// serving lists the peers that are up and still in the cluster.
func (s *sim) serving() []*simPeer {
	var out []*simPeer
	for _, sp := range s.up() {
		if !sp.leaving() && !sp.dead {
			out = append(out, sp)
		}
	}
	return out
}

func (s *sim) pick(ps []*simPeer) *simPeer {
	if len(ps) == 0 {
		return nil
	}
	return ps[s.rng.IntN(len(ps))]
}

// crash loses sp's memory: its disk stays.
func (s *sim) crash(sp *simPeer, why string) {
	s.tracef("crash %s (%s)", sp.name, why)
	sp.p = nil
	for k := range s.waiting {
		if s.holder[k] == sp.name {
			delete(s.waiting, k)
			delete(s.holder, k)
			s.c.Lost++
		}
	}
}

// ready acts on sp's Ready as a shell must: persist, send, answer.
func (s *sim) ready(sp *simPeer) {
	if sp.p == nil || !sp.p.HasReady() {
		return
	}
	if !s.quiet && s.rng.IntN(400) == 0 {
		s.c.Crashes++
		s.crash(sp, "before persisting")
		return
	}
	rd := sp.p.Ready()
	sp.disk.Apply(rd)
	if !s.quiet && s.rng.IntN(400) == 0 {
		s.c.Crashes++
		s.c.CrashesMidReady++
		s.crash(sp, "after persisting, before sending")
		return
	}
	for _, ev := range rd.Events {
		s.tracef("%s: %s", sp.name, ev.Text)
		switch {
		case ev.Warn && s.explained(sp, ev.Text):
			s.c.Expected++
		case ev.Warn:
			s.fail("%s warned: %s", sp.name, ev.Text)
		case strings.HasPrefix(ev.Text, "ipalloc: gave "):
			s.c.Donations++
		case strings.HasPrefix(ev.Text, "ipalloc: the ring is claimed"):
			s.c.Claims++
		case strings.HasPrefix(ev.Text, "rmpeer of "):
			var x string
			var n int64
			if _, err := fmt.Sscanf(ev.Text, "rmpeer of %s %d IPs taken over", &x, &n); err == nil && n > 0 {
				s.c.Reclaims++
				s.c.ReclaimedIPs += n
			}
		}
	}
	if rd.Broadcast != nil {
		data := EncodeMsg(&RingMsg{Ring: rd.Broadcast})
		for _, q := range s.peers {
			if q != sp {
				s.net = append(s.net, simMsg{from: sp.name, to: q.name, data: data})
				s.c.Msgs++
			}
		}
	}
	for _, m := range rd.Messages {
		s.net = append(s.net, simMsg{from: sp.name, to: m.To, data: EncodeMsg(m.Msg)})
		s.c.Msgs++
	}
	for _, a := range rd.Answers {
		if sp.dead {
			// Removed while alive (rmlive): its pods are gone with its
			// Node; a new allocation is caught by knowsRemoved below.
			if a.Err == nil && sp.knowsRemoved && !slices.ContainsFunc(sp.p.Allocations(), func(al Allocation) bool { return al.Key == a.Key }) {
				s.fail("%s allocated %s to %s after it was told it is removed", sp.name, a.Address, a.Key)
			}
			continue
		}
		if !s.waiting[a.Key] || s.holder[a.Key] != sp.name {
			if a.Err == nil && s.held[a.Key] != a.Address {
				s.fail("%s answered %s with %s, which nobody asked for", sp.name, a.Key, a.Address)
			}
			continue
		}
		delete(s.waiting, a.Key)
		if a.Err != nil {
			if !errors.Is(a.Err, ErrCanceled) {
				s.c.Failed++
			}
			s.tracef("%s: %s failed: %v", sp.name, a.Key, a.Err)
			delete(s.holder, a.Key)
			continue
		}
		s.tracef("%s: %s got %s", sp.name, a.Key, a.Address)
		if sp.knowsRemoved {
			s.fail("%s allocated %s to %s after it was told it is removed", sp.name, a.Address, a.Key)
		}
		s.held[a.Key] = a.Address
		s.c.Allocations++
	}
	if left, heir, ok := sp.p.Leaving(); left && ok {
		// weft reset returns, and the router goes with its state.
		s.tracef("%s: %s confirmed the handover; %s goes", sp.name, heir, sp.name)
		s.c.LeavesDone++
		sp.p, sp.dead, sp.left = nil, true, true
	}
}

func (s *sim) readyAll() {
	for _, sp := range s.peers {
		s.ready(sp)
	}
}

// connected reports whether a message from a reaches b.
func (s *sim) connected(a, b PeerName) bool {
	return s.group[a] == s.group[b] && !s.oneway[[2]PeerName{a, b}]
}

// explained reports whether a warning is what a fault of the schedule
// makes a correct peer say: another consensus size, a ring of another seed
// list, being removed while alive (rmlive).
func (s *sim) explained(sp *simPeer, text string) bool {
	switch {
	case strings.Contains(text, "runs the first claim with consensus="):
		return s.c.Mixed > 0
	case strings.Contains(text, "seeded apart") || strings.Contains(text, "ErrSplitRing") || strings.Contains(text, "were seeded apart"):
		for _, sp := range s.peers {
			if sp.otherSeeds && strings.Contains(text, string(sp.name)) {
				return true
			}
		}
		return s.otherSeedsUp() && strings.Contains(text, "refused the ring from")
	case strings.Contains(text, "is older than what peers know of this node"),
		strings.Contains(text, "is held in the saved state (older than what the peers know)"),
		strings.Contains(text, "as from this peer's lost self (a restored backup?)"):
		// Or a wiped peer that saved a ring no newer than the first claim
		// (ringUnseen, seed 8935) before it heard the cluster's.
		return sp.lostState
	case strings.Contains(text, "rmpeer waits: this node's pods use"):
		// A peer that lost its state hears only peers as new as it is
		// (ringUnseen, seed 8935).
		return sp.lostState
	case strings.Contains(text, "that this peer's ring still has as the first claim made it"):
		// The same, when a peer it hears lost its state too and moved
		// its own entries on since (staleFor, seed 18083).
		return sp.lostState
	case strings.Contains(text, "refused the ring from ") && s.fromRemovedLive(text):
		// A ring from a peer removed while alive: until it heard of its
		// removal, it went on changing its ranges (a donation), and its
		// ring carries that against the takeover (seed 3644 of the wipe
		// runs: a token it split inside the reclaimer's entry).
		return true
	case strings.Contains(text, "refused the ring from ") && s.inRemovedLive(text):
		// The same split, relayed: a peer that got a donation from a
		// peer removed while alive carries the donor's split of a range
		// the reclaimer took over (seed 14644 of make test-long's seeds
		// 10001-20000: j269's ring, "ring entry 2 (10.32.0.128): 127
		// free is more than the range's 64 addresses").
		return true
	case strings.Contains(text, "is removing this peer"), strings.Contains(text, "refused the ring from"),
		strings.Contains(text, "takes ranges this peer owns"):
		// Removed while alive: its reclaimer's ring takes its ranges, at
		// versions its live self may have used too (Ring.Reclaim).
		return *simRmLive && sp.dead
	}
	return false
}

// fromRemovedLive reports whether a refusal's text ("refused the ring from
// X: ...") names a peer removed while it was alive.
func (s *sim) fromRemovedLive(text string) bool {
	_, rest, _ := strings.Cut(text, "refused the ring from ")
	name, _, _ := strings.Cut(rest, ":")
	sp := s.by[PeerName(name)]
	return *simRmLive && sp != nil && sp.removedLive
}

// inRemovedLive reports whether a refusal of an invalid merged ring ("ring
// entry N (ADDR): ...") names an entry in a range that a peer removed
// while alive owned when it was removed.
func (s *sim) inRemovedLive(text string) bool {
	_, rest, ok := strings.Cut(text, "the merged ring would be invalid: ring entry ")
	if !ok || !*simRmLive {
		return false
	}
	_, rest, _ = strings.Cut(rest, "(")
	addr, _, _ := strings.Cut(rest, ")")
	ip, err := netip.ParseAddr(addr)
	if err != nil {
		return false
	}
	a, err := AddressFrom(ip)
	if err != nil {
		return false
	}
	for _, sp := range s.peers {
		if !sp.removedLive {
			continue
		}
		for _, rg := range sp.ownedAtRm {
			if rg.Contains(a) {
				return true
			}
		}
	}
	return false
}

func (s *sim) otherSeedsUp() bool {
	for _, sp := range s.peers {
		if sp.otherSeeds && sp.p != nil {
			return true
		}
	}
	return false
}

// deliver hands message i to its addressee.
func (s *sim) deliver(i int) {
	m := s.net[i]
	s.net = slices.Delete(s.net, i, i+1)
	to := s.by[m.to]
	if to == nil || to.p == nil || !s.connected(m.from, m.to) {
		s.c.Dropped++
		return
	}
	s.c.Delivered++
	msg, err := DecodeMsg(m.data)
	if err != nil {
		s.fail("%s -> %s: undecodable: %v", m.from, m.to, err)
		return
	}
	s.tracef("%s -> %s: %s", m.from, m.to, describe(msg))
	if rm, ok := msg.(*Remove); ok && rm.Peer == to.name {
		to.knowsRemoved = true
	}
	if err := to.p.Step(m.from, msg); err != nil {
		var size *ConsensusSizeError
		switch {
		case errors.Is(err, ErrRemovedPeer):
			s.c.Refused++
		case errors.As(err, &size) && (s.by[m.from].oddSize != 0 || to.oddSize != 0):
			s.c.Refused++
			s.c.Expected++
		case errors.Is(err, ErrSplitRing) && (s.by[m.from].otherSeeds || to.otherSeeds):
			s.c.Refused++
			s.c.Expected++
		case s.by[m.from].removedLive && *simRmLive:
			// From a peer removed while alive: its ring may carry what it
			// changed after the takeover, before it knew (explained above).
			s.c.Refused++
			s.c.Expected++
		case s.inRemovedLive(err.Error()):
			// The same, relayed by a peer that got a donation from it.
			s.c.Refused++
			s.c.Expected++
		case to.dead && *simRmLive:
			// Removed while alive: the reclaimer's ring takes its ranges,
			// at versions its live self may have used too; it refuses it.
			s.c.Refused++
			s.c.Expected++
		default:
			s.fail("%s refused a message from %s: %v", m.to, m.from, err)
		}
	}
	s.ready(to)
}

func describe(m Msg) string {
	switch m := m.(type) {
	case *RingMsg:
		return fmt.Sprintf("ring of %d entries", len(m.Ring.Entries))
	case *PaxosMsg:
		return fmt.Sprintf("%s %s %v", m.Type, m.Ballot, m.Value)
	case *Donation:
		return fmt.Sprintf("donation %x", m.ID)
	}
	return fmt.Sprintf("%T%+v", m, m)
}

// pushPull exchanges the gossip rings of two peers (memberlist's push-pull).
func (s *sim) pushPull(a, b *simPeer) {
	for _, pair := range [][2]*simPeer{{a, b}, {b, a}} {
		s.net = append(s.net, simMsg{from: pair[0].name, to: pair[1].name, data: EncodeMsg(&RingMsg{Ring: pair[0].p.Gossip()})})
		s.c.Msgs++
	}
}

func (s *sim) tick() {
	for _, sp := range s.up() {
		sp.p.Tick()
		s.ready(sp)
	}
}

// mayRemove reports whether rmpeer of x is allowed now: x is dead, and no
// other dead peer has a message in flight (the contract of rmpeer: remove a
// peer once nothing it sent can still arrive).
func (s *sim) mayRemove(x *simPeer) bool {
	return x.dead && !s.handled(x) && s.drained(x)
}

// drained reports whether no dead peer other than x has a message in flight.
func (s *sim) drained(x *simPeer) bool {
	for _, m := range s.net {
		if sp := s.by[m.from]; sp.dead && sp != x {
			return false
		}
	}
	return true
}

func (s *sim) allocate(sp *simPeer) {
	s.nextKey++
	k := Key{ContainerID: fmt.Sprintf("c%d", s.nextKey), IfName: "eth0"}
	s.waiting[k], s.holder[k] = true, sp.name
	s.tracef("%s: allocate %s", sp.name, k)
	sp.p.Allocate(k)
	s.ready(sp)
}

// handled reports whether some peer that is not dead has taken on the
// removal of x (on disk): otherwise the operator must rmpeer x (again).
func (s *sim) handled(x *simPeer) bool {
	for _, sp := range s.peers {
		removed := sp.disk.Removed
		if sp.p != nil {
			removed = sp.p.Removed()
		}
		if !sp.dead && removed[x.name] == sp.name && sp.disk.Removed[x.name] == sp.name {
			return true
		}
	}
	return false
}

// randomStep performs one random action.
func (s *sim) randomStep() {
	s.step++
	s.c.Steps++
	s.kubeStep()
	up := s.up()
	type action struct {
		w  int
		do func()
	}
	var dead, crashed, removable []*simPeer
	for _, sp := range s.peers {
		switch {
		case s.mayRemove(sp):
			removable = append(removable, sp)
		case !sp.dead && sp.p == nil && s.restartable(sp):
			crashed = append(crashed, sp)
		}
		if sp.dead {
			dead = append(dead, sp)
		}
	}
	// Peers dead, gone after leaving, or leaving: at most maxDie.
	out := len(dead)
	var claimed []*simPeer // peers that may leave
	for _, sp := range s.peers {
		switch {
		case sp.dead:
		case sp.leaving() || (sp.p == nil && sp.disk.Left != ""):
			out++
		case sp.p != nil && sp.p.Status().Claimed:
			claimed = append(claimed, sp)
		}
	}
	partitioned := false
	for _, g := range s.group {
		if g != 0 {
			partitioned = true
		}
	}
	actions := []action{
		{500, func() {
			if len(s.net) > 0 {
				s.deliver(s.rng.IntN(len(s.net)))
			}
		}},
		{30, func() {
			if len(s.net) > 0 {
				i := s.rng.IntN(len(s.net))
				s.tracef("drop %s -> %s", s.net[i].from, s.net[i].to)
				s.net = slices.Delete(s.net, i, i+1)
				s.c.Dropped++
			}
		}},
		{20, func() {
			if len(s.net) > 0 {
				s.net = append(s.net, s.net[s.rng.IntN(len(s.net))])
				s.c.Duplicated++
			}
		}},
		{120, s.tick},
		{100, func() {
			if sp := s.pick(s.serving()); sp != nil {
				s.allocate(sp)
			}
		}},
		{60, func() {
			keys := slices.SortedFunc(maps.Keys(s.holder), Key.Compare)
			if len(keys) == 0 {
				return
			}
			k := keys[s.rng.IntN(len(keys))]
			sp := s.by[s.holder[k]]
			if sp.p == nil {
				return
			}
			s.tracef("%s: release %s", sp.name, k)
			sp.p.Release(k)
			delete(sp.found, k)
			delete(s.held, k)
			delete(s.holder, k)
			if !s.waiting[k] {
				s.c.Releases++
			}
			delete(s.waiting, k)
			s.ready(sp)
		}},
		{40, func() {
			a, b := s.pick(up), s.pick(up)
			if a != nil && a != b {
				s.pushPull(a, b)
			}
		}},
		{3, func() {
			s.c.Partitions++
			for _, sp := range s.peers {
				s.group[sp.name] = s.rng.IntN(2)
			}
			s.tracef("partition %v", s.group)
		}},
	}
	if partitioned || len(s.oneway) > 0 {
		actions = append(actions, action{8, func() { clear(s.group); clear(s.oneway); s.tracef("heal") }})
	}
	actions = append(actions, action{3 * simWeight("oneway"), func() {
		a, b := s.pick(s.peers), s.pick(s.peers)
		if a != b {
			s.c.OneWay++
			s.oneway[[2]PeerName{a.name, b.name}] = true
			s.tracef("cut %s -> %s (one way)", a.name, b.name)
		}
	}})
	if s.claimedEverywhere() {
		var wipeable, wipeableSame []*simPeer
		for _, sp := range s.peers {
			if !sp.dead && !sp.leaving() && sp.disk.Left == "" && sp.oddSize == 0 && !sp.otherSeeds {
				wipeable = append(wipeable, sp)
				// A lone peer (seed= itself alone, consensus=1) cannot
				// detect a lost disk under its own name (docs/ipam.md).
				if !slices.Equal(sp.init.Seeds, []PeerName{sp.name}) && sp.init.Consensus != 1 {
					wipeableSame = append(wipeableSame, sp)
				}
			}
		}
		if len(wipeable) > 0 {
			if simFault("wipe") && len(wipeableSame) > 0 {
				actions = append(actions, action{2, func() { s.wipe(s.pick(wipeableSame), false) }})
			}
			if out < s.maxDie && len(up) > 2 && simFault("rename") {
				actions = append(actions, action{1, func() { s.wipe(s.pick(wipeable), true) }})
			}
		}
		if simFault("stale") {
			actions = append(actions, action{2, func() { s.takeBackup(s.pick(wipeableSame)) }})
			var restorable []*simPeer
			for _, sp := range wipeableSame {
				if sp.backup != nil {
					restorable = append(restorable, sp)
				}
			}
			if len(restorable) > 0 {
				actions = append(actions, action{2, func() { s.restoreBackup(s.pick(restorable)) }})
			}
		}
		if len(s.peers) < 12 && simFault("join") {
			actions = append(actions, action{1, func() { s.join(simFault("otherseeds") && s.rng.IntN(4) == 0) }})
		}
	}
	for _, sp := range s.peers {
		if sp.oddSize != 0 && sp.init.Consensus == sp.oddSize && !sp.dead {
			actions = append(actions, action{2, func() { s.fixOdd(sp) }})
		}
	}
	if *simRmLive {
		var cutoff []*simPeer
		for _, sp := range up {
			if !sp.dead && !sp.leaving() && !s.connected(sp.name, s.peers[0].name) {
				cutoff = append(cutoff, sp)
			}
		}
		if len(cutoff) > 0 && out < s.maxDie && len(s.serving()) > 2 {
			actions = append(actions, action{1, func() { s.rmpeerLive(s.pick(cutoff)) }})
		}
	}
	if len(up) > 0 {
		actions = append(actions, action{5, func() { s.c.Crashes++; s.crash(s.pick(up), "random") }})
	}
	if len(crashed) > 0 {
		actions = append(actions, action{15, func() {
			sp := s.pick(crashed)
			s.tracef("restart %s", sp.name)
			s.c.Restarts++
			s.start(sp)
		}})
	}
	if out < s.maxDie && len(up) > 2 {
		actions = append(actions, action{1, func() {
			sp := s.pick(up)
			s.c.Deaths++
			s.crash(sp, "for good")
			sp.dead = true
			for k, h := range s.holder { // its pods are gone with it
				if h == sp.name {
					delete(s.held, k)
					delete(s.holder, k)
					delete(s.waiting, k)
				}
			}
		}})
	}
	if out < s.maxDie && len(claimed) > 0 && len(s.serving()) > 2 {
		actions = append(actions, action{1, func() { s.leave(s.pick(claimed)) }})
	}
	if len(removable) > 0 && len(s.serving()) > 0 {
		actions = append(actions, action{10, func() { s.rmpeerGone(s.pick(removable)) }})
	}
	if len(dead) > 0 && len(s.serving()) > 0 {
		// The operator runs rmpeer again, maybe on another peer.
		actions = append(actions, action{2, func() {
			if x := s.pick(dead); s.drained(x) {
				s.rmpeer(x)
			}
		}})
	}
	total := 0
	for _, a := range actions {
		total += a.w
	}
	r := s.rng.IntN(total)
	for _, a := range actions {
		if r < a.w {
			a.do()
			break
		}
		r -= a.w
	}
	s.check()
}

// fixOdd is the operator giving the odd peer the cluster's N: it is
// restarted, with its state removed if it holds no ring (its saved N
// would be refused, as it should be).
func (s *sim) fixOdd(sp *simPeer) {
	if sp.p != nil {
		s.crash(sp, "the operator fixes its consensus size")
	}
	if sp.disk.Ring == nil || sp.disk.Ring.Empty() {
		sp.disk = HardState{}
	}
	sp.init = s.base
	s.tracef("%s restarts with consensus=%d", sp.name, sp.init.Consensus)
	s.c.Restarts++
	s.start(sp)
}

// claimedEverywhere reports whether every peer that is not gone has a
// claimed ring on disk: the first claim is over. (A disk lost during the
// first claim is not modelled: Paxos needs its acceptors' disks.)
func (s *sim) claimedEverywhere() bool {
	for _, sp := range s.peers {
		if !sp.dead && !sp.otherSeeds && (sp.disk.Ring == nil || sp.disk.Ring.Empty()) {
			return false
		}
	}
	return true
}

// restartable reports whether sp may restart now: a peer whose disk was
// wiped waits until nothing its lost process sent is in flight.
// drainUnseen is the operator's remedy when the cluster's ring was lost
// with every disk that had it (docs/ipam.md, Reclaim: a reclaim waits
// while this peer's ring is only the first claim and its node runs pods):
// every live peer's ring is the first claim, and a reclaim waits on it.
// The reclaimer's node is drained (its pods deleted through the CNI) and
// its router restarted; it finds no pods and goes on (make test-long seed
// 19566 of seeds 10001-20000: a lone seed's cluster, every disk lost).
//
// The same remedy for a takeover that waits because this node's pods use
// addresses in the removed peer's entries that every ring it hears has as
// the first claim made them (staleFor): its node is drained too.
func (s *sim) drainUnseen() {
	up := s.up()
	unseen := true
	for _, sp := range up {
		if sp.otherSeeds || sp.p.Status().Left {
			continue
		}
		if !sp.p.a.ring.FirstClaimOnly() {
			unseen = false // a peer has the cluster's ring: it will be heard
		}
	}
	for _, sp := range up {
		if len(sp.p.nodeFound) == 0 || len(sp.p.acks) == 0 {
			continue
		}
		why := "the cluster's ring is lost with every disk that had it"
		if !unseen {
			if !sp.p.waitsStale() {
				continue
			}
			why = "its takeover waits on entries that every ring it hears has as the first claim made them"
		}
		s.tracef("drain %s (%s)", sp.name, why)
		for k, h := range s.holder {
			if h != sp.name {
				continue
			}
			if _, ok := sp.p.Lookup(k); ok {
				sp.p.Release(k)
			}
			delete(s.held, k)
			delete(s.holder, k)
			delete(s.waiting, k)
		}
		sp.found = nil
		s.ready(sp)
		s.crash(sp, "drained")
		s.c.Restarts++
		s.start(sp)
	}
}

// waitsStale reports whether a takeover of this peer's waits on staleFor.
func (p *Peer) waitsStale() bool {
	for x := range p.acks {
		if _, stale := p.staleAt(x); stale && p.removed[x] == p.cfg.Self && !p.reclaimed[x] {
			return true
		}
	}
	return false
}

func (s *sim) restartable(sp *simPeer) bool {
	return !sp.wiped || !slices.ContainsFunc(s.net, func(m simMsg) bool { return m.from == sp.name })
}

// wipe loses sp's disk. Under its own name, it comes back with its pods
// still running (their addresses found on its bridge); under a new name,
// its node was rebuilt: its pods are gone and the old name is dead, for
// the operator to rmpeer.
func (s *sim) wipe(sp *simPeer, rename bool) {
	s.c.Wipes++
	if sp.p != nil {
		s.crash(sp, "disk lost")
	}
	sp.disk = HardState{}
	if !rename {
		sp.wiped, sp.lostState = true, true
		sp.found = map[Key]Address{}
		for k, h := range s.holder {
			if h == sp.name && !s.waiting[k] {
				sp.found[k] = s.held[k]
			}
		}
		s.tracef("%s lost its disk; %d pods still run on it", sp.name, len(sp.found))
		if s.rng.IntN(2) == 0 && s.restartable(sp) {
			s.c.Restarts++
			s.start(sp)
		}
		return
	}
	s.c.Renamed++
	s.c.Deaths++
	sp.dead = true
	for k, h := range s.holder {
		if h == sp.name {
			delete(s.held, k)
			delete(s.holder, k)
			delete(s.waiting, k)
		}
	}
	s.tracef("%s lost its disk and comes back under a new name", sp.name)
	s.addPeer(PeerName(fmt.Sprintf("%s-r%d", sp.name, s.step)), false)
}

// takeBackup copies sp's disk, to be restored later (the stale fault).
func (s *sim) takeBackup(sp *simPeer) {
	if sp == nil || sp.disk.Ring == nil || sp.disk.Ring.Empty() || sp.disk.Left != "" {
		return
	}
	s.c.Backups++
	b := sp.disk.Clone()
	sp.backup = &b
	s.tracef("backup of %s's disk", sp.name)
}

// restoreBackup restores sp's disk from its backup, over its newer state,
// and restarts it (as wipe does) with its pods still running, found on
// its bridge: a backup restored, a VM snapshot rolled back.
func (s *sim) restoreBackup(sp *simPeer) {
	s.c.Stale++
	if sp.p != nil {
		s.crash(sp, "disk restored from a backup")
	}
	sp.disk, sp.backup, sp.restored = sp.backup.Clone(), nil, true
	sp.wiped, sp.lostState = true, true
	sp.found = map[Key]Address{}
	for k, h := range s.holder {
		if h == sp.name && !s.waiting[k] {
			sp.found[k] = s.held[k]
		}
	}
	for k := range sp.disk.Allocations {
		if s.holder[k] != sp.name || s.waiting[k] {
			if sp.staleKeys == nil {
				sp.staleKeys = map[Key]bool{}
			}
			sp.staleKeys[k] = true
		}
	}
	s.tracef("%s's disk restored from a backup; %d pods still run on it", sp.name, len(sp.found))
	if s.rng.IntN(2) == 0 && s.restartable(sp) {
		s.c.Restarts++
		s.start(sp)
	}
}

// join adds a peer mid-run: a new node, as the operator configures one
// (consensus clusters: observer, since a late consensus peer could reach a
// quorum with other newcomers; seed clusters: the same list). otherSeeds:
// a node configured for another cluster (another seed list).
func (s *sim) join(otherSeeds bool) {
	s.c.Joins++
	s.addPeer(PeerName(fmt.Sprintf("j%d", s.step)), otherSeeds)
}

func (s *sim) addPeer(name PeerName, otherSeeds bool) {
	sp := &simPeer{name: name, init: s.base}
	switch {
	case otherSeeds:
		s.c.Mixed++
		sp.otherSeeds = true
		sp.init = Init{Seeds: []PeerName{name, s.pick(s.peers).name}}
		slices.Sort(sp.init.Seeds)
		sp.init.Seeds = slices.Compact(sp.init.Seeds)
	case s.base.Consensus > 0:
		sp.init = Init{Observer: true}
	}
	s.tracef("%s joins (%+v)", name, sp.init)
	s.peers = append(s.peers, sp)
	s.by[name] = sp
	s.start(sp)
}

// rmpeerLive is the operator's mistake (or Kubernetes deleting a Node that
// is only cut off): rmpeer of a peer that is alive. It must stop
// allocating once it knows; its pods are then the operator's to move.
func (s *sim) rmpeerLive(x *simPeer) {
	s.tracef("rmpeer of %s, alive but cut off", x.name)
	s.c.Deaths++
	x.dead = true
	x.removedLive = true
	if x.p != nil {
		x.ownedAtRm = x.p.Owned()
	}
	for k, h := range s.holder {
		if h == x.name {
			delete(s.held, k)
			delete(s.holder, k)
			delete(s.waiting, k)
		}
	}
	s.rmpeer(x)
}

// leave runs weft reset on sp: mostly forced, else refused while it holds
// pods. alive is what sp's mesh would see: peers up and reachable, and not
// leaving themselves.
func (s *sim) leave(sp *simPeer) {
	force := s.rng.IntN(4) != 0
	alive := func(q PeerName) bool {
		o := s.by[q]
		return o != nil && o.p != nil && !o.leaving() && s.connected(sp.name, q)
	}
	pods := 0
	for _, al := range sp.p.Allocations() {
		if !al.Key.Internal() {
			pods++
		}
	}
	s.tracef("%s: leave (force %v, %d pods)", sp.name, force, pods)
	res, err := sp.p.Leave(alive, force)
	switch {
	case err == nil:
		s.c.Leaves++
		s.tracef("%s: leaves, heir %s, %d addresses", sp.name, res.Heir, res.Size)
		if res.Heir == "" {
			s.fail("%s left without an heir", sp.name)
		}
	case !force && pods > 0 && errors.Is(err, ErrPodsHeld),
		errors.Is(err, ErrNoHeir), errors.Is(err, ErrHolding),
		strings.Contains(err.Error(), "(rmpeer) and waits for"):
		s.c.LeavesRefused++
		s.tracef("%s: leave refused: %v", sp.name, err)
	default:
		s.fail("leave of %s (force %v, %d pods): %v", sp.name, force, pods, err)
	}
	s.ready(sp)
	if sp.disk.Left != "" {
		// Done on disk: its pods are gone with the node.
		for k, h := range s.holder {
			if h == sp.name {
				delete(s.held, k)
				delete(s.holder, k)
				delete(s.waiting, k)
			}
		}
	}
}

// rmpeerGone is the operator removing a peer that is gone and that no
// live peer removes. A peer that left needs that only when its heir is
// gone too: otherwise the heir removes it.
func (s *sim) rmpeerGone(x *simPeer) {
	if heir := s.by[x.disk.Left]; x.left && x.rmpeers == 0 && heir != nil && !heir.dead && heir.disk.Removed[x.name] == heir.name {
		// (An heir that lost its disk since has forgotten the departure:
		// then the operator's rmpeer is needed, on the heir, as
		// ReclaimingError says.)
		s.fail("%s left, and its heir %s is not gone, but nobody removes %s", x.name, heir.name, x.name)
	}
	s.rmpeer(x)
}

func (s *sim) rmpeer(x *simPeer) {
	x.rmpeers++
	by := s.pick(s.serving())
	s.tracef("%s: rmpeer %s", by.name, x.name)
	s.readRegistry(by) // kube mode: the reclaim reads the registered peers first (kubeReclaim)
	if by.p == nil {
		return // it went meanwhile (a confirmed leave): the operator tries again
	}
	if err := by.p.PeerGone(x.name); err != nil {
		// Another (dead) peer is on it: the operator removes that one first.
		if _, ok := errors.AsType[*ReclaimingError](err); !ok {
			s.fail("rmpeer %s on %s: %v", x.name, by.name, err)
		}
		s.tracef("%s: %v", by.name, err)
	}
	s.ready(by)
	// The operator's command succeeded once the removal is on disk;
	// otherwise it will be tried again. From then on, x's addresses may be
	// handed out again: its pods are gone.
	x.removed = x.removed || by.disk.Removed[x.name] == by.name
	if x.removed {
		delete(s.registry, x.name) // the Node is deleted: no longer registered
	}
}

// check verifies the invariants: no address held by two keys anywhere
// (live peers' memory, crashed peers' disks, dead peers' disks until they
// are removed), every held address inside a range its holder owns in its
// own ring, and the containers' view matching the peers'.
func (s *sim) check() {
	if s.err != nil {
		return
	}
	type holder struct {
		k Key
		p PeerName
	}
	holders := make(map[Address]holder, 256)
	for _, sp := range s.peers {
		if sp.removed {
			continue
		}
		// The checker reads the allocator's maps directly: it runs after
		// every step, and must not make copies.
		als, ring := sp.disk.Allocations, sp.disk.Ring
		if sp.p != nil {
			als, ring = sp.p.a.byKey, sp.p.a.ring
		}
		for k, a := range als {
			if sp.staleKeys[k] && s.holder[k] != sp.name {
				// A record of a pod gone since, on a disk restored from a
				// backup: what matters is that nothing hands it out twice.
				continue
			}
			if other, ok := holders[a]; ok {
				s.fail("address %s is held by %s on %s and by %s on %s", a, other.k, other.p, k, sp.name)
				return
			}
			holders[a] = holder{k, sp.name}
			if a == s.u.Start || a == s.u.End-1 {
				s.fail("%s on %s holds the reserved address %s", k, sp.name, a)
			}
			if ring == nil {
				s.fail("%s on %s holds %s with no ring", k, sp.name, a)
				return
			}
			if o, ok := ring.Owner(a); !ok || o != sp.name {
				s.fail("%s on %s holds %s, which its own ring gives to %q", k, sp.name, a, o)
			}
		}
	}
	pods := make(map[Address]Key, len(s.held))
	for k, a := range s.held {
		if o, ok := pods[a]; ok {
			s.fail("containers %s and %s both have %s", o, k, a)
			return
		}
		pods[a] = k
		sp := s.by[s.holder[k]]
		var got Address
		var ok bool
		if sp.p != nil {
			got, ok = sp.p.Lookup(k)
		} else {
			got, ok = sp.disk.Allocations[k]
		}
		if f, wiped := sp.found[k]; wiped && !ok {
			if f != a {
				s.fail("the sim lost track of %s: %s found, %s held", k, f, a)
			}
			continue // its disk was wiped: not held again yet
		}
		if !ok || got != a {
			s.fail("container %s was given %s by %s, which now has %s, %v", k, a, sp.name, got, ok)
		}
		if sp.p != nil && ok && !sp.p.startHold {
			delete(sp.found, k)
		}
	}
	s.checkRings()
}

// checkRings checks the peers' rings: every (token, version) on the disks
// of the peers not removed has one content, and at most one live peer owns each address in its own
// ring (among the peers of one seed).
func (s *sim) checkRings() {
	type owner struct {
		rg Range
		p  PeerName
	}
	owners := map[Seed][]owner{}
	clear(s.seen)
	for _, sp := range s.peers {
		if sp.removed {
			continue // gone for good; its disk may hold a change nobody saw (Ring.Reclaim)
		}
		// Versions that left the peer: persisted (a Ready is persisted
		// before it is sent). Memory may hold a change that a crash loses
		// before anyone sees it.
		if r := sp.disk.Ring; r != nil {
			for _, e := range r.Entries {
				v := simVersion{r.Seed, e.Token, e.Version}
				if old, ok := s.seen[v]; !ok {
					s.seen[v] = simEntry{peer: e.Peer, free: e.Free, who: sp.name}
				} else if old.peer != e.Peer || old.free != e.Free {
					s.fail("token %s version %d is %s with %d free on %s but %s with %d free on %s",
						e.Token, e.Version, old.peer, old.free, old.who, e.Peer, e.Free, sp.name)
					return
				}
			}
		}
		if sp.p == nil || sp.removed || sp.p.rejoining() || sp.p.startHold || sp.leaving() {
			continue
		}
		r := sp.p.a.ring
		for _, rg := range r.Owned(sp.name) {
			owners[r.Seed] = append(owners[r.Seed], owner{rg, sp.name})
		}
	}
	for _, os := range owners {
		slices.SortFunc(os, func(a, b owner) int { return int(a.rg.Start) - int(b.rg.Start) })
		for i := 1; i < len(os); i++ {
			if os[i].rg.Start < os[i-1].rg.End {
				s.fail("%s and %s both own %s in their own rings", os[i-1].p, os[i].p, os[i].rg)
				return
			}
		}
	}
}

// settle heals everything and runs the cluster without faults until it is
// quiet: nothing in flight or waiting, rings equal, reclaims done.
func (s *sim) settle(what string) {
	s.quiet = true
	clear(s.group)
	clear(s.oneway)
	for _, sp := range s.peers {
		if sp.p != nil && sp.dead { // removed while alive (rmlive): the node goes
			s.crash(sp, "removed")
		}
		if sp.oddSize != 0 && sp.init.Consensus == sp.oddSize && !sp.dead {
			s.fixOdd(sp)
		}
		if sp.p == nil && !sp.dead {
			s.tracef("restart %s", sp.name)
			s.c.Restarts++
			s.start(sp)
		}
	}
	for round := 0; round < 3000 && s.err == nil; round++ {
		s.step++
		s.kubeStep()
		for len(s.net) > 0 && s.err == nil {
			s.deliver(s.rng.IntN(len(s.net)))
		}
		for _, sp := range s.peers {
			if s.mayRemove(sp) {
				s.rmpeerGone(sp)
			}
		}
		s.tick()
		if round%5 == 0 {
			// memberlist's push-pull: with the next peer, and with a
			// random one, so that over time every pair meets.
			up := s.up()
			for i, a := range up {
				s.pushPull(a, up[(i+1)%len(up)])
				if b := s.pick(up); b != a {
					s.pushPull(a, b)
				}
			}
		}
		s.check()
		if len(s.net) == 0 && s.quiescent() {
			return
		}
		if round == 1000 {
			s.drainUnseen()
		}
	}
	if s.err == nil {
		s.fail("%s: the cluster did not settle: %s", what, s.describeState())
	}
}

func (s *sim) quiescent() bool {
	var ring *Ring
	for _, sp := range s.up() {
		st := sp.p.Status()
		if st.Left || sp.otherSeeds {
			continue // its view is frozen: it merges nothing any more; or it is of another cluster
		}
		if len(sp.found) > 0 {
			return false
		}
		if st.Waiting > 0 || !st.Claimed {
			return false
		}
		for _, w := range st.Reclaims {
			if len(w) > 0 {
				return false
			}
		}
		for _, rp := range sp.p.Ring().Peers() {
			if s.by[rp].removed || s.by[rp].left {
				return false
			}
		}
		if ring == nil {
			ring = sp.p.Ring()
		} else if !ring.Equal(sp.p.Ring()) {
			return false
		}
	}
	return len(s.waiting) == 0
}

func (s *sim) describeState() string {
	var b strings.Builder
	for k := range s.waiting {
		fmt.Fprintf(&b, "\n  %s waits on %s", k, s.holder[k])
	}
	fmt.Fprintf(&b, "\n  %d messages in flight", len(s.net))
	for _, sp := range s.peers {
		if sp.p == nil {
			fmt.Fprintf(&b, "\n  %s: down (dead %v, removed %v)", sp.name, sp.dead, sp.removed)
			continue
		}
		st := sp.p.Status()
		fmt.Fprintf(&b, "\n  %s: %s, owned %d free %d, reclaims %v, removed %v, found %v, ring %v", sp.name, st, st.Owned, st.Free, st.Reclaims, sp.p.Removed(), sp.found, sp.p.Ring().Entries)
	}
	return b.String()
}

// run plays one schedule of steps, settles, and checks service at the end.
func (s *sim) run(steps int) error {
	for s.step < steps && s.err == nil {
		s.randomStep()
	}
	s.settle("after the schedule")
	if s.err != nil {
		return s.err
	}
	// Every live peer gets an address, if there is space for them all.
	var up []*simPeer
	for _, sp := range s.serving() {
		if !sp.otherSeeds {
			up = append(up, sp)
		}
	}
	var free uint64
	for _, sp := range up {
		free += sp.p.Stats().Free
	}
	if free >= uint64(len(up)) {
		var keys []Key
		for _, sp := range up {
			s.allocate(sp)
			keys = append(keys, Key{ContainerID: fmt.Sprintf("c%d", s.nextKey), IfName: "eth0"})
		}
		s.settle("after the final allocations")
		for i, k := range keys {
			if _, ok := s.held[k]; !ok && s.err == nil {
				s.fail("%s did not get an address for %s in the end, with %d free in the cluster:%s", up[i].name, k, free, s.describeState())
			}
		}
	}
	// Then fill the cluster through random peers: an allocation fails only
	// once no address is free anywhere.
	for s.err == nil {
		free = 0
		for _, sp := range up {
			free += sp.p.Stats().Free
		}
		failedBefore := s.c.Failed
		for range max(1, free/8) {
			s.allocate(s.pick(up))
		}
		s.settle("while filling the cluster")
		if s.c.Failed > failedBefore {
			var left uint64
			for _, sp := range up {
				left += sp.p.Stats().Free
			}
			if left > 0 && s.err == nil {
				s.fail("an allocation failed with %d addresses free in the cluster:%s", left, s.describeState())
			}
			break
		}
	}
	return s.err
}

func simRun(seed uint64, steps int, verbose bool) (*sim, error) {
	s := newSim(seed, verbose)
	err := s.run(steps)
	s.c.Schedules = 1
	return s, err
}

// TestSimulation runs many schedules. A failure prints the seed and the
// last steps; replay one with -ipalloc.sim.seed=N.
func TestSimulation(t *testing.T) {
	schedules, steps := 300, 1500
	switch {
	case testing.Short():
		schedules, steps = 40, 600
	case raceEnabled:
		schedules = 100 // make test runs 1500 more without the race detector
	}
	if *simSchedules > 0 {
		schedules = *simSchedules
	}
	if *simSteps > 0 {
		steps = *simSteps
	}
	if *simSeed != 0 {
		s, err := simRun(*simSeed, steps, testing.Verbose())
		t.Logf("seed %d: %s", *simSeed, &s.c)
		if err != nil {
			t.Fatalf("seed %d: %v", *simSeed, err)
		}
		return
	}
	var total simCounts
	var mu sync.Mutex
	var failures []string
	next := atomic.Uint64{}
	next.Store(*simFirst)
	last := *simFirst + uint64(schedules)
	start := time.Now()
	var wg sync.WaitGroup
	for range runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			for {
				seed := next.Add(1) - 1
				if seed >= last {
					return
				}
				s, err := simRun(seed, steps, false)
				total.add(&s.c)
				if err != nil {
					mu.Lock()
					failures = append(failures, fmt.Sprintf("seed %d: %v\nlast steps:\n%s\nreplay: go test ./ipalloc -run TestSimulation -v -ipalloc.sim.seed=%d -ipalloc.sim.steps=%d",
						seed, err, strings.Join(s.trace[max(0, len(s.trace)-60):], "\n"), seed, steps))
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%s in %s", &total, time.Since(start).Round(time.Millisecond))
	slices.Sort(failures)
	for i, f := range failures {
		if i >= 3 {
			// One line each: the seed and what failed (replay it for the rest).
			first, _, _ := strings.Cut(f, "\n")
			t.Errorf("also %s", first)
			continue
		}
		t.Error(f)
	}
}
