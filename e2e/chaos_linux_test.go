package e2e_test

// The chaos runs: five routers in namespaces under a seeded schedule of pod
// churn through the CNI runtime and faults (chaos_model_test.go), checked
// after every step and at every check point. Short in `go test`; long with
// `make chaos` (docs/reliability.md).

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/e2e"
)

var (
	chaosSeed  = flag.Int64("chaos.seed", 1, "seed of the chaos schedules (0: one from the clock; the seed is logged)")
	chaosOps   = flag.Int("chaos.ops", 24, "steps of each chaos run, check points not counted")
	chaosEvery = flag.Int("chaos.every", 8, "a check point after every so many chaos steps")
	chaosPods  = flag.Int("chaos.pods", 16, "at most so many live pods in a chaos run")
)

const (
	chaosNodes    = 5
	chaosUniverse = "10.32.0.0/26" // 64 addresses: about 12 a node, so space moves by donation
	// Bounds of waits on conditions; a slow machine meets them, a broken
	// cluster does not.
	chaosOpWait    = 45 * time.Second // one CNI call (the plugin gives up on the router after 30s)
	chaosReadyWait = 20 * time.Second // a restarted router, best effort during chaos
	chaosHealWait  = 3 * time.Minute  // convergence after heal
	chaosPingWait  = 2 * time.Minute  // full reachability after convergence
	// chaosGCGrace is the routers' --gc-grace: far longer than a burst's
	// ADDs and its racing GC take, short enough that an address whose pod
	// is gone is freed by a GC soon after heal.
	chaosGCGrace = 20 * time.Second
)

// chaosCluster is a chaos run: the cluster, what the test knows of its
// pods and faults, and the figures.
type chaosCluster struct {
	t    *testing.T
	ctx  context.Context
	c    *e2e.Cluster
	seed int64
	kube *kubeHooks // nil without --kube

	args func(n *e2e.Node) []string // router arguments of a node

	pods    map[string]*e2e.Pod // live pods by schedule name
	down    map[int]bool        // router killed
	gone    map[int]bool        // machine gone
	gen     map[int]int         // machines a node has had, for fresh peer names
	removed []string            // peer names of machines gone for good
	drops   map[int]map[int]bool
	cutLink map[int]bool

	figures map[string]int
	viol    []string
}

// kubeHooks are the Kubernetes side of a --kube run.
type kubeHooks struct {
	deleteNode func(ctx context.Context, n *e2e.Node) error
	createNode func(ctx context.Context, n *e2e.Node) error
	// deleted waits until a router logged the reclaim of n's peer.
	deleted func(ctx context.Context, n *e2e.Node, peer string) bool
}

// chaosSeedValue is the seed of this test process's chaos runs.
func chaosSeedValue(t *testing.T) int64 {
	s := *chaosSeed
	if s == 0 {
		s = time.Now().UnixNano() % 1_000_000_007
	}
	t.Logf("chaos seed %d (replay: go test ./e2e/ -run '%s$' -chaos.seed=%d -chaos.ops=%d -chaos.every=%d -chaos.pods=%d)",
		s, t.Name(), s, *chaosOps, *chaosEvery, *chaosPods)
	return s
}

// TestChaos: pod churn, kill -9 and restart, lost state directories,
// partitions (links cut, both ways and one way) and weft rmpeer of a
// machine gone for good, on five routers with --peers and consensus=5.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("e2e: skipped in -short mode")
	}
	seed := chaosSeedValue(t)
	run := e2e.NewTestRun(t)
	ctx, cancel := chaosContext(t)
	defer cancel()
	c, err := run.NewCluster(ctx, e2e.ClusterOpts{Nodes: chaosNodes})
	if err != nil {
		t.Fatal(err)
	}
	var all []string
	for _, n := range c.Nodes {
		all = append(all, n.UnderlayIP.String())
	}
	cc := newChaos(t, ctx, c, seed, nil, func(*e2e.Node) []string {
		return []string{"--peers", strings.Join(all, ","), "--ipalloc-init", fmt.Sprintf("consensus=%d", chaosNodes), "--ipalloc-range", chaosUniverse}
	})
	cc.run(schedule(seed, scheduleOpts{Nodes: chaosNodes, Ops: *chaosOps, CheckEvery: *chaosEvery, MaxPods: *chaosPods}))
}

// chaosContext bounds a run by the test's deadline, less a margin for
// Close and the log dump.
func chaosContext(t *testing.T) (context.Context, context.CancelFunc) {
	if dl, ok := t.Deadline(); ok {
		return context.WithDeadline(context.Background(), dl.Add(-30*time.Second))
	}
	return context.WithTimeout(context.Background(), time.Hour)
}

func newChaos(t *testing.T, ctx context.Context, c *e2e.Cluster, seed int64, kube *kubeHooks, args func(*e2e.Node) []string) *chaosCluster {
	return &chaosCluster{
		t: t, ctx: ctx, c: c, seed: seed, kube: kube,
		// A short --gc-grace: a racing GC (burst) must not free what the
		// ADDs got, which is what the grace is for (with none, the GC
		// freed a live pod's address: seed 1 on the merge of the
		// allocator's owner loop), and the check after heal can still
		// see every address without a live pod go (checkAfterGC).
		args: func(n *e2e.Node) []string {
			return append([]string{"--gc-grace", chaosGCGrace.String()}, args(n)...)
		},
		pods: map[string]*e2e.Pod{}, down: map[int]bool{}, gone: map[int]bool{}, gen: map[int]int{},
		drops: map[int]map[int]bool{}, cutLink: map[int]bool{}, figures: map[string]int{},
	}
}

// run starts every router, waits for the first check point, then runs ops.
// It fails the test with the seed, the schedule and every violation once a
// check point found any.
func (cc *chaosCluster) run(ops []op) {
	t := cc.t
	t.Logf("chaos schedule (seed %d, %d steps):\n%s", cc.seed, len(ops), scheduleText(ops))
	for _, n := range cc.c.Nodes {
		if _, err := n.StartRouter(cc.args(n)...); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	cc.check(-1)
	for i, s := range ops {
		if cc.ctx.Err() != nil {
			cc.fail(fmt.Sprintf("out of time before step %d", i))
			break
		}
		t.Logf("chaos step %d: %s", i, s)
		if s.Kind == opCheck {
			cc.figures["check points"]++
			cc.check(i)
			if len(cc.viol) > 0 {
				break
			}
			continue
		}
		cc.figures["steps"]++
		cc.figures["op "+string(s.Kind)]++
		if faults[s.Kind] {
			cc.figures["faults"]++
		}
		cc.step(i, s)
		for _, v := range checkPods(cc.livePods()) {
			cc.fail(fmt.Sprintf("after step %d (%s): %s", i, s, v))
		}
	}
	cc.figures["violations"] = len(cc.viol)
	f := cc.figures
	t.Logf("chaos figures (seed %d, %s):\n%s", cc.seed, time.Since(start).Round(time.Second), cc.figuresText())
	t.Logf("chaos summary %s seed=%d steps=%d faults=%d add-ok=%d add-failed=%d check-points=%d pings=%d kept-reclaims=%d violations=%d time=%s",
		t.Name(), cc.seed, f["steps"], f["faults"], f["add ok"], f["add failed"], f["check points"], f["pings"], f["re-claims kept by GC"], f["violations"], time.Since(start).Round(time.Second))
	if len(cc.viol) > 0 {
		t.Fatalf("chaos seed %d: %d violations:\n%s\nschedule:\n%s", cc.seed, len(cc.viol), strings.Join(cc.viol, "\n"), scheduleText(ops))
	}
}

func (cc *chaosCluster) fail(msg string) {
	cc.t.Logf("VIOLATION: %s", msg)
	cc.viol = append(cc.viol, msg)
}

func (cc *chaosCluster) figuresText() string {
	keys := make([]string, 0, len(cc.figures))
	for k := range cc.figures {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "  %-22s %d\n", k, cc.figures[k])
	}
	return b.String()
}

// livePods lists the pods the runtime has attached and still has.
func (cc *chaosCluster) livePods() []podSeen {
	var out []podSeen
	for _, p := range cc.sortedPods() {
		out = append(out, podSeen{Name: p.String(), Node: p.Node.Name, ContainerID: p.ContainerID, Addr: p.IP})
	}
	return out
}

func (cc *chaosCluster) sortedPods() []*e2e.Pod {
	var out []*e2e.Pod
	for _, p := range cc.pods {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].String() < out[j].String() })
	return out
}

// step runs one step. A CNI call that fails is counted, not a violation:
// a router that is down or cut off may refuse; what it must never do is
// hand out an address twice.
func (cc *chaosCluster) step(i int, s op) {
	t, ctx := cc.t, cc.ctx
	var n *e2e.Node
	if s.Node < len(cc.c.Nodes) {
		n = cc.c.Nodes[s.Node]
	}
	octx, cancel := context.WithTimeout(ctx, chaosOpWait)
	defer cancel()
	switch s.Kind {
	case opAdd:
		p, err := n.AddPod(octx, s.Pod)
		if err != nil {
			cc.figures["add failed"]++
			t.Logf("step %d: %v", i, firstLine(err))
			return
		}
		cc.figures["add ok"]++
		cc.pods[s.Pod] = p
		// The pod talks to its gateway, so that its address is in the
		// bridge's neighbour table, where a router that lost its state
		// finds it again.
		pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
		if err := e2e.Ping(pctx, p.NS, p.Gateway); err != nil {
			t.Logf("step %d: %s cannot ping its gateway: %v", i, p, firstLine(err))
		}
		pcancel()
	case opBurst:
		cc.burst(i, octx, n, s.Pods)
	case opDel, opLose:
		p := cc.pods[s.Pod]
		if p == nil {
			return // its ADD failed
		}
		delete(cc.pods, s.Pod)
		if s.Kind == opLose {
			if err := p.Node.LosePod(octx, p); err != nil {
				t.Fatal(err)
			}
			return
		}
		if err := p.Node.RemovePod(octx, p); err != nil {
			// A router that is down keeps the address until GC does.
			cc.figures["del failed"]++
			t.Logf("step %d: %v", i, firstLine(err))
		}
	case opGC:
		if err := n.GC(octx, cc.podsOn(n)); err != nil {
			cc.figures["gc failed"]++
			t.Logf("step %d: %v", i, firstLine(err))
		}
	case opKill:
		cc.kill(n)
	case opRestart:
		cc.restart(s.Node)
	case opWipe:
		cc.kill(n)
		cc.wipeState(n)
		cc.restart(s.Node)
	case opIsolate:
		cc.cutLink[s.Node] = true
		if err := cc.c.SetUnderlayLink(n, false); err != nil {
			t.Fatal(err)
		}
	case opPartition:
		for _, a := range s.Group {
			for b := range cc.c.Nodes {
				if !slices.Contains(s.Group, b) {
					cc.drop(a, b)
					cc.drop(b, a)
				}
			}
		}
		cc.applyDrops()
	case opOneWay:
		cc.drop(s.Node, s.Other)
		cc.applyDrops()
	case opHeal:
		cc.heal()
	case opRemove, opNodeDel:
		peer := n.PeerName
		cc.machineGone(s.Node)
		if s.Kind == opNodeDel {
			if err := cc.kube.deleteNode(octx, n); err != nil {
				t.Fatal(err)
			}
			cc.removed = append(cc.removed, peer)
			return
		}
		// As an operator would: rmpeer once the issuer no longer sees the
		// peer alive (it refuses until then).
		by := cc.c.Nodes[s.Other]
		rctx, rcancel := context.WithTimeout(ctx, chaosHealWait)
		defer rcancel()
		var out []byte
		var err error
		pollCond(rctx, func() bool {
			out, err = by.Weft(rctx, "rmpeer", peer)
			return err == nil || !strings.Contains(string(out), "is alive")
		})
		t.Logf("step %d: weft rmpeer %s on %s: %s (%v)", i, peer, by.Name, strings.TrimSpace(string(out)), err)
		if err != nil {
			cc.figures["rmpeer failed"]++
			return
		}
		cc.removed = append(cc.removed, peer)
	case opReplace, opNodeAdd:
		cc.freshMachine(s.Node)
	case opNodeFlap:
		if err := cc.kube.deleteNode(octx, n); err != nil {
			t.Fatal(err)
		}
		seen := cc.kube.deleted(octx, n, n.PeerName)
		t.Logf("step %d: a router took up the deletion of %s's Node before it came back: %v", i, n.Name, seen)
		if err := cc.kube.createNode(octx, n); err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatalf("step %d: unknown kind %q", i, s.Kind)
	}
}

// burst runs CNI ADDs of names on n at once with a GC on n's local API
// (what weft-cni sends for CNI GC, without libcni's own clean-up of its
// cache) that lists only the pods n had before: a runtime's GC that raced
// the ADDs. The router must not free what the ADDs got.
func (cc *chaosCluster) burst(i int, ctx context.Context, n *e2e.Node, names []string) {
	var valid []api.Attachment
	for _, p := range cc.podsOn(n) {
		valid = append(valid, api.Attachment{ContainerID: p.ContainerID, IfName: p.IfName})
	}
	if valid == nil {
		valid = []api.Attachment{}
	}
	pods := make([]*e2e.Pod, len(names))
	errs := make([]error, len(names)+1)
	var wg sync.WaitGroup
	for k, name := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pods[k], errs[k] = n.AddPod(ctx, name)
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		var res *api.GCResponse
		res, errs[len(names)] = api.NewClient(n.Socket).GC(ctx, valid)
		if res != nil && len(res.Released) > 0 {
			cc.t.Logf("step %d: the racing GC on %s released %d addresses", i, n.Name, len(res.Released))
		}
	}()
	wg.Wait()
	for k, p := range pods {
		if errs[k] != nil {
			cc.figures["add failed"]++
			cc.t.Logf("step %d: %v", i, firstLine(errs[k]))
			continue
		}
		cc.figures["add ok"]++
		cc.pods[names[k]] = p
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_ = e2e.Ping(pctx, p.NS, p.Gateway)
		cancel()
	}
	if err := errs[len(names)]; err != nil {
		cc.figures["gc failed"]++
		cc.t.Logf("step %d: racing GC: %v", i, firstLine(err))
	}
}

func firstLine(err error) string {
	s, _, _ := strings.Cut(err.Error(), "\n")
	return s
}

func (cc *chaosCluster) podsOn(n *e2e.Node) []*e2e.Pod {
	var out []*e2e.Pod
	for _, p := range cc.sortedPods() {
		if p.Node == n {
			out = append(out, p)
		}
	}
	return out
}

func (cc *chaosCluster) kill(n *e2e.Node) {
	if r := n.Router(); r != nil {
		if err := r.Kill(); err != nil {
			cc.t.Fatal(err)
		}
	}
	cc.down[n.Index] = true
}

// restart starts a killed router again and gives it a while to be ready;
// a router cut off from its peers may not be, which is no violation.
func (cc *chaosCluster) restart(i int) {
	n := cc.c.Nodes[i]
	if err := n.Router().Restart(); err != nil {
		cc.t.Fatal(err)
	}
	delete(cc.down, i)
	rctx, cancel := context.WithTimeout(cc.ctx, chaosReadyWait)
	defer cancel()
	if err := n.WaitReady(rctx); err != nil {
		cc.t.Logf("%s not ready yet after restart: %v", n.Name, firstLine(err))
	}
}

func (cc *chaosCluster) wipeState(n *e2e.Node) {
	if err := os.RemoveAll(n.StateDir); err != nil {
		cc.t.Fatal(err)
	}
	if err := os.MkdirAll(n.StateDir, 0o700); err != nil {
		cc.t.Fatal(err)
	}
}

// machineGone ends node i as a machine that died: router killed, pods
// lost with it, its kernel state gone.
func (cc *chaosCluster) machineGone(i int) {
	n := cc.c.Nodes[i]
	cc.kill(n)
	delete(cc.down, i)
	cc.gone[i] = true
	for name, p := range cc.pods {
		if p.Node == n {
			if err := n.LosePod(cc.ctx, p); err != nil {
				cc.t.Fatal(err)
			}
			delete(cc.pods, name)
		}
	}
	if err := n.WipeMachine(cc.ctx); err != nil {
		cc.t.Fatal(err)
	}
	cc.wipeState(n)
}

// freshMachine brings node i back as a new machine: no state, a new peer
// name, its Node registered again under --kube.
func (cc *chaosCluster) freshMachine(i int) {
	n := cc.c.Nodes[i]
	cc.gen[i]++
	n.PeerName = chaosPeerName(cc.c.Run.Prefix(), n.Name, cc.gen[i])
	if cc.kube != nil {
		if err := cc.kube.createNode(cc.ctx, n); err != nil {
			cc.t.Fatal(err)
		}
	}
	delete(cc.gone, i)
	cc.restart(i)
}

// chaosPeerName is a locally administered MAC-style peer name for the
// gen'th machine of a node.
func chaosPeerName(prefix, node string, gen int) string {
	h := sha256.Sum256(fmt.Appendf(nil, "%s/%s/%d", prefix, node, gen))
	h[0] = h[0]&^0x01 | 0x02
	return net.HardwareAddr(h[:6]).String()
}

// drop makes node a drop what node b sends it.
func (cc *chaosCluster) drop(a, b int) {
	if cc.drops[a] == nil {
		cc.drops[a] = map[int]bool{}
	}
	cc.drops[a][b] = true
}

func (cc *chaosCluster) applyDrops() {
	for i, n := range cc.c.Nodes {
		var from []netip.Addr
		for j := range cc.c.Nodes {
			if cc.drops[i][j] {
				from = append(from, cc.c.Nodes[j].UnderlayIP)
			}
		}
		if err := n.DropFrom(cc.ctx, from); err != nil {
			cc.t.Fatal(err)
		}
	}
}

// heal removes every cut.
func (cc *chaosCluster) heal() {
	for i := range cc.cutLink {
		if err := cc.c.SetUnderlayLink(cc.c.Nodes[i], true); err != nil {
			cc.t.Fatal(err)
		}
	}
	clear(cc.cutLink)
	clear(cc.drops)
	cc.applyDrops()
}

// chaosReport is the part of a router's /report the check reads.
type chaosReport struct {
	Router struct {
		Name    string `json:"name"`
		Gateway string `json:"gateway"`
		Ready   bool   `json:"ready"`
		Mesh    struct {
			Peers []struct {
				Name  string `json:"name"`
				State string `json:"state"`
			} `json:"peers"`
		} `json:"mesh"`
	} `json:"router"`
	IPAM struct {
		Status  string   `json:"status"`
		Seed    string   `json:"seed"`
		Owned   []string `json:"owned"`
		Entries []struct {
			Token json.RawMessage `json:"token"`
			Peer  string          `json:"peer"`
		} `json:"entries"`
		Owners []struct {
			Peer string `json:"peer"`
		} `json:"owners"`
		Allocations []struct {
			ContainerID string `json:"containerID"`
			Address     string `json:"address"`
		} `json:"allocations"`
		Reclaims map[string][]string `json:"reclaims"`
	} `json:"ipam"`
}

func chaosReportOf(ctx context.Context, n *e2e.Node) (chaosReport, error) {
	var rep chaosReport
	data, err := n.HTTPGet(ctx, "/report")
	if err != nil {
		return rep, err
	}
	return rep, json.Unmarshal(data, &rep)
}

// liveNodes are the nodes whose machine is there.
func (cc *chaosCluster) liveNodes() []*e2e.Node {
	var out []*e2e.Node
	for i, n := range cc.c.Nodes {
		if !cc.gone[i] {
			out = append(out, n)
		}
	}
	return out
}

// check is a check point: heal, restart every killed router, wait for one
// converged ring (every router ready, every peer alive everywhere, the same
// ring entries in every view, no removed peer owning space), GC on every
// node, then checkCluster, full reachability and no panic.
func (cc *chaosCluster) check(step int) {
	t, ctx := cc.t, cc.ctx
	where := "the first check point"
	if step >= 0 {
		where = fmt.Sprintf("the check point at step %d", step)
	}
	cc.heal()
	for i := range cc.c.Nodes {
		if cc.down[i] {
			cc.restart(i)
		}
	}
	live := cc.liveNodes()
	hctx, cancel := context.WithTimeout(ctx, chaosHealWait)
	defer cancel()
	// Every router gets the whole wait: one that never gets ready does not
	// eat the others' time.
	notReady := map[string]string{}
	for _, n := range live {
		notReady[n.Name] = "not asked yet"
	}
	pollCond(hctx, func() bool {
		round := map[string]string{}
		for _, n := range live {
			rctx, rcancel := context.WithTimeout(hctx, 2*time.Second)
			if err := n.WaitReady(rctx); err != nil {
				round[n.Name] = firstLine(err)
			}
			rcancel()
		}
		if hctx.Err() == nil || len(round) == 0 { // a round cut short by the deadline says nothing
			notReady = round
		}
		return len(round) == 0
	})
	for _, n := range live {
		if msg, ok := notReady[n.Name]; ok {
			cc.fail(fmt.Sprintf("%s: %s not ready within %s of heal: %s", where, n.Name, chaosHealWait, msg))
		}
	}
	if len(cc.viol) > 0 {
		return
	}
	healStart := time.Now()
	var last string
	converged := pollCond(hctx, func() bool {
		ok, state := cc.converged(hctx, live)
		if hctx.Err() == nil {
			last = state
		}
		return ok
	})
	if !converged {
		cc.fail(fmt.Sprintf("%s: no convergence within %s of heal: %s", where, chaosHealWait, last))
	} else {
		t.Logf("%s: converged in %s", where, time.Since(healStart).Round(100*time.Millisecond))
	}
	res := cc.checkAfterGC(where, live)
	for _, v := range res.Violations {
		cc.fail(fmt.Sprintf("%s: %s", where, v))
	}
	cc.figures["re-claims kept by GC"] += res.Kept
	if res.Kept > 0 {
		t.Logf("%s: %d re-claimed addresses without a live pod kept by GC (their routers lost state and do not know every live pod)", where, res.Kept)
	}
	cc.reachability(where)
	for _, n := range cc.c.Nodes {
		if line := panicLine(n.RouterLog); line != "" {
			cc.fail(fmt.Sprintf("%s: %s's router log: %s", where, n.Name, line))
		}
	}
}

// checkAfterGC runs GC on every live router and checks the cluster. An
// address whose pod went less than the routers' --gc-grace ago is kept by
// GC on purpose, so a result whose only violations are leaks is checked
// again, with a new GC, until it is clean or the grace and a CNI call's
// wait have passed; any other violation is reported at once.
func (cc *chaosCluster) checkAfterGC(where string, live []*e2e.Node) checkResult {
	ctx := cc.ctx
	var res checkResult
	gctx, cancel := context.WithTimeout(ctx, chaosGCGrace+chaosOpWait)
	defer cancel()
	var failures []string
	pollCond(gctx, func() bool {
		failures = nil
		for _, n := range live {
			octx, ocancel := context.WithTimeout(ctx, chaosOpWait)
			err := n.GC(octx, cc.podsOn(n))
			ocancel()
			if err != nil {
				failures = append(failures, fmt.Sprintf("%s: GC on %s after heal: %v", where, n.Name, firstLine(err)))
			}
		}
		var routers []routerSeen
		for _, n := range live {
			rep, err := chaosReportOf(ctx, n)
			if err != nil {
				failures = append(failures, fmt.Sprintf("%s: report of %s: %v", where, n.Name, err))
				continue
			}
			routers = append(routers, seenOf(n, rep))
		}
		res = checkCluster(cc.livePods(), routers, cc.removed)
		if len(failures) > 0 {
			return true
		}
		for _, v := range res.Violations {
			if v.Kind != "leak" {
				return true
			}
		}
		return len(res.Violations) == 0
	})
	for _, f := range failures {
		cc.fail(f)
	}
	return res
}

// converged reports whether live's routers agree: all peers alive in every
// view, one seed, the same ring entries, no removed peer in the ring, no
// reclaim waiting.
func (cc *chaosCluster) converged(ctx context.Context, live []*e2e.Node) (bool, string) {
	names := map[string]bool{}
	for _, n := range live {
		names[n.PeerName] = true
	}
	var ring string
	var problems []string
	for k, n := range live {
		rep, err := chaosReportOf(ctx, n)
		if err != nil {
			return false, err.Error()
		}
		alive := 0
		for _, p := range rep.Router.Mesh.Peers {
			if names[p.Name] && (p.State == "alive" || p.Name == n.PeerName) {
				alive++
			}
		}
		if alive < len(live) {
			problems = append(problems, fmt.Sprintf("%s sees %d of %d peers alive (%+v)", n.Name, alive, len(live), rep.Router.Mesh.Peers))
		}
		var ents []string
		for _, e := range rep.IPAM.Entries {
			ents = append(ents, string(e.Token)+"="+e.Peer)
		}
		r := rep.IPAM.Seed + " " + strings.Join(ents, ",")
		if k == 0 {
			ring = r
		} else if r != ring {
			problems = append(problems, fmt.Sprintf("%s's ring differs from %s's: %s vs %s", n.Name, live[0].Name, r, ring))
		}
		for _, o := range rep.IPAM.Owners {
			if slices.Contains(cc.removed, o.Peer) {
				problems = append(problems, fmt.Sprintf("removed peer %s still owns space in %s's ring (reclaims waiting: %v)", o.Peer, n.Name, rep.IPAM.Reclaims))
			}
		}
		if len(rep.IPAM.Reclaims) > 0 {
			problems = append(problems, fmt.Sprintf("%s still waits on reclaims %v", n.Name, rep.IPAM.Reclaims))
		}
	}
	return len(problems) == 0, strings.Join(problems, "; ")
}

func seenOf(n *e2e.Node, rep chaosReport) routerSeen {
	r := routerSeen{Node: n.Name, Peer: rep.Router.Name, Seed: rep.IPAM.Seed}
	r.Gateway, _ = netip.ParseAddr(rep.Router.Gateway)
	for _, o := range rep.IPAM.Owned {
		if p, err := netip.ParsePrefix(o); err == nil {
			r.Owned = append(r.Owned, p)
		}
	}
	for _, o := range rep.IPAM.Owners {
		r.Owners = append(r.Owners, o.Peer)
	}
	for _, a := range rep.IPAM.Allocations {
		addr, err := netip.ParseAddr(a.Address)
		if err != nil {
			if p, perr := netip.ParsePrefix(a.Address); perr == nil {
				addr = p.Addr()
			}
		}
		r.Allocs = append(r.Allocs, allocSeen{ContainerID: a.ContainerID, Addr: addr, Reclaimed: strings.Contains(a.ContainerID, "reclaimed_")})
	}
	return r
}

// reachability pings every live pod from every other until all answer or
// chaosPingWait has passed, retrying only the pairs that failed.
func (cc *chaosCluster) reachability(where string) {
	pods := cc.sortedPods()
	if len(pods) < 2 {
		return
	}
	pctx, cancel := context.WithTimeout(cc.ctx, chaosPingWait)
	defer cancel()
	m := e2e.PingMatrix(pctx, pods)
	cc.figures["pings"] += len(pods) * (len(pods) - 1)
	if len(m.Problems) > 0 {
		cc.fail(fmt.Sprintf("%s: ping matrix: %v", where, m.Problems))
		return
	}
	type pair struct{ i, j int }
	var failing []pair
	for i := range pods {
		for j := range pods {
			if i != j && !m.OK[i][j] {
				failing = append(failing, pair{i, j})
			}
		}
	}
	for len(failing) > 0 && pctx.Err() == nil {
		var mu sync.Mutex
		var still []pair
		var wg sync.WaitGroup
		sem := make(chan struct{}, 8)
		for _, p := range failing {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				defer func() { <-sem }()
				c, cancel := context.WithTimeout(pctx, 3*time.Second)
				defer cancel()
				if e2e.Ping(c, pods[p.i].NS, pods[p.j].IP) != nil {
					mu.Lock()
					still = append(still, p)
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		failing = still
	}
	if len(failing) > 0 {
		var s []string
		for _, p := range failing {
			s = append(s, fmt.Sprintf("%s->%s(%s)", pods[p.i], pods[p.j], pods[p.j].IP))
		}
		cc.fail(fmt.Sprintf("%s: %d of %d pairs unreachable after %s: %s", where, len(failing), len(pods)*(len(pods)-1), chaosPingWait, strings.Join(s, " ")))
	}
}

// pollCond polls cond every 250ms until it holds or ctx ends.
func pollCond(ctx context.Context, cond func() bool) bool {
	for {
		if cond() {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// readFile is the file's content, or "" when it cannot be read.
func readFile(path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return string(data)
}
