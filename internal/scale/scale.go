// Package scale runs many weft control planes in one process, for the scale
// benchmark (cmd scalebench) and its short test: each node is the real mesh
// (hashicorp/memberlist with weft's channels and topology view), the real
// ipalloc Service with its own bbolt state file (state.Open in a temporary
// directory, fsync and all), and the ring gossip adapter (ipalloc.Gossip) on
// the mesh's "ipam" channel, wired as the router wires them (router/ipam.go,
// router/mesh.go, router/build.go): the Service is loaded before the mesh is
// made, the mesh starts first, then the Service's owner loop sending through
// the channel, then the routine that tells the Service of every peer the
// mesh sees join. The transport is meshtest's in-memory network, wrapped to
// lose and delay packets and to count bytes (meshtest.Lossy).
//
// What a router has beside, and a node here has not: the tunnel, the
// bridge, the local API and status servers, the Kubernetes watch, and the
// tunnel's record in the mesh metadata (about 60 bytes a peer). The glue
// between the allocator and the mesh is the router's own (internal/ipammesh),
// wrapped here only to measure what passes.
package scale

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weft-net/weft/internal/ipammesh"
	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/mesh"
	"github.com/weft-net/weft/mesh/meshtest"
	"github.com/weft-net/weft/state"
)

// Config configures a Cluster.
type Config struct {
	// Dir holds one state directory per node; it must exist.
	Dir string
	// Universe is the pod range (--ipalloc-range); zero: 10.32.0.0/12.
	Universe netip.Prefix
	// Loss is the probability that a packet (UDP gossip, probe) is lost;
	// Delay is each kept packet's one-way latency. Streams (push-pull,
	// joins) are neither lost nor delayed.
	Loss  float64
	Delay time.Duration
	// Timings are the mesh's; zero fields take mesh.DefaultTimings.
	Timings mesh.Timings
	// NoCompression turns off memberlist's compression
	// (mesh.Config.NoCompression): fewer CPU, more bytes.
	NoCompression bool
	// Seed seeds the packet loss of every node.
	Seed uint64
	// Log is every node's logger (with the node's name); nil discards.
	Log *slog.Logger
}

// Cluster is a set of nodes on one in-memory network.
type Cluster struct {
	cfg Config
	net *meshtest.Network

	mu    sync.Mutex
	nodes []*Node

	watch atomic.Pointer[mesh.PeerName] // the node whose traffic is traced (Watch)
}

// Watch traces what every node sends to the node named name and what
// that node receives (see Trace); call it before that node is added.
func (c *Cluster) Watch(name mesh.PeerName) { c.watch.Store(&name) }

// NextName is the name the next Add gives its node.
func (c *Cluster) NextName() mesh.PeerName {
	c.mu.Lock()
	defer c.mu.Unlock()
	return nodeName(len(c.nodes))
}

func nodeName(i int) mesh.PeerName { return mesh.PeerName(fmt.Sprintf("node%04d", i)) }

func (c *Cluster) watched(p mesh.PeerName) bool {
	w := c.watch.Load()
	return w != nil && *w == p
}

// New returns an empty cluster.
func New(cfg Config) (*Cluster, error) {
	if cfg.Dir == "" {
		return nil, errors.New("scale: Config.Dir is empty")
	}
	if !cfg.Universe.IsValid() {
		cfg.Universe = netip.MustParsePrefix("10.32.0.0/12")
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Cluster{cfg: cfg, net: meshtest.NewNetwork()}, nil
}

// Node is one control plane.
type Node struct {
	Name  mesh.PeerName
	Mesh  *mesh.Mesh
	Svc   *ipalloc.Service
	Lossy *meshtest.Lossy

	db     *state.DB
	gossip *ipalloc.Gossip
	ch     *mesh.Channel
	tr     *ipammesh.Transport
	pulls  ipammesh.Pulls
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// The ipam channel's largest message received (broadcast or unicast)
	// and largest full state offered, in bytes.
	maxMsg, maxState atomic.Uint64
	received         atomic.Uint64 // ipam messages received
	// The largest message the allocator sent, and the sends the channel
	// refused (too large for a broadcast, no such peer).
	byKind                      [32]atomic.Uint64 // ipam messages received, by their kind byte
	maxSent, sendErrs, tooLarge atomic.Uint64
	maxSendTime                 atomic.Uint64 // nanoseconds
	ringUnicasts                atomic.Uint64 // ring messages unicast (SendTo did not fail)
	lastErr                     atomic.Value  // string

	c   *Cluster
	reg *prometheus.Registry // the mesh's metrics
	// Traced traffic to the watched node (Cluster.Watch): what this node
	// sent it by kind, and why sends failed; on the watched node, whom it
	// got a ring-carrying message from.
	toWatch, toWatchFailed [32]atomic.Uint64
	traceMu                sync.Mutex
	failures               map[string]int
	ringFrom               map[mesh.PeerName]string // sender -> how (unicast, broadcast, state)
}

// TooLarge counts the ipam broadcasts larger than mesh.MaxBroadcastSize
// (the whole ring, past about 20 owners once donations split it): the
// rings the transport spread by unicast or left to push-pull, and any
// other message the mesh refused as too large.
func (n *Node) TooLarge() uint64 {
	s := n.Spread()
	return n.tooLarge.Load() + s.OverLimit
}

// Spread is what the node's transport did with its rings
// (ipammesh.Transport.Spread).
func (n *Node) Spread() ipammesh.Spread {
	if n.tr == nil {
		return ipammesh.Spread{}
	}
	return n.tr.Spread()
}

// LastSendError is the text of the last send the mesh refused, or "".
func (n *Node) LastSendError() string {
	s, _ := n.lastErr.Load().(string)
	return s
}

// MaxSent is the largest ipam message this node's allocator sent, in bytes.
func (n *Node) MaxSent() uint64 { return n.maxSent.Load() }

// SendErrors counts the ipam sends the mesh refused, but for TooLarge.
func (n *Node) SendErrors() uint64 { return n.sendErrs.Load() }

// MaxSendTime is the longest one unicast of its allocator took (a stream:
// dial, the receiver's pre-auth, the write).
func (n *Node) MaxSendTime() time.Duration { return time.Duration(n.maxSendTime.Load()) }

// MaxMessage is the largest ipam message this node received, in bytes.
func (n *Node) MaxMessage() uint64 { return n.maxMsg.Load() }

// MaxState is the largest ipam push-pull state this node offered, in bytes.
func (n *Node) MaxState() uint64 { return n.maxState.Load() }

// Nodes returns the nodes so far, in the order they were added.
func (c *Cluster) Nodes() []*Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*Node(nil), c.nodes...)
}

// Addr is node i's gossip address on the in-memory network.
func Addr(i int) string { return fmt.Sprintf("10.%d.%d.%d:6783", 100+(i>>16&63), i>>8&255, i&255) }

// Add starts the next node with the first-claim mode init, joining the
// addresses in peers (its --peers).
func (c *Cluster) Add(ctx context.Context, init ipalloc.Init, peers []string) (_ *Node, err error) {
	c.mu.Lock()
	i := len(c.nodes)
	c.mu.Unlock()
	name := nodeName(i)
	log := c.cfg.Log.With("peer", name)
	n := &Node{Name: name, c: c, reg: prometheus.NewRegistry(), failures: map[string]int{}, ringFrom: map[mesh.PeerName]string{}}
	defer func() {
		if err != nil {
			n.close()
		}
	}()
	dir := filepath.Join(c.cfg.Dir, string(name))
	if n.db, err = state.Open(dir); err != nil {
		return nil, err
	}
	// openIPAM
	if n.Svc, err = ipalloc.NewService(ipalloc.ServiceConfig{
		Self: ipalloc.PeerName(name), Universe: c.cfg.Universe, Init: init, DB: n.db, Log: log,
		GCGrace: ipalloc.DefaultGCGrace,
	}); err != nil {
		return nil, err
	}
	n.gossip = ipalloc.NewGossip(n.Svc, log, nil)
	// newMesh
	inner, err := c.net.NewTransport(Addr(i))
	if err != nil {
		return nil, err
	}
	n.Lossy = meshtest.NewLossy(inner, c.cfg.Loss, c.cfg.Seed+uint64(i))
	n.Lossy.SetDelay(c.cfg.Delay)
	if n.Mesh, err = mesh.New(mesh.Config{
		Name: name, Nickname: string(name), Version: "scale", Peers: peers,
		Logger: log, Transport: n.Lossy, Timings: c.cfg.Timings, NoCompression: c.cfg.NoCompression, Registerer: n.reg,
	}); err != nil {
		n.Lossy.Shutdown()
		return nil, err
	}
	if n.ch, err = n.Mesh.Channel(ipammesh.Channel, gossiper{n, ipammesh.Gossiper{G: n.gossip}}); err != nil {
		return nil, err
	}
	// Run: the mesh, the allocator, the mesh members.
	if err := n.Mesh.Start(ctx); err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	n.wg.Add(3)
	n.tr = ipammesh.NewTransport(n.Mesh, n.ch)
	go func() { defer n.wg.Done(); n.Svc.Run(runCtx, transport{n, n.tr}) }()
	go func() { defer n.wg.Done(); ipammesh.RunMembers(runCtx, n.Mesh, n.Svc, n.tr) }()
	go func() { defer n.wg.Done(); ipammesh.RunPull(runCtx, n.Mesh, n.Svc, &n.pulls) }()
	c.mu.Lock()
	c.nodes = append(c.nodes, n)
	c.mu.Unlock()
	return n, nil
}

func (n *Node) close() {
	if n.cancel != nil {
		n.cancel()
		n.wg.Wait()
	}
	if n.Mesh != nil {
		n.Mesh.Close()
	}
	if n.db != nil {
		n.db.Close()
	}
}

// Close stops every node (in parallel) and removes their state files.
func (c *Cluster) Close() {
	var wg sync.WaitGroup
	for _, n := range c.Nodes() {
		wg.Add(1)
		go func() { defer wg.Done(); n.close() }()
	}
	wg.Wait()
	for _, n := range c.Nodes() {
		os.RemoveAll(filepath.Join(c.cfg.Dir, string(n.Name)))
	}
}

// RingUnicasts counts the ring messages the nodes' allocators unicast (a
// send that failed at once not counted; one parked for a peer the mesh did
// not see yet counted).
func (c *Cluster) RingUnicasts() uint64 {
	var r uint64
	for _, n := range c.Nodes() {
		r += n.ringUnicasts.Load()
	}
	return r
}

// BytesSent is every byte the nodes sent so far, packets and streams.
func (c *Cluster) BytesSent() uint64 {
	var b uint64
	for _, n := range c.Nodes() {
		b += n.Lossy.BytesSent()
	}
	return b
}

// gossiper is the router's gossiper on the mesh channel, measuring what
// passes.
type gossiper struct {
	n     *Node
	inner ipammesh.Gossiper
}

func (g gossiper) OnBroadcast(from mesh.PeerName, data []byte) ([]byte, error) {
	g.n.note(data)
	g.n.traceIn(from, "broadcast", data)
	return g.inner.OnBroadcast(from, data)
}

func (g gossiper) OnUnicast(from mesh.PeerName, data []byte) error {
	g.n.note(data)
	g.n.traceIn(from, "unicast", data)
	return g.inner.OnUnicast(from, data)
}

func (g gossiper) LocalState() []byte {
	s := g.inner.LocalState()
	storeMax(&g.n.maxState, uint64(len(s)))
	return s
}

func (g gossiper) MergeRemoteState(data []byte) error {
	if from, msg, err := ipalloc.DecodeStateFrame(data); err == nil {
		g.n.traceIn(mesh.PeerName(from), "state", msg)
	}
	return g.inner.MergeRemoteState(data)
}

// traceIn notes, on the watched node, a message that carries a claimed
// ring (a ring, a donation, ...), by its sender.
func (n *Node) traceIn(from mesh.PeerName, how string, data []byte) {
	if !n.c.watched(n.Name) {
		return
	}
	m, err := ipalloc.DecodeMsg(data)
	if err != nil {
		return
	}
	if rm, ok := m.(*ipalloc.RingMsg); !ok || rm.Ring == nil || rm.Ring.Empty() {
		return
	}
	n.traceMu.Lock()
	defer n.traceMu.Unlock()
	if _, ok := n.ringFrom[from]; !ok {
		n.ringFrom[from] = how
	}
}

// Trace is what the cluster sent the watched node (Cluster.Watch) and
// what that node made of it.
type Trace struct {
	Sent, Failed [32]uint64     // ipam messages sent to it by all nodes, by kind byte
	Failures     map[string]int // why sends to it failed (error text, addresses cut)
	RingsFrom    map[string]int // the watched node: claimed rings first received, by how
	Refused      map[string]float64
	Dropped      uint64 // its allocator's inbox drops
	Rejoin       string // its hold (Status.Rejoin)
	// All nodes' sends parked for a peer the mesh did not know yet
	// (ipammesh.Transport), sent once it did, and dropped.
	Parked, Unparked, ParkDropped uint64
	// All nodes' rings sent again after a failed unicast, and given up.
	Resent, ResendFailed uint64
	// The watched node's pulls (ipammesh.RunPull), and those that failed.
	Pulls, PullsFailed uint64
}

// Trace sums the traced traffic to w, a node of c.
func (c *Cluster) Trace(w *Node) Trace {
	t := Trace{Failures: map[string]int{}, RingsFrom: map[string]int{}, Refused: map[string]float64{}}
	for _, n := range c.Nodes() {
		for i := range n.toWatch {
			t.Sent[i] += n.toWatch[i].Load()
			t.Failed[i] += n.toWatchFailed[i].Load()
		}
		p, u, d := n.tr.Parked()
		t.Parked, t.Unparked, t.ParkDropped = t.Parked+p, t.Unparked+u, t.ParkDropped+d
		rs, rf := n.tr.Resent()
		t.Resent, t.ResendFailed = t.Resent+rs, t.ResendFailed+rf
		n.traceMu.Lock()
		for k, v := range n.failures {
			t.Failures[k] += v
		}
		n.traceMu.Unlock()
	}
	w.traceMu.Lock()
	for _, how := range w.ringFrom {
		t.RingsFrom[how]++
	}
	w.traceMu.Unlock()
	if mfs, err := w.reg.Gather(); err == nil {
		for _, mf := range mfs {
			if mf.GetName() != "weft_mesh_preauth_refused_total" && mf.GetName() != "weft_mesh_dropped_messages_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				if v := m.GetCounter().GetValue(); v > 0 {
					t.Refused[mf.GetName()[10:]+"/"+m.GetLabel()[0].GetValue()] += v
				}
			}
		}
	}
	t.Pulls, t.PullsFailed = w.pulls.Made.Load(), w.pulls.Failed.Load()
	t.Dropped = w.Svc.Dropped()
	t.Rejoin = w.Svc.Status().Rejoin
	return t
}

// KindNames are the ipam message kinds by their kind byte (ipalloc/codec.go).
var KindNames = []string{1: "ring", "prepare", "promise", "accept", "accepted", "nack", "donate-request", "donation",
	"denial", "remove", "remove-ack", "handover", "handover-ack", "withdraw", "withdraw-ack", "ask-removed", "want", "members"}

// Received counts the ipam messages this node received, by kind byte.
func (n *Node) Received() [32]uint64 {
	var out [32]uint64
	for i := range n.byKind {
		out[i] = n.byKind[i].Load()
	}
	return out
}

func (n *Node) note(data []byte) {
	size := len(data)
	if len(data) >= 2 {
		n.byKind[data[1]&31].Add(1)
	}
	n.received.Add(1)
	storeMax(&n.maxMsg, uint64(size))
}

// transport is the router's transport of the allocator, measuring what it
// sends and what the channel refuses.
type transport struct {
	n     *Node
	inner *ipammesh.Transport
}

func (t transport) Broadcast(data []byte) error {
	return t.n.sent(len(data), t.inner.Broadcast(data))
}

func (t transport) SendTo(p ipalloc.PeerName, data []byte) error {
	start := time.Now()
	err := t.inner.SendTo(p, data)
	storeMax(&t.n.maxSendTime, uint64(time.Since(start)))
	err = t.n.sent(len(data), err)
	if err == nil && len(data) >= 2 && data[1] == 1 {
		t.n.ringUnicasts.Add(1)
	}
	if t.n.c.watched(mesh.PeerName(p)) && len(data) >= 2 {
		k := data[1] & 31
		t.n.toWatch[k].Add(1)
		if err != nil {
			t.n.toWatchFailed[k].Add(1)
			t.n.traceMu.Lock()
			t.n.failures[errClass(err)]++
			t.n.traceMu.Unlock()
		}
	}
	return err
}

// errClass is err's text without the addresses and names that vary.
func errClass(err error) string {
	s := err.Error()
	if i := strings.LastIndex(s, ": "); i >= 0 && strings.Contains(s, "on channel") {
		return s[i+2:]
	}
	return s
}

func (n *Node) sent(size int, err error) error {
	storeMax(&n.maxSent, uint64(size))
	switch {
	case errors.Is(err, mesh.ErrTooLarge):
		n.tooLarge.Add(1)
	case err != nil:
		n.sendErrs.Add(1)
		n.lastErr.Store(err.Error())
	}
	return err
}

func storeMax(m *atomic.Uint64, v uint64) {
	for {
		old := m.Load()
		if v <= old || m.CompareAndSwap(old, v) {
			return
		}
	}
}

// saved is n's ring as its Service last saved and published it (what it
// offers in a push-pull), read without a step of its busy owner loop; nil
// if unreadable. The polls below look at it first and ask the owner loops
// only once it says yes.
func (n *Node) saved() *ipalloc.Ring {
	m, err := ipalloc.DecodeMsg(n.Svc.LocalState())
	if err != nil {
		return nil
	}
	if rm, ok := m.(*ipalloc.RingMsg); ok {
		return rm.Ring
	}
	return nil
}

// Claimed reports whether every node's allocator has a claimed ring.
func Claimed(nodes []*Node) bool {
	for _, n := range nodes {
		if r := n.saved(); r == nil || r.Empty() {
			return false
		}
	}
	return all(nodes, func(n *Node) bool { return n.Svc.Status().Claimed })
}

// all reports whether f holds for every node, asking them all at once: f
// reads through a node's owner loop, which may be busy for a while (a
// step, its save), and one poll of N loops asked in turn would wait for
// the sum of those steps, minutes at 200 nodes on 2 cores (the phase's
// bound then passes unnoticed); asked together it waits for the slowest.
func all(nodes []*Node, f func(*Node) bool) bool {
	var ok atomic.Bool
	ok.Store(true)
	var wg sync.WaitGroup
	for _, n := range nodes {
		wg.Go(func() {
			if !f(n) {
				ok.Store(false)
			}
		})
	}
	wg.Wait()
	return ok.Load()
}

// rings reads every node's ring through its owner loop, all at once (see
// all).
func rings(nodes []*Node) []*ipalloc.Ring {
	out := make([]*ipalloc.Ring, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Go(func() { out[i] = n.Svc.Ring() })
	}
	wg.Wait()
	return out
}

// OneRing reports whether every node holds the same ring, and how many
// peers own space in it.
func OneRing(nodes []*Node) (bool, int) {
	if len(nodes) == 0 {
		return true, 0
	}
	saved := nodes[0].saved()
	for _, n := range nodes {
		if r := n.saved(); saved == nil || r == nil || !r.Equal(saved) {
			return false, 0
		}
	}
	rs := rings(nodes)
	for _, r := range rs[1:] {
		if !r.Equal(rs[0]) {
			return false, 0
		}
	}
	return true, len(rs[0].Peers())
}

// SameOwners reports whether every node's ring gives every address to the
// same owner (what routes follow), whatever their free counts say.
func SameOwners(nodes []*Node) bool {
	if len(nodes) == 0 {
		return true
	}
	owners := func(r *ipalloc.Ring) []ipalloc.Entry {
		out := make([]ipalloc.Entry, len(r.Entries))
		for i, e := range r.Entries {
			out[i] = ipalloc.Entry{Token: e.Token, Peer: e.Peer}
		}
		return out
	}
	// The saved rings first (no owner loop asked), then the rings the
	// loops hold.
	var firstSaved []ipalloc.Entry
	for i, n := range nodes {
		r := n.saved()
		if r == nil {
			return false
		}
		if i == 0 {
			firstSaved = owners(r)
		} else if !slices.Equal(owners(r), firstSaved) {
			return false
		}
	}
	rs := rings(nodes)
	first := owners(rs[0])
	for _, r := range rs[1:] {
		if !slices.Equal(owners(r), first) {
			return false
		}
	}
	return true
}

// Owns reports whether every node's ring gives owner some space.
func Owns(nodes []*Node, owner mesh.PeerName) bool {
	return all(nodes, func(n *Node) bool { return len(n.Svc.Ring().Owned(ipalloc.PeerName(owner))) > 0 })
}

// AliveSeen accumulates which node's mesh has seen which peer alive, over
// calls to Update. It does not ask for every pair at one instant: on a
// starved machine memberlist's failure detector keeps suspecting some
// peer somewhere, which says nothing of who knows whom.
type AliveSeen map[[2]mesh.PeerName]bool

// Update notes what every node's mesh sees alive now, and reports whether
// every node has seen every node of nodes alive (itself included). A node
// that has seen them all is not read again: at 1,000 nodes one read of
// every view is a million entries.
func (a AliveSeen) Update(nodes []*Node) bool {
	complete := true
	for _, n := range nodes {
		if a.seenAll(n, nodes) {
			continue
		}
		for _, p := range n.Mesh.Peers() {
			if p.State == mesh.StateAlive {
				a[[2]mesh.PeerName{n.Name, p.Name}] = true
			}
		}
		if !a.seenAll(n, nodes) {
			complete = false
		}
	}
	return complete
}

// seenAll reports whether n has seen every node of nodes alive.
func (a AliveSeen) seenAll(n *Node, nodes []*Node) bool {
	for _, q := range nodes {
		if !a[[2]mesh.PeerName{n.Name, q.Name}] {
			return false
		}
	}
	return true
}

// Missing lists, by node, the nodes it has never seen alive.
func (a AliveSeen) Missing(nodes []*Node) []string {
	var out []string
	for _, n := range nodes {
		var never []string
		for _, q := range nodes {
			if !a[[2]mesh.PeerName{n.Name, q.Name}] {
				never = append(never, string(q.Name))
			}
		}
		if len(never) > 0 {
			out = append(out, fmt.Sprintf("%s never saw %s", n.Name, strings.Join(never, ", ")))
		}
	}
	return out
}

// Refused sums what the nodes refused or dropped: gossip frames of an
// unknown version, messages the allocators' inboxes dropped.
func Refused(nodes []*Node) (refused, dropped uint64) {
	for _, n := range nodes {
		refused += n.gossip.Refused()
		dropped += n.Svc.Dropped()
	}
	return refused, dropped
}

// WaitFor polls cond every interval until it holds or ctx ends.
func WaitFor(ctx context.Context, interval time.Duration, cond func() bool) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}
