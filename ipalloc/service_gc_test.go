package ipalloc

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/weft-net/weft/state"
)

// A GC whose list of valid attachments was taken before an ADD finished
// must not collect that ADD's address: the pod exists, the runtime just
// listed too early. On the old code the GC released it at once, and the
// next ADD elsewhere on the node could get the running pod's address.
func TestServiceGCRacesAdd(t *testing.T) {
	db, err := state.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	now := testNow
	svc, err := NewService(ServiceConfig{
		Self: "self", Universe: netip.MustParsePrefix("10.32.0.0/24"), DB: db,
		Now: func() time.Time { return now }, GCGrace: DefaultGCGrace,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	old, _, err := svc.Allocate(ctx, key(1), Meta{})
	if err != nil {
		t.Fatal(err)
	}
	now = now.Add(10 * time.Minute)
	valid := []Key{} // the runtime lists its attachments: key(2) is not there yet
	raced, _, err := svc.Allocate(ctx, key(2), Meta{})
	if err != nil {
		t.Fatal(err)
	}
	now = now.Add(time.Second) // then its GC arrives
	dropped, err := svc.GC(valid)
	if err != nil {
		t.Fatal(err)
	}
	if len(dropped) != 1 || dropped[0].Key != key(1) || dropped[0].Address.Addr() != old {
		t.Fatalf("GC dropped %v, want only %s (%s)", dropped, key(1), old)
	}
	if a, ok := svc.Lookup(key(2)); !ok || a != raced {
		t.Fatalf("the ADD that raced the GC lost its address: %s, %v", a, ok)
	}
	// A later GC that still does not list it collects it.
	now = now.Add(2 * DefaultGCGrace)
	if dropped, err := svc.GC(valid); err != nil || len(dropped) != 1 || dropped[0].Key != key(2) {
		t.Fatalf("later GC = %v, %v; want %s dropped", dropped, err, key(2))
	}
}
