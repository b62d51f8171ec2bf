package mesh

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

const converge = 20 * time.Second // generous: -race on a shared two-core machine

// startN starts n peers, each joining node1, and waits until all see all.
func startN(t *testing.T, c *cluster, n int) []*peer {
	t.Helper()
	var ps []*peer
	for i := 1; i <= n; i++ {
		cfg := Config{}
		if i > 1 {
			cfg.Peers = []string{addrOf(1)}
		}
		ps = append(ps, c.start(i, cfg))
	}
	waitStates(t, converge, ps, aliveAll(ps))
	return ps
}

func TestBroadcastReachesAll(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 5)
	defer closeAll(t, ps...)

	if err := ps[0].ch.Broadcast([]byte("set:a,b")); err != nil {
		t.Fatal(err)
	}
	if err := ps[3].ch.Broadcast([]byte("set:c")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, converge, "every peer to have a, b and c", func() bool {
		for _, p := range ps {
			if !p.set.has("a", "b", "c") {
				return false
			}
		}
		return true
	})
	for _, p := range ps {
		if d := p.m.droppedCounts(); len(d) > 0 {
			t.Errorf("%s dropped messages: %v", p.m.Name(), d)
		}
	}
	if err := ps[0].ch.Broadcast(make([]byte, MaxBroadcastSize+1)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized broadcast: got %v, want ErrTooLarge", err)
	}
}

func TestSendToReachesOne(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 4)
	defer closeAll(t, ps...)

	if err := ps[0].ch.SendTo("node3", []byte("hello")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, converge, "node3 to get the unicast", func() bool { return len(ps[2].set.received()) == 1 })
	if got := ps[2].set.received(); got[0] != "node1:hello" {
		t.Errorf("node3 got %q, want node1:hello", got)
	}
	for _, i := range []int{0, 1, 3} {
		if got := ps[i].set.received(); len(got) != 0 {
			t.Errorf("%s got unicasts %q meant for node3", ps[i].m.Name(), got)
		}
	}
	if err := ps[0].ch.SendTo("nobody", []byte("x")); !errors.Is(err, ErrUnknownPeer) {
		t.Errorf("SendTo an unknown peer: got %v, want ErrUnknownPeer", err)
	}
	if err := ps[0].ch.SendTo("node1", []byte("x")); err == nil {
		t.Error("SendTo ourselves succeeded")
	}
	if err := ps[0].ch.SendTo("node2", make([]byte, MaxMessageSize+1)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized SendTo: got %v, want ErrTooLarge", err)
	}
}

// A peer that joins late gets the full state of every channel by push-pull,
// and its own state reaches the others.
func TestPushPullLateJoiner(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 3)
	for i, p := range ps {
		p.set.add(fmt.Sprintf("local%d", i+1)) // state only, never broadcast
	}
	late := c.start(4, Config{Peers: []string{addrOf(2)}})
	late.set.add("local4")
	ps = append(ps, late)
	defer closeAll(t, ps...)

	waitFor(t, converge, "every peer to hold every peer's local state", func() bool {
		for _, p := range ps {
			if !p.set.has("local1", "local2", "local3", "local4") {
				return false
			}
		}
		return true
	})
}

// A crashed peer becomes unreachable in the others' views; restarted under
// the same name it rejoins, and subscribers see both events.
func TestCrashUnreachableRejoin(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 3)
	events, cancel := ps[0].m.Subscribe(64)
	defer cancel()

	ps[2].m.kill()
	waitStates(t, converge, ps[:2], map[PeerName]PeerState{"node3": StateUnreachable})
	waitFor(t, converge, "node1's log to say node3 is unreachable", func() bool {
		return ps[0].log.contains("peer node3(10.0.0.3) unreachable")
	})

	again := c.start(3, Config{Peers: []string{addrOf(1)}})
	ps[2] = again
	defer closeAll(t, ps...)
	waitStates(t, converge, ps, aliveAll(ps))
	waitFor(t, converge, "node1's log to say node3 rejoined", func() bool {
		return ps[0].log.contains("peer node3(10.0.0.3) rejoined")
	})

	var kinds []EventKind
	waitFor(t, converge, "node1's subscriber to see node3 unreachable, then rejoined", func() bool {
		for {
			select {
			case ev := <-events:
				if ev.Peer.Name == "node3" {
					kinds = append(kinds, ev.Kind)
				}
				continue
			default:
			}
			break
		}
		i := slices.Index(kinds, EventUnreachable)
		return i >= 0 && slices.Contains(kinds[i:], EventRejoined)
	})
}

// A peer that closes is "left", not "unreachable", in the others' views.
func TestGracefulLeave(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 3)
	defer closeAll(t, ps...)

	if err := ps[1].m.Close(); err != nil {
		t.Fatal(err)
	}
	waitStates(t, converge, []*peer{ps[0], ps[2]}, map[PeerName]PeerState{"node2": StateLeft})
	for _, p := range []*peer{ps[0], ps[2]} {
		if !p.log.contains("peer node2(10.0.0.2) left") || p.log.contains("peer node2(10.0.0.2) unreachable") {
			t.Errorf("%s did not log (only) that node2 left", p.m.Name())
		}
	}
	if got := ps[0].m.KnownPeers(); slices.Contains(got, addrOf(2)) {
		t.Errorf("KnownPeers %v still has the peer that left", got)
	}
}

// Garbage from peers is dropped and counted by reason, never a panic, and
// the mesh keeps working.
func TestGarbageDropped(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 2)
	defer closeAll(t, ps...)
	d := &delegate{m: ps[0].m}

	good := encodeMessage(kindBroadcast, "set", "node2", []byte("set:x"))
	cases := []struct {
		msg    []byte
		reason string
	}{
		{nil, reasonTruncated},
		{[]byte{wireVersion}, reasonTruncated},
		{good[:len(good)-2], reasonTruncated},
		{[]byte{9, kindBroadcast, 0}, reasonVersion},
		{append(slices.Clone(good), 0), reasonMalformed},
		{encodeMessage(7, "set", "node2", nil), reasonMalformed},
		{encodeMessage(kindBroadcast, "SET!", "node2", nil), reasonMalformed},
		{encodeMessage(kindBroadcast, "set", "bad name", nil), reasonMalformed},
		{encodeMessage(kindBroadcast, "set", "node2", make([]byte, MaxBroadcastSize+1)), reasonOversized},
		{encodeMessage(kindBroadcast, "nosuch", "node2", []byte("x")), reasonUnknown},
		{encodeMessage(kindBroadcast, "set", "node2", []byte("not a set")), reasonRejected},
		{encodeMessage(kindUnicast, "_topology", "node2", []byte("x")), reasonRejected},
		{encodeMessage(kindBroadcast, "_topology", "node2", []byte{1, 2, 3}), reasonRejected},
	}
	want := map[string]uint64{}
	for _, tc := range cases {
		d.NotifyMsg(tc.msg)
		want[tc.reason]++
	}
	d.MergeRemoteState([]byte{wireVersion, kindState, 1, 3, 's'}, false)
	want[reasonTruncated]++
	d.MergeRemoteState(encodeState([]channelState{{"nosuch", []byte("x")}, {"set", []byte("set:y")}}), false)
	want[reasonUnknown]++

	// And garbage that came over the network, as a peer would send it.
	ml := ps[1].m.ml.Load()
	to := &memberlist.Node{Name: "node1", Addr: net.ParseIP("10.0.0.1"), Port: 6783}
	if err := ml.SendReliable(to, []byte{wireVersion, kindUnicast, 200}); err != nil {
		t.Fatal(err)
	}
	want[reasonTruncated]++
	if err := ml.SendBestEffort(to, encodeMessage(kindBroadcast, "other", "node2", nil)); err != nil {
		t.Fatal(err)
	}
	want[reasonUnknown]++

	waitFor(t, converge, fmt.Sprintf("drop counts %v", want), func() bool {
		got := ps[0].m.droppedCounts()
		for r, n := range want {
			if got[r] != n {
				return false
			}
		}
		return true
	})
	if !ps[0].set.has("y") {
		t.Error("the valid channel of a state with an unknown one was not merged")
	}
	if v := counterValue(t, ps[0].m.metrics.dropped.WithLabelValues(reasonUnknown)); v != float64(want[reasonUnknown]) {
		t.Errorf("dropped metric for unknown-channel = %v, want %d", v, want[reasonUnknown])
	}
	if !ps[0].log.contains(`reason=truncated count=1`) {
		t.Error("the first drop of a reason was not logged at info")
	}
	// Still working.
	if err := ps[1].ch.Broadcast([]byte("set:after")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, converge, "a broadcast after the garbage", func() bool { return ps[0].set.has("after") })
}

func counterValue(t testing.TB, c prometheus.Metric) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	if m.Counter != nil {
		return m.Counter.GetValue()
	}
	return m.Gauge.GetValue()
}

// A second live peer with the same name is reported clearly by both sides,
// and everybody keeps running.
func TestDuplicateName(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 2)
	twin := c.start(9, Config{Name: "node2", Peers: []string{addrOf(1)}})
	defer closeAll(t, append(ps, twin)...)

	waitFor(t, converge, "node1 to log the conflict", func() bool {
		return ps[0].log.contains("two peers claim the name node2: 10.0.0.2:6783 (known) and 10.0.0.9:6783 (ignored)")
	})
	waitFor(t, converge, "a node2 to log that another peer claims its name", func() bool {
		return twin.log.contains("another peer claims this peer's name node2") || ps[1].log.contains("another peer claims this peer's name node2")
	})
	if v := counterValue(t, ps[0].m.metrics.conflicts); v < 1 {
		t.Errorf("conflict metric = %v, want >= 1", v)
	}
	// node1 still sees the original node2, at its address, alive.
	p, ok := ps[0].m.Peer("node2")
	if !ok || p.State != StateAlive || p.Addr.String() != addrOf(2) {
		t.Errorf("node1 sees node2 as %+v, want alive at %s", p, addrOf(2))
	}
	if err := ps[0].ch.Broadcast([]byte("set:still")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, converge, "the original node2 to still get broadcasts", func() bool { return ps[1].set.has("still") })
}

// A partition makes each side see the other unreachable; when it heals,
// the join loop merges the sides again without any action.
func TestPartitionHeals(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 4)
	defer closeAll(t, ps...)

	a, b := []string{addrOf(1), addrOf(2)}, []string{addrOf(3), addrOf(4)}
	c.net.Partition(a, b)
	waitStates(t, converge, ps[:2], map[PeerName]PeerState{"node3": StateUnreachable, "node4": StateUnreachable})
	waitStates(t, converge, ps[2:], map[PeerName]PeerState{"node1": StateUnreachable, "node2": StateUnreachable})

	// A change made on one side during the partition...
	if err := ps[0].ch.Broadcast([]byte("set:during")); err != nil {
		t.Fatal(err)
	}
	c.net.Heal()
	waitStates(t, converge, ps, aliveAll(ps))
	// ...reaches the other side after the heal, by push-pull.
	waitFor(t, converge, "the change made during the partition to reach node4", func() bool { return ps[3].set.has("during") })
}

// An unresolvable --peers entry is logged clearly and retried; the peer
// joins through the others and keeps running.
func TestUnresolvableTarget(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 2)

	tr, err := c.net.NewTransport(addrOf(3))
	if err != nil {
		t.Fatal(err)
	}
	log, lb := newLogger(t, "node3")
	m, err := New(Config{Name: "node3", Port: 6783, Transport: tr, Logger: log, Timings: testTimings(),
		Peers: []string{"no-such-peer.invalid", addrOf(1)}})
	if err != nil {
		t.Fatal(err)
	}
	var lookups atomic.Int32
	m.lookup = func(ctx context.Context, host string) ([]netip.Addr, error) {
		if host == "no-such-peer.invalid" {
			lookups.Add(1)
			return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
		}
		return lookupHost(ctx, host)
	}
	if err := m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	p3 := &peer{m: m, log: lb}
	defer closeAll(t, append(ps, p3)...)

	waitStates(t, converge, []*peer{p3}, aliveAll(ps))
	waitFor(t, converge, "the bad target to be logged", func() bool {
		return lb.contains(`peer target no-such-peer.invalid (from peers): cannot resolve \"no-such-peer.invalid\"`)
	})
	waitFor(t, converge, "the bad target to be retried", func() bool { return lookups.Load() >= 3 })
	var conns bytes.Buffer
	if err := m.WriteStatusConnections(&conns); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(conns.String(), "-> no-such-peer.invalid:6783  failed") {
		t.Errorf("connections status lacks the failed target:\n%s", conns.String())
	}
	if strings.Count(lb.String(), "cannot resolve") != 1 {
		t.Errorf("the same resolution error was logged more than once:\n%s", lb.String())
	}
}

// Subscribers that fall behind lose events but learn how many.
func TestSubscriberDropped(t *testing.T) {
	c := newCluster(t)
	p1 := c.start(1, Config{})
	events, cancel := p1.m.Subscribe(1)
	ps := []*peer{p1}
	for i := 2; i <= 4; i++ {
		ps = append(ps, c.start(i, Config{Peers: []string{addrOf(1)}}))
	}
	defer closeAll(t, ps...)
	waitStates(t, converge, ps[:1], aliveAll(ps))
	first := <-events
	if first.Kind != EventJoined {
		t.Errorf("first event %v, want joined", first.Kind)
	}
	// Three joins happened; the buffer held one. Provoke one more event.
	ps[3].m.kill()
	var ev Event
	waitFor(t, converge, "the next event", func() bool {
		select {
		case ev = <-events:
			return true
		default:
			return false
		}
	})
	if ev.Dropped == 0 {
		t.Errorf("event %v after an overflow has Dropped 0", ev.Kind)
	}
	cancel()
	cancel()
	if _, open := <-events; open {
		t.Error("the events channel is open after cancel")
	}
}

// KnownPeers feeds Config.Remembered: a restarted peer with no --peers
// joins through the peers it remembers.
func TestRememberedPeers(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 3)
	known := ps[2].m.KnownPeers()
	if want := []string{addrOf(1), addrOf(2)}; !slices.Equal(known, want) {
		t.Fatalf("KnownPeers = %v, want %v", known, want)
	}
	ps[2].m.kill()
	again := c.start(3, Config{Remembered: known})
	ps[2] = again
	defer closeAll(t, ps...)
	waitStates(t, converge, ps, aliveAll(ps))
}

// Peer metadata that does not decode shows as "invalid metadata" and is
// counted.
func TestInvalidPeerMeta(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 1)
	defer closeAll(t, ps...)
	d := &delegate{m: ps[0].m}
	d.NotifyJoin(&memberlist.Node{Name: "weird", Addr: net.ParseIP("10.0.0.7"), Port: 6783, Meta: []byte{1, 200}})
	p, ok := ps[0].m.Peer("weird")
	if !ok || p.MetaError == "" || p.State != StateAlive {
		t.Fatalf("peer with bad metadata: %+v", p)
	}
	if v := counterValue(t, ps[0].m.metrics.badMeta); v != 1 {
		t.Errorf("invalid metadata metric = %v, want 1", v)
	}
	var b bytes.Buffer
	ps[0].m.WriteStatusPeers(&b)
	if !strings.Contains(b.String(), "invalid metadata") {
		t.Errorf("peers status does not show the invalid metadata:\n%s", b.String())
	}
	d.NotifyLeave(&memberlist.Node{Name: "weird"})
}

// The status text and report of a three-peer mesh.
func TestStatus(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 3)
	defer closeAll(t, ps...)

	var s, peers, conns bytes.Buffer
	if err := ps[0].m.WriteStatus(&s); err != nil {
		t.Fatal(err)
	}
	if want := "Peers: 3\nConnections: 2 (2 established)\nTargets: 0\n"; s.String() != want {
		t.Errorf("status:\n%s\nwant:\n%s", s.String(), want)
	}
	ps[1].m.WriteStatus(&s)
	if !strings.Contains(s.String(), "Targets: 1") {
		t.Errorf("node2's status does not count its target:\n%s", s.String())
	}
	ps[0].m.WriteStatusPeers(&peers)
	lines := strings.Split(strings.TrimSpace(peers.String()), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "node1(host1)  10.0.0.1:6783  alive") || !strings.HasSuffix(lines[0], "(self)") {
		t.Errorf("peers status:\n%s", peers.String())
	}
	ps[0].m.WriteStatusConnections(&conns)
	if !strings.Contains(conns.String(), "-> 10.0.0.2:6783  established  alive  node2(host2)") {
		t.Errorf("connections status:\n%s", conns.String())
	}
	r := ps[0].m.Report()
	if r.PeerCount != 3 || r.Established != 2 || len(r.Peers) != 3 {
		t.Errorf("report: %+v", r)
	}
	for _, p := range r.Peers {
		if p.ReachableFrom != 2 {
			t.Errorf("%s reachable from %d peers, want 2", p.Name, p.ReachableFrom)
		}
		if b, ok := p.Meta.Component("tunnel"); !ok || !bytes.Equal(b.Data, testTunnel(6784, "udp").Data) || p.Nickname == "" || p.Meta.Version != "test" {
			t.Errorf("%s metadata %+v", p.Name, p.Meta)
		}
	}
	if got := ps[0].m.ReachableFrom("node2"); !slices.Equal(got, []PeerName{"node1", "node3"}) {
		t.Errorf("ReachableFrom(node2) = %v", got)
	}
}

// TestStatusUnresolvedTargets: targets the join loop has not resolved yet
// (the peers joined this one before it tried them) are not counted as
// failed connections when they are literal addresses of a live peer or of
// this peer itself; a literal address that is no peer is. (An e2e test saw
// "Connections: 5 (2 established)" for three live peers under load.)
func TestStatusUnresolvedTargets(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 3)
	defer closeAll(t, ps...)
	m := ps[0].m
	m.mu.Lock()
	for _, spec := range []string{"10.0.0.1", "10.0.0.3", "10.0.0.9"} {
		m.targets = append(m.targets, &target{spec: spec, source: "peers", host: spec, port: 6783})
	}
	m.mu.Unlock()
	r := m.Report()
	var failed []string
	for _, c := range r.Connections {
		if c.Outcome != "established" {
			failed = append(failed, c.Address)
		}
	}
	if r.Established != 2 || !slices.Equal(failed, []string{"10.0.0.9:6783"}) {
		t.Errorf("connections %+v: established %d, failed %v; want 2 and only 10.0.0.9:6783", r.Connections, r.Established, failed)
	}
}

// A peer that others report unreachable while this one still sees it
// alive is suspect.
func TestSuspectFromReports(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 3)
	defer closeAll(t, ps...)
	m := ps[0].m
	m.applyReport(report{Origin: "node2", Version: uint64(time.Now().UnixNano()), Unreachable: []PeerName{"node3"}})
	p, _ := m.Peer("node3")
	if p.State != StateSuspect || !slices.Equal(p.UnreachableFrom, []PeerName{"node2"}) || p.ReachableFrom != 1 {
		t.Errorf("node3 = %+v, want suspect, unreachable from node2", p)
	}
	if !ps[0].log.contains("peer node3(10.0.0.3) suspect: unreachable from node2") {
		t.Error("suspect not logged")
	}
	m.applyReport(report{Origin: "node2", Version: uint64(time.Now().UnixNano())})
	if p, _ := m.Peer("node3"); p.State != StateAlive {
		t.Errorf("node3 = %v after node2 reaches it again, want alive", p.State)
	}
	if !ps[0].log.contains("peer node3(10.0.0.3) reachable again") {
		t.Error("reachable again not logged")
	}
}

func TestLifecycleErrors(t *testing.T) {
	c := newCluster(t)
	tr, _ := c.net.NewTransport(addrOf(1))
	m, err := New(Config{Name: "node1", Transport: tr, Timings: testTimings()})
	if err != nil {
		t.Fatal(err)
	}
	ch, err := m.Channel("set", newSetGossiper())
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"", "_x", "Set", "9set", strings.Repeat("a", 33)} {
		if _, err := m.Channel(bad, newSetGossiper()); err == nil {
			t.Errorf("channel name %q accepted", bad)
		}
	}
	if _, err := m.Channel("set", newSetGossiper()); err == nil {
		t.Error("a channel registered twice")
	}
	if err := ch.SendTo("node2", nil); !errors.Is(err, ErrNotStarted) {
		t.Errorf("SendTo before Start: %v", err)
	}
	if err := m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := m.Start(context.Background()); !errors.Is(err, ErrStarted) {
		t.Errorf("second Start: %v", err)
	}
	if _, err := m.Channel("late", newSetGossiper()); !errors.Is(err, ErrStarted) {
		t.Errorf("Channel after Start: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ch.Broadcast(nil); !errors.Is(err, ErrClosed) {
		t.Errorf("Broadcast after Close: %v", err)
	}
	if err := m.Start(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("Start after Close: %v", err)
	}

	// Closed without being started.
	tr2, _ := c.net.NewTransport(addrOf(2))
	m2, err := New(Config{Name: "node2", Transport: tr2})
	if err != nil {
		t.Fatal(err)
	}
	m2.Close()
	checkLeaks(t)
}

func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "peer name"},
		{Config{Name: "a b"}, "peer name"},
		{Config{Name: "a", Port: 70000}, "--port"},
		{Config{Name: "a", BindAddr: "nonsense"}, "--host"},
		{Config{Name: "a", Peers: []string{"host:notaport"}}, `--peers entry "host:notaport"`},
		{Config{Name: "a", Nickname: strings.Repeat("n", 64)}, "nickname"},
		{Config{Name: "a", Components: []Component{{Name: "Tunnel"}}}, "component name"},
		{Config{Name: "a", Components: []Component{{Name: "x", Data: make([]byte, 9), Max: 8}}}, "bound"},
		{Config{Name: "a", Components: []Component{{Name: "x", Max: 300}}}, "bound"},
		{Config{Name: "a", Components: []Component{{Name: "x"}, {Name: "x"}}}, "twice"},
	} {
		_, err := New(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v, want an error about %s", tc.cfg, err, tc.want)
		}
	}
}

// A port in use is a clear error naming the port and the flag.
func TestPortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	_, err = New(Config{Name: "a", BindAddr: "127.0.0.1", Port: port})
	if err == nil {
		t.Fatal("New on a port in use succeeded")
	}
	for _, want := range []string{fmt.Sprintf("gossip port %d", port), "--port", "in use"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	checkLeaks(t)
}

func TestRegistererMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := newCluster(t)
	tr, _ := c.net.NewTransport(addrOf(1))
	m, err := New(Config{Name: "node1", Transport: tr, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{Name: "node1", Transport: tr, Registerer: reg}); err == nil {
		t.Error("a second mesh registered the same metrics")
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range fams {
		names = append(names, f.GetName())
	}
	for _, want := range []string{"weft_mesh_peers", "weft_mesh_dropped_messages_total"} {
		if !slices.Contains(names, want) {
			t.Errorf("metric %s not registered; have %v", want, names)
		}
	}
	m.Close()
	m2, err := New(Config{Name: "node1", Transport: tr, Registerer: reg})
	if err != nil {
		t.Fatalf("metrics not unregistered by Close: %v", err)
	}
	m2.Close()
}

// A peer started with no targets (a fresh Kubernetes node: the node list
// arrives after the start) joins as soon as AddTargets gives it one, not at
// the next reconnect round.
func TestAddTargetsJoinsAtOnce(t *testing.T) {
	c := newCluster(t)
	tm := testTimings()
	tm.ReconnectInterval = time.Hour // the old loop tried added targets only here
	first := c.start(1, Config{Timings: tm})
	fresh := c.start(2, Config{Timings: tm})
	ps := []*peer{first, fresh}
	defer func() { closeAll(t, ps...) }()
	// The join loop has started with nothing to join.
	waitFor(t, converge, "the join loop to find no targets", func() bool { return fresh.log.contains("no peers to join") })
	if err := fresh.m.AddTargets(addrOf(1)); err != nil {
		t.Fatal(err)
	}
	waitStates(t, converge, ps, aliveAll(ps))
	waitFor(t, converge, "the join logged", func() bool { return fresh.log.contains("joined the mesh") })

	// Once joined, a target added later (a node that joins the cluster)
	// is dialled at once too.
	late := c.start(3, Config{Timings: tm})
	ps = append(ps, late)
	if err := fresh.m.AddTargets(addrOf(3)); err != nil {
		t.Fatal(err)
	}
	waitStates(t, converge, ps, aliveAll(ps))
}

// A peer gone for good (its Node deleted, its ranges reclaimed) is
// forgotten: not shown, not remembered, not dialled; discovery's targets
// replace the added and remembered ones that it no longer lists.
func TestForgetAndSetTargets(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 3)
	// node2 also remembers node3, as after a restart, and was given it by
	// discovery.
	if err := ps[1].m.AddTargets(addrOf(3)); err != nil {
		t.Fatal(err)
	}
	ps[2].m.kill()
	live := ps[:2]
	defer closeAll(t, live...)
	waitStates(t, converge, live, map[PeerName]PeerState{"node3": StateUnreachable})

	if err := ps[0].m.Forget("node2"); !errors.Is(err, ErrPeerAlive) {
		t.Errorf("Forget of an alive peer: %v, want ErrPeerAlive", err)
	}
	if err := ps[0].m.Forget("nobody"); !errors.Is(err, ErrUnknownPeer) {
		t.Errorf("Forget of an unknown peer: %v, want ErrUnknownPeer", err)
	}
	if err := ps[0].m.Forget("node1"); err == nil {
		t.Error("Forget of self accepted")
	}
	for _, p := range live {
		if err := p.m.Forget("node3"); err != nil {
			t.Fatal(err)
		}
		if _, ok := p.m.Peer("node3"); ok {
			t.Errorf("%s still shows node3", p.m.Name())
		}
		if known := p.m.KnownPeers(); slices.Contains(known, addrOf(3)) {
			t.Errorf("%s still remembers node3: %v", p.m.Name(), known)
		}
	}
	// node2 still has node3 as a target; discovery no longer lists it.
	if !slices.Contains(ps[1].m.Report().Targets, addrOf(3)) {
		t.Fatalf("targets: %v", ps[1].m.Report().Targets)
	}
	if err := ps[1].m.SetTargets("10.0.0.1"); err != nil {
		t.Fatal(err)
	}
	rep := ps[1].m.Report()
	if !slices.Equal(rep.Targets, []string{addrOf(1)}) { // the --peers entry stays, the same host is not added twice
		t.Errorf("targets after SetTargets: %v, want only %s", rep.Targets, addrOf(1))
	}
	for _, cn := range rep.Connections {
		if cn.Address == addrOf(3) {
			t.Errorf("node3 still shown as a connection: %+v", cn)
		}
	}
	if err := ps[1].m.SetTargets("bad host"); err == nil {
		t.Error("SetTargets accepted an invalid address")
	}
}

// TestPushPullWithOnePeer: with the periodic push-pull hours apart and no
// broadcast, a channel's state reaches a peer only through PushPull, both
// ways; an unknown peer is refused.
func TestPushPullWithOnePeer(t *testing.T) {
	c := newCluster(t)
	tm := testTimings()
	tm.PushPullInterval = 10 * time.Hour
	a := c.start(1, Config{Timings: tm})
	b := c.start(2, Config{Timings: tm, Peers: []string{addrOf(1)}})
	waitStates(t, 10*time.Second, []*peer{a, b}, aliveAll([]*peer{a, b}))
	a.set.add("from-a") // in the state only: never broadcast
	b.set.add("from-b")
	if err := b.m.PushPull("node1"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "both states exchanged", func() bool { return a.set.has("from-b") && b.set.has("from-a") })
	if err := b.m.PushPull("nobody"); !errors.Is(err, ErrUnknownPeer) {
		t.Errorf("PushPull with an unknown peer: %v, want ErrUnknownPeer", err)
	}
}

// A push-pull's reports are taken in together, the peers' states derived
// once: a report that makes a peer suspect and a goodbye of a peer already
// unreachable, in one state, give both outcomes and their log lines.
func TestMergeReportsTogether(t *testing.T) {
	c := newCluster(t)
	ps := startN(t, c, 3)
	defer closeAll(t, ps...)
	m := ps[0].m
	m.onAlive("gone", netip.MustParseAddrPort("10.0.0.9:6783"), nil)
	m.onDead("gone")
	v := uint64(time.Now().UnixNano())
	state := encodeReports([]report{
		{Origin: "node2", Version: v, Unreachable: []PeerName{"node3"}},
		{Origin: "gone", Version: v, Leaving: true},
		{Origin: "stranger", Version: v, Unreachable: []PeerName{"node2"}}, // no peer: ignored
	})
	if err := (*topologyGossiper)(m).MergeRemoteState(state); err != nil {
		t.Fatal(err)
	}
	if p, _ := m.Peer("node3"); p.State != StateSuspect || !slices.Equal(p.UnreachableFrom, []PeerName{"node2"}) {
		t.Errorf("node3 = %+v, want suspect, unreachable from node2", p)
	}
	if p, _ := m.Peer("node2"); p.State != StateAlive {
		t.Errorf("node2 = %v, want alive (the stranger's report is not taken)", p.State)
	}
	if p, _ := m.Peer("gone"); p.State != StateLeft {
		t.Errorf("gone = %v after its goodbye, want left", p.State)
	}
	for _, line := range []string{"peer node3(10.0.0.3) suspect: unreachable from node2", "peer gone(10.0.0.9) left"} {
		if !ps[0].log.contains(line) {
			t.Errorf("not logged: %q", line)
		}
	}
	// The same state again is no news.
	if n := m.applyReports([]report{{Origin: "node2", Version: v, Unreachable: []PeerName{"node3"}}}); n != 0 {
		t.Errorf("a report seen already: %d news, want 0", n)
	}
}
