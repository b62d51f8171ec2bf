package router

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"k8s.io/client-go/kubernetes/fake"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/kube"
)

// withKube gives r a Kube on a fake API server (not run: the reclaim
// callbacks only read the ConfigMap).
func withKube(t *testing.T, r *Router) {
	t.Helper()
	k, err := kube.New(kube.Config{Client: fake.NewClientset(), NodeName: "n1", PeerName: r.name})
	if err != nil {
		t.Fatal(err)
	}
	r.kube = k
}

func step(t *testing.T, r *Router, from ipalloc.PeerName, m ipalloc.Msg) {
	t.Helper()
	if err := r.ipam.Step(from, ipalloc.EncodeMsg(m)); err != nil {
		t.Fatal(err)
	}
}

// TestKubeReclaimOtherReclaimer: another peer's reclaim in the allocator
// is not done while the peer still owns ranges here: the kube package must
// keep its marker and retry (the old callback said done, and the ranges
// stayed stranded when that reclaimer was dead). Once the other reclaimer
// is removed too, this router takes the reclaim over.
func TestKubeReclaimOtherReclaimer(t *testing.T) {
	r, _ := newTestRouter(t, "10.32.0.0/24")
	withKube(t, r)
	ctx := context.Background()
	step(t, r, "x", &ipalloc.DonateRequest{ID: 1}) // x owns a range
	step(t, r, "z", &ipalloc.Remove{Peer: "x"})    // z reclaims x
	err := r.kubeReclaim(ctx, "x")
	var other *ipalloc.ReclaimingError
	if !errors.As(err, &other) || other.By != "z" {
		t.Fatalf("kubeReclaim with z reclaiming x = %v, want z's ReclaimingError", err)
	}
	if err := r.ipam.PeerGone("z"); err != nil { // z is gone too
		t.Fatal(err)
	}
	if err := r.kubeReclaim(ctx, "x"); err != nil {
		t.Fatalf("taking over the reclaim of x: %v", err)
	}
	if slices.Contains(r.ipam.Ring().Peers(), "x") {
		t.Fatalf("x still owns ranges: %v", r.ipam.Ring().Entries)
	}
}

// TestKubeWithdraw: a peer that came back before its barrier completed
// gets its reclaim withdrawn; after the takeover, withdrawing is a no-op
// that logs what to do.
func TestKubeWithdraw(t *testing.T) {
	r, _ := newTestRouter(t, "10.32.0.0/24")
	withKube(t, r)
	ctx := context.Background()
	step(t, r, "x", &ipalloc.DonateRequest{ID: 1})
	if err := r.ipam.AddMembers([]ipalloc.PeerName{"k"}); err != nil { // holds the barrier open
		t.Fatal(err)
	}
	if err := r.kubeReclaim(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	if rec, done := r.ipam.Reclaiming("x"); !rec || done {
		t.Fatalf("reclaiming x: %v, done %v", rec, done)
	}
	if err := r.kubeWithdraw(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	if rec, _ := r.ipam.Reclaiming("x"); rec || !slices.Contains(r.ipam.Ring().Peers(), "x") {
		t.Fatalf("after the withdrawal: reclaiming %v, owners %v", rec, r.ipam.Ring().Peers())
	}
	// Again, and this time k is gone too: the takeover happens.
	if err := r.kubeReclaim(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	if err := r.ipam.PeerGone("k"); err != nil {
		t.Fatal(err)
	}
	if _, done := r.ipam.Reclaiming("x"); !done {
		t.Fatalf("reclaim of x not done: %+v", r.ipam.Status().Reclaims)
	}
	if err := r.kubeWithdraw(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	if rec, done := r.ipam.Reclaiming("x"); !rec || !done {
		t.Fatal("a reclaim that took over was withdrawn")
	}
}

// TestAllocateRemoved: ADD on a removed peer answers a conflict that says
// the node was removed and how to bring it back.
func TestAllocateRemoved(t *testing.T) {
	r, cl := newTestRouter(t, "10.32.0.0/24")
	r.setReady(true, "")
	step(t, r, "a", &ipalloc.Remove{Peer: ipalloc.PeerName(r.name)})
	_, err := cl.Allocate(context.Background(), api.AllocateRequest{Attachment: api.Attachment{ContainerID: "c1", IfName: "eth0"}})
	if !api.IsCode(err, api.CodeConflict) || !strings.Contains(err.Error(), "removed") || !strings.Contains(err.Error(), "weft reset") {
		t.Fatalf("ADD on a removed peer: %v", err)
	}
}
