package kube

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
)

// reclaimer sets up a router that reclaims through rec.
func reclaimer(rec *recorder, mod ...func(*Config)) func(*Config) {
	return func(c *Config) {
		c.Reclaim = rec.reclaim
		c.Resync = time.Hour // passes only on deletions and when the test asks
		for _, m := range mod {
			m(c)
		}
	}
}

func deleteNode(t *testing.T, f *casFake, name string) {
	t.Helper()
	if err := f.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// registered waits until k has registered its peer.
func registered(t *testing.T, k *testKube) {
	t.Helper()
	eventually(t, "registration", func() bool {
		k.mu.Lock()
		defer k.mu.Unlock()
		return k.registered
	})
}

// TestReclaimRace: a Node is deleted; the routers of the other nodes race
// on the same API server (the fake with compare-and-swap); exactly one
// reclaims, the peer's entry goes, the reclaim is noted. Repeated to vary
// the interleavings, with frequent passes besides the deletion's.
func TestReclaimRace(t *testing.T) {
	for round := range 8 {
		f := newCASFake(node("a", internal("10.0.0.1")), node("b", internal("10.0.0.2")),
			node("c", internal("10.0.0.3")), node("d", internal("10.0.0.4")))
		f.putConfigMap(t, map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{"pc": {Node: "c"}})})
		var calls atomic.Int32
		var winners sync.Map
		var ks []*testKube
		var stops []func()
		// Every router's marker write waits until all three have read
		// the ConfigMap and try to write: a real race, every round.
		bar := NewUpdateBarrier(f, 3, func(cm *corev1.ConfigMap) bool {
			return strings.Contains(cm.Data[KeyPeers], `"reclaimer"`)
		})
		for _, n := range []string{"a", "b", "d"} {
			k := newTestKube(t, f, n, "p"+n, func(c *Config) {
				c.Client = bar
				c.Resync = 3 * time.Millisecond
				c.Reclaim = func(_ context.Context, peer string) error {
					if peer != "pc" {
						t.Errorf("p%s reclaims %s", n, peer)
					}
					calls.Add(1)
					winners.Store("p"+n, true)
					return nil
				}
			})
			ks = append(ks, k)
			stops = append(stops, k.run(t))
			registered(t, k)
		}
		deleteNode(t, f, "c")
		eventually(t, "pc reclaimed", func() bool {
			data := f.configMap(t)
			_, has := peersOf(t, data)["pc"]
			return !has && reclaimedOf(t, data)["pc"].By != ""
		})
		var wg sync.WaitGroup
		for _, k := range ks { // one more full pass each, in parallel
			wg.Go(func() { k.reconcile(context.Background()) })
		}
		wg.Wait()
		if n := calls.Load(); n != 1 {
			t.Fatalf("round %d: pc reclaimed %d times, want exactly once", round, n)
		}
		by := reclaimedOf(t, f.configMap(t))["pc"].By
		if _, ok := winners.Load(by); !ok {
			t.Errorf("round %d: the note names %s, which did not reclaim", round, by)
		}
		for _, k := range ks {
			if k.cfg.PeerName == by {
				if k.log.count("node c deleted: reclaiming peer pc's ranges") != 1 || k.log.count("node c deleted: peer pc reclaimed") != 1 {
					t.Errorf("the winner's log:\n%s", k.log)
				}
				if v := counterValue(t, k.metrics.reclaims); v != 1 {
					t.Errorf("winner's reclaims metric = %v", v)
				}
			} else if k.log.count("reclaiming peer pc's ranges") != 0 {
				t.Errorf("%s also claims to reclaim:\n%s", k.cfg.PeerName, k.log)
			}
		}
		for _, stop := range stops {
			stop()
		}
		var conflicts float64
		losers := 0
		for _, k := range ks {
			conflicts += counterValue(t, k.metrics.conflicts)
			losers += k.log.count("is reclaiming pc")
		}
		// The losers' writes conflict; after reading again they see
		// the winner's marker (and say so), or its entry already gone.
		if conflicts != 2 || losers > 2 {
			t.Errorf("round %d: %v conflicts and %d loser lines, want 2 and at most 2", round, conflicts, losers)
		}
	}
}

// TestReclaimLoser: between this router's read and its marker write,
// another live router marks the peer; the write conflicts, and after
// reading again this router leaves the reclaim to the other and says so.
func TestReclaimLoser(t *testing.T) {
	f := newCASFake(node("a", internal("10.0.0.1")), node("b", internal("10.0.0.2")))
	f.putConfigMap(t, map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{
		"pa": {Node: "a", Nickname: "a"}, "pb": {Node: "b"}, "pc": {Node: "c"},
	})})
	f.beforeUpdate = func(tr k8stesting.ObjectTracker, _ *corev1.ConfigMap) {
		cur, _ := tr.Get(cmGVR, DefaultNamespace, DefaultConfigMapName)
		c := cur.(*corev1.ConfigMap).DeepCopy()
		c.Data[KeyPeers] = mustJSON(t, map[string]PeerRecord{
			"pa": {Node: "a", Nickname: "a"}, "pb": {Node: "b"}, "pc": {Node: "c", Reclaimer: "pb"},
		})
		f.bumpRVLocked(tr, c)
	}
	rec := &recorder{}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec))
	k.run(t)
	registered(t, k)
	k.reconcile(context.Background())
	if got := rec.get(); len(got) != 0 {
		t.Errorf("the loser reclaimed %v", got)
	}
	if k.log.count("node c deleted: peer pb is reclaiming pc") != 1 {
		t.Errorf("log:\n%s", k.log)
	}
	if r := peersOf(t, f.configMap(t))["pc"]; r.Reclaimer != "pb" {
		t.Errorf("pc's marker %+v", r)
	}
}

// TestReclaimStaleMarker: pc's reclaimer pb is gone too (its Node was
// deleted). pb is reclaimed first, then pc's marker is stale and pa takes
// the reclaim over: the allocator's order (the dead reclaimer, then its
// peer).
func TestReclaimStaleMarker(t *testing.T) {
	f := newCASFake(node("a", internal("10.0.0.1")))
	f.putConfigMap(t, map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{
		"pa": {Node: "a", Nickname: "a"}, "pb": {Node: "b"}, "pc": {Node: "c", Reclaimer: "pb"},
	})})
	rec := &recorder{}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec))
	k.run(t)
	registered(t, k)
	k.reconcile(context.Background())
	if got := rec.get(); !slices.Equal(got, []string{"pb", "pc"}) {
		t.Errorf("reclaimed %v, want [pb pc]", got)
	}
	data := f.configMap(t)
	if peers := peersOf(t, data); len(peers) != 1 {
		t.Errorf("peers left: %+v", peers)
	}
	done := reclaimedOf(t, data)
	if done["pb"].By != "pa" || done["pc"].By != "pa" || done["pc"].Node != "c" {
		t.Errorf("reclaimed notes %+v", done)
	}
	if k.log.count("node c deleted: reclaiming peer pc's ranges, taking over from pb, which is gone too") != 1 {
		t.Errorf("log:\n%s", k.log)
	}
}

// TestReclaimLiveMarker: pc's reclaimer pb is alive (its Node exists):
// pa leaves it, however often it looks.
func TestReclaimLiveMarker(t *testing.T) {
	f := newCASFake(node("a", internal("10.0.0.1")), node("b", internal("10.0.0.2")))
	f.putConfigMap(t, map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{
		"pa": {Node: "a", Nickname: "a"}, "pb": {Node: "b"}, "pc": {Node: "c", Reclaimer: "pb"},
	})})
	rec := &recorder{}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec))
	k.run(t)
	registered(t, k)
	for range 3 {
		k.reconcile(context.Background())
	}
	if got := rec.get(); len(got) != 0 {
		t.Errorf("reclaimed %v", got)
	}
	if k.log.count("node c deleted: peer pb is reclaiming pc") != 1 {
		t.Errorf("want the line once; log:\n%s", k.log)
	}
}

// TestReclaimResume: this router marked pc before it restarted; it calls
// the reclaim again and finishes.
func TestReclaimResume(t *testing.T) {
	f := newCASFake(node("a", internal("10.0.0.1")))
	f.putConfigMap(t, map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{
		"pa": {Node: "a", Nickname: "a"}, "pc": {Node: "c", Reclaimer: "pa"},
	})})
	rec := &recorder{}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec))
	k.run(t)
	registered(t, k)
	k.reconcile(context.Background())
	if got := rec.get(); !slices.Equal(got, []string{"pc"}) {
		t.Errorf("reclaimed %v", got)
	}
	if k.log.count("reclaiming peer pc's ranges (resuming)") != 1 {
		t.Errorf("log:\n%s", k.log)
	}
}

// TestReclaimChain: pb reclaimed pc earlier, then pb's Node went too. pa
// reclaims pb, then turns pc's note back into an entry and reclaims pc
// again, so that pc's reclaim is finished even if pb died in its middle.
func TestReclaimChain(t *testing.T) {
	f := newCASFake(node("a", internal("10.0.0.1")))
	f.putConfigMap(t, map[string]string{
		KeyPeers:     mustJSON(t, map[string]PeerRecord{"pa": {Node: "a", Nickname: "a"}, "pb": {Node: "b"}}),
		KeyReclaimed: mustJSON(t, map[string]ReclaimRecord{"pc": {Node: "c", By: "pb", At: time.Now().UTC()}}),
	})
	rec := &recorder{}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec))
	k.run(t)
	registered(t, k)
	k.reconcile(context.Background())
	if got := rec.get(); !slices.Equal(got, []string{"pb", "pc"}) {
		t.Errorf("reclaimed %v, want [pb pc]", got)
	}
	done := reclaimedOf(t, f.configMap(t))
	if done["pb"].By != "pa" || done["pc"].By != "pa" {
		t.Errorf("notes %+v", done)
	}
	// Nothing more to do.
	k.reconcile(context.Background())
	if got := rec.get(); len(got) != 2 {
		t.Errorf("reclaimed again: %v", got)
	}
}

// TestReclaimTombstoneTTL: notes older than TombstoneTTL are dropped when
// a reclaim is noted.
func TestReclaimTombstoneTTL(t *testing.T) {
	now := time.Date(2025, 6, 1, 0, 0, 0, 0, time.UTC)
	f := newCASFake(node("a", internal("10.0.0.1")))
	f.putConfigMap(t, map[string]string{
		KeyPeers: mustJSON(t, map[string]PeerRecord{"pa": {Node: "a", Nickname: "a"}, "pc": {Node: "c"}}),
		KeyReclaimed: mustJSON(t, map[string]ReclaimRecord{
			"old": {Node: "x", By: "pa", At: now.Add(-25 * time.Hour)},
			"new": {Node: "y", By: "pa", At: now.Add(-time.Hour)},
		}),
	})
	rec := &recorder{}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec, func(c *Config) { c.Now = func() time.Time { return now } }))
	k.run(t)
	registered(t, k)
	k.reconcile(context.Background())
	done := reclaimedOf(t, f.configMap(t))
	if _, ok := done["old"]; ok || done["new"].By != "pa" || done["pc"].By != "pa" {
		t.Errorf("notes %+v", done)
	}
}

// TestReclaimOnlyDeletedNodes: a NotReady Node keeps its peer; a Node that
// the informer has lost but the API server still has (a lagging cache)
// too; a peer whose Node is gone but that the mesh sees alive waits.
func TestReclaimOnlyDeletedNodes(t *testing.T) {
	notReady := node("b", internal("10.0.0.2"))
	notReady.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionUnknown}}
	f := newCASFake(node("a", internal("10.0.0.1")), notReady, node("c", internal("10.0.0.3")), node("d", internal("10.0.0.4")))
	f.putConfigMap(t, map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{
		"pa": {Node: "a", Nickname: "a"}, "pb": {Node: "b"}, "pc": {Node: "c"}, "pd": {Node: "d"},
	})})
	// The API server still has c after the informer saw it deleted.
	f.PrependReactor("get", "nodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.(k8stesting.GetAction).GetName() == "c" {
			return true, node("c"), nil
		}
		return false, nil, nil
	})
	var alive atomic.Bool
	alive.Store(true)
	rec := &recorder{}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec, func(c *Config) {
		c.PeerAlive = func(p string) bool { return p == "pd" && alive.Load() }
	}))
	k.run(t)
	registered(t, k)
	deleteNode(t, f, "c")
	deleteNode(t, f, "d")
	eventually(t, "the informer sees c and d deleted", func() bool { return k.NodeCount() == 2 })
	k.reconcile(context.Background())
	if got := rec.get(); len(got) != 0 {
		t.Errorf("reclaimed %v; want none yet", got)
	}
	if k.log.count("node d deleted, but peer pd still answers in the mesh") != 1 {
		t.Errorf("log:\n%s", k.log)
	}
	alive.Store(false)
	k.reconcile(context.Background())
	if got := rec.get(); !slices.Equal(got, []string{"pd"}) {
		t.Errorf("reclaimed %v; want [pd]", got)
	}
	if peers := peersOf(t, f.configMap(t)); len(peers) != 3 {
		t.Errorf("peers %+v; want pa, pb, pc", peers)
	}
}

// TestReclaimCallbackFails: the reclaim callback fails; the marker stays,
// and the next pass calls it again and finishes.
func TestReclaimCallbackFails(t *testing.T) {
	f := newCASFake(node("a", internal("10.0.0.1")))
	f.putConfigMap(t, map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{
		"pa": {Node: "a", Nickname: "a"}, "pc": {Node: "c"},
	})})
	rec := &recorder{fail: map[string]int{"pc": 1}}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec))
	k.run(t)
	registered(t, k)
	k.reconcile(context.Background())
	eventually(t, "the first call", func() bool { return len(rec.get()) >= 1 })
	if r, ok := peersOf(t, f.configMap(t))["pc"]; len(rec.get()) == 1 && (!ok || r.Reclaimer != "pa") {
		t.Errorf("after the failure pc's entry is %+v, %v; want marked by pa", r, ok)
	}
	k.reconcile(context.Background())
	if got := rec.get(); !slices.Equal(got, []string{"pc", "pc"}) {
		t.Errorf("calls %v", got)
	}
	if _, ok := peersOf(t, f.configMap(t))["pc"]; ok {
		t.Error("pc's entry is left")
	}
	if k.log.count("reclaiming peer pc's ranges failed; retrying at the next pass") != 1 {
		t.Errorf("log:\n%s", k.log)
	}
}

// TestReclaimCorruptPeers: a corrupt peers key stops reclaims with one
// clear log line, not a crash.
func TestReclaimCorruptPeers(t *testing.T) {
	f := newCASFake(node("a", internal("10.0.0.1")))
	f.putConfigMap(t, map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{"pa": {Node: "a", Nickname: "a"}})})
	rec := &recorder{}
	k := newTestKube(t, f, "a", "pa", reclaimer(rec))
	k.run(t)
	registered(t, k)
	cm, _ := f.CoreV1().ConfigMaps(DefaultNamespace).Get(context.Background(), DefaultConfigMapName, metav1.GetOptions{})
	cm.Data[KeyReclaimed] = "{broken"
	if _, err := f.CoreV1().ConfigMaps(DefaultNamespace).Update(context.Background(), cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	k.reconcile(context.Background())
	k.reconcile(context.Background())
	if k.log.count(`reclaim pass failed`) != 1 || k.log.count(`key \"reclaimed\"`) != 1 {
		t.Errorf("log:\n%s", k.log)
	}
}
