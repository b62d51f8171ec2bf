package router

import (
	"context"
	"encoding/binary"
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

// FuzzIPAMStateFrame feeds arbitrary push-pull states (the sender frame
// and the allocator's state after it, as a peer or anyone who reaches the
// gossip port without a password sends them) to MergeRemoteState: it must
// never panic, and whatever it accepts, every address this router holds
// stays in a range its own ring gives it.
func FuzzIPAMStateFrame(f *testing.F) {
	r := fuzzRouter(f)
	g := ipamGossiper{r: r}
	own := g.LocalState()
	f.Add(own)
	n, k := binary.Uvarint(own)
	if k > 0 {
		other := binary.AppendUvarint(nil, 5)
		other = append(other, "peer2"...)
		f.Add(append(other, own[k+int(n):]...))
	}
	f.Add([]byte{})
	f.Add([]byte{0x05, 'p', 'e', 'e', 'r'})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})

	f.Fuzz(func(t *testing.T, data []byte) {
		_ = g.MergeRemoteState(data)
		snap := r.ipam.Snapshot()
		if len(snap.Allocations) == 0 {
			t.Fatalf("after %x: the pod's address is gone", data)
		}
		for _, a := range snap.Allocations {
			if owner, ok := snap.Ring.Owner(a.Address); !ok || owner != snap.Self {
				t.Fatalf("after %x: %v holds %s, which its ring gives to %q", data, a.Key, a.Address, owner)
			}
		}
	})
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
