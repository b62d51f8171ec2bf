package e2e_test

import (
	"net/netip"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// A clean cluster: three pods on two routers, each allocation inside its
// router's range, one ring.
func cleanCluster() ([]podSeen, []routerSeen) {
	a := netip.MustParseAddr
	pods := []podSeen{
		{Name: "n0/p0", Node: "n0", ContainerID: "c0", Addr: a("10.32.0.2")},
		{Name: "n0/p1", Node: "n0", ContainerID: "c1", Addr: a("10.32.0.3")},
		{Name: "n1/p2", Node: "n1", ContainerID: "c2", Addr: a("10.32.0.130")},
	}
	routers := []routerSeen{
		{Node: "n0", Peer: "x0", Seed: "s", Gateway: a("10.32.0.1"), Owned: []netip.Prefix{netip.MustParsePrefix("10.32.0.0/25")},
			Owners: []string{"x0", "x1"}, Allocs: []allocSeen{{"c0", a("10.32.0.2"), false}, {"c1", a("10.32.0.3"), false}}},
		{Node: "n1", Peer: "x1", Seed: "s", Gateway: a("10.32.0.129"), Owned: []netip.Prefix{netip.MustParsePrefix("10.32.0.128/25")},
			Owners: []string{"x0", "x1"}, Allocs: []allocSeen{{"c2", a("10.32.0.130"), false}}},
	}
	return pods, routers
}

func kinds(vs []violation) []string {
	var out []string
	for _, v := range vs {
		out = append(out, v.Kind)
	}
	return out
}

// TestChaosCheckerCatches plants one broken promise at a time into a clean
// cluster and wants the checker to name it; the clean cluster passes.
func TestChaosCheckerCatches(t *testing.T) {
	a := netip.MustParseAddr
	if p, r := cleanCluster(); len(checkCluster(p, r, nil).Violations) != 0 || checkCluster(p, r, nil).Kept != 0 {
		res := checkCluster(p, r, nil)
		t.Fatalf("clean cluster: %v (kept %d)", res.Violations, res.Kept)
	}
	cases := []struct {
		name    string
		plant   func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string)
		want    string
		wantAll []string // when set, exactly these kinds
	}{
		{"two live pods, one address", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			p[2].Addr = p[0].Addr // n1's pod got n0's address
			return p, r, nil
		}, "duplicate", nil},
		{"a pod with a router's gateway", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			p[2].Addr = a("10.32.0.1")
			r[1].Allocs[0].Addr = p[2].Addr
			return p, r, nil
		}, "duplicate", nil},
		{"two routers allocate one address", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			r[1].Allocs = append(r[1].Allocs, allocSeen{"c9", a("10.32.0.2"), false})
			return p, r, nil
		}, "duplicate", nil},
		{"two seeds", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			r[1].Seed = "other"
			return p, r, nil
		}, "split-ring", []string{"split-ring"}},
		{"a range owned twice", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			r[1].Owned = append(r[1].Owned, netip.MustParsePrefix("10.32.0.64/26"))
			return p, r, nil
		}, "overlap", []string{"overlap"}},
		{"an allocation outside the router's ranges", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			p[2].Addr = a("10.32.0.100")
			r[1].Allocs[0].Addr = p[2].Addr
			return p, r, nil
		}, "foreign", []string{"foreign"}},
		{"an allocation no pod has", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			r[0].Allocs = append(r[0].Allocs, allocSeen{"gone", a("10.32.0.9"), false})
			return p, r, nil
		}, "leak", []string{"leak"}},
		{"a re-claim no pod has while every pod is known", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			r[0].Allocs = append(r[0].Allocs, allocSeen{"_reclaimed_x", a("10.32.0.9"), true})
			return p, r, nil
		}, "leak", []string{"leak"}},
		{"a live pod its router forgot", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			r[0].Allocs = r[0].Allocs[:1]
			return p, r, nil
		}, "unaccounted", []string{"unaccounted"}},
		{"a removed peer still owns", func(p []podSeen, r []routerSeen) ([]podSeen, []routerSeen, []string) {
			r[0].Owners = append(r[0].Owners, "dead")
			return p, r, []string{"dead"}
		}, "removed-owner", []string{"removed-owner"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, r := cleanCluster()
			p, r, removed := c.plant(p, r)
			res := checkCluster(p, r, removed)
			got := kinds(res.Violations)
			if !slices.Contains(got, c.want) {
				t.Fatalf("planted %s, checker found %v", c.want, res.Violations)
			}
			if c.wantAll != nil && !slices.Equal(got, c.wantAll) {
				t.Fatalf("planted %s, checker found %v, want exactly %v", c.want, res.Violations, c.wantAll)
			}
			for _, v := range res.Violations {
				if v.Detail == "" {
					t.Errorf("violation without detail: %+v", v)
				}
			}
		})
	}
}

// TestChaosCheckerKeptReclaims: after lost state a router holds its live
// pods' addresses under re-claimed keys and does not know their
// attachments; GC then keeps every re-claim (it cannot tell whose it is).
// That is counted apart, not a violation; the same re-claim once every pod
// is known is a leak (see TestChaosCheckerCatches).
func TestChaosCheckerKeptReclaims(t *testing.T) {
	a := netip.MustParseAddr
	p, r := cleanCluster()
	r[0].Allocs = []allocSeen{{"_reclaimed_2", a("10.32.0.2"), true}, {"_reclaimed_3", a("10.32.0.3"), true}, {"_reclaimed_9", a("10.32.0.9"), true}}
	res := checkCluster(p, r, nil)
	if len(res.Violations) != 0 || res.Kept != 1 {
		t.Fatalf("re-claims after lost state: %v, kept %d; want none, kept 1", res.Violations, res.Kept)
	}
}

// TestChaosCheckPods: the check after every step finds two live pods with
// one address.
func TestChaosCheckPods(t *testing.T) {
	p, _ := cleanCluster()
	if v := checkPods(p); len(v) != 0 {
		t.Fatal(v)
	}
	p[1].Addr = p[2].Addr
	v := checkPods(p)
	if len(v) != 1 || v[0].Kind != "duplicate" || !strings.Contains(v[0].Detail, "n0/p1") || !strings.Contains(v[0].Detail, "n1/p2") {
		t.Fatalf("planted duplicate: %v", v)
	}
}

// TestChaosSchedule: a seed is one schedule; it keeps to its model (pods
// deleted only after they were added, at most one machine gone, never
// fewer than a majority of routers up, checks at the given interval and at
// the end), and the kinds the two runs need all occur over some seeds.
func TestChaosSchedule(t *testing.T) {
	for _, kube := range []bool{false, true} {
		o := scheduleOpts{Nodes: 5, Ops: 200, CheckEvery: 10, Kube: kube, MaxPods: 30}
		if a, b := schedule(7, o), schedule(7, o); !reflect.DeepEqual(a, b) {
			t.Fatalf("kube=%v: seed 7 gave two schedules", kube)
		}
		if reflect.DeepEqual(schedule(7, o), schedule(8, o)) {
			t.Fatalf("kube=%v: seeds 7 and 8 gave one schedule", kube)
		}
		seen := map[opKind]int{}
		for seed := int64(1); seed <= 20; seed++ {
			ops := schedule(seed, o)
			live := map[string]bool{}
			gone := map[int]bool{}
			down := map[int]bool{}
			steps := 0
			for i, s := range ops {
				seen[s.Kind]++
				switch s.Kind {
				case opCheck:
					if steps%o.CheckEvery != 0 && steps != o.Ops {
						t.Fatalf("seed %d: a check after %d steps", seed, steps)
					}
					clear(down)
					continue
				case opAdd:
					live[s.Pod] = true
				case opBurst:
					for _, p := range s.Pods {
						live[p] = true
					}
				case opDel, opLose:
					if !live[s.Pod] {
						t.Fatalf("seed %d step %d: %s of a pod never added", seed, i, s)
					}
					delete(live, s.Pod)
				case opKill:
					down[s.Node] = true
					if 5-len(down)-len(gone) < 3 {
						t.Fatalf("seed %d step %d: %s leaves fewer than 3 routers", seed, i, s)
					}
				case opRemove, opNodeDel:
					if len(gone) > 0 {
						t.Fatalf("seed %d step %d: a second machine gone", seed, i)
					}
					if s.Kind == opRemove && (s.Other == s.Node || down[s.Other]) {
						t.Fatalf("seed %d step %d: %s from a router that is not running", seed, i, s)
					}
					gone[s.Node] = true
					delete(down, s.Node)
				case opReplace, opNodeAdd:
					if !gone[s.Node] {
						t.Fatalf("seed %d step %d: %s of a machine that is there", seed, i, s)
					}
					delete(gone, s.Node)
				case opRestart:
					delete(down, s.Node)
				case opWipe:
					delete(down, s.Node)
				}
				steps++
			}
			if steps != o.Ops || ops[len(ops)-1].Kind != opCheck {
				t.Fatalf("seed %d: %d steps, last %s", seed, steps, ops[len(ops)-1])
			}
		}
		want := []opKind{opAdd, opBurst, opDel, opLose, opGC, opKill, opRestart, opWipe, opIsolate, opPartition, opOneWay, opHeal}
		if kube {
			want = append(want, opNodeDel, opNodeAdd, opNodeFlap)
		} else {
			want = append(want, opRemove, opReplace)
		}
		for _, k := range want {
			if seen[k] == 0 {
				t.Errorf("kube=%v: no %s in 20 schedules", kube, k)
			}
		}
	}
}

// TestChaosPanicLine: the panic check finds a Go panic and a fatal runtime
// error in a router log, and nothing in a clean one or a missing one.
func TestChaosPanicLine(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := dir + "/" + name
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	clean := write("clean", "time=x level=INFO msg=\"ready: pods can be attached\"\ntime=y level=WARN msg=\"a panic-free line\"\n")
	if l := panicLine(clean); l != "" {
		t.Errorf("clean log: %q", l)
	}
	if l := panicLine(dir + "/missing"); l != "" {
		t.Errorf("missing log: %q", l)
	}
	for _, text := range []string{
		"time=x level=INFO msg=ok\npanic: runtime error: index out of range [3] with length 3\n\ngoroutine 1 [running]:\n",
		"fatal error: concurrent map writes\n",
	} {
		if l := panicLine(write("bad", text)); l == "" {
			t.Errorf("no panic found in %q", text)
		}
	}
}
