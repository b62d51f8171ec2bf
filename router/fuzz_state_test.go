package router

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/weft-net/weft/ipalloc"
)

// fuzzRouter is a router with its allocator open on a fresh state dir
// (no mesh, no kernel), owning the whole of 10.32.0.0/24 with a pod.
func fuzzRouter(f *testing.F) *Router {
	c := Defaults()
	dir := f.TempDir()
	c.StateDir, c.Socket, c.CNIBinDir, c.CNIConfDir = dir+"/state", dir+"/s.sock", dir+"/bin", dir+"/conf"
	c.IPAllocRange = "10.32.0.0/24"
	v, err := c.Validate()
	if err != nil {
		f.Fatal(err)
	}
	r, err := New(v, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { r.db.Close() })
	if err := r.openIPAM(context.Background()); err != nil {
		f.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, _, err := r.ipam.Allocate(ctx, ipalloc.Key{ContainerID: "pod1", IfName: "eth0"}, ipalloc.Meta{}); err != nil {
		f.Fatalf("a lone router's first allocation: %v", err)
	}
	return r
}

// FuzzKnownPeers reads an arbitrary value as the remembered peers (a state
// file that is damaged, or from another version): an error or a bounded
// list, never a panic.
func FuzzKnownPeers(f *testing.F) {
	f.Add([]byte(`["10.0.0.1:6783","node2"]`))
	f.Add([]byte(`[]`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"a":1}`))
	f.Add([]byte(`["`))
	f.Fuzz(func(t *testing.T, data []byte) {
		peers, err := decodeKnownPeers(data)
		if err == nil && len(peers) > maxKnownPeers {
			t.Fatalf("%d remembered peers kept", len(peers))
		}
	})
}
