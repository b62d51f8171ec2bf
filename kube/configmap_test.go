package kube

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stesting "k8s.io/client-go/testing"
)

func peersOf(t *testing.T, data map[string]string) map[string]PeerRecord {
	t.Helper()
	peers := map[string]PeerRecord{}
	if s := data[KeyPeers]; s != "" {
		if err := json.Unmarshal([]byte(s), &peers); err != nil {
			t.Fatalf("peers key %q: %v", s, err)
		}
	}
	return peers
}

func reclaimedOf(t *testing.T, data map[string]string) map[string]ReclaimRecord {
	t.Helper()
	done := map[string]ReclaimRecord{}
	if s := data[KeyReclaimed]; s != "" {
		if err := json.Unmarshal([]byte(s), &done); err != nil {
			t.Fatalf("reclaimed key %q: %v", s, err)
		}
	}
	return done
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestRegisterPeer(t *testing.T) {
	f := newCASFake()
	ctx := context.Background()
	a := newTestKube(t, f, "a", "pa")
	if err := a.RegisterPeer(ctx, "pa", "node-a"); err != nil {
		t.Fatal(err)
	}
	cm, err := f.CoreV1().ConfigMaps(DefaultNamespace).Get(ctx, DefaultConfigMapName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the ConfigMap was not created: %v", err)
	}
	if cm.Labels["app.kubernetes.io/name"] != "weft" {
		t.Errorf("labels %v", cm.Labels)
	}
	if p := peersOf(t, cm.Data)["pa"]; p.Node != "a" || p.Nickname != "node-a" || p.Registered.IsZero() {
		t.Errorf("pa's record %+v", p)
	}

	// Registering again with the same values writes nothing.
	updates := f.countActions("update", "configmaps")
	if err := a.RegisterPeer(ctx, "pa", "node-a"); err != nil {
		t.Fatal(err)
	}
	if n := f.countActions("update", "configmaps"); n != updates {
		t.Errorf("re-registering unchanged wrote %d times", n-updates)
	}

	// A second router adds itself beside the first.
	b := newTestKube(t, f, "b", "pb")
	if err := b.RegisterPeer(ctx, "pb", "node-b"); err != nil {
		t.Fatal(err)
	}
	peers := peersOf(t, f.configMap(t))
	if len(peers) != 2 || peers["pa"].Node != "a" || peers["pb"].Node != "b" {
		t.Errorf("peers %+v", peers)
	}

	// A new peer on node a (the state was lost): warned about the old one.
	a2 := newTestKube(t, f, "a", "pa2")
	if err := a2.RegisterPeer(ctx, "pa2", "node-a"); err != nil {
		t.Fatal(err)
	}
	if a2.log.count("the ConfigMap maps another peer to this node") != 1 || !strings.Contains(a2.log.String(), "other=pa") {
		t.Errorf("no warning about pa; log:\n%s", a2.log)
	}
}

// TestRegisterPeerConflict: another router writes between our read and our
// update; the update conflicts, is retried on the new data, and keeps the
// other router's entry.
func TestRegisterPeerConflict(t *testing.T) {
	f := newCASFake()
	f.putConfigMap(t, map[string]string{KeyPeers: `{"pb":{"node":"b"}}`})
	f.beforeUpdate = func(tr k8stesting.ObjectTracker, cm *corev1.ConfigMap) {
		cur, _ := tr.Get(cmGVR, DefaultNamespace, DefaultConfigMapName)
		c := cur.(*corev1.ConfigMap).DeepCopy()
		c.Data[KeyPeers] = `{"pb":{"node":"b"},"pc":{"node":"c"}}`
		f.bumpRVLocked(tr, c)
	}
	k := newTestKube(t, f, "a", "pa")
	if err := k.RegisterPeer(context.Background(), "pa", "a"); err != nil {
		t.Fatal(err)
	}
	peers := peersOf(t, f.configMap(t))
	if len(peers) != 3 || peers["pa"].Node != "a" || peers["pc"].Node != "c" {
		t.Errorf("peers after the conflict: %+v", peers)
	}
	if n := f.countActions("update", "configmaps"); n != 2 {
		t.Errorf("%d updates, want 2 (one conflicted)", n)
	}
	if v := counterValue(t, k.metrics.conflicts); v != 1 {
		t.Errorf("conflicts = %v, want 1", v)
	}
	if k.log.count("changed under us (registering peer pa)") != 1 {
		t.Errorf("the conflict is not logged; log:\n%s", k.log)
	}
}

// TestRegisterPeerConflictStorm: conflicts injected repeatedly, a timeout
// among them: retried with the conflict backoff until it goes through.
func TestRegisterPeerConflictStorm(t *testing.T) {
	f := newCASFake()
	f.putConfigMap(t, map[string]string{})
	f.failN("update", "configmaps", 5, apierrors.NewConflict(schema.GroupResource{Resource: "configmaps"}, "weft", errors.New("modified")))
	f.failN("get", "configmaps", 1, apierrors.NewServerTimeout(schema.GroupResource{Resource: "configmaps"}, "get", 1))
	k := newTestKube(t, f, "a", "pa")
	if err := k.RegisterPeer(context.Background(), "pa", "a"); err != nil {
		t.Fatal(err)
	}
	if peersOf(t, f.configMap(t))["pa"].Node != "a" {
		t.Error("pa not registered")
	}
	var conflictWaits int
	for _, d := range k.delays.get() {
		if d <= DefaultConflictBackoff.Max {
			conflictWaits++
		}
	}
	if conflictWaits < 5 {
		t.Errorf("waits %v: want 5 conflict waits", k.delays.get())
	}
}

// TestRegisterPeerCorrupt: a peers key that does not decode is reported
// with the ConfigMap and the key, and left as it is.
func TestRegisterPeerCorrupt(t *testing.T) {
	for _, bad := range []string{
		`not json`,
		`{"pb":{"node":"Bad_Node"}}`,
		`{"has space":{"node":"b"}}`,
		`{"pb":{"node":"b","reclaimer":"x y"}}`,
	} {
		f := newCASFake()
		f.putConfigMap(t, map[string]string{KeyPeers: bad})
		k := newTestKube(t, f, "a", "pa")
		err := k.RegisterPeer(context.Background(), "pa", "a")
		var ce *CorruptError
		if !errors.As(err, &ce) || ce.Key != KeyPeers || !strings.Contains(err.Error(), `ConfigMap kube-system/weft, key "peers"`) {
			t.Errorf("%s: RegisterPeer = %v; want a CorruptError naming the ConfigMap and key", bad, err)
		}
		if got := f.configMap(t)[KeyPeers]; got != bad {
			t.Errorf("the corrupt key was overwritten: %q", got)
		}
	}
}

// TestRegisterPeerCallsOffReclaim: a router whose entry carries another
// peer's reclaim marker (its Node was deleted and re-created) clears it
// and says so.
func TestRegisterPeerCallsOffReclaim(t *testing.T) {
	f := newCASFake()
	f.putConfigMap(t, map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{
		"pa": {Node: "a", Nickname: "a", Reclaimer: "pb", ReclaimStarted: time.Now()},
		"pb": {Node: "b"},
	})})
	k := newTestKube(t, f, "a", "pa")
	if err := k.RegisterPeer(context.Background(), "pa", "a"); err != nil {
		t.Fatal(err)
	}
	if r := peersOf(t, f.configMap(t))["pa"]; r.Reclaimer != "" {
		t.Errorf("marker left: %+v", r)
	}
	if k.log.count("peer pb had started to reclaim this peer's ranges") != 1 {
		t.Errorf("log:\n%s", k.log)
	}
}
