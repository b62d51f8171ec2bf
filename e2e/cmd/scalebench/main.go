// Command scalebench measures N whole weft control planes in one process
// (internal/scale: the real mesh, the real ipalloc Service on its own bbolt
// file, the ring gossip adapter, on meshtest's in-memory network): the time
// to the first claim by consensus=N, for the ring to be one on every node,
// for a late node's first address and for its donation to reach every
// node; gossip bytes per node per second idle and while converging; the
// largest ipam message and push-pull state, the largest memberlist packet
// and stream; heap and CPU per node. It prints a Markdown table for
// docs/benchmarks.md. Time is real, not virtual: on a loaded machine read
// the figures with the load it prints.
//
//	go run ./e2e/cmd/scalebench -n 10,100,300
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/weft-net/weft/internal/ipammesh"
	"github.com/weft-net/weft/internal/scale"
	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/mesh"
)

func main() {
	var (
		ns       = flag.String("n", "10,100,300", "cluster sizes")
		loss     = flag.Float64("loss", 0, "packet loss probability")
		delay    = flag.Duration("delay", time.Millisecond, "one-way packet latency")
		pushPull = flag.Duration("pushpull", 0, "memberlist push-pull interval (0: production, 30 s)")
		idle     = flag.Duration("idle", 20*time.Second, "window to measure idle bandwidth and CPU")
		bound    = flag.Duration("timeout", 3*time.Minute, "bound of each phase")
		initMode = flag.String("init", "consensus", "first claim: consensus (consensus=N on every node) or seed (seed= the first three nodes, on every node)")
		verbose  = flag.Bool("v", false, "log the nodes at warn")
		pods     = flag.Bool("pods", false, "one address allocated on every node before the idle window (a pod on every node: the donations split the ring, past the broadcast limit from about 60 nodes)")
		meshGate = flag.Bool("meshgate", true, "stop at the mesh phase (every node has seen every node alive) when it does not end within -timeout; false: say so and go on")
		compress = flag.Bool("compress", true, "memberlist's compression, on in a router; -compress=false saves about a quarter of the CPU and sends about 3 times the bytes (mesh.Config.NoCompression)")
		cpuProf  = flag.String("cpuprofile", "", "write a CPU profile to this file (go tool pprof)")
		profFor  = flag.Duration("cpuprofile-for", 0, "stop the CPU profile after this long (0: at the end of the run)")
		scaleBy  = flag.Float64("timescale", 1, "multiply memberlist's timings (gossip and probe intervals, probe and stream timeouts, push-pull) by this: with N nodes sharing 2 cores, the failure detector starves and flaps at the production timings; the allocator's own timers stay as they are")
	)
	flag.Parse()
	level := slog.LevelError + 1
	if *verbose {
		level = slog.LevelWarn
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if *scaleBy < 1 || *scaleBy > 100 {
		fmt.Fprintf(os.Stderr, "scalebench: -timescale %g: give 1 to 100\n", *scaleBy)
		os.Exit(2)
	}
	tm := scaled(mesh.Timings{PushPullInterval: *pushPull}, *scaleBy)
	shown := tm.PushPullInterval
	if *initMode != "consensus" && *initMode != "seed" {
		fmt.Fprintf(os.Stderr, "scalebench: -init %q: give consensus or seed\n", *initMode)
		os.Exit(2)
	}
	fmt.Printf("%s, %d CPUs, load %s, init %s, loss %g%%, delay %s, push-pull %s (memberlist scales it up above 32 peers), memberlist timings x%g (probe every %s, gossip every %s), compression %v\n\n",
		time.Now().UTC().Format(time.RFC3339), runtime.NumCPU(), load(), *initMode, *loss*100, *delay, shown, *scaleBy, tm.ProbeInterval, tm.GossipInterval, *compress)
	fmt.Println("| N | first claim, all | one ring (same owners), all | late node's first address | its donation seen by all | idle B/node/s | converging B/node/s | largest ipam msg sent / state | largest packet / stream | heap/node | CPU/node idle | rings over the broadcast limit | load |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	var sizes []int
	for _, f := range strings.Split(*ns, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 2 {
			fmt.Fprintf(os.Stderr, "scalebench: bad size %q\n", f)
			os.Exit(2)
		}
		sizes = append(sizes, n)
	}
	if *cpuProf != "" {
		f, err := os.Create(*cpuProf)
		if err != nil {
			fmt.Fprintln(os.Stderr, "scalebench:", err)
			os.Exit(2)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "scalebench:", err)
			os.Exit(2)
		}
		var once sync.Once
		stop := func() {
			once.Do(func() {
				pprof.StopCPUProfile()
				f.Close()
				fmt.Fprintln(os.Stderr, "scalebench: CPU profile written to", *cpuProf)
			})
		}
		defer stop()
		if *profFor > 0 {
			time.AfterFunc(*profFor, stop)
		}
	}
	for _, n := range sizes {
		row, err := bench(n, *initMode, *pods, *meshGate, scale.Config{Loss: *loss, Delay: *delay, Timings: tm, NoCompression: !*compress, Log: log, Seed: uint64(n)}, *idle, *bound)
		if err != nil {
			// A phase that did not end is a result too: its row says
			// where the nodes were.
			fmt.Fprintln(os.Stderr, "scalebench:", err)
			row = fmt.Sprintf("| %d | %s | | | | | | | | | | | %s |", n, err, load())
		}
		fmt.Println(row)
	}
}

// scaled returns t with memberlist's intervals and timeouts multiplied by
// k, zero fields first taking the production timings. It slows the mesh's
// own clock: the failure detector's probes and suspicion, the gossip
// rounds, push-pull; the allocator's ticks are not scaled, so its retries
// come k times more often in mesh time than in a router. Times measured
// under k > 1 are of this slower mesh.
func scaled(t mesh.Timings, k float64) mesh.Timings {
	d := mesh.DefaultTimings()
	mul := func(v *time.Duration, def time.Duration) {
		if *v <= 0 {
			*v = def
		}
		*v = time.Duration(float64(*v) * k)
	}
	mul(&t.GossipInterval, d.GossipInterval)
	mul(&t.ProbeInterval, d.ProbeInterval)
	mul(&t.ProbeTimeout, d.ProbeTimeout)
	mul(&t.TCPTimeout, d.TCPTimeout)
	mul(&t.PushPullInterval, d.PushPullInterval)
	return t
}

func bench(n int, initMode string, pods, meshGate bool, cfg scale.Config, idle, bound time.Duration) (string, error) {
	dir, err := os.MkdirTemp("", "scalebench-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	cfg.Dir = dir
	c, err := scale.New(cfg)
	if err != nil {
		return "", err
	}
	defer c.Close()
	runtime.GC()
	var ms0 runtime.MemStats
	runtime.ReadMemStats(&ms0)

	ctx := context.Background()
	// Each poll reads every node (its owner loop, its mesh view): at 1,000
	// nodes a poll every 20 ms would be most of the process's work.
	every := max(20*time.Millisecond, time.Duration(n)*time.Millisecond)
	phase := func(what string, cond func() bool) (time.Duration, error) {
		began := time.Now()
		pctx, cancel := context.WithTimeout(ctx, bound)
		defer cancel()
		if err := scale.WaitFor(pctx, every, cond); err != nil {
			return 0, fmt.Errorf("N=%d: %s: not within %s; %s", n, what, bound, diagnose(c.Nodes()))
		}
		return time.Since(began), nil
	}
	init := ipalloc.Init{Consensus: n}
	if initMode == "seed" {
		init = ipalloc.Init{Seeds: []ipalloc.PeerName{"node0000", "node0001", "node0002"}}
	}
	began := time.Now()
	for i := range n {
		var peers []string
		if i > 0 {
			peers = []string{scale.Addr(0)}
		}
		if _, err := c.Add(ctx, init, peers); err != nil {
			return "", err
		}
	}
	nodes := c.Nodes()
	fmt.Fprintf(os.Stderr, "scalebench: N=%d: %d nodes started in %s\n", n, n, time.Since(began).Round(time.Millisecond))
	if _, err := phase("first claim", func() bool { return scale.Claimed(nodes) }); err != nil {
		return "", err
	}
	claim := time.Since(began)
	// One ring: every node's ring gives every range to the same owner.
	// Not the same ring to the last version: a peer whose start hold ends
	// jumps its entries' versions (ipalloc/peer_rejoin.go), which only
	// changes free counts and travels by push-pull (30 s to 3 min), so that
	// with consensus, where every node holds at first, the rings' versions
	// differ for minutes while their owners agree.
	if _, err := phase("one ring", func() bool { return scale.SameOwners(nodes) }); err != nil {
		return "", err
	}
	ring := time.Since(began)
	fmt.Fprintf(os.Stderr, "scalebench: N=%d: ring unicasts until one ring: %d (N(N-1)/2 = %d)\n", n, c.RingUnicasts(), n*(n-1)/2)
	// Every node has seen every node alive, not every pair at one instant
	// (scale.AliveSeen): with many nodes on 2 cores the failure detector
	// keeps suspecting some peer somewhere (docs/benchmarks.md, points 6
	// and 7), which says nothing of who knows whom.
	alive := scale.AliveSeen{}
	// Not a gate with -meshgate=false: the phases after it need no full
	// view (an allocation needs the rings of the peers it waits for), and
	// past 200 nodes on 2 cores the last few peers a starved failure
	// detector declared dead come back only by push-pull, minutes later.
	d, err := phase("mesh (every node has seen every node alive)", func() bool { return alive.Update(nodes) })
	switch {
	case err != nil && meshGate:
		return "", fmt.Errorf("%w; %s", err, firstMissing(alive.Missing(nodes)))
	case err != nil:
		fmt.Fprintf(os.Stderr, "scalebench: N=%d: going on without the full view: %v; %s; %s\n", n, err, firstMissing(alive.Missing(nodes)), aliveNow(nodes))
	default:
		fmt.Fprintf(os.Stderr, "scalebench: N=%d: every node has seen every node alive, %s after one ring; %s\n", n, d.Round(time.Millisecond), aliveNow(nodes))
	}

	if pods {
		// A pod on every node, retried as kubelet retries a failed ADD.
		began := time.Now()
		pctx, cancel := context.WithTimeout(ctx, bound)
		errs := make(chan error, n)
		for i, nd := range nodes {
			go func() {
				var err error
				for {
					_, _, err = nd.Svc.Allocate(pctx, ipalloc.Key{ContainerID: fmt.Sprintf("pod-%d", i), IfName: "eth0"}, ipalloc.Meta{PodName: "p"})
					if err == nil || pctx.Err() != nil {
						break
					}
				}
				errs <- err
			}()
		}
		var failed error
		for range n {
			if err := <-errs; err != nil {
				failed = err
			}
		}
		cancel()
		if failed != nil {
			return "", fmt.Errorf("N=%d: a pod on every node: %v; %s", n, failed, diagnose(nodes))
		}
		took := time.Since(began)
		r := nodes[0].Svc.Ring()
		fmt.Fprintf(os.Stderr, "scalebench: N=%d: a pod on every node in %s; node0000's ring: %d entries, %d bytes as a message\n",
			n, took.Round(time.Millisecond), len(r.Entries), len(ipalloc.EncodeMsg(&ipalloc.RingMsg{Ring: r})))
		// Every node's ring giving every range to the same owner (what
		// the routes follow); the free counts follow by push-pull.
		if d, err := phase("the same owners everywhere after the pods", func() bool { return scale.SameOwners(nodes) }); err != nil {
			fmt.Fprintf(os.Stderr, "scalebench: %v\n", err)
		} else {
			fmt.Fprintf(os.Stderr, "scalebench: N=%d: the same owners on every node %s after the last pod's address\n", n, d.Round(time.Millisecond))
		}
	}

	// Idle: bytes and CPU over the window, then the heap.
	b0, t0, cpu0 := c.BytesSent(), time.Now(), cpuTime()
	time.Sleep(idle) // measuring a rate over a fixed window, not waiting for an event
	secs := time.Since(t0).Seconds()
	idleBps := float64(c.BytesSent()-b0) / secs / float64(n)
	idleCPU := (cpuTime() - cpu0).Seconds() / secs / float64(n)
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heap := (int64(ms.HeapAlloc) - int64(ms0.HeapAlloc)) / int64(n)

	// A late node, its first address, its donation everywhere.
	b0, t0 = c.BytesSent(), time.Now()
	c.Watch(c.NextName())
	late, err := c.Add(ctx, init, []string{scale.Addr(n / 2)})
	if err != nil {
		return "", err
	}
	traceDone := make(chan struct{})
	traced := make(chan struct{})
	go func() {
		defer close(traced)
		tk := time.NewTicker(5 * time.Second)
		defer tk.Stop()
		for {
			select {
			case <-traceDone:
				fmt.Fprintf(os.Stderr, "scalebench: N=%d: late node at %s: %s\n", n, time.Since(t0).Round(time.Millisecond), traceLine(c.Trace(late)))
				return
			case <-tk.C:
				fmt.Fprintf(os.Stderr, "scalebench: N=%d: late node at %s: %s\n", n, time.Since(t0).Round(time.Second), traceLine(c.Trace(late)))
			}
		}
	}()
	// Retried as kubelet retries a failed CNI ADD: the core gives up on
	// one allocation after its own deadline (300 ticks).
	actx, cancel := context.WithTimeout(ctx, bound)
	for {
		_, _, err = late.Svc.Allocate(actx, ipalloc.Key{ContainerID: "late", IfName: "eth0"}, ipalloc.Meta{PodName: "p"})
		if err == nil || actx.Err() != nil {
			break
		}
	}
	cancel()
	close(traceDone)
	<-traced
	addr, reach := "no address in "+bound.String(), "-"
	if err == nil {
		addr = ms3(time.Since(t0))
		t1 := time.Now()
		all := c.Nodes()
		if d, err := phase("donation", func() bool { return scale.Owns(all, late.Name) }); err == nil {
			reach = ms3(d)
		} else {
			reach = "not in " + bound.String()
		}
		_ = t1
	} else {
		fmt.Fprintf(os.Stderr, "scalebench: N=%d: the late node's allocation: %v\n", n, err)
	}
	fmt.Fprintf(os.Stderr, "scalebench: N=%d: ring unicasts so far: %d\n", n, c.RingUnicasts())
	busyBps := float64(c.BytesSent()-b0) / time.Since(t0).Seconds() / float64(n+1)

	var maxSent, maxState, maxPkt, maxStream, tooLarge uint64
	var spread ipammesh.Spread
	for _, nd := range c.Nodes() {
		maxSent = max(maxSent, nd.MaxSent())
		maxState = max(maxState, nd.MaxState())
		maxPkt = max(maxPkt, nd.Lossy.MaxPacket())
		maxStream = max(maxStream, nd.Lossy.MaxStream())
		tooLarge += nd.TooLarge()
		s := nd.Spread()
		spread.Rings += s.Rings
		spread.Sent += s.Sent
		spread.Failed += s.Failed
		spread.Deferred += s.Deferred
	}
	fmt.Fprintf(os.Stderr, "scalebench: N=%d: rings spread by unicast (a change of the sender's ranges) %d, by %d unicasts (%d failed, sent again); rings over the broadcast limit %d, of which left to push-pull alone %d\n",
		n, spread.Rings, spread.Sent, spread.Failed, tooLarge, spread.Deferred)
	return fmt.Sprintf("| %d | %s | %s | %s | %s | %.0f | %.0f | %d B / %d B | %d B / %d B | %d KiB | %.2f%% | %d | %s |",
		n, ms3(claim), ms3(ring), addr, reach, idleBps, busyBps, maxSent, maxState, maxPkt, maxStream,
		heap/1024, idleCPU*100, tooLarge, load()), nil
}

// firstMissing is the first three of AliveSeen.Missing's lines.
func firstMissing(m []string) string {
	if len(m) > 3 {
		m = append(m[:3:3], fmt.Sprintf("and %d more nodes", len(m)-3))
	}
	return strings.Join(m, "; ")
}

// aliveNow says how many peers the nodes see alive at this instant.
func aliveNow(nodes []*scale.Node) string {
	fewest, all := len(nodes), 0
	for _, nd := range nodes {
		alive := 0
		for _, p := range nd.Mesh.Peers() {
			if p.State == mesh.StateAlive {
				alive++
			}
		}
		fewest = min(fewest, alive)
		if alive == len(nodes) {
			all++
		}
	}
	return fmt.Sprintf("now %d of %d nodes see all alive, the fewest alive any sees %d", all, len(nodes), fewest)
}

// diagnose summarises where the nodes are, for a phase that did not end.
func diagnose(nodes []*scale.Node) string {
	claimed, minKnown, maxKnown, minAlive := 0, 1<<30, 0, 1<<30
	var tooLarge, sendErrs uint64
	conflict, last := "", ""
	sts := make([]ipalloc.PeerStatus, len(nodes))
	var wg sync.WaitGroup
	for i, nd := range nodes {
		wg.Go(func() { sts[i] = nd.Svc.Status() }) // together: each waits for its busy owner loop
	}
	wg.Wait()
	for i, nd := range nodes {
		st := sts[i]
		if st.Claimed {
			claimed++
		}
		minKnown, maxKnown = min(minKnown, st.Known), max(maxKnown, st.Known)
		if st.Conflict != "" {
			conflict = st.Conflict
		}
		alive := 0
		for _, p := range nd.Mesh.Peers() {
			if p.State == mesh.StateAlive {
				alive++
			}
		}
		minAlive = min(minAlive, alive)
		tooLarge += nd.TooLarge()
		sendErrs += nd.SendErrors()
		if e := nd.LastSendError(); e != "" {
			last = e
		}
	}
	var kinds [32]uint64
	for _, nd := range nodes {
		for i, v := range nd.Received() {
			kinds[i] += v
		}
	}
	var recv []string
	for i, v := range kinds {
		if v > 0 && i < len(scale.KindNames) {
			recv = append(recv, fmt.Sprintf("%s %d", scale.KindNames[i], v))
		}
	}
	refused, dropped := scale.Refused(nodes)
	return fmt.Sprintf("received %s; %d of %d claimed, known %d..%d, fewest alive seen %d, broadcasts too large %d, other send errors %d (last %q), refused %d, inbox drops %d, conflict %q",
		strings.Join(recv, ", "), claimed, len(nodes), minKnown, maxKnown, minAlive, tooLarge, sendErrs, last, refused, dropped, conflict)
}

// traceLine is what the late node was sent and made of it.
func traceLine(t scale.Trace) string {
	var sent []string
	for i, v := range t.Sent {
		if v > 0 && i < len(scale.KindNames) {
			sent = append(sent, fmt.Sprintf("%s %d (failed %d)", scale.KindNames[i], v, t.Failed[i]))
		}
	}
	w := t.Rejoin
	if i := strings.Index(w, "("); i >= 0 {
		if j := strings.Index(w[i:], ")"); j >= 0 {
			w = fmt.Sprintf("waits for %d: %s", strings.Count(w[i:i+j], ",")+1, w[i+1:min(i+j, i+80)])
		}
	}
	return fmt.Sprintf("sent to it: %s; failures %v; parked (all nodes) %d, sent %d, dropped %d; rings resent %d, given up %d; its pulls %d (failed %d); claimed rings first from %v; its refusals %v; inbox drops %d; hold: %q",
		strings.Join(sent, ", "), t.Failures, t.Parked, t.Unparked, t.ParkDropped, t.Resent, t.ResendFailed, t.Pulls, t.PullsFailed, t.RingsFrom, t.Refused, t.Dropped, w)
}

func ms3(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) + " ms" }

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// load is the machine's 1-minute load average.
func load() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Fields(string(b))[0]
}
