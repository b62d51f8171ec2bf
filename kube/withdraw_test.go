package kube

import (
	"context"
	"testing"
	"time"
)

// TestReclaimCalledOff: pa had marked the reclaim of px (px's Node was
// gone), then px's router comes back and registers again, which calls the
// marker off and names pa; pa's next pass withdraws the reclaim in its
// allocator (Config.Withdraw) and clears the note. The same when px comes
// back after pa had finished in the ConfigMap (a reclaimed note).
func TestReclaimCalledOff(t *testing.T) {
	for _, tc := range []struct {
		name string
		data func(t *testing.T) map[string]string
	}{
		{"marker", func(t *testing.T) map[string]string {
			return map[string]string{KeyPeers: mustJSON(t, map[string]PeerRecord{
				"pa": {Node: "a", Nickname: "a"}, "px": {Node: "x", Reclaimer: "pa"},
			})}
		}},
		{"reclaimed note", func(t *testing.T) map[string]string {
			return map[string]string{
				KeyPeers:     mustJSON(t, map[string]PeerRecord{"pa": {Node: "a", Nickname: "a"}}),
				KeyReclaimed: mustJSON(t, map[string]ReclaimRecord{"px": {Node: "x", By: "pa", At: time.Now().UTC()}}),
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newCASFake(node("a", internal("10.0.0.1")), node("x", internal("10.0.0.9")))
			f.putConfigMap(t, tc.data(t))
			// px's router starts again on node x.
			kx := newTestKube(t, f, "x", "px")
			kx.run(t)
			registered(t, kx)
			peers := peersOf(t, f.configMap(t))
			if got := peers["px"]; got.Reclaimer != "" || got.CalledOff != "pa" {
				t.Fatalf("px's entry after it registered again: %+v", got)
			}
			withdrawn := &recorder{fail: map[string]int{"px": 1}}
			ka := newTestKube(t, f, "a", "pa", reclaimer(&recorder{}), func(c *Config) { c.Withdraw = withdrawn.reclaim })
			ka.run(t)
			registered(t, ka)
			// The first call fails: the note stays, and the next pass retries.
			eventually(t, "the withdrawal", func() bool {
				ka.reconcile(context.Background())
				return len(withdrawn.get()) >= 2
			})
			if got := peersOf(t, f.configMap(t))["px"]; got.CalledOff != "" || got.Node != "x" {
				t.Fatalf("px's entry after the withdrawal: %+v", got)
			}
			ka.reconcile(context.Background())
			if got := withdrawn.get(); len(got) != 2 {
				t.Errorf("withdrawn again: %v", got)
			}
			if ka.log.count("px came back") < 2 {
				t.Errorf("log:\n%s", ka.log)
			}
		})
	}
}
