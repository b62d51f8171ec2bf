package ipalloc

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/weft-net/weft/state"
)

// TestServiceLoadsMainState: a state file written by main before the ring
// was saved in the wire encoding (testdata, made by 8aaa770: three
// allocations, two members, the ring as JSON) loads with its allocations,
// their metadata and its members; the next save rewrites the ring in the
// wire encoding, which loads too.
func TestServiceLoadsMainState(t *testing.T) {
	old, err := os.ReadFile("testdata/state-main-8aaa770.db")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, state.FileName), old, 0o600); err != nil {
		t.Fatal(err)
	}
	db, err := state.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if ring, _ := db.Get(bucketIPAM, keyRing); len(ring) == 0 || ring[0] != '{' {
		t.Fatalf("testdata's ring is not JSON: %q", ring)
	}
	db.Close()
	e := &svcEnv{t: t, dir: dir, universe: "10.32.0.0/12"}
	svc := e.mustStart()
	check := func(svc *Service) {
		t.Helper()
		for i := range 3 {
			k := Key{ContainerID: fmt.Sprintf("old-%d", i), IfName: "eth0"}
			want := fmt.Sprintf("10.32.0.%d", i+1)
			if a, ok := svc.Lookup(k); !ok || a.String() != want {
				t.Errorf("Lookup(%s) = %s, %v; want %s", k, a, ok, want)
			}
		}
		snap := svc.Snapshot()
		if len(snap.Allocations) < 3 || snap.Allocations[0].PodNamespace != "ns" {
			t.Errorf("allocations and metadata: %+v", snap.Allocations)
		}
		if m := svc.p.Members(); len(m) != 2 || m[0] != "peer-a" || m[1] != "peer-b" {
			t.Errorf("members: %v", m)
		}
	}
	check(svc)
	n := e.mustAllocate(key(9))
	if n.String() != "10.32.0.4" {
		t.Errorf("next allocation %s, want 10.32.0.4", n)
	}
	if ring, _ := e.db.Get(bucketIPAM, keyRing); len(ring) == 0 || ring[0] != wireFormat {
		t.Fatalf("the ring was not rewritten in the wire encoding: %q", ring)
	}
	svc = e.restart()
	check(svc)
	if a, ok := svc.Lookup(key(9)); !ok || a != n {
		t.Errorf("after the rewrite: Lookup = %s, %v", a, ok)
	}
}
