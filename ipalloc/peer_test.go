package ipalloc

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// cluster is a lossless in-order network of Peers, for unit tests.
type cluster struct {
	t      *testing.T
	u      Range
	peers  map[PeerName]*Peer
	disk   map[PeerName]*HardState
	inits  map[PeerName]Init
	names  []PeerName
	queue  []simMsg
	answer map[Key]Answer
	events []string
	cut    map[PeerName]bool // peers whose messages are lost
	split  bool              // refused rings (seeded apart) are expected
	// onRefuse, if set, says whether a refused message is expected.
	onRefuse func(error) bool
	// drop, if set, says whether a message is lost.
	drop func(from, to PeerName, m Msg) bool
	// noBroadcast loses every broadcast ring, as the mesh refuses a ring
	// over its broadcast limit (from about 60 owners of an even claim).
	noBroadcast bool
}

func newCluster(t *testing.T, universe string, inits map[PeerName]Init) *cluster {
	c := &cluster{t: t, u: rangeOf(universe), peers: map[PeerName]*Peer{}, disk: map[PeerName]*HardState{},
		inits: inits, answer: map[Key]Answer{}, cut: map[PeerName]bool{}}
	for n := range inits {
		c.names = append(c.names, n)
	}
	slices.Sort(c.names)
	for _, n := range c.names {
		c.disk[n] = &HardState{}
		c.start(n)
	}
	return c
}

// newConsensusCluster starts n peers a, b, c, ... with consensus=n over
// a /12.
func newConsensusCluster(t *testing.T, n int) *cluster {
	inits := map[PeerName]Init{}
	for i := range n {
		inits[PeerName(string(rune('a'+i)))] = Init{Consensus: n}
	}
	return newCluster(t, "10.32.0.0/12", inits)
}

func (c *cluster) start(n PeerName) *Peer {
	c.t.Helper()
	p, err := NewPeer(PeerConfig{Self: n, Universe: c.u, Init: c.inits[n], Peers: c.names, Timing: simTiming,
		Rand: rand.New(rand.NewPCG(uint64(len(n)), 7))}, c.disk[n].Clone())
	if err != nil {
		c.t.Fatal(err)
	}
	c.peers[n] = p
	c.ready(n)
	return p
}

func (c *cluster) ready(n PeerName) {
	p := c.peers[n]
	if p == nil || !p.HasReady() {
		return
	}
	rd := p.Ready()
	c.disk[n].Apply(rd)
	for _, e := range rd.Events {
		c.events = append(c.events, string(n)+": "+e.Text)
	}
	if rd.Broadcast != nil && !c.noBroadcast {
		for _, q := range c.names {
			if q != n {
				c.queue = append(c.queue, simMsg{n, q, EncodeMsg(&RingMsg{Ring: rd.Broadcast})})
			}
		}
	}
	for _, m := range rd.Messages {
		c.queue = append(c.queue, simMsg{n, m.To, EncodeMsg(m.Msg)})
	}
	for _, a := range rd.Answers {
		c.answer[a.Key] = a
	}
}

// run delivers everything and ticks until quiet, at most ticks times.
func (c *cluster) run(ticks int) {
	c.t.Helper()
	for i := 0; i < ticks; i++ {
		for delivered := 0; len(c.queue) > 0; delivered++ {
			if delivered > 100000 {
				// Peers that answer each other for ever (two reclaimers that
				// both think they go first) would hold the test here.
				c.t.Fatalf("a message storm: over %d messages within one tick, still %d queued (last: %s -> %s)",
					delivered, len(c.queue), c.queue[0].from, c.queue[0].to)
			}
			m := c.queue[0]
			c.queue = c.queue[1:]
			to := c.peers[m.to]
			if to == nil || c.cut[m.from] || c.cut[m.to] {
				continue
			}
			msg, err := DecodeMsg(m.data)
			if err != nil {
				c.t.Fatal(err)
			}
			if c.drop != nil && c.drop(m.from, m.to, msg) {
				continue
			}
			if err := to.Step(m.from, msg); err != nil && !errors.Is(err, ErrRemovedPeer) && !(c.split && errors.Is(err, ErrSplitRing)) &&
				(c.onRefuse == nil || !c.onRefuse(err)) {
				c.t.Fatalf("%s -> %s: %v", m.from, m.to, err)
			}
			c.ready(m.to)
		}
		for _, n := range c.names {
			if p := c.peers[n]; p != nil {
				p.Tick()
				c.ready(n)
			}
		}
	}
}

func (c *cluster) alloc(n PeerName, k Key) {
	c.peers[n].Allocate(k)
	c.ready(n)
}

func (c *cluster) hasEvent(s string) bool {
	for _, e := range c.events {
		if strings.Contains(e, s) {
			return true
		}
	}
	return false
}

func TestPeerSeed(t *testing.T) {
	seeds := []PeerName{"a", "b", "c"}
	c := newCluster(t, "10.32.0.0/24", map[PeerName]Init{"a": {Seeds: seeds}, "b": {Seeds: seeds}, "c": {Seeds: seeds}, "d": {Seeds: seeds}})
	want := NewRing(c.u)
	if err := want.ClaimEvenly(seeds); err != nil {
		t.Fatal(err)
	}
	for _, n := range c.names {
		if r := c.disk[n].Ring; r == nil || r.Seed != want.Seed || len(r.Entries) != 3 {
			t.Fatalf("%s saved %v, want the seeded ring", n, r)
		}
	}
	// d is not in the list: it asks for space, and gets it.
	c.alloc("d", key(1))
	c.run(5)
	if a := c.answer[key(1)]; a.Err != nil || a.Address == 0 {
		t.Fatalf("d's allocation: %+v", a)
	}
	if !c.hasEvent("to d, which asked for space") {
		t.Errorf("no donation to d logged: %v", c.events)
	}
	if c.peers["d"].Status().String() != "ready" {
		t.Errorf("d's status: %s", c.peers["d"].Status())
	}
}

func TestPeerConsensus(t *testing.T) {
	inits := map[PeerName]Init{"a": {Consensus: 3}, "b": {Consensus: 3}, "c": {Consensus: 3}, "obs": {Observer: true}}
	c := newCluster(t, "10.32.0.0/12", inits)
	if got := c.peers["a"].Status().String(); got != "awaiting consensus (quorum: 2, known: 1)" {
		t.Errorf("status before the claim: %q", got)
	}
	if got := c.peers["obs"].Status().String(); got != "waiting for the ring from a peer" {
		t.Errorf("observer's status before the claim: %q", got)
	}
	c.alloc("a", key(1))
	c.run(60)
	ring := c.peers["a"].Ring()
	if ring.Empty() {
		t.Fatalf("no claim: %v", c.events)
	}
	for _, n := range c.names {
		if !c.peers[n].Ring().Equal(ring) {
			t.Errorf("%s's ring differs", n)
		}
	}
	// Each of the three owns about a third; the observer nothing.
	for _, s := range ring.Shares() {
		if s.Peer == "obs" {
			t.Errorf("the observer owns %d", s.Size)
		}
		if pc := Percent(s.Size, uint64(c.u.Size())); pc < 32 || pc > 35 {
			t.Errorf("%s owns %.1f%%", s.Peer, pc)
		}
	}
	if a := c.answer[key(1)]; a.Err != nil {
		t.Fatal(a.Err)
	}
	// The observer allocates through a donation.
	c.alloc("obs", key(2))
	c.run(5)
	if a := c.answer[key(2)]; a.Err != nil || !slices.ContainsFunc(c.peers["obs"].Owned(), func(r Range) bool { return r.Contains(a.Address) }) {
		t.Fatalf("observer's allocation: %+v, owned %v", a, c.peers["obs"].Owned())
	}
}

func TestPeerWaitsThenFails(t *testing.T) {
	// Alone, with consensus=3: no quorum, so the allocation waits, then fails.
	c := newCluster(t, "10.32.0.0/24", map[PeerName]Init{"a": {Consensus: 3}})
	c.alloc("a", key(1))
	c.alloc("a", key(2))
	c.peers["a"].Release(key(2))
	c.ready("a")
	if a := c.answer[key(2)]; !errors.Is(a.Err, ErrCanceled) {
		t.Errorf("released while waiting: %+v", a)
	}
	c.run(simTiming.AllocDeadline - 1)
	if _, ok := c.answer[key(1)]; ok {
		t.Fatal("answered before the deadline")
	}
	c.run(1)
	a := c.answer[key(1)]
	if !ErrIsExhausted(a.Err) || !strings.Contains(a.Err.Error(), "awaiting consensus (quorum: 2, known: 1)") {
		t.Fatalf("after the deadline: %+v", a)
	}
}

func TestPeerRestart(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", map[PeerName]Init{"a": {Seeds: []PeerName{"a", "b"}}, "b": {Seeds: []PeerName{"a", "b"}}})
	for i := range 5 {
		c.alloc("a", key(i))
	}
	c.peers["a"].Release(key(0))
	c.ready("a")
	before := c.peers["a"].Allocations()
	c.start("a")
	if got := c.peers["a"].Allocations(); !slices.Equal(got, before) {
		t.Fatalf("after restart: %v, want %v", got, before)
	}
	c.run(3)
	if !c.peers["a"].Ring().Equal(c.peers["b"].Ring()) {
		t.Fatal("rings differ after restart")
	}
}

func TestPeerRefusesTakeaway(t *testing.T) {
	c := newCluster(t, "10.32.0.0/24", map[PeerName]Init{"a": {Seeds: []PeerName{"a", "b"}}, "b": {Seeds: []PeerName{"a", "b"}}})
	c.alloc("a", key(1))
	c.run(5)
	// b (wrongly) reclaims a, which is alive.
	r := c.peers["b"].Ring()
	if _, err := r.Reclaim("a", "b"); err != nil {
		t.Fatal(err)
	}
	err := c.peers["a"].Step("b", &RingMsg{Ring: r})
	if !errors.Is(err, ErrRangeTaken) || !strings.Contains(err.Error(), "1 of them in use here") {
		t.Fatalf("Step = %v, want ErrRangeTaken", err)
	}
	c.ready("a")
	if !c.hasEvent("refused the ring from b") {
		t.Errorf("no event: %v", c.events)
	}
}

func TestPeerGone(t *testing.T) {
	names := []PeerName{"a", "b", "c", "d"}
	inits := map[PeerName]Init{}
	for _, n := range names {
		inits[n] = Init{Seeds: names}
	}
	c := newCluster(t, "10.32.0.0/24", inits)
	a := c.peers["a"]
	if err := a.PeerGone("a"); err == nil || !strings.Contains(err.Error(), "weft reset") {
		t.Errorf("rmpeer of self: %v", err)
	}
	if err := a.PeerGone("bad name"); err == nil {
		t.Error("rmpeer of a bad name succeeded")
	}
	// d dies; c is cut off: the takeover waits for c.
	c.peers["d"] = nil
	c.cut["c"] = true
	if err := a.PeerGone("d"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(20)
	if a.Ring().Peers()[3] != "d" {
		t.Fatal("took d's ranges over before c acknowledged")
	}
	if st := a.Status(); !slices.Equal(st.Reclaims["d"], []PeerName{"c"}) {
		t.Errorf("status: %+v", st.Reclaims)
	}
	// Another peer may not remove d at the same time on its own.
	if err := c.peers["b"].PeerGone("d"); err == nil || !strings.Contains(err.Error(), "a is taking over") {
		t.Errorf("second rmpeer: %v", err)
	}
	delete(c.cut, "c")
	c.run(20)
	if slices.Contains(a.Ring().Peers(), "d") {
		t.Fatalf("d still owns ranges: %v", a.Ring().Entries)
	}
	if !c.hasEvent("rmpeer of d: 64 IPs taken over") {
		t.Errorf("no takeover logged: %v", c.events)
	}
	for _, n := range names[:3] {
		if !c.peers[n].Ring().Equal(a.Ring()) {
			t.Errorf("%s's ring differs", n)
		}
	}
	// Messages from d are refused everywhere.
	for _, n := range names[:3] {
		if err := c.peers[n].Step("d", &DonateRequest{ID: 1}); !errors.Is(err, ErrRemovedPeer) {
			t.Errorf("%s took a message from d: %v", n, err)
		}
	}
	// A peer told that it is removed warns.
	c.peers["b"].Step("a", &Remove{Peer: "b"})
	c.ready("b")
	if !c.hasEvent("b: ipalloc: a is removing this peer") {
		t.Errorf("no warning: %v", c.events)
	}
}

// TestPeerGoneInSplitCluster: a peer of a ring seeded apart (a split
// cluster) never acknowledges this ring's removals; once its ring has been
// refused it stops counting as a live peer, so the reclaim completes.
func TestPeerGoneInSplitCluster(t *testing.T) {
	ours := []PeerName{"a", "b", "c"}
	c := newCluster(t, "10.32.0.0/24", map[PeerName]Init{"a": {Seeds: ours}, "b": {Seeds: ours}, "c": {Seeds: ours}, "z": {Seeds: []PeerName{"z"}}})
	c.split = true
	c.run(5) // z's ring and theirs meet, and are refused both ways
	if !c.hasEvent("a: ipalloc: z's ring was seeded apart from this one") {
		t.Fatalf("a did not mark z's ring as foreign: %v", c.events)
	}
	c.peers["c"] = nil // c dies
	a := c.peers["a"]
	if err := a.PeerGone("c"); err != nil {
		t.Fatal(err)
	}
	c.ready("a")
	c.run(20)
	if slices.Contains(a.Ring().Peers(), "c") {
		t.Fatalf("the reclaim of c waits for z, a peer of another ring: %+v", a.Status().Reclaims)
	}
	if !c.hasEvent("rmpeer of c:") || !c.peers["b"].Ring().Equal(a.Ring()) {
		t.Errorf("no takeover, or b's ring differs: %v", c.events)
	}
	// z's ring is untouched: it still owns everything of its own.
	if got := c.peers["z"].Ring().Peers(); !slices.Equal(got, []PeerName{"z"}) {
		t.Errorf("z's ring changed: %v", got)
	}
}

func TestPeerDonationDenied(t *testing.T) {
	// a owns all but nothing is free; b has free space; c asks: gets it from b.
	names := []PeerName{"a", "b"}
	c := newCluster(t, "10.32.0.0/28", map[PeerName]Init{"a": {Seeds: names}, "b": {Seeds: names}, "c": {Observer: true}})
	for i := 0; i < 7; i++ {
		c.alloc("a", key(i))
	}
	c.run(2)
	c.alloc("c", key(100))
	c.run(10)
	if a := c.answer[key(100)]; a.Err != nil {
		t.Fatalf("c's allocation: %+v (%v)", a, c.events)
	}
	// With everything full, the request fails after its deadline.
	for i := 200; ; i++ {
		c.alloc("c", key(i))
		c.run(1)
		if a, ok := c.answer[key(i)]; !ok || a.Err != nil {
			c.run(simTiming.AllocDeadline + 1)
			if a := c.answer[key(i)]; !ErrIsExhausted(a.Err) {
				t.Fatalf("allocation in a full cluster: %+v", a)
			} else if msg := a.Err.Error(); !strings.Contains(msg, "shows 0 free addresses at 0 live peers") || strings.Contains(msg, " 0 times no live peer") {
				t.Errorf("the error does not say that no peer had space to ask for: %v", a.Err)
			}
			break
		}
		if i > 300 {
			t.Fatal("never full")
		}
	}
}

// TestPeerDonationUnansweredSaysSo: a donor that never answers (dead, or
// its messages lost) is named in the error of the allocation that waited.
func TestPeerDonationUnansweredSaysSo(t *testing.T) {
	names := []PeerName{"a", "b"}
	c := newCluster(t, "10.32.0.0/28", map[PeerName]Init{"a": {Seeds: names}, "b": {Seeds: names}, "c": {Observer: true}})
	for i := 0; i < 7; i++ {
		c.alloc("a", key(i)) // a is full
	}
	c.run(5)
	c.peers["b"] = nil // b, with free space, dies unnoticed
	c.alloc("c", key(100))
	c.run(simTiming.AllocDeadline + 1)
	a, ok := c.answer[key(100)]
	if !ok || !errors.Is(a.Err, ErrNoSpace) {
		t.Fatalf("c's allocation: %+v, want ErrNoSpace", a)
	}
	for _, want := range []string{" 0 donations", "b did not answer", "free addresses at 1 live peers"} {
		if !strings.Contains(a.Err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, a.Err)
		}
	}
	if strings.Contains(a.Err.Error(), " 0 unanswered") {
		t.Errorf("the error counts no unanswered request: %v", a.Err)
	}
}

func TestNewPeerRefuses(t *testing.T) {
	u := rangeOf("10.32.0.0/24")
	for _, tt := range []struct {
		cfg  PeerConfig
		want string
	}{
		{PeerConfig{Self: "", Universe: u, Init: Init{Observer: true}}, "peer name"},
		{PeerConfig{Self: "a", Universe: u}, "exactly one"},
		{PeerConfig{Self: "a", Universe: u, Init: Init{Observer: true, Consensus: 2}}, "exactly one"},
		{PeerConfig{Self: "a", Universe: u, Init: Init{Seeds: []PeerName{"x y"}}}, "printable"},
	} {
		if _, err := NewPeer(tt.cfg, HardState{}); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("NewPeer(%+v) = %v, want %q", tt.cfg, err, tt.want)
		}
	}
	if _, err := NewPeer(PeerConfig{Self: "a", Universe: u, Init: Init{Observer: true}}, HardState{Ring: testRing(t)}); err == nil {
		t.Error("NewPeer with a ring of another universe succeeded")
	}
	// A saved allocation that cannot be restored is reported, not fatal.
	hs := HardState{Allocations: map[Key]Address{key(1): u.Start + 5}}
	p, err := NewPeer(PeerConfig{Self: "a", Universe: u, Init: Init{Observer: true}}, hs)
	if err != nil {
		t.Fatal(err)
	}
	rd := p.Ready()
	if len(rd.Events) != 1 || !rd.Events[0].Warn || !strings.Contains(rd.Events[0].Text, fmt.Sprint(key(1))) {
		t.Errorf("events: %+v", rd.Events)
	}
}
