package mesh

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"time"
)

// joinFanout is how many targets the initial join reaches before it stops
// trying more: one is enough to merge into the mesh, a few guard against a
// target that is itself cut off.
const joinFanout = 3

// reconnectBatch is how many unreached addresses each reconnect round tries.
const reconnectBatch = 3

// target is one entry of --peers, the remembered peers or AddTargets.
type target struct {
	spec    string // as given
	source  string // "peers", "remembered" or "added"
	host    string
	port    int
	addrs   []netip.AddrPort // from the last resolution
	err     string           // why the last attempt failed; "" if it worked
	self    bool             // it resolves to this peer only
	logged  string           // the error last logged, to log each new one once
	lastTry time.Time
}

// addTargetLocked adds a target unless it is already there, and reports
// whether it did.
func (m *Mesh) addTargetLocked(spec, source string) bool {
	host, port, err := splitTarget(spec, m.defaultPort())
	if err != nil {
		return false
	}
	for _, t := range m.targets {
		if t.host == host && t.port == port {
			return false
		}
	}
	m.targets = append(m.targets, &target{spec: spec, source: source, host: host, port: port})
	return true
}

// defaultPort is the port of a target that names none: ours, as all peers
// of a cluster usually share it, or DefaultPort when ours is ephemeral.
func (m *Mesh) defaultPort() int {
	if m.cfg.Port != 0 {
		return m.cfg.Port
	}
	return DefaultPort
}

// AddTargets adds peers to join, in the --peers syntax (host[:port]); the
// join loop tries them from its next round on. Discovery (e.g. the
// Kubernetes node list) feeds in here.
func (m *Mesh) AddTargets(specs ...string) error {
	for _, s := range specs {
		if _, _, err := splitTarget(s, DefaultPort); err != nil {
			return fmt.Errorf("peer address %q: %w", s, err)
		}
	}
	m.mu.Lock()
	added := false
	for _, s := range specs {
		added = m.addTargetLocked(s, "added") || added
	}
	m.mu.Unlock()
	if added {
		// The join loop tries them now, not at its next round: a fresh
		// node learns its targets from discovery after it started.
		select {
		case m.targetsAdded <- struct{}{}:
		default:
		}
	}
	return nil
}

// SetTargets makes the targets from discovery exactly specs (the
// Kubernetes node list, once it has synced): those added before and no
// longer listed are dropped, and so are the remembered ones not listed
// (discovery knows the cluster's nodes better than the last run did), so
// that a deleted node is no longer dialled. --peers stay. New targets are
// tried at once, as with AddTargets.
func (m *Mesh) SetTargets(specs ...string) error {
	type hostPort struct {
		host string
		port int
	}
	want := map[hostPort]bool{}
	for _, s := range specs {
		host, port, err := splitTarget(s, m.defaultPort())
		if err != nil {
			return fmt.Errorf("peer address %q: %w", s, err)
		}
		want[hostPort{host, port}] = true
	}
	m.mu.Lock()
	var dropped []string
	m.targets = slices.DeleteFunc(m.targets, func(t *target) bool {
		if t.source == "peers" || want[hostPort{t.host, t.port}] {
			return false
		}
		dropped = append(dropped, t.spec+" (from "+t.source+")")
		return true
	})
	m.mu.Unlock()
	if len(dropped) > 0 {
		m.log.Info("no longer joining peer targets that discovery does not list", "targets", dropped)
	}
	return m.AddTargets(specs...)
}

func (m *Mesh) targetSpecs() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, len(m.targets))
	for i, t := range m.targets {
		out[i] = t.spec
	}
	return out
}

// aliveOthers counts the other peers alive in the view.
func (m *Mesh) aliveOthers() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, p := range m.peers {
		if !p.Self && p.base == StateAlive {
			n++
		}
	}
	return n
}

// routineJoin joins the targets, retrying with capped, jittered exponential
// backoff until a peer is reached (or one reaches us), then every
// ReconnectInterval retries the targets and unreachable peers that are not
// alive, so that a healed partition merges again without an operator.
// Targets added while it waits (AddTargets: the Kubernetes node list comes
// after the start) are tried at once, the first join with its backoff.
func (m *Mesh) routineJoin(ctx context.Context) {
	defer m.wg.Done()
	t := m.cfg.Timings
	// wait returns false when ctx ends, true after d or as soon as new
	// targets were added.
	wait := func(d time.Duration) bool {
		timer := time.NewTimer(d)
		defer timer.Stop()
		select {
		case <-ctx.Done():
			return false
		case <-timer.C:
			return true
		case <-m.targetsAdded:
			return true
		}
	}

	if len(m.targetSpecs()) == 0 {
		m.log.Info("no peers to join (none given and none remembered yet); waiting for targets, or for other peers to join this one")
	}
	joined := false // the first join is done (or another peer joined us)
	backoff := t.JoinBackoffMin
	for {
		switch {
		case joined:
			m.joinRound(ctx, 1)
		case m.aliveOthers() > 0:
			joined = true
			m.log.Info("joined the mesh", "peers-alive", m.aliveOthers()+1)
		case len(m.targetSpecs()) > 0:
			if m.joinRound(ctx, joinFanout) > 0 || m.aliveOthers() > 0 {
				joined = true
				m.log.Info("joined the mesh", "peers-alive", m.aliveOthers()+1)
				break
			}
			d := jitter(backoff)
			m.log.Info("could not reach any peer yet; retrying", "in", d.Round(time.Millisecond), "targets", m.targetSpecs())
			if !wait(d) {
				return
			}
			backoff = min(2*backoff, t.JoinBackoffMax)
			continue
		default:
			m.joinRound(ctx, 1) // no targets: unreachable peers, if any
		}
		if !wait(jitter(t.ReconnectInterval)) {
			return
		}
	}
}

// joinRound tries the addresses that are not alive peers, in random order,
// until `want` joins succeeded; at most reconnectBatch addresses once some
// peer is alive. It returns the number of successes.
func (m *Mesh) joinRound(ctx context.Context, want int) int {
	ml := m.ml.Load()
	if ml == nil {
		return 0
	}
	cands := m.candidates(ctx)
	rand.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	budget := len(cands)
	if m.aliveOthers() > 0 {
		budget = min(budget, reconnectBatch)
	}
	ok := 0
	for _, c := range cands[:budget] {
		if ctx.Err() != nil || ok >= want {
			break
		}
		_, err := ml.Join([]string{c.addr.String()})
		if err != nil {
			m.metrics.joins.WithLabelValues("failed").Inc()
			m.noteTarget(c.t, fmt.Sprintf("cannot reach %s: %v", c.addr, err))
			continue
		}
		m.metrics.joins.WithLabelValues("ok").Inc()
		m.noteTarget(c.t, "")
		ok++
	}
	return ok
}

type candidate struct {
	addr netip.AddrPort
	t    *target // nil for an unreachable peer's address
}

// candidates resolves every target (anew each time) and returns the
// addresses worth a join: not ours, and not of a peer that is alive. The
// addresses of unreachable peers are added, so that the two sides of a
// healed partition find each other even with no target on the other side.
func (m *Mesh) candidates(ctx context.Context) []candidate {
	m.mu.Lock()
	targets := slices.Clone(m.targets)
	alive := map[netip.AddrPort]bool{m.advertise: true}
	var out []candidate
	seen := map[netip.AddrPort]bool{}
	for _, p := range m.peers {
		if p.base == StateAlive {
			alive[p.Addr] = true
		}
	}
	for _, p := range m.peers {
		if p.base == StateUnreachable && !alive[p.Addr] && !seen[p.Addr] {
			seen[p.Addr] = true
			out = append(out, candidate{addr: p.Addr})
		}
	}
	m.mu.Unlock()

	for _, t := range targets {
		ips, err := m.lookup(ctx, t.host)
		if ctx.Err() != nil {
			return nil
		}
		if err == nil && len(ips) == 0 {
			err = fmt.Errorf("no addresses")
		}
		if err != nil {
			m.metrics.joins.WithLabelValues("unresolvable").Inc()
			m.noteTarget(t, fmt.Sprintf("cannot resolve %q: %v", t.host, err))
			continue
		}
		addrs := make([]netip.AddrPort, 0, len(ips))
		self := false
		for _, ip := range ips {
			a := netip.AddrPortFrom(ip, uint16(t.port))
			addrs = append(addrs, a)
			self = self || a == m.advertise
			if !alive[a] && !seen[a] {
				seen[a] = true
				out = append(out, candidate{addr: a, t: t})
			}
		}
		m.mu.Lock()
		t.addrs = addrs
		first := self && len(addrs) == 1 && !t.self
		t.self = self && len(addrs) == 1
		m.mu.Unlock()
		if first {
			m.log.Info("peer target is this peer's own address; skipping it", "target", t.spec)
		}
	}
	return out
}

// noteTarget records the outcome of an attempt on a target and logs each
// new error once (at warn), so that a target that stays unreachable does
// not flood the log.
func (m *Mesh) noteTarget(t *target, errText string) {
	if t == nil {
		return
	}
	m.mu.Lock()
	t.err = errText
	t.lastTry = m.now()
	logIt := errText != "" && errText != t.logged
	if errText == "" && t.logged != "" {
		m.log.Info("reached peer target", "target", t.spec, "source", t.source)
	}
	t.logged = errText
	m.mu.Unlock()
	if logIt {
		m.log.Warn(fmt.Sprintf("peer target %s (from %s): %s; will retry", t.spec, t.source, errText), "target", t.spec)
	}
}

// PushPull exchanges the full state (memberlist's and every channel's)
// with one live peer now, as a join does, instead of waiting for the
// periodic push-pull with a random one: for a component that knows whose
// state it lacks (the allocator's rejoin hold). It blocks for at most the
// TCP timeout.
func (m *Mesh) PushPull(name PeerName) error {
	if m.closed.Load() {
		return ErrClosed
	}
	ml := m.ml.Load()
	if ml == nil {
		return ErrNotStarted
	}
	p, ok := m.Peer(name)
	switch {
	case !ok:
		return fmt.Errorf("push-pull with %s: %w", name, ErrUnknownPeer)
	case p.Self:
		return fmt.Errorf("push-pull with %s: this peer", name)
	case p.State == StateUnreachable || p.State == StateLeft:
		return fmt.Errorf("push-pull with %s: %w (%s)", name, ErrPeerUnreachable, p.State)
	}
	if _, err := ml.Join([]string{p.Addr.String()}); err != nil {
		return fmt.Errorf("push-pull with %s at %s: %w", name, p.Addr, err)
	}
	return nil
}
