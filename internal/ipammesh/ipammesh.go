// Package ipammesh is the glue between the allocator (ipalloc) and the mesh:
// the gossiper on the mesh's "ipam" channel, the transport the allocator's
// owner loop sends through, and the routine that tells the allocator about
// every peer the mesh sees join. The router wires it (router/ipam.go,
// router/mesh.go, router/build.go), and so does the scale harness
// (internal/scale), so that what the harness measures is the router's glue.
// It lives apart from ipalloc so that the allocator talks to the mesh
// through its Transport interface only.
package ipammesh

import (
	"context"

	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/mesh"
)

// Channel is the mesh channel the allocators talk on.
const Channel = "ipam"

// Gossiper plugs the allocator's gossip adapter (ipalloc.Gossip: the
// versioned push-pull frame, a queue for the owner loop) into the mesh
// (a mesh.Gossiper).
type Gossiper struct{ G *ipalloc.Gossip }

func (g Gossiper) OnBroadcast(from mesh.PeerName, data []byte) ([]byte, error) {
	return nil, g.G.OnBroadcast(ipalloc.PeerName(from), data)
}

func (g Gossiper) OnUnicast(from mesh.PeerName, data []byte) error {
	return g.G.OnUnicast(ipalloc.PeerName(from), data)
}

func (g Gossiper) LocalState() []byte { return g.G.LocalState() }

func (g Gossiper) MergeRemoteState(data []byte) error { return g.G.MergeRemoteState(data) }

// Transport sends the allocator's messages on its channel (an
// ipalloc.Transport).
type Transport struct{ Ch *mesh.Channel }

func (t Transport) Broadcast(data []byte) error { return t.Ch.Broadcast(data) }

func (t Transport) SendTo(p ipalloc.PeerName, data []byte) error {
	return t.Ch.SendTo(mesh.PeerName(p), data)
}

// RunMembers tells svc about every peer m sees, then again whenever one
// joins or rejoins (or events were dropped), until ctx ends or m closes.
func RunMembers(ctx context.Context, m *mesh.Mesh, svc *ipalloc.Service) {
	events, cancel := m.Subscribe(64)
	defer cancel()
	add := func() {
		for _, p := range m.Peers() {
			if !p.Self {
				svc.AddPeer(ipalloc.PeerName(p.Name))
			}
		}
	}
	add()
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				return
			}
			if ev.Kind == mesh.EventJoined || ev.Kind == mesh.EventRejoined || ev.Dropped > 0 {
				add()
			}
		}
	}
}

var (
	_ mesh.Gossiper     = Gossiper{}
	_ ipalloc.Transport = Transport{}
)
