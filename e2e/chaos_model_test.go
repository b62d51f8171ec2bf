package e2e_test

// The pure half of the chaos runs (chaos_linux_test.go): the schedule, made
// from a seed alone, and the checker of what the routers and pods show.
// Both are tested without root in chaos_check_test.go.

import (
	"errors"
	"fmt"
	"math/rand"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strings"
)

// opKind is one kind of step of a chaos schedule.
type opKind string

const (
	opAdd       opKind = "add"       // CNI ADD of a new pod on Node
	opDel       opKind = "del"       // CNI DEL of Pod, its namespace removed
	opLose      opKind = "lose"      // Pod's namespace removed without DEL (a runtime that lost it)
	opGC        opKind = "gc"        // CNI GC on Node with the pods it still has
	opBurst     opKind = "burst"     // ADDs of Pods on Node at once, racing a GC that lists only the pods from before
	opKill      opKind = "kill"      // kill -9 of Node's router
	opRestart   opKind = "restart"   // start Node's killed router again, same state
	opWipe      opKind = "wipe"      // kill -9, state directory wiped, started again (same name, pods kept)
	opIsolate   opKind = "isolate"   // Node's underlay link down
	opPartition opKind = "partition" // Group and the rest drop each other's packets
	opOneWay    opKind = "oneway"    // Node drops what Other sends it; Other still hears Node
	opHeal      opKind = "heal"      // every cut removed
	opRemove    opKind = "remove"    // Node's machine gone for good (router and pods); weft rmpeer on Other
	opReplace   opKind = "replace"   // a fresh machine for Node: no state, a new peer name
	opNodeDel   opKind = "node-del"  // --kube: Node's machine gone, its Node object deleted
	opNodeAdd   opKind = "node-add"  // --kube: a fresh machine registers Node again, new peer name
	opNodeFlap  opKind = "node-flap" // --kube: Node object deleted while its router runs, then registered again
	opCheck     opKind = "check"     // heal all, wait for convergence, GC, check everything
)

// faults are the kinds that inject a fault (counted in the figures).
var faults = map[opKind]bool{
	opLose: true, opKill: true, opWipe: true, opIsolate: true, opPartition: true, opOneWay: true,
	opRemove: true, opNodeDel: true, opNodeFlap: true,
}

// op is one step. Node and Other index the cluster's nodes.
type op struct {
	Kind  opKind
	Node  int
	Other int
	Pod   string   // opAdd: the new pod's name; opDel, opLose: the pod
	Pods  []string // opBurst: the new pods
	Group []int    // opPartition: one side
}

func (o op) String() string {
	switch o.Kind {
	case opAdd:
		return fmt.Sprintf("add %s on n%d", o.Pod, o.Node)
	case opDel, opLose:
		return fmt.Sprintf("%s %s", o.Kind, o.Pod)
	case opOneWay:
		return fmt.Sprintf("oneway n%d->n%d dropped", o.Other, o.Node)
	case opPartition:
		return fmt.Sprintf("partition %v | rest", o.Group)
	case opRemove:
		return fmt.Sprintf("remove n%d (rmpeer on n%d)", o.Node, o.Other)
	case opBurst:
		return fmt.Sprintf("burst %s on n%d racing gc", strings.Join(o.Pods, ","), o.Node)
	case opHeal, opCheck:
		return string(o.Kind)
	}
	return fmt.Sprintf("%s n%d", o.Kind, o.Node)
}

// scheduleOpts shape a schedule.
type scheduleOpts struct {
	Nodes      int
	Ops        int // steps, checks not counted
	CheckEvery int // a check after every so many steps, and one at the end
	Kube       bool
	MaxPods    int // live pods in the whole cluster
}

// nodeState is what the schedule's model knows of a node.
type nodeState int

const (
	nodeUp nodeState = iota
	nodeDown
	nodeGone
)

// schedule makes the steps of a chaos run from seed alone: the model
// assumes every step does what it says (an ADD that fails at run time makes
// a later DEL of that pod a no-op), so one seed is one schedule, whatever
// the routers answer.
func schedule(seed int64, o scheduleOpts) []op {
	rng := rand.New(rand.NewSource(seed))
	state := make([]nodeState, o.Nodes)
	pods := map[string]int{} // live pod -> node
	nextPod := 0
	var out []op
	count := func(s nodeState) int {
		n := 0
		for _, st := range state {
			if st == s {
				n++
			}
		}
		return n
	}
	pick := func(ok func(i int) bool) (int, bool) {
		var c []int
		for i := range state {
			if ok(i) {
				c = append(c, i)
			}
		}
		if len(c) == 0 {
			return 0, false
		}
		return c[rng.Intn(len(c))], true
	}
	podNames := func() []string {
		names := make([]string, 0, len(pods))
		for p := range pods {
			names = append(names, p)
		}
		sort.Strings(names)
		return names
	}
	dropPodsOf := func(n int) {
		for p, at := range pods {
			if at == n {
				delete(pods, p)
			}
		}
	}
	up := func(i int) bool { return state[i] == nodeUp }
	// Half the pods go to the first two nodes, so that they run out of
	// their share and space moves by donation.
	pickPodNode := func() (int, bool) {
		if rng.Intn(2) == 0 {
			return pick(func(i int) bool { return i < 2 && state[i] != nodeGone })
		}
		return pick(func(i int) bool { return state[i] != nodeGone })
	}
	notGone := func(i int) bool { return state[i] != nodeGone }
	// Weights of the kinds; one that does not fit the model is redrawn.
	type weighted struct {
		k opKind
		w int
	}
	kinds := []weighted{
		{opAdd, 30}, {opDel, 12}, {opLose, 4}, {opGC, 6}, {opBurst, 4}, {opKill, 7}, {opRestart, 9}, {opWipe, 4},
		{opIsolate, 4}, {opPartition, 4}, {opOneWay, 4}, {opHeal, 5},
	}
	if o.Kube {
		kinds = append(kinds, weighted{opNodeDel, 3}, weighted{opNodeAdd, 6}, weighted{opNodeFlap, 3})
	} else {
		kinds = append(kinds, weighted{opRemove, 3}, weighted{opReplace, 6})
	}
	total := 0
	for _, k := range kinds {
		total += k.w
	}
	steps := 0
	for steps < o.Ops {
		x := rng.Intn(total)
		var k opKind
		for _, c := range kinds {
			if x < c.w {
				k = c.k
				break
			}
			x -= c.w
		}
		s := op{Kind: k}
		ok := true
		switch k {
		case opAdd:
			s.Node, ok = pickPodNode()
			ok = ok && len(pods) < o.MaxPods
			if ok {
				s.Pod = fmt.Sprintf("p%d", nextPod)
				nextPod++
				pods[s.Pod] = s.Node
			}
		case opBurst:
			s.Node, ok = pickPodNode()
			ok = ok && len(pods)+3 <= o.MaxPods
			for j := 0; ok && j < 3; j++ {
				name := fmt.Sprintf("p%d", nextPod)
				nextPod++
				s.Pods = append(s.Pods, name)
				pods[name] = s.Node
			}
		case opDel, opLose:
			names := podNames()
			if ok = len(names) > 0; ok {
				s.Pod = names[rng.Intn(len(names))]
				s.Node = pods[s.Pod]
				delete(pods, s.Pod)
			}
		case opGC:
			s.Node, ok = pick(up)
		case opKill:
			// Keep a majority of the machines' routers running.
			s.Node, ok = pick(up)
			ok = ok && count(nodeUp) > o.Nodes/2+1
			if ok {
				state[s.Node] = nodeDown
			}
		case opRestart:
			if s.Node, ok = pick(func(i int) bool { return state[i] == nodeDown }); ok {
				state[s.Node] = nodeUp
			}
		case opWipe:
			if s.Node, ok = pick(notGone); ok {
				state[s.Node] = nodeUp
			}
		case opIsolate:
			s.Node, ok = pick(notGone)
		case opOneWay:
			s.Node, ok = pick(notGone)
			if ok {
				s.Other, ok = pick(func(i int) bool { return notGone(i) && i != s.Node })
			}
		case opPartition:
			var live []int
			for i := range state {
				if notGone(i) {
					live = append(live, i)
				}
			}
			if ok = len(live) >= 2; ok {
				rng.Shuffle(len(live), func(i, j int) { live[i], live[j] = live[j], live[i] })
				s.Group = live[:1+rng.Intn(len(live)-1)]
				slices.Sort(s.Group)
			}
		case opHeal:
		case opRemove, opNodeDel:
			// One machine gone at a time, and never below three.
			ok = count(nodeGone) == 0 && o.Nodes-count(nodeGone) > 3
			if ok {
				s.Node, ok = pick(notGone)
			}
			if ok && k == opRemove {
				s.Other, ok = pick(func(i int) bool { return up(i) && i != s.Node })
			}
			if ok {
				state[s.Node] = nodeGone
				dropPodsOf(s.Node)
			}
		case opReplace, opNodeAdd:
			if s.Node, ok = pick(func(i int) bool { return state[i] == nodeGone }); ok {
				state[s.Node] = nodeUp
			}
		case opNodeFlap:
			s.Node, ok = pick(up)
		}
		if !ok {
			continue
		}
		out = append(out, s)
		steps++
		if steps%o.CheckEvery == 0 || steps == o.Ops {
			out = append(out, op{Kind: opCheck})
			for i := range state {
				if state[i] == nodeDown {
					state[i] = nodeUp // a check restarts every killed router
				}
			}
		}
	}
	return out
}

// scheduleText is a schedule one step a line, numbered, for the log.
func scheduleText(ops []op) string {
	var b strings.Builder
	for i, s := range ops {
		fmt.Fprintf(&b, "%3d %s\n", i, s)
	}
	return b.String()
}

// The checker's input: what the test knows of its live pods and what each
// running router reports.

// podSeen is a live pod: one the runtime attached and still has.
type podSeen struct {
	Name        string // e.g. "n1/p7"
	Node        string
	ContainerID string
	Addr        netip.Addr
}

// allocSeen is one allocation a router reports.
type allocSeen struct {
	ContainerID string
	Addr        netip.Addr
	Reclaimed   bool // held as re-claimed from the bridge after lost state
}

// routerSeen is one running router's /report.
type routerSeen struct {
	Node    string
	Peer    string
	Seed    string
	Gateway netip.Addr
	Owned   []netip.Prefix
	Owners  []string // peers that own space in its view of the ring
	Allocs  []allocSeen
}

// violation is a broken promise, by kind: duplicate, split-ring, overlap,
// foreign, unaccounted, leak, removed-owner.
type violation struct {
	Kind   string
	Detail string
}

func (v violation) String() string { return v.Kind + ": " + v.Detail }

// checkResult is what one check found.
type checkResult struct {
	Violations []violation
	// Kept counts re-claimed allocations with no live pod that GC keeps on
	// purpose: the router has live pods it does not know (its state was
	// lost), so it cannot tell which re-claimed address is theirs, and
	// keeping an address is safe where freeing it is not.
	Kept int
}

// checkPods is the check after every step: no address held by two live
// pods.
func checkPods(pods []podSeen) []violation {
	var out []violation
	holder := map[netip.Addr]string{}
	for _, p := range pods {
		if !p.Addr.IsValid() {
			continue
		}
		if h, dup := holder[p.Addr]; dup {
			out = append(out, violation{"duplicate", fmt.Sprintf("%s is held by the live pods %s and %s", p.Addr, h, p.Name)})
			continue
		}
		holder[p.Addr] = p.Name
	}
	return out
}

// checkCluster is the check of a check point, after heal, convergence and
// GC on every node: live pods and every router's gateway unique; one ring
// (one seed); no address owned by two routers; every allocation inside its
// router's own ranges; every live pod's address held by its node's router;
// no allocation without a live pod (but see checkResult.Kept); removed
// peers own nothing.
func checkCluster(pods []podSeen, routers []routerSeen, removed []string) checkResult {
	var res checkResult
	add := func(kind, format string, args ...any) {
		res.Violations = append(res.Violations, violation{kind, fmt.Sprintf(format, args...)})
	}
	all := append([]podSeen(nil), pods...)
	for _, r := range routers {
		if r.Gateway.IsValid() {
			all = append(all, podSeen{Name: r.Node + "'s gateway", Node: r.Node, Addr: r.Gateway})
		}
	}
	res.Violations = append(res.Violations, checkPods(all)...)

	seeds := map[string][]string{}
	for _, r := range routers {
		seeds[r.Seed] = append(seeds[r.Seed], r.Node)
	}
	if len(seeds) > 1 {
		var parts []string
		for s, ns := range seeds {
			parts = append(parts, fmt.Sprintf("seed %s on %v", s, ns))
		}
		sort.Strings(parts)
		add("split-ring", "%s", strings.Join(parts, "; "))
	}
	for i, a := range routers {
		for _, b := range routers[i+1:] {
			for _, pa := range a.Owned {
				for _, pb := range b.Owned {
					if pa.Overlaps(pb) {
						add("overlap", "%s owns %s and %s owns %s", a.Node, pa, b.Node, pb)
					}
				}
			}
		}
	}
	byAddr := map[netip.Addr]string{}
	for _, r := range routers {
		for _, al := range r.Allocs {
			if h, dup := byAddr[al.Addr]; dup {
				add("duplicate", "%s is allocated by %s and by %s", al.Addr, h, r.Node)
			}
			byAddr[al.Addr] = r.Node
			in := false
			for _, p := range r.Owned {
				in = in || p.Contains(al.Addr)
			}
			if !in {
				add("foreign", "%s holds %s (%s) outside its own ranges %v", r.Node, al.Addr, al.ContainerID, r.Owned)
			}
		}
	}
	for _, r := range routers {
		mine := map[netip.Addr]podSeen{}
		byID := map[string]bool{}
		for _, p := range pods {
			if p.Node == r.Node {
				mine[p.Addr] = p
			}
		}
		for _, al := range r.Allocs {
			byID[al.ContainerID] = true
		}
		unknown := false
		for _, p := range mine {
			unknown = unknown || !byID[p.ContainerID]
		}
		held := map[netip.Addr]bool{}
		for _, al := range r.Allocs {
			held[al.Addr] = true
			p, ok := mine[al.Addr]
			switch {
			case ok && (al.Reclaimed || al.ContainerID == p.ContainerID):
			case ok:
				add("leak", "%s holds %s for %s, but the live pod %s has it", r.Node, al.Addr, al.ContainerID, p.Name)
			case al.Reclaimed && unknown:
				res.Kept++
			default:
				add("leak", "%s holds %s for %s after GC, and no live pod has it", r.Node, al.Addr, al.ContainerID)
			}
		}
		for _, p := range mine {
			if !held[p.Addr] {
				add("unaccounted", "the live pod %s has %s, which its router does not hold (it may hand it out again)", p.Name, p.Addr)
			}
		}
	}
	for _, r := range routers {
		for _, o := range r.Owners {
			if slices.Contains(removed, o) {
				add("removed-owner", "in %s's ring the removed peer %s still owns space", r.Node, o)
			}
		}
	}
	sort.SliceStable(res.Violations, func(i, j int) bool { return res.Violations[i].Kind < res.Violations[j].Kind })
	return res
}

// panicLine returns the first line of a log that shows a Go panic or fatal
// runtime error, or "".
func panicLine(path string) string {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return ""
	}
	if err != nil {
		return "unreadable: " + err.Error()
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "panic: ") || strings.HasPrefix(line, "fatal error: ") || strings.Contains(line, "[recovered]") {
			return line
		}
	}
	return ""
}
