package mesh

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/weft-net/weft/mesh/meshtest"
)

// testTimings are fast enough for tests, slow enough for -race on a busy
// two-core machine not to see false failures.
func testTimings() Timings {
	return Timings{
		GossipInterval:      20 * time.Millisecond,
		GossipNodes:         3,
		RetransmitMult:      4,
		ProbeInterval:       300 * time.Millisecond,
		ProbeTimeout:        200 * time.Millisecond,
		SuspicionMult:       3,
		PushPullInterval:    300 * time.Millisecond,
		GossipToTheDeadTime: time.Second,
		DeadNodeReclaimTime: 500 * time.Millisecond,
		TCPTimeout:          time.Second,
		JoinBackoffMin:      20 * time.Millisecond,
		JoinBackoffMax:      200 * time.Millisecond,
		ReconnectInterval:   200 * time.Millisecond,
		LeaveTimeout:        time.Second,
		PeerRetention:       time.Hour,
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond) // polling interval, not a wait for an event
	}
}

// logBuf is a slog destination the test can search; it is printed when
// the test fails.
type logBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *logBuf) contains(s string) bool { return strings.Contains(l.String(), s) }

func newLogger(t testing.TB, name string) (*slog.Logger, *logBuf) {
	lb := &logBuf{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("log of %s:\n%s", name, lb.String())
		}
	})
	return slog.New(slog.NewTextHandler(lb, &slog.HandlerOptions{Level: slog.LevelDebug})).With("self", name), lb
}

// setGossiper is a grow-only set of strings, the simplest CRDT: a
// broadcast carries items, the news are the items not seen before.
type setGossiper struct {
	mu       sync.Mutex
	items    map[string]bool
	unicasts []string // "from:data"
}

func newSetGossiper() *setGossiper { return &setGossiper{items: map[string]bool{}} }

func (g *setGossiper) add(items ...string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, it := range items {
		g.items[it] = true
	}
}

func (g *setGossiper) has(items ...string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, it := range items {
		if !g.items[it] {
			return false
		}
	}
	return true
}

func (g *setGossiper) merge(data []byte) ([]byte, error) {
	if len(data) > 0 && !bytes.HasPrefix(data, []byte("set:")) {
		return nil, fmt.Errorf("not a set: %q", data)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	var news []string
	for _, it := range strings.Split(strings.TrimPrefix(string(data), "set:"), ",") {
		if it != "" && !g.items[it] {
			g.items[it] = true
			news = append(news, it)
		}
	}
	if len(news) == 0 {
		return nil, nil
	}
	return []byte("set:" + strings.Join(news, ",")), nil
}

func (g *setGossiper) OnBroadcast(_ PeerName, data []byte) ([]byte, error) { return g.merge(data) }

func (g *setGossiper) OnUnicast(from PeerName, data []byte) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.unicasts = append(g.unicasts, string(from)+":"+string(data))
	return nil
}

func (g *setGossiper) LocalState() []byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	var items []string
	for it := range g.items {
		items = append(items, it)
	}
	slices.Sort(items)
	return []byte("set:" + strings.Join(items, ","))
}

func (g *setGossiper) MergeRemoteState(data []byte) error {
	_, err := g.merge(data)
	return err
}

func (g *setGossiper) received() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.unicasts)
}

// peer is one mesh in a test cluster with its set channel.
type peer struct {
	m    *Mesh
	set  *setGossiper
	ch   *Channel
	log  *logBuf
	addr string
}

// cluster is a set of meshes on one in-memory network.
type cluster struct {
	t   testing.TB
	net *meshtest.Network
	// wrap, if set, wraps each peer's transport (to watch what it sends).
	wrap func(*meshtest.Transport) memberlist.NodeAwareTransport
}

func newCluster(t testing.TB) *cluster {
	return &cluster{t: t, net: meshtest.NewNetwork()}
}

func addrOf(i int) string { return fmt.Sprintf("10.0.0.%d:6783", i) }

// start starts peer i ("node<i>" at 10.0.0.i:6783 unless cfg says
// otherwise) with the set channel, joining the given peers.
func (c *cluster) start(i int, cfg Config) *peer {
	t := c.t
	t.Helper()
	addr := addrOf(i)
	if cfg.AdvertiseAddr != "" {
		addr = cfg.AdvertiseAddr + ":6783"
		cfg.AdvertiseAddr = ""
	}
	tr, err := c.net.NewTransport(addr)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Name == "" {
		cfg.Name = PeerName(fmt.Sprintf("node%d", i))
	}
	if cfg.Nickname == "" {
		cfg.Nickname = fmt.Sprintf("host%d", i)
	}
	cfg.Port = 6783
	if cfg.Components == nil {
		cfg.Components = []Component{testTunnel(6784, "udp")}
	}
	cfg.Version = "test"
	cfg.Transport = tr
	if c.wrap != nil {
		cfg.Transport = c.wrap(tr)
	}
	if cfg.Timings == (Timings{}) {
		cfg.Timings = testTimings()
	}
	var lb *logBuf
	cfg.Logger, lb = newLogger(t, string(cfg.Name)+"@"+addr)
	p := &peer{set: newSetGossiper(), log: lb, addr: addr}
	p.m, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.m.Close() })
	if p.ch, err = p.m.Channel("set", p.set); err != nil {
		t.Fatal(err)
	}
	if err := p.m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	return p
}

// state is what p's view says about name, or -1 when it does not know it.
func (p *peer) state(name PeerName) PeerState {
	if q, ok := p.m.Peer(name); ok {
		return q.State
	}
	return -1
}

// waitStates waits until every peer in ps sees every name in want in the
// given state.
func waitStates(t testing.TB, timeout time.Duration, ps []*peer, want map[PeerName]PeerState) {
	t.Helper()
	waitFor(t, timeout, fmt.Sprintf("views to be %v", want), func() bool {
		for _, p := range ps {
			for n, s := range want {
				if p.state(n) != s {
					return false
				}
			}
		}
		return true
	})
}

func aliveAll(ps []*peer) map[PeerName]PeerState {
	want := map[PeerName]PeerState{}
	for _, p := range ps {
		want[p.m.Name()] = StateAlive
	}
	return want
}

// kill stops a mesh the way a crash would: no goodbye, no leave.
func (m *Mesh) kill() {
	m.closeOnce.Do(func() {
		m.closed.Store(true)
		if m.cancel != nil {
			m.cancel()
		}
		m.wg.Wait()
		if ml := m.ml.Load(); ml != nil {
			_ = ml.Shutdown()
		}
		m.mu.Lock()
		m.viewDone = true
		for s := range m.subs {
			close(s.ch)
			delete(m.subs, s)
		}
		m.mu.Unlock()
	})
}

// checkLeaks fails the test if goroutines of memberlist, the mesh or
// meshtest are still running a while after everything was closed; call it
// deferred, after the closes. (wireguard-go's goroutineLeakCheck.)
func checkLeaks(t testing.TB) {
	t.Helper()
	var leaked []string
	deadline := time.Now().Add(10 * time.Second)
	for {
		leaked = leaked[:0]
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		for _, g := range strings.Split(string(buf), "\n\n") {
			if strings.Contains(g, "checkLeaks") {
				continue
			}
			if strings.Contains(g, "hashicorp/memberlist") || strings.Contains(g, "weft/mesh.") || strings.Contains(g, "weft/mesh/meshtest.") {
				leaked = append(leaked, g)
			}
		}
		if len(leaked) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines leaked:\n%s", len(leaked), strings.Join(leaked, "\n\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// closeAll closes every mesh, then checks for leaked goroutines.
func closeAll(t testing.TB, ps ...*peer) {
	t.Helper()
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.m.Close()
		}()
	}
	wg.Wait()
	checkLeaks(t)
}
