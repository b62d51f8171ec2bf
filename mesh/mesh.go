package mesh

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
)

// Errors of the channel API.
var (
	ErrNotStarted      = errors.New("the mesh is not started")
	ErrStarted         = errors.New("the mesh is already started")
	ErrClosed          = errors.New("the mesh is closed")
	ErrTooLarge        = errors.New("message too large")
	ErrUnknownPeer     = errors.New("unknown peer")
	ErrPeerUnreachable = errors.New("peer is unreachable")
)

// topologyChannel is the internal channel on which peers publish their
// reports (see report). Names starting with '_' are reserved.
const topologyChannel = "_topology"

// maxQueued bounds the outgoing broadcast queue; beyond it the most
// retransmitted broadcasts are pruned (counted as "queue-full").
const maxQueued = 4096

// Mesh is this peer's membership in the mesh: memberlist underneath, the
// gossip channels, the topology view and the join loop.
//
// Life cycle: New binds the gossip port and registers metrics; Channel
// registers the gossip channels; Start creates the memberlist node and
// starts joining; Close leaves and stops everything. Close is safe to call
// at any point, more than once, and must be called even when Start failed.
type Mesh struct {
	cfg       Config
	log       *slog.Logger
	metrics   *metrics
	meta      []byte // our encoded metadata
	transport memberlist.NodeAwareTransport
	advertise netip.AddrPort
	queue     *memberlist.TransmitLimitedQueue
	numAlive  atomic.Int64 // peers alive in the view, us included: the queue's N
	now       func() time.Time
	lookup    func(ctx context.Context, host string) ([]netip.Addr, error)
	drops     rateLimiter
	auth      *authFailures
	mlLog     *log.Logger // memberlist's logger, shared by its transport and itself

	dropMu     sync.Mutex
	dropCounts map[string]uint64 // guarded by dropMu

	ml     atomic.Pointer[memberlist.Memberlist]
	closed atomic.Bool
	kick   chan struct{} // cap 1: the view changed; routineTopology republishes

	targetsAdded chan struct{} // cap 1: AddTargets added some; routineJoin tries them now

	chMu     sync.RWMutex
	channels map[string]*Channel // guarded by chMu; frozen once started
	started  bool                // guarded by chMu

	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once

	mu      sync.Mutex // guards the fields below
	peers   map[PeerName]*peerEntry
	reports map[PeerName]report // the latest report of every other peer
	// unreachBy indexes reports by whom they name: target -> the origins
	// whose latest report lists it unreachable (whether or not they are
	// alive), so that a change derives the states of the peers it
	// concerns, not of every peer (refreshLocked).
	unreachBy map[PeerName]map[PeerName]bool
	alive     int                // peers alive in the view (base), this one included
	counts    [StateLeft + 1]int // peers by State, for the gauges
	ownReport report
	subs      map[*subscriber]struct{}
	targets   []*target
	viewDone  bool // set by Close: no more events
}

// New validates cfg, binds the gossip port (TCP and UDP) unless
// cfg.Transport is given, and prepares the mesh. A port in use is an
// error naming the port and the --port flag.
func New(cfg Config) (*Mesh, error) {
	cfg, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	meta, err := encodeMeta(cfg.Nickname, cfg.Version, cfg.Components)
	if err != nil {
		return nil, err
	}
	met, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("registering the mesh metrics: %w", err)
	}
	m := &Mesh{
		cfg:          cfg,
		log:          cfg.Logger,
		metrics:      met,
		meta:         meta,
		now:          time.Now,
		lookup:       lookupHost,
		kick:         make(chan struct{}, 1),
		targetsAdded: make(chan struct{}, 1),
		channels:     map[string]*Channel{},
		peers:        map[PeerName]*peerEntry{},
		reports:      map[PeerName]report{},
		unreachBy:    map[PeerName]map[PeerName]bool{},
		subs:         map[*subscriber]struct{}{},
	}
	m.drops.every = time.Minute
	m.auth = &authFailures{log: m.log, count: met.authFailures, now: func() time.Time { return m.now() }}
	m.auth.limit.every, m.auth.limit.maxKeys = time.Minute, maxAuthSources
	m.mlLog = memberlistLogger(m.log, m.auth, m.closed.Load)
	m.queue = &memberlist.TransmitLimitedQueue{
		RetransmitMult: cfg.Timings.RetransmitMult,
		NumNodes:       func() int { return int(m.numAlive.Load()) },
	}
	m.numAlive.Store(1)
	m.channels[topologyChannel] = &Channel{m: m, name: topologyChannel, g: (*topologyGossiper)(m)}

	for _, p := range cfg.Peers {
		m.addTargetLocked(p, "peers")
	}
	for _, p := range cfg.Remembered {
		if _, _, err := splitTarget(p, DefaultPort); err != nil {
			m.log.Warn("ignoring a remembered peer address", "address", p, "err", err)
			continue
		}
		m.addTargetLocked(p, "remembered")
	}

	fail := func(err error) (*Mesh, error) {
		met.unregister(cfg.Registerer)
		return nil, err
	}
	m.transport = cfg.Transport
	if m.transport == nil {
		bind := cfg.BindAddr
		if bind == "" {
			bind = "0.0.0.0"
		}
		nt, err := newUDPTransport(bind, cfg.Port, m.mlLog)
		if err != nil {
			return fail(fmt.Errorf("gossip port %d on %s (--port, TCP and UDP) is not available: %w; is another weft router or program using it? stop it or choose another --port", cfg.Port, bind, err))
		}
		m.transport = nt
	}
	inner := m.transport
	g, err := newGuard(inner, cfg.SecretKey, cfg.PreAuth.withDefaults(cfg.Timings.TCPTimeout), m.refused, m.auth.failed)
	if err != nil {
		shutdownUnused(inner)
		return fail(err)
	}
	m.transport = g
	adv := cfg.AdvertiseAddr
	if adv == "" && cfg.BindAddr != "" && cfg.BindAddr != "0.0.0.0" {
		adv = cfg.BindAddr
	}
	ip, port, err := m.transport.FinalAdvertiseAddr(adv, cfg.Port)
	if err == nil && port == 0 {
		// An ephemeral port: advertise the one the transport bound.
		ip, port, err = m.transport.FinalAdvertiseAddr(ip.String(), boundPort(inner))
	}
	if err != nil {
		shutdownUnused(m.transport)
		return fail(fmt.Errorf("choosing the address to advertise to other peers: %w; give --host", err))
	}
	addr, _ := netip.AddrFromSlice(ip)
	m.advertise = netip.AddrPortFrom(addr.Unmap(), uint16(port))
	m.cfg.AdvertiseAddr = m.advertise.Addr().String()
	m.cfg.Port = port
	return m, nil
}

// boundPort is the port the gossip transport bound when asked for port 0.
func boundPort(t memberlist.Transport) int {
	if ut, ok := t.(*udpTransport); ok {
		return ut.port()
	}
	return 0
}

// shutdownUnused shuts down a transport that no memberlist reads from: its
// listeners block on unbuffered channels, so drain them meanwhile.
func shutdownUnused(t memberlist.Transport) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-t.PacketCh():
			case c := <-t.StreamCh():
				c.Close()
			case <-done:
				return
			}
		}
	}()
	_ = t.Shutdown()
	close(done)
	wg.Wait()
}

// Name is this peer's name.
func (m *Mesh) Name() PeerName { return m.cfg.Name }

// Addr is the gossip address other peers reach this one at.
func (m *Mesh) Addr() netip.AddrPort { return m.advertise }

// Start creates the memberlist node (from now on other peers can join this
// one), then joins the configured and remembered peers in the background,
// retrying with backoff until one is reached, and keeps retrying targets
// and unreachable peers every ReconnectInterval so that a partition heals
// by itself. ctx bounds the background work; Close must still be called.
func (m *Mesh) Start(ctx context.Context) error {
	if m.closed.Load() {
		return ErrClosed
	}
	m.chMu.Lock()
	if m.started {
		m.chMu.Unlock()
		return ErrStarted
	}
	m.started = true
	m.chMu.Unlock()

	t := m.cfg.Timings
	conf := memberlist.DefaultLANConfig()
	conf.Name = string(m.cfg.Name)
	conf.Transport = m.transport
	conf.AdvertiseAddr = m.advertise.Addr().String()
	conf.AdvertisePort = int(m.advertise.Port())
	conf.BindPort = m.cfg.Port // the default port of Join addresses
	conf.GossipInterval = t.GossipInterval
	conf.GossipNodes = t.GossipNodes
	conf.RetransmitMult = t.RetransmitMult
	conf.ProbeInterval = t.ProbeInterval
	conf.ProbeTimeout = t.ProbeTimeout
	conf.SuspicionMult = t.SuspicionMult
	conf.PushPullInterval = t.PushPullInterval
	conf.GossipToTheDeadTime = t.GossipToTheDeadTime
	conf.DeadNodeReclaimTime = t.DeadNodeReclaimTime
	conf.TCPTimeout = t.TCPTimeout
	conf.EnableCompression = !m.cfg.NoCompression
	d := &delegate{m: m}
	conf.Delegate = d
	conf.Events = d
	conf.Conflict = d
	conf.Logger = m.mlLog
	if len(m.cfg.SecretKey) > 0 {
		kr, err := memberlist.NewKeyring(nil, m.cfg.SecretKey)
		if err != nil {
			return fmt.Errorf("the gossip key: %w", err)
		}
		conf.Keyring = kr
		conf.GossipVerifyIncoming, conf.GossipVerifyOutgoing = true, true
	}

	m.publishReport(false) // our first report, newer than any from a previous run
	ml, err := memberlist.Create(conf)
	if err != nil {
		return fmt.Errorf("starting the gossip layer on %s: %w", m.advertise, err)
	}
	m.ml.Store(ml)
	m.log.Info("mesh started", "name", m.cfg.Name, "nickname", m.cfg.Nickname, "address", m.advertise, "encrypted", len(m.cfg.SecretKey) > 0,
		"targets", m.targetSpecs(), "gossip-interval", t.GossipInterval, "gossip-nodes", t.GossipNodes, "probe-interval", t.ProbeInterval)

	ctx, m.cancel = context.WithCancel(ctx)
	m.wg.Add(2)
	go m.routineJoin(ctx)
	go m.routineTopology(ctx)
	return nil
}

// Close leaves the mesh and stops everything, in this order:
//  1. the join and topology loops stop (an attempt in flight ends within
//     TCPTimeout);
//  2. a leaving report is gossiped (waiting at most LeaveTimeout), then
//     memberlist.Leave gossips our departure (waiting at most LeaveTimeout
//     again), so that the others show this peer as "left", not
//     "unreachable";
//  3. memberlist shuts down with its transport and goroutines;
//  4. subscriptions are closed and the metrics unregistered.
//
// Gossiper methods are not called once Close has begun.
func (m *Mesh) Close() error {
	var err error
	m.closeOnce.Do(func() {
		m.closed.Store(true)
		if m.cancel != nil {
			m.cancel()
		}
		m.wg.Wait()
		if ml := m.ml.Load(); ml != nil {
			// The goodbye goes out before memberlist's leave, so that the
			// others know it is a leave when memberlist tells them.
			if sent := m.publishReport(true); sent != nil && m.aliveOthers() > 0 {
				timer := time.NewTimer(m.cfg.Timings.LeaveTimeout)
				select {
				case <-sent:
				case <-timer.C:
				}
				timer.Stop()
			}
			if lerr := ml.Leave(m.cfg.Timings.LeaveTimeout); lerr != nil {
				m.log.Warn("leaving the mesh: the departure may not have reached every peer; they will see this peer as unreachable", "err", lerr)
			}
			err = ml.Shutdown()
		} else {
			shutdownUnused(m.transport)
		}
		m.mu.Lock()
		m.viewDone = true
		for s := range m.subs {
			close(s.ch)
			delete(m.subs, s)
		}
		m.mu.Unlock()
		m.metrics.unregister(m.cfg.Registerer)
		m.log.Info("mesh closed", "name", m.cfg.Name)
	})
	return err
}

// kickTopology asks routineTopology to republish our report.
func (m *Mesh) kickTopology() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

// routineTopology republishes our report when the view changes and drops
// long-gone peers from the view.
func (m *Mesh) routineTopology(ctx context.Context) {
	defer m.wg.Done()
	reap := time.NewTicker(min(m.cfg.Timings.PeerRetention/10, time.Minute))
	defer reap.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.kick:
			m.publishReport(false)
		case <-reap.C:
			m.reap()
		}
	}
}

// enqueue queues a framed broadcast, pruning the queue when it is full.
func (m *Mesh) enqueue(b memberlist.Broadcast) {
	m.queue.QueueBroadcast(b)
	if n := m.queue.NumQueued(); n > maxQueued {
		m.queue.Prune(maxQueued)
		m.metrics.dropped.WithLabelValues(reasonQueueFull).Add(float64(n - maxQueued))
		m.dropMu.Lock()
		if m.dropCounts == nil {
			m.dropCounts = map[string]uint64{}
		}
		m.dropCounts[reasonQueueFull] += uint64(n - maxQueued)
		m.dropMu.Unlock()
		m.dropped(reasonQueueFull, "", fmt.Errorf("%d broadcasts queued, more than %d: the oldest were pruned", n, maxQueued))
	}
}

// dropped logs a dropped message: at debug each time, at info at most once
// a minute per reason with the count since the last info line.
func (m *Mesh) dropped(reason, channel string, err error) {
	if reason != reasonQueueFull {
		m.metrics.dropped.WithLabelValues(reason).Inc()
		m.dropMu.Lock()
		if m.dropCounts == nil {
			m.dropCounts = map[string]uint64{}
		}
		m.dropCounts[reason]++
		m.dropMu.Unlock()
	}
	m.log.Debug("dropped a gossip message", "reason", reason, "channel", channel, "err", err)
	if n, ok := m.drops.allow(reason, m.now()); ok {
		m.log.Info("dropped gossip messages", "reason", reason, "count", n, "channel", channel, "last-error", err)
	}
}

// droppedCounts returns the dropped messages so far, by reason.
func (m *Mesh) droppedCounts() map[string]uint64 {
	m.dropMu.Lock()
	defer m.dropMu.Unlock()
	if len(m.dropCounts) == 0 {
		return nil
	}
	out := make(map[string]uint64, len(m.dropCounts))
	for k, v := range m.dropCounts {
		out[k] = v
	}
	return out
}

// rateLimiter lets one event per key through every `every`, counting the
// ones it held back. It is bounded: a key is forgotten once its window has
// passed (swept at most once per window), and when maxKeys are tracked a
// new key shares the overflow key "" with every other one, so a flood of
// distinct keys (spoofed sources) costs at most maxKeys entries. The
// count of events held back for a key may be lost when it expires.
type rateLimiter struct {
	every   time.Duration
	maxKeys int // 0: defaultMaxKeys
	mu      sync.Mutex
	last    map[string]time.Time
	held    map[string]int
	swept   time.Time
}

const defaultMaxKeys = 1024

// allow counts an event for key; when it may be logged it returns the
// number of events (this one included) since the last that was, and true.
func (r *rateLimiter) allow(key string, now time.Time) (int, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.last == nil {
		r.last, r.held = map[string]time.Time{}, map[string]int{}
	}
	if now.Sub(r.swept) >= r.every {
		for k, t := range r.last {
			// A key with events held back stays one window more, so
			// that its next line still carries their count.
			if age := now.Sub(t); age >= 2*r.every || age >= r.every && r.held[k] == 0 {
				delete(r.last, k)
				delete(r.held, k)
			}
		}
		r.swept = now
	}
	max := r.maxKeys
	if max <= 0 {
		max = defaultMaxKeys
	}
	if _, ok := r.last[key]; !ok && len(r.last) >= max-1 {
		key = ""
	}
	r.held[key]++
	if last, ok := r.last[key]; ok && now.Sub(last) < r.every {
		return 0, false
	}
	n := r.held[key]
	r.last[key], r.held[key] = now, 0
	return n, true
}

// size is the number of keys tracked (for tests).
func (r *rateLimiter) size() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.last)
}

// preAuthKeys are the rate limiter's keys of the refusal reasons, apart
// from the drop reasons (both have a "truncated").
var preAuthKeys = func() map[string]string {
	k := map[string]string{}
	for _, r := range refusedReasons {
		k[r] = "preauth/" + r
	}
	return k
}()

// refused is the guard's report of a packet or stream it did not hand to
// memberlist: counted by reason, at debug each time, and at most once a
// minute per reason at info with the count. The error text is the
// guard's own; from is only an address.
func (m *Mesh) refused(reason string, from netip.Addr, err error) {
	m.metrics.refusedCounter(reason).Inc()
	if m.log.Enabled(context.Background(), slog.LevelDebug) {
		m.log.Debug("refused unauthenticated gossip", "reason", reason, "from", from, "err", err)
	}
	if n, ok := m.drops.allow(preAuthKeys[reason], m.now()); ok {
		m.log.Info("refused unauthenticated gossip (packets or streams that are not from a peer with the password, or over the limits)",
			"reason", reason, "count", n, "last-from", from, "last-error", err)
	}
}

// lookupHost resolves a --peers host; an IP address is returned as is.
func lookupHost(ctx context.Context, host string) ([]netip.Addr, error) {
	if a, err := netip.ParseAddr(host); err == nil {
		return []netip.Addr{a.Unmap()}, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	for i := range addrs {
		addrs[i] = addrs[i].Unmap()
	}
	return addrs, err
}

// jitter returns a duration uniformly in [d/2, d].
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

// nodeAddr is a memberlist node's address.
func nodeAddr(n *memberlist.Node) netip.AddrPort {
	a, _ := netip.AddrFromSlice(n.Addr)
	return netip.AddrPortFrom(a.Unmap(), n.Port)
}

// splitTarget splits host[:port]; an IPv6 address needs brackets to carry
// a port.
func splitTarget(s string, defPort int) (string, int, error) {
	var host, ps string
	if a, err := netip.ParseAddr(s); err == nil {
		host = a.String() // a zone is checked below like any host text
	} else if host, ps, err = net.SplitHostPort(s); err != nil {
		host, ps = s, ""
	}
	if host == "" {
		return "", 0, errors.New("no host: give host[:port], e.g. 10.0.0.2 or node2:6783")
	}
	port := defPort
	if ps != "" {
		p, err := strconv.Atoi(ps)
		if err != nil || p < 1 || p > 65535 {
			return "", 0, fmt.Errorf("port %q: give a number between 1 and 65535", ps)
		}
		port = p
	}
	for _, r := range host {
		if r <= ' ' || r > '~' || r == '/' || r == ',' {
			return "", 0, fmt.Errorf("host %q: not a host name or address", host)
		}
	}
	return host, port, nil
}
