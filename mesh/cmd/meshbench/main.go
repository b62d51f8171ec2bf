// Command meshbench measures the mesh: how long a new peer and a channel
// delta take to reach every peer, and how many gossip bytes a peer sends
// per second, for N in-process peers on an in-memory network (or on
// loopback UDP/TCP), with and without packet loss. It prints a Markdown
// table for docs/benchmarks.md.
//
//	go run ./mesh/cmd/meshbench -n 10,50,100 -loss 0,0.1
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/weft-net/weft/mesh"
	"github.com/weft-net/weft/mesh/meshtest"
)

func main() {
	var (
		ns        = flag.String("n", "10,50,100", "cluster sizes")
		losses    = flag.String("loss", "0,0.1", "packet loss probabilities")
		transport = flag.String("transport", "mem", "mem (in-memory network) or udp (real UDP/TCP on 127.0.0.1)")
		runs      = flag.Int("runs", 5, "measurements of each kind per configuration")
		idle      = flag.Duration("idle", 15*time.Second, "window to measure idle gossip bandwidth")
		seed      = flag.Uint64("seed", uint64(time.Now().UnixNano()), "seed of the packet loss and of the choice of peers")
		verbose   = flag.Bool("v", false, "log the meshes at info")
	)
	flag.Parse()
	level := slog.LevelError + 1
	if *verbose {
		level = slog.LevelInfo
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	t := mesh.DefaultTimings()
	fmt.Printf("seed %d, transport %s, gossip interval %s, fanout %d, retransmit mult %d, probe interval %s, push-pull %s\n\n",
		*seed, *transport, t.GossipInterval, t.GossipNodes, t.RetransmitMult, t.ProbeInterval, t.PushPullInterval)
	fmt.Println("| N | loss | new peer seen by 50% / 99% / all (median of runs) | delta seen by 50% / 99% / all (median) | worst run, all (peer / delta) | idle bytes/peer/s | bytes/peer/s while converging |")
	fmt.Println("|---|---|---|---|---|---|---|")
	for _, n := range ints(*ns) {
		for _, loss := range floats(*losses) {
			r, err := bench(n, loss, *transport, *runs, *idle, *seed, log)
			if err != nil {
				fmt.Fprintln(os.Stderr, "meshbench:", err)
				os.Exit(1)
			}
			fmt.Printf("| %d | %g%% | %s | %s | %s / %s | %.0f | %.0f |\n", n, loss*100,
				triple(r.join), triple(r.delta), ms(r.joinWorst), ms(r.deltaWorst), r.idleBps, r.busyBps)
		}
	}
}

type result struct {
	join, delta           [3]time.Duration // medians of 50%, 99%, 100%
	joinWorst, deltaWorst time.Duration
	idleBps, busyBps      float64
}

// node is one peer of the benchmark.
type node struct {
	m      *mesh.Mesh
	ch     *mesh.Channel
	g      *recorder
	lossy  *meshtest.Lossy
	events <-chan mesh.Event
}

// recorder is a grow-only set that records when each item arrived.
type recorder struct {
	mu   sync.Mutex
	seen map[string]time.Time
}

func (r *recorder) add(item string, at time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.seen[item]; ok {
		return false
	}
	r.seen[item] = at
	return true
}

func (r *recorder) at(item string) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	t, ok := r.seen[item]
	return t, ok
}

func (r *recorder) OnBroadcast(_ mesh.PeerName, data []byte) ([]byte, error) {
	if r.add(string(data), time.Now()) {
		return data, nil
	}
	return nil, nil
}
func (r *recorder) OnUnicast(mesh.PeerName, []byte) error { return nil }
func (r *recorder) LocalState() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	var items []string
	for it := range r.seen {
		items = append(items, it)
	}
	return []byte(strings.Join(items, "\n"))
}
func (r *recorder) MergeRemoteState(data []byte) error {
	now := time.Now()
	for _, it := range strings.Split(string(data), "\n") {
		if it != "" {
			r.add(it, now)
		}
	}
	return nil
}

func bench(n int, loss float64, transport string, runs int, idle time.Duration, seed uint64, log *slog.Logger) (result, error) {
	var res result
	rng := rand.New(rand.NewPCG(seed, uint64(n)))
	network := meshtest.NewNetwork()
	var nodes []*node
	defer func() {
		var wg sync.WaitGroup
		for _, nd := range nodes {
			wg.Add(1)
			go func() { defer wg.Done(); nd.m.Close() }()
		}
		wg.Wait()
	}()
	start := func(i int, join string) (*node, error) {
		var inner memberlist.NodeAwareTransport
		if transport == "udp" {
			nt, err := memberlist.NewNetTransport(&memberlist.NetTransportConfig{BindAddrs: []string{"127.0.0.1"}, BindPort: 0})
			if err != nil {
				return nil, err
			}
			inner = nt
		} else {
			mt, err := network.NewTransport(fmt.Sprintf("10.%d.%d.%d:6783", i>>16&255, i>>8&255, i&255))
			if err != nil {
				return nil, err
			}
			inner = mt
		}
		nd := &node{g: &recorder{seen: map[string]time.Time{}}, lossy: meshtest.NewLossy(inner, loss, seed+uint64(i))}
		cfg := mesh.Config{Name: mesh.PeerName(fmt.Sprintf("peer%03d", i)), Transport: nd.lossy, Logger: log.With("peer", i)}
		if join != "" {
			cfg.Peers = []string{join}
		}
		m, err := mesh.New(cfg)
		if err != nil {
			return nil, err
		}
		nd.m = m
		if nd.ch, err = m.Channel("bench", nd.g); err != nil {
			return nil, err
		}
		nd.events, _ = m.Subscribe(4 * n)
		if err := m.Start(context.Background()); err != nil {
			return nil, err
		}
		return nd, nil
	}

	// The cluster: every peer joins the first one.
	for i := range n {
		join := ""
		if i > 0 {
			join = nodes[0].m.Addr().String()
		}
		nd, err := start(i, join)
		if err != nil {
			return res, err
		}
		nodes = append(nodes, nd)
	}
	if err := waitAll(nodes, n, 5*time.Minute); err != nil {
		return res, err
	}
	bytesNow := func() uint64 {
		var b uint64
		for _, nd := range nodes {
			b += nd.lossy.BytesSent()
		}
		return b
	}

	// Idle bandwidth: probes, and push-pulls when they fall in the window.
	b0, t0 := bytesNow(), time.Now()
	time.Sleep(idle) // measuring a rate over a fixed window, not waiting for an event
	res.idleBps = float64(bytesNow()-b0) / time.Since(t0).Seconds() / float64(n)

	// Convergence: new peers, then deltas, one at a time.
	var joins, deltas [][3]time.Duration
	b0, t0 = bytesNow(), time.Now()
	for r := range runs {
		via := nodes[rng.IntN(len(nodes))]
		began := time.Now()
		nd, err := start(len(nodes), via.m.Addr().String())
		if err != nil {
			return res, err
		}
		nodes = append(nodes, nd)
		name := nd.m.Name()
		var seen []time.Duration
		for _, o := range nodes[:len(nodes)-1] {
			at, err := joinedAt(o, name, began, time.Minute)
			if err != nil {
				return res, fmt.Errorf("run %d: %s did not see %s join: %w", r, o.m.Name(), name, err)
			}
			seen = append(seen, at)
		}
		joins = append(joins, percentiles(seen))

		from := nodes[rng.IntN(len(nodes))]
		item := fmt.Sprintf("delta-%d", r)
		began = time.Now()
		from.g.add(item, began)
		if err := from.ch.Broadcast([]byte(item)); err != nil {
			return res, err
		}
		seen = seen[:0]
		deadline := began.Add(time.Minute)
		for _, o := range nodes {
			for {
				if at, ok := o.g.at(item); ok {
					seen = append(seen, at.Sub(began))
					break
				}
				if time.Now().After(deadline) {
					return res, fmt.Errorf("run %d: %s did not get the delta", r, o.m.Name())
				}
				time.Sleep(5 * time.Millisecond) // polling interval
			}
		}
		deltas = append(deltas, percentiles(seen))
	}
	res.busyBps = float64(bytesNow()-b0) / time.Since(t0).Seconds() / float64(len(nodes))
	res.join, res.joinWorst = summarize(joins)
	res.delta, res.deltaWorst = summarize(deltas)
	return res, nil
}

// waitAll waits until every node sees want peers alive.
func waitAll(nodes []*node, want int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ok := true
		for _, nd := range nodes {
			alive := 0
			for _, p := range nd.m.Peers() {
				if p.State == mesh.StateAlive {
					alive++
				}
			}
			ok = ok && alive >= want
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the cluster of %d did not converge in %s", want, timeout)
		}
		time.Sleep(50 * time.Millisecond) // polling interval
	}
}

// joinedAt reads o's events until name joins and returns how long after
// began that was (by the event's own time: the events are read later).
func joinedAt(o *node, name mesh.PeerName, began time.Time, timeout time.Duration) (time.Duration, error) {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		select {
		case ev := <-o.events:
			if ev.Peer.Name == name && (ev.Kind == mesh.EventJoined || ev.Kind == mesh.EventRejoined) {
				return ev.Peer.Since.Sub(began), nil
			}
		case <-timer.C:
			return 0, fmt.Errorf("timeout")
		}
	}
}

// percentiles returns the times by which 50%, 99% and all had it.
func percentiles(ds []time.Duration) [3]time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	at := func(q float64) time.Duration {
		i := int(q*float64(len(s))+0.999999) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	return [3]time.Duration{at(0.5), at(0.99), s[len(s)-1]}
}

// summarize returns the per-column medians over runs and the worst "all".
func summarize(runs [][3]time.Duration) ([3]time.Duration, time.Duration) {
	var med [3]time.Duration
	var worst time.Duration
	for c := range 3 {
		col := make([]time.Duration, len(runs))
		for i, r := range runs {
			col[i] = r[c]
			worst = max(worst, r[2])
		}
		slices.Sort(col)
		med[c] = col[len(col)/2]
	}
	return med, worst
}

func triple(d [3]time.Duration) string { return ms(d[0]) + " / " + ms(d[1]) + " / " + ms(d[2]) }

func ms(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) + " ms" }

func ints(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v < 2 {
			fmt.Fprintf(os.Stderr, "meshbench: bad size %q\n", f)
			os.Exit(2)
		}
		out = append(out, v)
	}
	return out
}

func floats(s string) []float64 {
	var out []float64
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || v < 0 || v >= 1 {
			fmt.Fprintf(os.Stderr, "meshbench: bad loss %q\n", f)
			os.Exit(2)
		}
		out = append(out, v)
	}
	return out
}
